"""summary() counts every anonymous byte mapoffload holds: besides the weights'
host stores, the buffers its machinery keeps (uncached buffers, the
copier's staging slots, the CPU twin's device buffers, fp8 working buffers),
in the table and its totals, checked against the process's own RssAnon."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

import mapoffload  # noqa: E402
from child import TESTS, describe  # noqa: E402
from stacks import mapped  # noqa: E402

MIB = 1 << 20


GROWTH = """
import json, os, sys
import torch
torch.set_num_threads(1)
import mapoffload
from mapoffload import rss_anon_bytes
from mapoffload._log import format_bytes
from mapoffload.pagecache import coordinator as coordinator_module
from fake_cgroups import v2_cap
from stacks import mapped

path, x, want = sys.argv[1], torch.load(sys.argv[2]), torch.load(sys.argv[3])
coordinator_module.CGROUP_ROOT = sys.argv[4]
v2_cap(sys.argv[4], 100 << 20, 10 << 20, 0, 0)  # 100 MiB cap, 10 MiB in use: room for ~11 of 24 MiB of layers
os.environ["MAPOFFLOAD_PAGE_CACHE_MARGIN_MIB"] = "67.125"  # 64 MiB + 100 MiB / 32, no thin share
model = mapped(path).eval()
with torch.no_grad():
    model(x)  # torch's own first-use allocations
handle = mapoffload.offload(model, device="cpu", layers="blocks", reads="uncached")
# After the offload: its own bookkeeping and threads (~3 MiB here, in either reads mode) are
# not buffers; what the forwards grow is. (Buffers rounded up to 2 MiB, twice a layer here, hid them.)
before = rss_anon_bytes()
with torch.no_grad():
    for _ in range(2):
        assert torch.equal(model(x), want)
grown = rss_anon_bytes() - before
rows = {r.unit: r for r in handle.rows}
text = handle.summary()
total = sum(r.anonymous_bytes for r in rows.values())
print(json.dumps({"grown": grown, "read": rows["blocks"].read_per_forward, "layer": handle.managers["blocks"].parts.layer_bytes(0),
                  "buffers": [rows["buffers"].how, rows["buffers"].nbytes, rows["buffers"].anonymous_bytes]
                  if "buffers" in rows else None, "text": text, "total": format_bytes(total)}))
handle.close()
"""


def test_uncached_buffers_are_in_the_table_and_its_totals(ckpt, tmp_path):
    """In a fresh process (the allocator holds no memory freed by earlier work), so that its RssAnon
    growth over two forwards is what the offload made: the uncached buffers."""
    path, x, want = ckpt
    torch.save(x, tmp_path / "x.pt")
    torch.save(want, tmp_path / "want.pt")
    env = dict(os.environ, PYTHONPATH=TESTS)
    env.pop("MAPOFFLOAD_HOST_AVAILABLE_GIB", None)
    proc = subprocess.run([sys.executable, "-c", GROWTH, str(path), str(tmp_path / "x.pt"), str(tmp_path / "want.pt"),
                           str(tmp_path / "cg")], capture_output=True, text=True, timeout=120, env=env,
                          cwd=tmp_path)  # not the source folder: the installed package
    assert proc.returncode == 0, describe(proc)
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["read"] > 0, "the cap must make layers stream (else nothing is read uncached)"
    # Two 2 MiB layers in flight at most (1 + prefetch depth): the growth is the buffers, measured.
    assert got["grown"] >= 3 * MIB, got["grown"]
    how, nbytes, anonymous = got["buffers"]
    assert how == "reused" and nbytes == 0  # not weights: no part of a host copy of the model
    # Nothing the forwards grew is hidden (the untouched tail of a buffer is not resident, so the
    # table, which counts what is held, may say more), and what is held is the window: 1 + depth
    # buffers of less than twice a layer each.
    assert got["grown"] <= anonymous + MIB, (anonymous, got["grown"])
    assert anonymous <= 2 * 2 * got["layer"], anonymous
    text = got["text"]
    assert "uncached buffers" in text and "nothing is copied" not in text
    total_line = next(line for line in text.splitlines() if line.startswith("total"))
    assert got["total"] in total_line, (total_line, got["total"])


def test_without_buffers_there_is_no_buffers_row(ckpt):
    path, x, want = ckpt
    model = mapped(path)
    with mapoffload.offload(model, device="cpu", layers="blocks", reads="mapping") as handle:
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
    with LayerwiseOffloadManager(model, "blocks", device="cpu", cpu_twin=True, host_store="mapped") as mgr:
        mgr.register_forward_hooks()
        with torch.no_grad():
            assert torch.equal(model(x), want)
        handle = OffloadHandle(model, mgr.options)
        handle.managers["blocks"] = mgr
        buffers = {r.unit: r for r in handle.rows}["buffers"]
        staging = mgr.copier.slots * mgr.copier.staging_bytes
        assert buffers.anonymous_bytes == staging + mgr.parts.device_bytes
        assert mgr.parts.device_bytes >= 2 * (2 * MIB)  # at least the layer running and the one prefetched
        assert "staging" in handle.summary() and "device buffers" in handle.summary()
        handle.managers.clear()  # the manager's own close() gives the model back
