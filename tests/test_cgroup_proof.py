"""The real thing: a child process in a memory cgroup capped at about half the
checkpoint loads it through load_checkpoint with the gate deciding, reads every
weight and exits 0; the same load forced to copy is killed."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import save_file

from cgroups import memory_cgroup

MIB = 1 << 20
LAYERS, ROWS, COLS = 16, 2048, 8192  # 16 x 64 MiB fp32 = 1 GiB

CHILD = textwrap.dedent(
    f"""
    import sys, torch
    from torch import nn
    from mapoffload import empty_weights, load_checkpoint
    from mapoffload.memory.budget import cgroup_memory_limit_bytes

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear({COLS}, {ROWS}, bias=False) for _ in range({LAYERS}))

    cap = cgroup_memory_limit_bytes()
    assert cap is not None and cap[0] <= 600 * 2**20, cap
    with empty_weights():
        model = Stack()
    mode = sys.argv[2]
    report = load_checkpoint(model, sys.argv[1], keep_mapping=None if mode == "gate" else False)
    assert report.keep_mapping == (mode == "gate"), report
    total = 0.0
    for i, layer in enumerate(model.layers):
        w = layer.weight
        assert float(w[0, 0]) == float(i) and float(w[-1, -1]) == float(i)
        total += float(w.sum(dtype=torch.float64))
    expected = sum(float(i) * {ROWS * COLS} for i in range({LAYERS}))
    assert total == expected, (total, expected)
    print("OK", report)
    """
)


@pytest.fixture(scope="module")
def big_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("big") / "stack.safetensors"
    save_file({f"layers.{i}.weight": torch.full((ROWS, COLS), float(i)) for i in range(LAYERS)}, path)
    yield path
    os.unlink(path)


def run_capped(cgroup: str, checkpoint, mode: str) -> subprocess.CompletedProcess:
    script = f'echo $$ > {cgroup}/cgroup.procs && exec "$0" -c "$1" "$2" "$3"'
    env = {k: v for k, v in os.environ.items() if k != "MAPOFFLOAD_HOST_AVAILABLE_GIB"}
    return subprocess.run(
        ["sh", "-c", script, sys.executable, CHILD, str(checkpoint), mode],
        capture_output=True, text=True, timeout=300, env=env,
        cwd=os.path.dirname(checkpoint),  # not the source folder: it would shadow the installed package
    )


@pytest.mark.slow
def test_gate_keeps_a_too_big_checkpoint_mapped_under_a_real_cap(big_checkpoint):
    cap = os.path.getsize(big_checkpoint) // 2
    try:
        cm = memory_cgroup(cap)
        cgroup = cm.__enter__()
    except OSError as exc:
        pytest.skip(str(exc))
    try:
        ok = run_capped(cgroup, big_checkpoint, "gate")
        assert ok.returncode == 0, ok.stderr[-3000:]
        assert "OK" in ok.stdout and "left on the file mapping" in ok.stdout
        copied = run_capped(cgroup, big_checkpoint, "copy")
        assert copied.returncode != 0, "a 1 GiB copy fit under a 512 MiB cap"
        assert copied.returncode in (-9, 137) or "MemoryError" in copied.stderr, (copied.returncode, copied.stderr[-2000:])
    finally:
        cm.__exit__(None, None, None)


CACHE_CHILD = textwrap.dedent(
    """
    import json, os, sys
    from mapoffload.memory.budget import cgroup_memory_limit_bytes

    def raw_usage():
        for name in ("memory.current", "memory.usage_in_bytes"):
            try:
                return int(open(os.path.join(sys.argv[1], name)).read())
            except OSError:
                pass

    cold = (cgroup_memory_limit_bytes(), raw_usage())
    with open(sys.argv[2], "rb") as f:
        while f.read(1 << 24):
            pass
    warm = (cgroup_memory_limit_bytes(), raw_usage())
    print(json.dumps({"cold": cold, "warm": warm}))
    """
)


def test_headroom_does_not_shrink_when_the_cache_warms_under_a_real_cap(tmp_path):
    """Reading a file fills page cache charged to the cgroup: the raw usage
    grows by the file, the budget's usage does not."""
    import json

    data = tmp_path / "cache.bin"
    with open(data, "wb") as f:
        chunk = os.urandom(MIB)
        for _ in range(256):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    drop_fd = os.open(data, os.O_RDONLY)
    os.posix_fadvise(drop_fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(drop_fd)
    try:
        cm = memory_cgroup(512 * MIB)
        cgroup = cm.__enter__()
    except OSError as exc:
        pytest.skip(str(exc))
    try:
        script = f'echo $$ > {cgroup}/cgroup.procs && exec "$0" -c "$1" "$2" "$3"'
        r = subprocess.run(["sh", "-c", script, sys.executable, CACHE_CHILD, cgroup, str(data)],
                           capture_output=True, text=True, timeout=120, cwd=tmp_path)
    finally:
        cm.__exit__(None, None, None)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    (cold_cap, cold_usage), cold_raw = out["cold"]
    (warm_cap, warm_usage), warm_raw = out["warm"]
    if warm_raw - cold_raw < 128 * MIB:
        pytest.skip(f"the file's cache was not charged to the test cgroup ({cold_raw} -> {warm_raw} bytes)")
    assert cold_cap == warm_cap == 512 * MIB
    assert warm_usage - cold_usage < 64 * MIB, out
