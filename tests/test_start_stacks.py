"""The one front door (issue 42): ``start_stacks`` starts a manager per stack with its hooks on, and
a start that fails half-way - a bad stack, or an interrupt - closes those it started, newest first,
leaving the model whole and computing as before; the first error is the one raised."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mapoffload import OffloadOptions
from mapoffload.offload.manager import LayerwiseOffloadManager, start_stacks


class TwoStacks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.b = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in [*self.a, *self.b]:
            x = torch.tanh(layer(x))
        return x


def _hooks(model: nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


@pytest.mark.parametrize("device", ["cpu", "twin"])
def test_every_stack_started_with_its_hooks(device):
    torch.manual_seed(0)
    model = TwoStacks().eval()
    x = torch.randn(2, 8)
    with torch.no_grad():
        want = model(x)
    options = OffloadOptions(device="cpu", cpu_twin=device == "twin")
    managers = start_stacks(model, [("a", options), ("b", options)])
    try:
        assert [len(m.layers) for m in managers] == [3, 2] and _hooks(model) > 0
        with torch.no_grad():
            assert torch.equal(model(x), want)
    finally:
        for m in managers:
            m.close()
    assert _hooks(model) == 0


def test_a_failed_start_closes_those_started_before_it():
    model = TwoStacks().eval()
    x = torch.randn(2, 8)
    with torch.no_grad():
        want = model(x)
    options = OffloadOptions(device="cpu", cpu_twin=True)
    with pytest.raises(AttributeError, match="layer path .nope.: TwoStacks has no attribute .nope."):
        start_stacks(model, [("a", options), ("nope", options)])
    assert _hooks(model) == 0
    with torch.no_grad():
        assert torch.equal(model(x), want)  # the real weights, not placeholders
    LayerwiseOffloadManager(model, "a", options).close()  # nothing holds the stack: it can be offloaded again


def test_an_interrupt_mid_start_closes_what_started(monkeypatch):
    model = TwoStacks().eval()
    options = OffloadOptions(device="cpu", cpu_twin=True)
    closed = []
    real_close = LayerwiseOffloadManager.close

    def close(self):
        closed.append(len(self.layers))
        real_close(self)

    def units():
        yield "a", options
        yield "b", options
        raise KeyboardInterrupt

    monkeypatch.setattr(LayerwiseOffloadManager, "close", close)
    with pytest.raises(KeyboardInterrupt):
        start_stacks(model, units())
    assert closed == [2, 3] and _hooks(model) == 0  # newest first
