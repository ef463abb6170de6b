"""Fake cgroup trees for the budget and the page-cache plan: files under a
root folder that the library reads instead of / (``root=`` of the budget
functions, ``coordinator.CGROUP_ROOT``), and the default margin pinned for
the caps the tests use."""

from __future__ import annotations

import os

from mapoffload.memory.budget import ENV_PAGE_CACHE_MARGIN_MIB

MIB = 1 << 20


def write(root, rel, text):
    """Write ``text`` at ``root/rel``, making the folders."""
    path = os.path.join(root, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def v1_cap(root, cap, usage, active_file, inactive_file):
    """A cgroup v1 memory controller capping this process (leaf /app) at ``cap`` with ``usage`` in use."""
    write(root, "proc/self/cgroup", "4:memory:/app\n0::/\n")
    write(root, "sys/fs/cgroup/memory/app/memory.limit_in_bytes", str(cap))
    write(root, "sys/fs/cgroup/memory/app/memory.usage_in_bytes", str(usage))
    write(root, "sys/fs/cgroup/memory/app/memory.stat",
          f"cache 1\ntotal_active_file {active_file}\ntotal_inactive_file {inactive_file}\n")


def v2_cap(root, cap, usage, active_file, inactive_file, high="max"):
    """A cgroup v2 tree capping this process (leaf /app) at ``cap`` (``memory.high`` ``high``) with ``usage`` in use."""
    write(root, "proc/self/cgroup", "0::/app\n")
    write(root, "sys/fs/cgroup/app/memory.max", str(cap))
    write(root, "sys/fs/cgroup/app/memory.high", high)
    write(root, "sys/fs/cgroup/app/memory.current", str(usage))
    write(root, "sys/fs/cgroup/app/memory.stat", f"anon 5\nactive_file {active_file}\ninactive_file {inactive_file}\n")


# The default margin of the README's knobs table, "64 MiB + 1/32 of the cgroup's or machine's limit",
# worked out by hand for the caps the tests use (cap in MiB -> margin in MiB): 64 + cap / 32.
DEFAULT_MARGIN_MIB = {
    78: "66.4375",  # 78 / 32 = 2.4375
    79: "66.46875",  # 79 / 32 = 2.46875
    85: "66.65625",  # 85 / 32 = 2.65625
    90: "66.8125",  # 90 / 32 = 2.8125
    100: "67.125",  # 100 / 32 = 3.125
    200: "70.25",  # 200 / 32 = 6.25
    1024: "96",  # 1024 / 32 = 32
}


def pin_whole_margin(monkeypatch, cap: int) -> None:
    """The default margin for ``cap`` (bytes, one of DEFAULT_MARGIN_MIB's) as the user's
    (``MAPOFFLOAD_PAGE_CACHE_MARGIN_MIB``): no thin share for the cached set (tests of the plan's
    other rules; test_thin_margin tests that share)."""
    assert cap % MIB == 0 and cap // MIB in DEFAULT_MARGIN_MIB, f"work out the margin of a {cap / MIB} MiB cap"
    monkeypatch.setenv(ENV_PAGE_CACHE_MARGIN_MIB, DEFAULT_MARGIN_MIB[cap // MIB])


def fake_cap(tmp_path, monkeypatch, *, margin: int, in_use: int):
    """Point the page-cache coordinator at a fake cgroup v2 tree under ``tmp_path`` (peers there too) with
    the user's margin of ``margin`` bytes; returns ``cap(limit, in_use=in_use)``, which writes the cap."""
    from mapoffload.memory.budget import ENV_HOST_AVAILABLE_GIB
    from mapoffload.pagecache import coordinator as coordinator_module

    assert not coordinator_module.coordinator().managers()
    monkeypatch.delenv(ENV_HOST_AVAILABLE_GIB, raising=False)
    monkeypatch.setattr(coordinator_module, "CGROUP_ROOT", str(tmp_path))
    monkeypatch.setenv("MAPOFFLOAD_PEERS_DIR", str(tmp_path / "peers"))
    monkeypatch.setenv(ENV_PAGE_CACHE_MARGIN_MIB, str(margin / MIB))
    return lambda limit, in_use=in_use: v2_cap(tmp_path, int(limit), in_use, 0, 0)
