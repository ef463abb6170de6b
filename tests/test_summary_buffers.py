"""summary() counts every anonymous byte mapoffload holds: besides the weights'
host stores, the buffers its machinery keeps (read-around buffers, the
copier's staging slots, the CPU twin's device buffers, fp8 working buffers),
in the table and its totals, checked against the process's own RssAnon."""

from __future__ import annotations

import importlib
import os

import pytest

torch = pytest.importorskip("torch")

import mapoffload  # noqa: E402
from mapoffload import rss_anon_bytes  # noqa: E402
from mapoffload._manager import coordinator as coordinator_module  # noqa: E402
from stacks import mapped  # noqa: E402

MIB = 1 << 20


def _cap(root, cap_mib: int, used_mib: int) -> None:
    """A fake cgroup v2 tree capping this process at ``cap_mib`` with ``used_mib`` in use."""
    files = {"proc/self/cgroup": "0::/app\n", "sys/fs/cgroup/app/memory.max": str(cap_mib * MIB),
             "sys/fs/cgroup/app/memory.high": "max", "sys/fs/cgroup/app/memory.current": str(used_mib * MIB),
             "sys/fs/cgroup/app/memory.stat": "anon 5\nactive_file 0\ninactive_file 0\n"}
    for rel, text in files.items():
        os.makedirs(os.path.dirname(os.path.join(root, rel)), exist_ok=True)
        with open(os.path.join(root, rel), "w") as f:
            f.write(text)


@pytest.fixture
def capped(tmp_path, monkeypatch):
    """100 MiB cap, 10 MiB in use, the margin 64 MiB + 100/32 MiB: room for about 11 of the 24 MiB of layers."""
    monkeypatch.delenv("MAPOFFLOAD_HOST_AVAILABLE_GIB", raising=False)
    monkeypatch.setattr(coordinator_module, "CGROUP_ROOT", str(tmp_path))
    monkeypatch.setenv("MAPOFFLOAD_PAGE_CACHE_MARGIN_MIB", "67.125")
    _cap(tmp_path, 100, 10)


def _grown_by_forwards(model, x, want, handle_of) -> tuple[int, object]:
    importlib.import_module("torch._dynamo")  # the hooks import it (a fixed cost, README), not a buffer
    with torch.no_grad():
        model(x)  # torch's own first-use allocations
    before = rss_anon_bytes()
    handle = handle_of(model)
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(x), want)
    return rss_anon_bytes() - before, handle


def test_read_around_buffers_are_in_the_table_and_its_totals(ckpt, capped):
    path, x, want = ckpt
    model = mapped(path)
    grown, handle = _grown_by_forwards(
        model, x, want, lambda m: mapoffload.offload(m, device="cpu", layers="blocks", stream_reads="direct"))
    with handle:
        rows = {r.unit: r for r in handle.rows}
        stack = rows["blocks"]
        assert stack.read_per_forward > 0, "the cap must make layers stream (else nothing is read around)"
        # Two 2 MiB layers in flight at most (1 + prefetch depth): the growth is the buffers, measured.
        assert grown >= 3 * MIB, grown
        buffers = rows["buffers"]
        assert buffers.how == "reused" and buffers.nbytes == 0  # not weights: no part of a host copy of the model
        # Nothing the forwards grew is hidden (the untouched tail of a buffer is not resident, so the
        # table, which counts what is held, may say more), and what is held is the window: 1 + depth
        # buffers of less than twice a layer each.
        assert grown <= buffers.anonymous_bytes + MIB, (buffers.anonymous_bytes, grown)
        assert buffers.anonymous_bytes <= 2 * 2 * handle.managers["blocks"].layer_bytes(0), buffers
        text = handle.summary()
        assert "read-around buffers" in text and "nothing is copied" not in text
        total = sum(r.anonymous_bytes for r in handle.rows)
        assert total >= buffers.anonymous_bytes
        total_line = next(line for line in text.splitlines() if line.startswith("total"))
        assert mapoffload._log.format_bytes(total) in total_line, (total_line, total)


def test_without_buffers_there_is_no_buffers_row(ckpt):
    path, x, want = ckpt
    model = mapped(path)
    with mapoffload.offload(model, device="cpu", layers="blocks", stream_reads="mapping") as handle:
        with torch.no_grad():
            assert torch.equal(model(x), want)
        assert "buffers" not in {r.unit for r in handle.rows}
        assert "nothing is copied" in handle.summary()


def test_the_cpu_twins_device_buffers_and_staging_are_counted(ckpt):
    """The device pipeline on the CPU: its 'device' buffers are host memory, and so is the staging ring."""
    from mapoffload import LayerwiseOffloadManager
    from mapoffload.hf.offload import OffloadHandle

    path, x, want = ckpt
    model = mapped(path)
    importlib.import_module("torch._dynamo")
    with LayerwiseOffloadManager(model, "blocks", device="cpu", cpu_twin=True, host_store="mapped") as mgr:
        mgr.register_forward_hooks()
        with torch.no_grad():
            assert torch.equal(model(x), want)
        handle = OffloadHandle(model, torch.device("cpu"))
        handle.managers["blocks"] = mgr
        buffers = {r.unit: r for r in handle.rows}["buffers"]
        staging = mgr.copier.slots * mgr.copier.staging_bytes
        assert buffers.anonymous_bytes == staging + mgr.device_bytes
        assert mgr.device_bytes >= 2 * (2 * MIB)  # at least the layer running and the one prefetched
        assert "staging" in handle.summary() and "device buffers" in handle.summary()
        handle.managers.clear()  # the manager's own close() gives the model back
