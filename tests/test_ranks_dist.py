"""Two real ranks (torch.multiprocessing spawn, gloo) share one page cache.

One spawn, several checks (keeps the test near 10 s on a small machine):
every rank's Pss of the checkpoint mapping is about half its Rss (the pages
are shared, not copied), the local world comes from torch.distributed and
from LOCAL_WORLD_SIZE, the gate counts copies per local rank, a row slice is
a view inside the file mapping, column slices are counted as copied, and the
tensor-parallel pair gives the single-process output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from child import describe
from models import Pair

TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("ranks")
    torch.manual_seed(0)
    full = Pair(64, 4096)  # 2 MiB of float32 weights: 512 pages, shared or not
    ckpt = str(root / "pair.safetensors")
    save_file({k: v.contiguous() for k, v in full.state_dict().items()}, ckpt)
    out = root / "out"
    out.mkdir()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (TESTS, env.get("PYTHONPATH")) if p)
    env.pop("LOCAL_WORLD_SIZE", None)
    env.pop("MAPOFFLOAD_HOST_AVAILABLE_GIB", None)
    try:
        proc = subprocess.run([sys.executable, os.path.join(TESTS, "ranks_worker.py"), str(out), ckpt],
                              capture_output=True, text=True, timeout=120, env=env, cwd=str(root))
    except subprocess.TimeoutExpired:
        pytest.fail("the two ranks did not finish in 120 s")
    if (out / "skip").exists():
        pytest.skip((out / "skip").read_text())
    assert proc.returncode == 0, describe(proc)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)], os.path.getsize(ckpt)


@pytest.mark.slow
def test_ranks_share_the_checkpoints_pages(ranks):
    results, size = ranks
    for r in results:
        rss, pss = r["smaps"]["Rss"], r["smaps"]["Pss"]
        assert rss >= size - 4096, r["smaps"]  # every page of the file resident in this rank
        assert abs(pss - rss / 2) <= 0.05 * rss, r["smaps"]  # ... and shared with the other
    assert results[0]["checksum"] == results[1]["checksum"]


def test_local_world_and_gate_in_real_ranks(ranks):
    for r in ranks[0]:
        assert r["world_from_dist"] == [2, "torch.distributed world size"]
        assert r["world_from_env"] == [2, "LOCAL_WORLD_SIZE"]
        assert r["gate"] == [False, True]


def test_row_slices_are_views_columns_copied_outputs_match(ranks):
    down_bytes = 64 * 2048 * 4
    for r in ranks[0]:
        assert r["row_slice_view"] == [True, True, True, True]
        assert r["column_slice_held"] is False
        shard, sliced_mapped, sliced_copied, copied = r["report"]
        assert shard == [r["rank"], 2]
        assert sliced_mapped == (2048 * 64 + 2048) * 4
        assert sliced_copied == down_bytes and copied == {"column slice": down_bytes}
        assert r["max_diff"] <= 1e-5 * max(1.0, r["scale"])
