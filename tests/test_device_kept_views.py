"""The device path (run here as its CPU twin; CUDA runs the same code): a view of a layer's weight kept past
its forward (a hook keeping ``weight.detach()``, a module caching ``weight.t()``) pointed into a device
buffer the pool handed to the next layer of its size, and silently took that layer's values (found by a
hostile review). A buffer a view still holds is now left to it; a plain run reuses every buffer."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

from mapoffload import LayerwiseOffloadManager

W = 64


class Cached(nn.Linear):
    """Caches a view of its weight at its first call, as some modules do."""

    def forward(self, x):
        if getattr(self, "wt", None) is None:
            self.wt = self.weight.t()
        return x @ self.wt + self.bias


class Stack(nn.Module):
    def __init__(self, block=nn.Linear) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(block(W, W) for _ in range(4))

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return x


def _pair(block=nn.Linear):
    torch.manual_seed(0)
    base = Stack(block).eval().requires_grad_(False)
    return base, copy.deepcopy(base)


def _twin(model, device="cpu"):
    twin = {"cpu_twin": True} if device == "cpu" else {}
    return LayerwiseOffloadManager(model, "blocks", device=device, prefetch_layers=1, **twin)


def test_a_weight_kept_by_a_hook_keeps_its_layer_s_values():
    ref, model = _pair()
    kept = {}
    x = torch.randn(2, W)
    with _twin(model) as mgr:
        mgr.register_forward_hooks()
        def keep(module, args):  # the weight as the layer computes with it, kept past its forward
            kept.setdefault("w", module.weight.detach())

        model.blocks[0].register_forward_pre_hook(keep)
        with torch.no_grad():
            for _ in range(2):
                assert torch.equal(model(x), ref(x))
        assert torch.equal(kept["w"], ref.blocks[0].weight)


def test_a_module_caching_a_view_of_its_weight_computes_as_the_plain_model():
    ref, model = _pair(Cached)
    x = torch.randn(2, W)
    with _twin(model) as mgr:
        mgr.register_forward_hooks()
        with torch.no_grad():
            for _ in range(3):
                assert torch.equal(model(x), ref(x))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_plain_run_reuses_every_buffer(caplog, device):
    """Nothing but the layer holds its buffers at release (on CUDA too: no copy handle keeps them)."""
    ref, model = _pair()
    x = torch.randn(2, W)
    with caplog.at_level(logging.INFO, logger="mapoffload"), _twin(model, device) as mgr:
        mgr.register_forward_hooks()
        same = torch.equal if device == "cpu" else torch.allclose  # GPU arithmetic differs in the last bits
        with torch.no_grad():
            want = ref(x)
            assert same(model(x.to(device)).cpu(), want)
            held = mgr.parts.loads.pool.bytes
            for _ in range(3):
                assert same(model(x.to(device)).cpu(), want)
        assert mgr.parts.loads.pool.bytes == held  # nothing made afresh: every buffer given back was pooled
    assert "outlived" not in caplog.text
