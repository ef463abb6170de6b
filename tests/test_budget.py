"""Host memory budget: cgroup v1/v2 on fake trees, the override, the gate."""

from __future__ import annotations

import os

import pytest

from mapoffload import (
    GIB_BYTES,
    HOST_COPY_RESERVE_BYTES,
    cgroup_memory_limit_bytes,
    describe_host,
    host_copies_would_not_fit,
    host_memory_available_bytes,
)
from mapoffload.memory.budget import ENV_HOST_AVAILABLE_GIB

from fake_cgroups import write

GIB = GIB_BYTES


def v2_tree(root, own="/user.slice/app.scope", caps=None):
    write(root, "proc/self/cgroup", f"0::{own}\n")
    for rel, (cap, usage) in (caps or {}).items():
        write(root, f"sys/fs/cgroup/{rel}/memory.max".replace("//", "/"), cap)
        write(root, f"sys/fs/cgroup/{rel}/memory.current".replace("//", "/"), str(usage))


def v1_tree(root, own="/process_api/abc", caps=None):
    write(root, "proc/self/cgroup", f"12:cpu,cpuacct:/\n4:memory:{own}\n0::/\n")
    for rel, (cap, usage) in (caps or {}).items():
        write(root, f"sys/fs/cgroup/memory/{rel}/memory.limit_in_bytes".replace("//", "/"), cap)
        write(root, f"sys/fs/cgroup/memory/{rel}/memory.usage_in_bytes".replace("//", "/"), str(usage))


def test_v2_leaf_cap(tmp_path):
    v2_tree(tmp_path, caps={"user.slice/app.scope": (str(8 * GIB), GIB), "user.slice": ("max", 3 * GIB)})
    assert cgroup_memory_limit_bytes(root=str(tmp_path)) == (8 * GIB, GIB)


def test_v2_nested_caps_take_the_tightest(tmp_path):
    v2_tree(
        tmp_path,
        caps={"user.slice/app.scope": (str(16 * GIB), GIB), "user.slice": (str(10 * GIB), 9 * GIB), "": ("max", 0)},
    )
    assert cgroup_memory_limit_bytes(root=str(tmp_path)) == (10 * GIB, 9 * GIB)


def test_v2_uncapped_garbage_and_missing(tmp_path):
    v2_tree(tmp_path, caps={"user.slice/app.scope": ("max\n", GIB), "user.slice": ("lots", 0)})
    assert cgroup_memory_limit_bytes(root=str(tmp_path)) is None
    assert cgroup_memory_limit_bytes(root=str(tmp_path / "nothing-here")) is None


def test_v1_nested_path_and_sentinel(tmp_path):
    v1_tree(
        tmp_path,
        caps={"process_api/abc": (str(9223372036854771712), GIB), "process_api": (str(12 * GIB), 2 * GIB)},
    )
    assert cgroup_memory_limit_bytes(root=str(tmp_path)) == (12 * GIB, 2 * GIB)


def test_container_path_missing_under_mount_tries_suffixes_then_mount(tmp_path):
    # The host's path is /kubepods/pod1/ctr; inside the container only /ctr exists.
    v2_tree(tmp_path, own="/kubepods/pod1/ctr", caps={"ctr": (str(6 * GIB), GIB)})
    assert cgroup_memory_limit_bytes(root=str(tmp_path)) == (6 * GIB, GIB)
    other = tmp_path / "mountonly"
    v2_tree(other, own="/kubepods/pod1/ctr", caps={"": (str(5 * GIB), 2 * GIB)})
    assert cgroup_memory_limit_bytes(root=str(other)) == (5 * GIB, 2 * GIB)


def test_v2_is_tried_before_v1(tmp_path):
    write(tmp_path, "proc/self/cgroup", "4:memory:/a\n0::/b\n")
    write(tmp_path, "sys/fs/cgroup/b/memory.max", str(3 * GIB))
    write(tmp_path, "sys/fs/cgroup/b/memory.current", "0")
    write(tmp_path, "sys/fs/cgroup/memory/a/memory.limit_in_bytes", str(2 * GIB))
    write(tmp_path, "sys/fs/cgroup/memory/a/memory.usage_in_bytes", "0")
    assert cgroup_memory_limit_bytes(root=str(tmp_path)) == (3 * GIB, 0)


def test_cap_wins_over_free_memory_and_the_reverse(tmp_path, monkeypatch):
    import psutil

    class VM:
        available = 64 * GIB

    monkeypatch.setattr(psutil, "virtual_memory", lambda: VM)
    v2_tree(tmp_path, caps={"user.slice/app.scope": (str(32 * GIB), 2 * GIB)})
    assert host_memory_available_bytes(root=str(tmp_path)) == 30 * GIB
    VM.available = 8 * GIB
    assert host_memory_available_bytes(root=str(tmp_path)) == 8 * GIB
    assert "cgroup cap 32.00 GiB" in describe_host(root=str(tmp_path))


def test_override_behaves_like_a_smaller_host(tmp_path, monkeypatch):
    write(tmp_path, "proc/self/status", "Name: python\nRssAnon:\t  1048576 kB\n")
    monkeypatch.setenv(ENV_HOST_AVAILABLE_GIB, "8")
    assert host_memory_available_bytes(root=str(tmp_path)) == 7 * GIB
    monkeypatch.setenv(ENV_HOST_AVAILABLE_GIB, "0.5")
    assert host_memory_available_bytes(root=str(tmp_path)) == 0
    assert ENV_HOST_AVAILABLE_GIB in describe_host(root=str(tmp_path))
    for bad in ("lots", "-1", "nan", "inf"):
        monkeypatch.setenv(ENV_HOST_AVAILABLE_GIB, bad)
        with pytest.raises(ValueError, match=ENV_HOST_AVAILABLE_GIB):
            host_memory_available_bytes()


def test_override_has_one_meaning_for_the_gate_and_the_page_cache_budget(tmp_path, monkeypatch):
    # X GiB less RssAnon, in place of the machine and of every cgroup cap, for both:
    # a cap tighter than X (here 2 GiB) and a machine looser than X change neither answer.
    from mapoffload.memory.budget import page_cache_budget
    import psutil

    class VM:
        available, total = 64 * GIB, 128 * GIB

    monkeypatch.setattr(psutil, "virtual_memory", lambda: VM)
    write(tmp_path, "proc/self/status", "Name: python\nRssAnon:\t  1048576 kB\n")
    v2_tree(tmp_path, caps={"user.slice/app.scope": (str(2 * GIB), GIB)})
    monkeypatch.setenv(ENV_HOST_AVAILABLE_GIB, "8")
    root = str(tmp_path)
    assert host_memory_available_bytes(root=root) == 7 * GIB
    b = page_cache_budget(root=root)
    assert (b.source, b.limit, b.other_bytes) == (ENV_HOST_AVAILABLE_GIB, 8 * GIB, GIB)
    assert b.usable == 7 * GIB - b.margin
    # Both describe one host: what the gate sees available is what the budget sees free before its margin.
    assert host_memory_available_bytes(root=root) == b.limit - b.other_bytes
    monkeypatch.delenv(ENV_HOST_AVAILABLE_GIB)
    assert host_memory_available_bytes(root=root) == GIB  # the cap again
    assert page_cache_budget(root=root).source == "cgroup"


def test_gate_matches_the_seed_expectations():
    assert HOST_COPY_RESERVE_BYTES == 4 * GIB
    assert host_copies_would_not_fit(62 * GIB, available_bytes=32 * GIB)
    assert not host_copies_would_not_fit(20 * GIB, available_bytes=128 * GIB)
    # The reserve is not spendable: exactly available - reserve does not fit.
    assert host_copies_would_not_fit(28 * GIB, available_bytes=32 * GIB)
    assert not host_copies_would_not_fit(28 * GIB - 1, available_bytes=32 * GIB)
    assert not host_copies_would_not_fit(0, available_bytes=0)
    assert not host_copies_would_not_fit(-5, available_bytes=0)
    assert host_copies_would_not_fit(1, available_bytes=2 * GIB)


def test_gate_is_the_room_the_copies_may_take():
    # One definition of what copies may spend, read by the gate, the pinned-store budget and the summary.
    from mapoffload.memory.budget import host_copy_room

    assert host_copy_room(32 * GIB) == 28 * GIB
    assert host_copy_room(32 * GIB, 4) == 16 * GIB
    assert host_copy_room(GIB, 2) < 0  # the reserves alone do not fit
    for available in (0, GIB, 20 * GIB, 32 * GIB + 7):
        for n in (1, 2, 3, 8):
            room = host_copy_room(available, n)
            for w in (1, GIB, room // n, room // n + 1, -(-room // n), 40 * GIB):
                assert host_copies_would_not_fit(w, available_bytes=available, local_ranks=n) == (
                    w > 0 and n * w >= room)


def test_gate_reads_the_host_when_not_told(monkeypatch):
    monkeypatch.setenv(ENV_HOST_AVAILABLE_GIB, "16")
    assert host_copies_would_not_fit(13 * GIB)
    assert not host_copies_would_not_fit(GIB)


def _meminfo_available() -> int:
    """MemAvailable of /proc/meminfo, read here (psutil is what the library asks)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no MemAvailable in /proc/meminfo")


def _cgroup_read_here(root: str = "/") -> tuple[int, int] | None:
    """This process's tightest memory cap, read from the real cgroup files by the test itself:
    (cap, usage less inactive file cache) of the directory with the least headroom from the leaf up
    to the mount, cgroup v2 first, then v1; None where nothing caps (the rule of DESIGN.md)."""
    own = {}
    with open(os.path.join(root, "proc/self/cgroup")) as f:
        for line in f:
            hid, controllers, path = line.rstrip("\n").split(":", 2)
            if hid == "0" and controllers == "":
                own["v2"] = path
            elif "memory" in controllers.split(","):
                own["v1"] = path
    versions = (
        ("v2", os.path.join(root, "sys/fs/cgroup"), ("memory.max", "memory.high"), "memory.current",
         "inactive_file"),
        ("v1", os.path.join(root, "sys/fs/cgroup/memory"), ("memory.limit_in_bytes",), "memory.usage_in_bytes",
         "total_inactive_file"),
    )
    for key, mount, cap_files, usage_file, cache_field in versions:
        if key not in own:
            continue
        parts = [p for p in own[key].split("/") if p]
        leaf = next((os.path.join(mount, *parts[i:]) for i in range(len(parts) + 1)
                     if os.path.isdir(os.path.join(mount, *parts[i:]))), mount)
        found = []
        d = leaf
        while True:
            caps = []
            for name in cap_files:
                try:
                    with open(os.path.join(d, name)) as f:
                        text = f.read().strip()
                except OSError:
                    continue
                if text.isdigit() and not (key == "v1" and int(text) >= 1 << 62):  # "max", the v1 sentinel
                    caps.append(int(text))
            if caps:
                with open(os.path.join(d, usage_file)) as f:
                    usage = int(f.read())
                cache = 0
                try:
                    with open(os.path.join(d, "memory.stat")) as f:
                        stat = dict(line.split() for line in f if len(line.split()) == 2)
                    cache = int(stat.get(cache_field, 0))
                except OSError:
                    pass
                found.append((min(caps), max(0, usage - cache)))
            if d == mount or not d.startswith(mount):
                break
            d = os.path.dirname(d)
        if found:
            return min(found, key=lambda cu: cu[0] - cu[1])
    return None


def test_this_machine_answers_what_its_files_say(monkeypatch, tmp_path):
    """The real machine, against /proc/meminfo and the cgroup files read here: the same cap, the
    same usage and the same available memory, up to what moves between two readings."""
    monkeypatch.delenv(ENV_HOST_AVAILABLE_GIB, raising=False)
    # The test's own reader, on trees whose answer is known (this machine may have no cap at all).
    v2_tree(tmp_path / "v2", caps={"user.slice/app.scope": (str(8 * GIB), 3 * GIB), "user.slice": ("max", 0)})
    write(tmp_path / "v2", "sys/fs/cgroup/user.slice/app.scope/memory.stat", f"inactive_file {GIB}\n")
    assert _cgroup_read_here(str(tmp_path / "v2")) == (8 * GIB, 2 * GIB)
    v1_tree(tmp_path / "v1", caps={"process_api/abc": ("9223372036854771712", GIB), "process_api": (str(6 * GIB), 0)})
    assert _cgroup_read_here(str(tmp_path / "v1")) == (6 * GIB, 0)
    slack = 256 << 20  # other processes (a CI run) allocate and free between the readings
    before_cg, before_free = _cgroup_read_here(), _meminfo_available()
    result = cgroup_memory_limit_bytes()
    available = host_memory_available_bytes()
    after_cg, after_free = _cgroup_read_here(), _meminfo_available()
    assert (result is None) == (before_cg is None) == (after_cg is None), (result, before_cg, after_cg)
    # min(MemAvailable, cap - usage), each term taken at its lowest and at its highest reading.
    low, high = min(before_free, after_free), max(before_free, after_free)
    if result is not None:
        cap = before_cg[0]
        assert result[0] == cap == after_cg[0], (result, before_cg, after_cg)
        usages = [before_cg[1], after_cg[1]]
        assert min(usages) - slack <= result[1] <= max(usages) + slack, (result, usages)
        low, high = min(low, max(0, cap - max(usages))), min(high, max(0, cap - min(usages)))
    assert low - slack <= available <= high + slack, (available, low, high, result)
    assert available > 0


# --- page cache is not usage; memory.high is a cap -------------------------------------


def v2_stat(root, rel, inactive_file, active_file=0):
    write(root, f"sys/fs/cgroup/{rel}/memory.stat".replace("//", "/"),
          f"anon 123\nfile {inactive_file + active_file}\nactive_file {active_file}\n"
          f"inactive_file {inactive_file}\nslab 7\n")


def v1_stat(root, rel, total_inactive_file, local_inactive_file=0):
    write(root, f"sys/fs/cgroup/memory/{rel}/memory.stat".replace("//", "/"),
          f"cache 5\ninactive_file {local_inactive_file}\ntotal_cache 9\n"
          f"total_inactive_file {total_inactive_file}\ntotal_active_file 0\n")


def test_v2_same_answer_with_a_warm_or_a_cold_cache(tmp_path):
    leaf = "user.slice/app.scope"
    cold, warm = tmp_path / "cold", tmp_path / "warm"
    v2_tree(cold, caps={leaf: (str(8 * GIB), 2 * GIB)})
    v2_stat(cold, leaf, inactive_file=0)
    # The same process after reading 5 GiB of checkpoint: the kernel counts the
    # cache in memory.current, but it can drop it.
    v2_tree(warm, caps={leaf: (str(8 * GIB), 7 * GIB)})
    v2_stat(warm, leaf, inactive_file=5 * GIB)
    assert cgroup_memory_limit_bytes(root=str(cold)) == (8 * GIB, 2 * GIB)
    assert cgroup_memory_limit_bytes(root=str(warm)) == (8 * GIB, 2 * GIB)
    assert host_copies_would_not_fit(GIB, available_bytes=_available(warm)) == host_copies_would_not_fit(
        GIB, available_bytes=_available(cold))
    assert _available(warm) == _available(cold) == 6 * GIB


def _available(root):
    cap, usage = cgroup_memory_limit_bytes(root=str(root))
    return cap - usage


def test_v1_same_answer_with_a_warm_or_a_cold_cache(tmp_path):
    cold, warm = tmp_path / "cold", tmp_path / "warm"
    v1_tree(cold, caps={"process_api/abc": (str(12 * GIB), GIB)})
    v1_stat(cold, "process_api/abc", total_inactive_file=0)
    v1_tree(warm, caps={"process_api/abc": (str(12 * GIB), 4 * GIB)})
    # The local count is a decoy: usage_in_bytes is hierarchical, so is total_*.
    v1_stat(warm, "process_api/abc", total_inactive_file=3 * GIB, local_inactive_file=GIB)
    assert cgroup_memory_limit_bytes(root=str(cold)) == (12 * GIB, GIB)
    assert cgroup_memory_limit_bytes(root=str(warm)) == (12 * GIB, GIB)


def test_cache_is_left_out_at_every_level_of_the_walk(tmp_path):
    # The parent looks tightest by raw usage, but most of it is cache.
    # Headroom: parent 10 - (9 - 8) = 9 GiB, leaf 16 - 8 = 8 GiB: the leaf decides.
    v2_tree(tmp_path, caps={"user.slice/app.scope": (str(16 * GIB), 8 * GIB), "user.slice": (str(10 * GIB), 9 * GIB)})
    v2_stat(tmp_path, "user.slice", inactive_file=8 * GIB)
    v2_stat(tmp_path, "user.slice/app.scope", inactive_file=0)
    assert cgroup_memory_limit_bytes(root=str(tmp_path)) == (16 * GIB, 8 * GIB)


def test_cache_larger_than_usage_clamps_to_zero(tmp_path):
    v2_tree(tmp_path, caps={"user.slice/app.scope": (str(4 * GIB), GIB)})
    v2_stat(tmp_path, "user.slice/app.scope", inactive_file=2 * GIB)  # read at another moment
    assert cgroup_memory_limit_bytes(root=str(tmp_path)) == (4 * GIB, 0)


def test_garbage_memory_stat_leaves_usage_as_read(tmp_path):
    v2_tree(tmp_path, caps={"user.slice/app.scope": (str(4 * GIB), GIB)})
    write(tmp_path, "sys/fs/cgroup/user.slice/app.scope/memory.stat", "inactive_file lots\nnonsense\n")
    assert cgroup_memory_limit_bytes(root=str(tmp_path)) == (4 * GIB, GIB)


def test_v2_memory_high_tighter_than_max(tmp_path):
    leaf = "user.slice/app.scope"
    v2_tree(tmp_path, caps={leaf: (str(8 * GIB), GIB)})
    write(tmp_path, f"sys/fs/cgroup/{leaf}/memory.high", f"{5 * GIB}\n")
    assert cgroup_memory_limit_bytes(root=str(tmp_path)) == (5 * GIB, GIB)
    write(tmp_path, f"sys/fs/cgroup/{leaf}/memory.high", "max\n")
    assert cgroup_memory_limit_bytes(root=str(tmp_path)) == (8 * GIB, GIB)


def test_v2_memory_high_alone_caps(tmp_path):
    leaf = "user.slice/app.scope"
    v2_tree(tmp_path, caps={leaf: ("max", GIB)})
    write(tmp_path, f"sys/fs/cgroup/{leaf}/memory.high", str(3 * GIB))
    assert cgroup_memory_limit_bytes(root=str(tmp_path)) == (3 * GIB, GIB)
    # memory.max looser than memory.high: high still decides.
    write(tmp_path, f"sys/fs/cgroup/{leaf}/memory.max", str(9 * GIB))
    assert cgroup_memory_limit_bytes(root=str(tmp_path)) == (3 * GIB, GIB)


def test_host_memory_reports_the_adjusted_usage(tmp_path, monkeypatch):
    import psutil

    class VM:
        available = 64 * GIB

    monkeypatch.setattr(psutil, "virtual_memory", lambda: VM)
    monkeypatch.delenv(ENV_HOST_AVAILABLE_GIB, raising=False)
    leaf = "user.slice/app.scope"
    v2_tree(tmp_path, caps={leaf: (str(8 * GIB), 7 * GIB)})
    v2_stat(tmp_path, leaf, inactive_file=5 * GIB)
    assert host_memory_available_bytes(root=str(tmp_path)) == 6 * GIB
    assert "usage 2.00 GiB" in describe_host(root=str(tmp_path))
