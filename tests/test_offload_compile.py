"""torch.compile on an offloaded model: the layers (hooks and forwards) run
eagerly, the rest is compiled, and the result is right - in place and the
device pipeline's CPU twin, several forwards, and after close()."""

from __future__ import annotations

import shutil

import pytest
import torch

from mapoffload import LayerwiseOffloadManager

from models import TinyModel

IDS = torch.arange(16).reshape(2, 8) % 64

BACKENDS = [
    "eager",
    "aot_eager",
    pytest.param("inductor", marks=pytest.mark.skipif(
        shutil.which("g++") is None and shutil.which("c++") is None, reason="inductor on the CPU needs a C++ compiler"
    )),
]


@pytest.mark.slow
@pytest.mark.parametrize("twin", [False, True], ids=["in-place", "twin"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_offloaded_model_is_exact(backend, twin):
    torch._dynamo.reset()
    torch.manual_seed(0)
    ref = TinyModel(width=32, layers=3)
    with torch.no_grad():
        want = ref(IDS)
    model = TinyModel(width=32, layers=3)
    model.load_state_dict(ref.state_dict())
    mgr = LayerwiseOffloadManager(model, "blocks", device="cpu", cpu_twin=twin)
    mgr.register_forward_hooks()
    compiled = torch.compile(model, backend=backend)
    # Inductor's kernels for the compiled rest (embedding, head) round differently from eager's.
    same = torch.equal if backend != "inductor" else (lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-5))
    with torch.no_grad():
        for _ in range(3):
            # Before: inductor computed wrong values silently (in place), the others failed inside Dynamo.
            assert same(compiled(IDS), want)
    assert not any(mgr.parts.is_loaded(i) for i in range(3))  # the hooks ran: every layer released
    mgr.close()
    with torch.no_grad():
        assert same(compiled(IDS), want)  # the model whole again, recompiled as needed



DYNAMO_LATE = """
import sys, torch
from torch import nn
from mapoffload import LayerwiseOffloadManager
from mapoffload.offload import sequencer

calls = []
real = sequencer.Sequencer.ensure  # each layer's pre-hook waits for its layer here, holding the turn
sequencer.Sequencer.ensure = lambda self, i: (calls.append(i), real(self, i))[1]


class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        for b in self.blocks:
            x = torch.relu(b(x))
        return self.head(x)


torch.manual_seed(0)
model, x = M().eval(), torch.randn(2, 16)
with torch.no_grad():
    want = model(x)
mgr = LayerwiseOffloadManager(model, "blocks", device="cpu", cpu_twin=TWIN)
mgr.register_forward_hooks()
with torch.no_grad():
    assert torch.equal(model(x), want)
print("dynamo before compile:", "torch._dynamo" in sys.modules)
compiled = torch.compile(model, backend="aot_eager")  # imports TorchDynamo after the hooks were made
with torch.no_grad():
    for _ in range(3):
        calls.clear()
        assert torch.equal(compiled(x), want)
        assert calls == [0, 1, 2], calls  # the hooks ran eagerly, each forward: not traced into a graph
mgr.close()
print("ok")
"""


@pytest.mark.slow
@pytest.mark.parametrize("twin", [False, True], ids=["in-place", "twin"])
def test_no_dynamo_until_the_user_compiles_then_the_hooks_run_eagerly(twin):
    """Issue 42: marking the hooks for TorchDynamo imported it in every offloading process (68 MiB of
    anonymous memory, torch 2.13) though few compile. The hooks are marked when TorchDynamo is imported:
    until the user compiles nothing imports it, and hooks made before ``torch.compile`` still run eagerly."""
    from child import run_python

    proc = run_python(DYNAMO_LATE.replace("TWIN", str(twin)))
    assert proc.returncode == 0, proc.stderr
    assert "dynamo before compile: False" in proc.stdout and "ok" in proc.stdout, proc.stdout
