"""Input gradients through frozen, offloaded weights (attribution, prompt
tuning): exact in place (``device="cpu"``), which computes from the host
stores; the device pipeline (its CPU twin here; CUDA recycles buffers the
same way) refuses clearly, with a typed error, since autograd would keep
views of pooled buffers that later layers overwrite."""

from __future__ import annotations

import pytest
import torch

from mapoffload import LayerwiseOffloadManager, OffloadedGradientError

from models import TinyModel

IDS = torch.arange(16).reshape(2, 8) % 64


def blocks_grad(model) -> tuple[torch.Tensor, torch.Tensor]:
    """Output of the blocks and d(sum of squares)/d(input) for a fixed input embedding."""
    x = model.embed(IDS).detach().requires_grad_()
    y = x
    for b in model.blocks:
        y = b(y)
    (y.square().sum()).backward()
    return y.detach(), x.grad


def frozen_pair():
    torch.manual_seed(0)
    ref = TinyModel(width=32, layers=4)
    model = TinyModel(width=32, layers=4)
    model.load_state_dict(ref.state_dict())
    for m in (ref, model):
        m.requires_grad_(False)
    return ref, model


def test_input_gradients_in_place_are_exact():
    ref, model = frozen_pair()
    want_y, want_g = blocks_grad(ref)
    with LayerwiseOffloadManager(model, "blocks", device="cpu") as mgr:
        mgr.register_forward_hooks()
        for _ in range(2):
            y, g = blocks_grad(model)
            assert torch.equal(y, want_y) and torch.equal(g, want_g)


def test_recording_autograd_through_the_device_pipeline_is_refused_clearly():
    ref, model = frozen_pair()
    with torch.no_grad():
        want = ref(IDS)
    with LayerwiseOffloadManager(model, "blocks", device="cpu", cpu_twin=True) as mgr:
        mgr.register_forward_hooks()
        with pytest.raises(OffloadedGradientError, match="device pipeline") as info:
            blocks_grad(model)
        assert "torch.no_grad" in str(info.value) and "blocks.0" in str(info.value)
        assert (info.value.layer, info.value.reason) == (0, "autograd recorded")
        assert not any(mgr.parts.is_loaded(i) for i in range(4))  # released, turn left
        with torch.no_grad():
            assert torch.equal(model(IDS), want)
        # Grad mode on, nothing requiring grad: nothing is recorded, nothing refused.
        assert torch.equal(model(IDS), want)
