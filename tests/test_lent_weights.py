"""A weight swapped out of an offloaded model and put back computes as the original again, as in plain
PyTorch: ``torch.func.functional_call`` (a plain tensor put into ``module._parameters`` for one call, the
original put back after it), and a user's own swap and swap back. The manager took the swapped-in tensor
as the weight, by writing it into the original parameter (in place: the original's ``.data`` became the
other model's storage) or into the weight's host store (the device path): the model kept computing with
the temporary weights after they were put back, and after ``close()``, silently. On the device path what
the model holds between forwards is a placeholder, and a parameter that replaced the weight had its values
written into the weight's host store: the old parameter (its data the store or a device buffer) took the
new values, and the old placeholder put back was taken for the new weight. Each now stands for the old
weight, and put back is that weight again."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mapoffload import LayerwiseOffloadManager, WeightNotLoadedError
from mapoffload.offload.placeholder import OffloadedWeight
from mapoffload.offload.runtime import OffloadedGradientError
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
                assert torch.equal(model(x), want)
                assert model.blocks[3].weight is orig  # the placeholder put back is the one held again
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


@pytest.mark.parametrize("path_kind", PATHS)
def test_functional_call_with_another_models_parameters(ckpt, path_kind):
    """``dict(other.named_parameters())``: Parameters, not plain tensors, each taken as a replacement for the
    call; what functional_call puts back after it (on the device path the placeholders) is the model's own
    weights again, and the other model keeps its values."""
    from torch.func import functional_call

    path, x, want = ckpt
    ref = mapped(path).eval()
    other = _other(ref)
    kept = {k: v.detach().clone() for k, v in other.named_parameters()}
    model = mapped(path).eval()
    with LayerwiseOffloadManager(model, "blocks", device="cpu", **PATHS[path_kind]) as mgr:
        mgr.register_forward_hooks()
        with torch.no_grad():
            for _ in range(2):
                assert torch.equal(functional_call(model, dict(other.named_parameters()), (x,)), other(x))
                assert torch.equal(model(x), want)
    with torch.no_grad():
        assert torch.equal(model(x), want)
    assert all(torch.equal(p.detach(), kept[k]) for k, p in other.named_parameters())
    assert not any(isinstance(p, OffloadedWeight) for p in model.parameters())


@pytest.mark.parametrize("host_store", ["mapped", "pageable"])
def test_a_loaded_weights_parameter_put_back_after_a_swap_on_the_device_path(ckpt, host_store):
    """Taken while its layer is loaded (a resident layer), the weight is the real parameter, whose data was
    the device buffer (or the host store) the swapped-in values were then written into."""
    path, x, want = ckpt
    model = mapped(path).eval()
    tmp = torch.full_like(model.blocks[0].weight, 0.01)
    with LayerwiseOffloadManager(model, "blocks", device="cpu", cpu_twin=True, host_store=host_store,
                                 resident_layers=1) as mgr:
        mgr.register_forward_hooks()
        with torch.no_grad():
            model(x)
            orig = model.blocks[0].weight
            assert not isinstance(orig, OffloadedWeight)
            model.blocks[0].weight = nn.Parameter(tmp.clone())
            model(x)
            model.blocks[0].weight = orig
            assert torch.equal(model(x), want)
    with torch.no_grad():
        assert torch.equal(model(x), want)
    assert model.blocks[0].weight is orig


@pytest.mark.parametrize("path_kind", PATHS)
def test_torch_func_over_weights_lent_outside_the_layers(ckpt, path_kind):
    """A lent weight outside the layers is a functorch wrapper under torch.func: it has no storage to look
    up among the outside weights (it raised "Cannot access data pointer")."""
    from torch.func import functional_call, grad, vmap

    path, x, _ = ckpt
    ref = mapped(path).eval()
    params = {k: v.detach() for k, v in _other(ref).named_parameters() if k.startswith("mix")}
    plain_grads = grad(lambda p: functional_call(ref, p, (x,), strict=False).square().sum())(params)
    with torch.no_grad():
        plain_vmap = vmap(lambda p: functional_call(ref, p, (x,), strict=False))(
            {k: v.unsqueeze(0).expand(2, *v.shape) for k, v in params.items()})
    model = mapped(path).eval()
    with LayerwiseOffloadManager(model, "blocks", device="cpu", **PATHS[path_kind]) as mgr:
        mgr.register_forward_hooks()
        with torch.no_grad():
            batched = vmap(lambda p: functional_call(model, p, (x,), strict=False))(
                {k: v.unsqueeze(0).expand(2, *v.shape) for k, v in params.items()})
        if path_kind == "twin":  # gradients are refused on the device path (its layers' buffers are reused)
            with pytest.raises(OffloadedGradientError):
                grad(lambda p: functional_call(model, p, (x,), strict=False).square().sum())(params)
        else:
            grads = grad(lambda p: functional_call(model, p, (x,), strict=False).square().sum())(params)
            assert all(torch.equal(grads[k], plain_grads[k]) for k in params)
    assert torch.equal(batched, plain_vmap)


TWIN = PATHS["twin"]


def test_the_swapped_out_placeholder_is_its_old_parameter(ckpt):
    """``.data =`` or ``requires_grad_`` on the placeholder of a parameter swapped out changes that parameter
    only (they went to the weight the slot holds now); put back into another layer's slot, it is that
    layer's replacement (its placeholder stays that layer's own: a ``.data =`` there was written into the
    first layer)."""
    path, x, _ = ckpt
    ref, model = mapped(path).eval(), mapped(path).eval()
    new, values = torch.full_like(ref.blocks[3].weight, 0.01), torch.full_like(ref.blocks[3].weight, -0.02)
    with LayerwiseOffloadManager(model, "blocks", device="cpu", **TWIN) as mgr:
        mgr.register_forward_hooks()
        olds = {}
        with torch.no_grad():
            for m in (model, ref):
                olds[id(m)] = m.blocks[3].weight  # on the twin, the placeholder
                m.blocks[3].weight = nn.Parameter(new.clone())
                m(x)
                olds[id(m)].data = values.clone()
                olds[id(m)].requires_grad_(False)
            assert torch.equal(model(x), ref(x)) and model.blocks[3].weight.requires_grad
            for m in (model, ref):
                m.blocks[4].weight = olds[id(m)]
                m.blocks[4].weight.data = new.clone() * 2
            assert torch.equal(model(x), ref(x))
    for name, p in ref.named_parameters():
        assert type(model.get_parameter(name)) is nn.Parameter and torch.equal(model.get_parameter(name), p), name


def test_an_update_then_a_swap_then_the_old_weight_put_back(ckpt):
    """The old parameter's values are what an update wrote (it still viewed the mapping it was bound to)."""
    path, x, _ = ckpt
    model = mapped(path).eval()
    update = torch.full_like(model.blocks[0].weight, 0.03)
    with LayerwiseOffloadManager(model, "blocks", device="cpu", **TWIN) as mgr:
        mgr.register_forward_hooks()
        with torch.no_grad():
            model(x)
            orig = model.blocks[0].weight
            mgr.update_cpu_weights({"blocks.0.weight": update})
            model.blocks[0].weight = nn.Parameter(torch.zeros_like(update))
            model(x)
            model.blocks[0].weight = orig
            got = model(x)
    plain = mapped(path).eval()
    plain.blocks[0].weight = nn.Parameter(update.clone())
    with torch.no_grad():
        assert torch.equal(got, plain(x)) and torch.equal(model(x), plain(x))


def test_the_placeholder_put_back_while_its_layer_is_loaded_is_the_weight(ckpt):
    path, x, want = ckpt
    model = mapped(path).eval()
    with LayerwiseOffloadManager(model, "blocks", device="cpu", **TWIN) as mgr:
        mgr.register_forward_hooks()
        orig = model.blocks[3].weight
        assert isinstance(orig, OffloadedWeight)
        mgr.load_all_layers()
        model.blocks[3].weight = orig  # what the slot held before the load: no edit
        with torch.no_grad():
            assert torch.equal(model(x), want)


def test_close_never_raises_with_a_refused_edit_and_a_load_in_flight(ckpt):
    path, _, _ = ckpt
    for kw in ({}, {"reads": "uncached"}, TWIN):
        model = mapped(path).eval()
        mgr = LayerwiseOffloadManager(model, "blocks", device="cpu", **kw)
        mgr.register_forward_hooks()
        mgr.prefetch_layer(3)  # read ahead, not waited for
        model.blocks[3].bias = nn.Parameter(torch.zeros(7))  # a wrong shape: refused at a forward
        mgr.close()
        assert model.blocks[3].bias.shape == (7,)  # given back as the user left it


def test_a_placeholder_used_after_close_says_so(ckpt):
    path, x, _ = ckpt
    model = mapped(path).eval()
    with LayerwiseOffloadManager(model, "blocks", device="cpu", **TWIN) as mgr:
        mgr.register_forward_hooks()
        held = model.blocks[3].weight
    assert type(model.blocks[3].weight) is nn.Parameter
    words = r"placeholder .* its manager has closed.*take that one from the model"
    with pytest.raises(WeightNotLoadedError, match=words):
        held.sum()


def test_data_on_the_held_placeholder_before_the_swap_is_taken_up(ckpt):
    """No forward between the swap and ``.data =`` on the placeholder held from before it: the value went
    into the new parameter (the swap was taken up by the write)."""
    path, x, _ = ckpt
    ref, model = mapped(path).eval(), mapped(path).eval()
    new, values = torch.full_like(ref.blocks[3].weight, 0.01), torch.full_like(ref.blocks[3].weight, -0.02)
    with LayerwiseOffloadManager(model, "blocks", device="cpu", **TWIN) as mgr:
        mgr.register_forward_hooks()
        with torch.no_grad():
            for m in (model, ref):
                old = m.blocks[3].weight
                m.blocks[3].weight = nn.Parameter(new.clone())
                old.data = values.clone()
            assert torch.equal(model(x), ref(x))
    assert torch.equal(model.blocks[3].weight.detach(), new)


def test_data_given_to_the_swapped_out_parameter_is_kept(ckpt):
    path, x, _ = ckpt
    ref, model = mapped(path).eval(), mapped(path).eval()
    new, values = torch.full_like(ref.blocks[3].weight, 0.01), torch.full_like(ref.blocks[3].weight, -0.02)
    with LayerwiseOffloadManager(model, "blocks", device="cpu", **TWIN) as mgr:
        mgr.register_forward_hooks()
        mgr.prefetch_layer(3, non_blocking=False)
        with torch.no_grad():
            for m in (model, ref):
                old = m.blocks[3].weight  # the real parameter (its layer is loaded)
                m.blocks[3].weight = nn.Parameter(new.clone())
                old.data = values.clone()
                if m is model:
                    mgr.release_layer(3)
                m.blocks[3].weight = old
            assert torch.equal(old.detach(), values) and torch.equal(model(x), ref(x))


def test_requires_grad_follows_the_weight_in_the_slot(ckpt):
    """The gradient rule asks the weight a swap put in the slot (a frozen one was refused as trainable), and
    ``model.parameters()`` between forwards answers what each real parameter says (a flag set on one while
    its layer was loaded was not seen)."""
    from torch.func import functional_call

    path, x, _ = ckpt
    model = mapped(path).eval()
    with LayerwiseOffloadManager(model, "blocks", device="cpu", **TWIN) as mgr:
        mgr.register_forward_hooks()
        model.requires_grad_(False)
        with torch.no_grad():
            functional_call(model, {"blocks.0.weight": nn.Parameter(torch.zeros(1024, 512), requires_grad=False)},
                            (x,))
        model(x)  # autograd on, every weight frozen: nothing refused
        model.blocks[0].weight = nn.Parameter(torch.zeros(1024, 512), requires_grad=False)
        model(x)
        mgr.prefetch_layer(3, non_blocking=False)
        real = model.blocks[3].weight
        mgr.release_layer(3)
        real.requires_grad_(True)
        assert [n for n, p in model.named_parameters() if p.requires_grad] == ["blocks.3.weight"]
        held = model.blocks[4].weight
    with pytest.raises(WeightNotLoadedError, match="its manager has closed"):
        held.requires_grad_(False)  # the model holds its real parameter again: this changed nothing


def test_close_never_raises_with_a_swap_beside_a_refused_edit(ckpt):
    """Taking up the swap set its placeholder's requires_grad through the placeholder's own rule, which took
    up the layer's edits again, strictly: the refused one beside it raised out of close()."""
    path, _, _ = ckpt
    model = mapped(path).eval()
    new = nn.Parameter(torch.zeros(1024, 512))
    mgr = LayerwiseOffloadManager(model, "blocks", device="cpu", **TWIN)
    mgr.register_forward_hooks()
    model.blocks[3].weight = new
    model.blocks[3].bias = nn.Parameter(torch.zeros(7))  # a wrong shape: refused
    mgr.close()
    assert model.blocks[3].weight is new and model.blocks[3].bias.shape == (7,)
