"""In place means in place: on ``device="cpu"`` nothing moves, so the model
stays a normal model between forwards. Its parameters are the mapped tensors
themselves (the same objects, on the file mapping), ``state_dict()`` and
comparing a weight work, a forward outside ``no_grad`` gives the reference's
output, and input gradients are exact - through the mapping and with the
streamed layers read uncached alike. The device path (its CPU
twin here) keeps placeholders and refuses gradients with a typed error."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from mapoffload import LayerwiseOffloadManager, MappedRegions, OffloadedGradientError, OffloadedWeight

from stacks import LAYERS, mapped

READS = ["mapping", "uncached"]


def _manager(model, reads: str, **kw) -> LayerwiseOffloadManager:
    """In place, every layer streamed (no page cache for them): the window is what moves."""
    layer = model.blocks[0].weight.nbytes + model.blocks[0].bias.nbytes
    return LayerwiseOffloadManager(model, "blocks", device="cpu", page_cache_bytes=2 * layer,
                                   reads=reads, **kw)


def _assert_mapped_and_whole(model, params: dict, checkpoint: dict) -> None:
    regions = MappedRegions()
    for name, p in model.named_parameters():
        assert p is params[name], name  # the model's own parameter objects, never a placeholder
        assert not isinstance(p, OffloadedWeight), name
        if name.startswith("blocks."):
            assert regions.holds(p), f"{name} is not on the file mapping"
        assert torch.equal(p, checkpoint[name]), name


@pytest.mark.parametrize("reads", READS)
def test_between_forwards_the_parameters_are_the_mapped_tensors(ckpt, reads):
    path, x, want = ckpt
    checkpoint = load_file(path)
    model = mapped(path)
    params = dict(model.named_parameters())
    with _manager(model, reads) as mgr:
        _assert_mapped_and_whole(model, params, checkpoint)  # before any forward
        mgr.register_forward_hooks()
        for _ in range(2):
            with torch.no_grad():
                assert torch.equal(model(x), want)
            _assert_mapped_and_whole(model, params, checkpoint)
            state = model.state_dict()
            assert state.keys() == checkpoint.keys()
            for k, v in checkpoint.items():
                assert torch.equal(state[k], v), k
        # A loaded layer is the same: prefetched, it computes from where it is read in.
        mgr.prefetch_layer(3, non_blocking=False)
        assert torch.equal(model.blocks[3].weight, checkpoint["blocks.3.weight"])
        mgr.release_layer(3)
        _assert_mapped_and_whole(model, params, checkpoint)


@pytest.mark.parametrize("reads", READS)
def test_a_forward_outside_no_grad_equals_the_reference(ckpt, reads):
    path, x, want = ckpt
    model = mapped(path)
    assert model.blocks[0].weight.requires_grad  # a plain model: nothing frozen
    with _manager(model, reads) as mgr:
        mgr.register_forward_hooks()
        for _ in range(2):
            out = model(x)
            assert out.requires_grad and torch.equal(out.detach(), want)
        _assert_mapped_and_whole(model, dict(model.named_parameters()), load_file(path))


@pytest.mark.parametrize("frozen", [False, True], ids=["trainable", "frozen"])
@pytest.mark.parametrize("reads", READS)
def test_input_gradients_in_place_are_exact(ckpt, reads, frozen):
    path, x, _ = ckpt
    ref = mapped(path)  # the same bytes on the same kind of mapping, no manager
    model = mapped(path)
    for m in (ref, model):
        m.requires_grad_(not frozen)
    xr = x.clone().requires_grad_()
    want_y = ref(xr)
    (want_g,) = torch.autograd.grad(want_y.square().sum(), xr)
    with _manager(model, reads) as mgr:
        mgr.register_forward_hooks()
        # A layer loaded ahead under no_grad (into a reused uncached buffer) is read
        # again through its mapping when it runs with autograd recording.
        with torch.no_grad():
            mgr.prefetch_layer(0, non_blocking=False)
        for _ in range(2):
            xi = x.clone().requires_grad_()
            y = model(xi)
            (g,) = torch.autograd.grad(y.square().sum(), xi)
            assert torch.equal(y.detach(), want_y.detach()) and torch.equal(g, want_g)
        if not frozen:  # weight gradients too: computed from the weights the forward used
            want_w = torch.autograd.grad(ref(x).sum(), ref.blocks[LAYERS - 1].weight)[0]
            got_w = torch.autograd.grad(model(x).sum(), model.blocks[LAYERS - 1].weight)[0]
            assert torch.equal(got_w, want_w)


def test_a_dtype_conversion_is_still_refused_and_a_device_move_leaves_the_mapping(ckpt):
    path, x, want = ckpt
    model = mapped(path)
    params = dict(model.named_parameters())
    with LayerwiseOffloadManager(model, "blocks", device="cpu") as mgr:
        mgr.register_forward_hooks()
        with pytest.raises(TypeError, match="was converted"):
            model.half()
        model.to("cpu")
        model.float()  # its own dtype: nothing to convert
        _assert_mapped_and_whole(model, params, load_file(path))
        with torch.no_grad():
            assert torch.equal(model(x), want)


def test_the_device_path_keeps_placeholders_and_refuses_gradients_with_a_typed_error(ckpt):
    path, x, want = ckpt
    model = mapped(path)
    with LayerwiseOffloadManager(model, "blocks", device="cpu", cpu_twin=True) as mgr:
        mgr.register_forward_hooks()
        assert isinstance(model.blocks[0].weight, OffloadedWeight)
        with pytest.raises(OffloadedGradientError, match=r"blocks\.0.*device buffers.*torch\.no_grad") as info:
            model(x)
        assert isinstance(info.value, RuntimeError) and info.value.layer == 0
        model.requires_grad_(False)
        xi = x.clone().requires_grad_()
        with pytest.raises(OffloadedGradientError, match="later layers overwrite"):
            model(xi)
        assert not any(mgr.parts.is_loaded(i) for i in range(LAYERS))  # released, turn left
        with torch.no_grad():
            assert torch.equal(model(x), want)


@pytest.mark.parametrize("reads", READS)
def test_a_host_weight_edit_is_the_parameter_and_what_the_forward_computes_with(ckpt, reads):
    path, x, _ = ckpt
    checkpoint = load_file(path)
    ref = mapped(path)
    new = checkpoint["blocks.2.weight"] * 0.5
    ref.blocks[2].weight = torch.nn.Parameter(new.clone())
    with torch.no_grad():
        want = ref(x)
    model = mapped(path)
    weight = model.blocks[2].weight
    with _manager(model, reads) as mgr:
        mgr.register_forward_hooks()
        with torch.no_grad():
            model(x)
        mgr.update_cpu_weights({"blocks.2.weight": new})
        assert model.blocks[2].weight is weight and torch.equal(weight, new)  # between forwards already
        assert not MappedRegions().holds(weight)  # an owned tensor now: the mapping is left as it is
        for _ in range(2):
            with torch.no_grad():
                assert torch.equal(model(x), want)
            assert torch.equal(model.blocks[2].weight, new)
    assert torch.equal(model.blocks[2].weight, new)
    assert torch.equal(load_file(path)["blocks.2.weight"], checkpoint["blocks.2.weight"])  # the file unchanged
