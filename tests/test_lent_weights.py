"""A weight swapped out of an offloaded model and put back computes as the original again, as in plain
PyTorch: ``torch.func.functional_call`` (a plain tensor put into ``module._parameters`` for one call, the
original put back after it), and a user's own swap and swap back. The manager took the swapped-in tensor
as the weight, by writing it into the original parameter (in place: the original's ``.data`` became the
other model's storage) or into the weight's host store (the device path): the model kept computing with
the temporary weights after they were put back, and after ``close()``, silently. On the device path what
the model holds between forwards is a placeholder: put back after a parameter replaced its weight, it is
refused by name (it stood for the old values, which are gone)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mapoffload import LayerwiseOffloadManager, ReplacedWeightError
from mapoffload.offload.placeholder import OffloadedWeight
from stacks import mapped

PATHS = {"in-place": {}, "uncached": {"reads": "uncached"}, "twin": {"cpu_twin": True, "host_store": "mapped"}}


def _other(ref: nn.Module) -> nn.Module:
    other = copy.deepcopy(ref)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(0.9)
    return other


@pytest.mark.parametrize("path_kind", PATHS)
def test_functional_call_leaves_the_model_its_weights(ckpt, path_kind):
    from torch.func import functional_call

    path, x, want = ckpt
    ref = mapped(path).eval()
    other = _other(ref)
    params = {k: v.detach() for k, v in other.named_parameters()}
    kept = {k: v.clone() for k, v in params.items()}
    model = mapped(path).eval()
    with LayerwiseOffloadManager(model, "blocks", device="cpu", **PATHS[path_kind]) as mgr:
        mgr.register_forward_hooks()
        with torch.no_grad():
            assert torch.equal(model(x), want)
            for _ in range(2):
                assert torch.equal(functional_call(model, params, (x,)), other(x))
                assert torch.equal(model(x), want)  # its own weights again
    with torch.no_grad():
        assert torch.equal(model(x), want)
    assert all(type(v) is torch.Tensor and torch.equal(v, kept[k]) for k, v in params.items())  # the caller's
    assert model.blocks[3].weight.data_ptr() != other.blocks[3].weight.data_ptr()


@pytest.mark.parametrize("path_kind", PATHS)
@pytest.mark.parametrize("way", ["plain tensor", "parameter"])
def test_a_weight_swapped_and_put_back_computes_as_the_original(ckpt, path_kind, way):
    path, x, want = ckpt
    ref = mapped(path).eval()
    model = mapped(path).eval()
    tmp = torch.full_like(ref.blocks[3].weight, 0.01)
    plain_tmp = copy.deepcopy(ref)
    plain_tmp.blocks[3].weight = nn.Parameter(tmp.clone())
    with LayerwiseOffloadManager(model, "blocks", device="cpu", **PATHS[path_kind]) as mgr:
        mgr.register_forward_hooks()
        orig = model.blocks[3].weight  # on the device path between forwards, its placeholder
        twin_placeholder = isinstance(orig, OffloadedWeight)
        with torch.no_grad():
            model(x)
            for _ in range(2):
                if way == "parameter":
                    model.blocks[3].weight = nn.Parameter(tmp.clone())
                else:
                    model.blocks[3]._parameters["weight"] = tmp
                assert torch.equal(model(x), plain_tmp(x))
                model.blocks[3].weight = orig
                assert model.blocks[3].weight is orig
                if twin_placeholder and way == "parameter":
                    # What the user held was the placeholder of a weight since replaced: refused, by name.
                    with pytest.raises(ReplacedWeightError, match=r"blocks\.3\.weight .*placeholder .*replaced"):
                        model(x)
                    return
                assert torch.equal(model(x), want)
    assert type(orig) is (OffloadedWeight if twin_placeholder else nn.Parameter)
    assert torch.equal(model.blocks[3].weight.detach(), ref.blocks[3].weight.detach())
    assert torch.equal(tmp, torch.full_like(tmp, 0.01))  # the swapped-in tensor was not written either
    with torch.no_grad():
        assert torch.equal(model(x), want)


def test_functional_call_gradients_reach_the_callers_tensors(ckpt):
    """In place the layers compute from the caller's tensors, so autograd reaches them (they were detached)."""
    from torch.func import functional_call

    path, x, _ = ckpt
    ref = mapped(path).eval()
    other = _other(ref)
    params = {k: v.detach().clone().requires_grad_(True) for k, v in other.named_parameters()}
    plain = {k: v.detach().clone().requires_grad_(True) for k, v in other.named_parameters()}
    functional_call(ref, plain, (x,)).square().sum().backward()
    model = mapped(path).eval()
    with LayerwiseOffloadManager(model, "blocks", device="cpu") as mgr:
        mgr.register_forward_hooks()
        functional_call(model, params, (x,)).square().sum().backward()
    for k in plain:
        assert params[k].grad is not None and torch.equal(params[k].grad, plain[k].grad), k
