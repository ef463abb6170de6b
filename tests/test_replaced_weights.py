"""A weight the user replaces in an offloaded model between forwards is the weight that computes
(issue 36): ``layer.weight = nn.Parameter(new)``, ``layer.weight.data = new`` and
``load_state_dict(sd, assign=True)``, in place (``device="cpu"``) and on the CPU twin of the device
pipeline, through the manager, ``offload()`` and ``from_pretrained``; a replacement the manager
cannot compute with is refused by name, never undone silently. Each output is compared with a plain
model holding the new weights."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import mapoffload
from mapoffload import LayerwiseOffloadManager, ReplacedWeightError
from stacks import mapped

WAYS = ["parameter", "data", "assign"]
PATHS = {"in-place": {}, "twin": {"cpu_twin": True, "host_store": "mapped"}}


def _replace(module: nn.Module, attr: str, new: torch.Tensor, way: str, like: nn.Module) -> None:
    """Replace ``module.attr`` with ``new`` the ``way`` a user would (``like``: the plain module, whose
    other weights a whole state dict carries)."""
    if way == "parameter":
        setattr(module, attr, nn.Parameter(new.clone()))
    elif way == "data":
        getattr(module, attr).data = new.clone()
    else:  # what LoRA merges and weight swaps do: the whole module's state, assigned
        sd = {n: (new.clone() if n == attr else p.detach().clone()) for n, p in like.named_parameters()}
        module.load_state_dict(sd, assign=True)


@pytest.fixture
def stack(ckpt):
    path, x, _ = ckpt
    ref = mapped(path)  # the plain model: the same checkpoint, no manager
    return path, x, ref


def _plain_with(ref: nn.Module, edits: dict[str, torch.Tensor]) -> nn.Module:
    plain = copy.deepcopy(ref)
    for name, value in edits.items():
        mod_name, attr = name.rsplit(".", 1)
        setattr(plain.get_submodule(mod_name), attr, nn.Parameter(value.clone()))
    return plain


@pytest.mark.parametrize("path_kind", PATHS)
@pytest.mark.parametrize("way", WAYS)
def test_a_replaced_layer_weight_computes_through_the_manager(stack, way, path_kind):
    path, x, ref = stack
    model = mapped(path)
    torch.manual_seed(1)
    new = torch.randn_like(ref.blocks[3].weight)
    with LayerwiseOffloadManager(model, "blocks", device="cpu", **PATHS[path_kind]) as mgr:
        mgr.register_forward_hooks()
        with torch.no_grad():
            model(x)  # a forward first: the slots were bound and released
        _replace(model.blocks[3], "weight", new, way, like=ref.blocks[3])
        want = _plain_with(ref, {"blocks.3.weight": new})
        with torch.no_grad():
            for _ in range(2):  # the second forward too: nothing reverts it later
                assert torch.equal(model(x), want(x))
        assert mgr.parts.store_of("blocks.3.weight") == "strided"  # an owned tensor now, counted as such
        assert mgr.pageable_bytes >= new.numel() * 4
    # closed: the model is given back with the new weight
    assert torch.equal(model.blocks[3].weight.detach(), new)
    with torch.no_grad():
        assert torch.equal(model(x), want(x))


def test_in_place_the_users_parameter_is_the_models(stack):
    """In place nothing moves: the parameter the user put there stays the model's (an optimizer
    holding it sees the weight that computes), and an in-place edit of it after the swap counts."""
    path, x, ref = stack
    model = mapped(path)
    with LayerwiseOffloadManager(model, "blocks", device="cpu") as mgr:
        mgr.register_forward_hooks()
        p = nn.Parameter(torch.randn_like(ref.blocks[5].weight))
        model.blocks[5].weight = p
        with torch.no_grad():
            model(x)
            assert model.blocks[5].weight is p
            p.mul_(2)  # the user's later in-place edit of their own parameter
            assert torch.equal(model(x), _plain_with(ref, {"blocks.5.weight": p.detach()})(x))
    assert model.blocks[5].weight is p


@pytest.mark.parametrize("path_kind", PATHS)
def test_only_some_layers_replaced(stack, path_kind):
    path, x, ref = stack
    model = mapped(path)
    torch.manual_seed(2)
    edits = {f"blocks.{i}.weight": torch.randn_like(ref.blocks[i].weight) for i in (0, 7, 11)}
    edits["blocks.7.bias"] = torch.randn_like(ref.blocks[7].bias)
    with LayerwiseOffloadManager(model, "blocks", device="cpu", **PATHS[path_kind]) as mgr:
        mgr.register_forward_hooks()
        for name, value in edits.items():
            mod, attr = name.rsplit(".", 1)
            setattr(model.get_submodule(mod), attr, nn.Parameter(value.clone()))
        with torch.no_grad():
            assert torch.equal(model(x), _plain_with(ref, edits)(x))
        assert mgr.parts.store_of("blocks.1.weight") == "mapped"  # the others stay on their mapping


@pytest.mark.parametrize("path_kind", PATHS)
def test_a_replacement_while_the_hooks_are_off_is_taken_when_they_are_on_again(stack, path_kind):
    path, x, ref = stack
    model = mapped(path)
    new = torch.randn_like(ref.blocks[2].weight)
    with LayerwiseOffloadManager(model, "blocks", device="cpu", **PATHS[path_kind]) as mgr:
        mgr.register_forward_hooks()
        mgr.remove_forward_hooks()  # the model whole: a normal model
        model.blocks[2].weight = nn.Parameter(new.clone())
        mgr.register_forward_hooks()
        with torch.no_grad():
            assert torch.equal(model(x), _plain_with(ref, {"blocks.2.weight": new})(x))


def test_update_cpu_weights_after_a_replacement_wins(stack):
    path, x, ref = stack
    model = mapped(path)
    a, b = torch.randn_like(ref.blocks[4].weight), torch.randn_like(ref.blocks[4].weight)
    with LayerwiseOffloadManager(model, "blocks", device="cpu", cpu_twin=True, host_store="mapped") as mgr:
        mgr.register_forward_hooks()
        model.blocks[4].weight = nn.Parameter(a)
        mgr.update_cpu_weights({"blocks.4.weight": b})  # the later of the two
        with torch.no_grad():
            assert torch.equal(model(x), _plain_with(ref, {"blocks.4.weight": b})(x))


def test_a_kept_layer_replaced_between_forwards(stack):
    path, x, ref = stack
    model = mapped(path)
    new = torch.randn_like(ref.blocks[0].weight)
    with LayerwiseOffloadManager(model, "blocks", device="cpu", cpu_twin=True, host_store="mapped",
                                 resident_layers=1) as mgr:
        mgr.register_forward_hooks()
        with torch.no_grad():
            model(x)  # layer 0 stays loaded on the "device"
            assert mgr.parts.is_loaded(0)
            model.blocks[0].weight = nn.Parameter(new.clone())
            assert torch.equal(model(x), _plain_with(ref, {"blocks.0.weight": new})(x))


@pytest.mark.parametrize("path_kind", PATHS)
@pytest.mark.parametrize("bad, words", [
    (lambda w: nn.Parameter(torch.zeros(3, 3)), "shape"),
    (lambda w: nn.Parameter(w.detach().to(torch.float64)), "float64"),
    (lambda w: nn.Parameter(torch.empty_like(w, device="meta")), "meta"),
    (lambda w: None, "removed"),
], ids=["shape", "dtype", "meta", "none"])
def test_a_replacement_it_cannot_compute_with_is_refused_by_name(stack, path_kind, bad, words):
    path, x, ref = stack
    model = mapped(path)
    with LayerwiseOffloadManager(model, "blocks", device="cpu", **PATHS[path_kind]) as mgr:
        mgr.register_forward_hooks()
        model.blocks[6]._parameters["weight"] = bad(ref.blocks[6].weight)
        for _ in range(2):  # and again: never undone silently on a retry
            with pytest.raises(ReplacedWeightError, match=rf"blocks\.6\.weight.*{words}"), torch.no_grad():
                model(x)
        bad_value = model.blocks[6]._parameters["weight"]
    # given back as the user left it (close never raises)
    assert model.blocks[6]._parameters["weight"] is bad_value


def test_a_tied_weight_replaced_in_one_place_only_is_refused(tmp_path):
    from safetensors.torch import save_file

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
            self.b.weight = self.a.weight  # one weight in two places of the layer

        def forward(self, x):
            return self.b(self.a(x))

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(2))

        def forward(self, x):
            for blk in self.blocks:
                x = blk(x)
            return x

    torch.manual_seed(0)
    ref = Tied()
    save_file({k: v for k, v in ref.state_dict().items() if ".b.weight" not in k}, tmp_path / "t.safetensors")
    with mapoffload.empty_weights():
        model = Tied()
    mapoffload.load_checkpoint(model, tmp_path / "t.safetensors", keep_mapping=True, strict=False)
    with LayerwiseOffloadManager(model, "blocks", device="cpu") as mgr:
        mgr.register_forward_hooks()
        model.blocks[1].b.weight = nn.Parameter(torch.ones(8, 8))
        with pytest.raises(ReplacedWeightError, match="some of the places"), torch.no_grad():
            model(torch.ones(1, 8))
        both = nn.Parameter(torch.ones(8, 8))
        model.blocks[1].a.weight = model.blocks[1].b.weight = both  # tied again, both replaced
        with torch.no_grad():
            plain = copy.deepcopy(ref)
            plain.blocks[1].a.weight = plain.blocks[1].b.weight = nn.Parameter(torch.ones(8, 8))
            got, want = model(torch.ones(1, 8)), plain(torch.ones(1, 8))
            assert model.blocks[1].a.weight is model.blocks[1].b.weight is both
            # layer 0 computes from its mapped view, the plain copy from an aligned one: the kernels' sums
            # may differ in the last bit
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_another_layers_offloaded_weight_is_refused(stack):
    path, x, _ = stack
    model = mapped(path)
    with LayerwiseOffloadManager(model, "blocks", device="cpu") as mgr:
        mgr.register_forward_hooks()
        model.blocks[1].weight = model.blocks[2].weight
        with pytest.raises(ReplacedWeightError, match="offloads already"), torch.no_grad():
            model(x)


def test_refused_new_data_is_given_back_as_the_user_left_it(stack):
    path, x, ref = stack
    model = mapped(path)
    odd = torch.ones(2, 2, dtype=torch.float16)
    with LayerwiseOffloadManager(model, "blocks", device="cpu") as mgr:
        mgr.register_forward_hooks()
        model.blocks[8].weight.data = odd
        with pytest.raises(ReplacedWeightError, match=r"blocks\.8\.weight.*shape"), torch.no_grad():
            model(x)
    assert model.blocks[8].weight.data_ptr() == odd.data_ptr()  # close() did not undo it either


WRITES = {
    "load_state_dict": lambda model, name, new: model.load_state_dict({name: new}, strict=False),
    "mul_": lambda model, name, new: model.get_parameter(name).copy_(new),
}


@pytest.mark.parametrize("write", WRITES)
@pytest.mark.parametrize("then", ["release_all", "hooks_again", "close", "forward"])
def test_a_loaded_layer_written_in_place_on_the_twin_keeps_the_write(stack, write, then):
    """Issue 41: on the device path (its CPU twin), a weight of a loaded layer written in place - an
    ordinary ``load_state_dict(sd)`` (not ``assign``) or ``w.copy_`` / ``w.mul_`` under ``no_grad`` -
    computed at first, and the next release, the hooks registered again or ``close()`` brought the
    checkpoint's weight back without a word. The write is the weight from then on."""
    path, x, ref = stack
    model = mapped(path)
    new = torch.randn_like(ref.blocks[2].weight)
    want = _plain_with(ref, {"blocks.2.weight": new})
    mgr = LayerwiseOffloadManager(model, "blocks", device="cpu", cpu_twin=True, host_store="mapped")
    mgr.register_forward_hooks()
    mgr.load_all_layers()
    with torch.no_grad():
        WRITES[write](model, "blocks.2.weight", new)
        assert torch.equal(model(x), want(x))
        if then == "release_all":
            mgr.release_all()
        elif then == "hooks_again":
            mgr.remove_forward_hooks()
            mgr.register_forward_hooks()
        elif then == "close":
            mgr.close()
            assert torch.equal(model.blocks[2].weight.detach(), new)
        for _ in range(2):
            assert torch.equal(model(x), want(x))
    if then != "close":
        assert mgr.parts.store_of("blocks.2.weight") == "strided"  # an owned copy now, counted as such
        mgr.close()
    assert torch.equal(model.blocks[2].weight.detach(), new)


def test_a_resident_layer_written_in_place_on_the_twin_keeps_the_write(stack):
    path, x, ref = stack
    model = mapped(path)
    new = torch.randn_like(ref.blocks[0].weight)
    with LayerwiseOffloadManager(model, "blocks", device="cpu", cpu_twin=True, host_store="mapped",
                                 resident_layers=3) as mgr:
        mgr.register_forward_hooks()
        with torch.no_grad():
            model(x)
            assert mgr.parts.is_loaded(0)
            model.blocks[0].weight.mul_(0).add_(new)
            for _ in range(2):
                assert torch.equal(model(x), _plain_with(ref, {"blocks.0.weight": new})(x))
            mgr.release_layer(0)
            assert torch.equal(model(x), _plain_with(ref, {"blocks.0.weight": new})(x))
    assert torch.equal(model.blocks[0].weight.detach(), new)


@pytest.mark.parametrize("path_kind", PATHS)
def test_a_parametrization_added_while_offloaded_is_refused_as_such(stack, path_kind):
    """weight_norm / register_parametrization moves the weight out of the slot: it was refused as "removed
    (None)", which the user never did."""
    from torch.nn.utils import parametrizations

    path, x, _ = stack
    model = mapped(path)
    with LayerwiseOffloadManager(model, "blocks", device="cpu", **PATHS[path_kind]) as mgr:
        mgr.register_forward_hooks()
        with torch.no_grad():
            model(x)
        if path_kind == "twin":  # between forwards the slot holds a placeholder: refused as it is read
            with pytest.raises(mapoffload.WeightNotLoadedError, match=r"blocks\.4\.weight is offloaded .*not loaded"):
                parametrizations.weight_norm(model.blocks[4])
            return
        parametrizations.weight_norm(model.blocks[4])
        with pytest.raises(ReplacedWeightError, match=r"blocks\.4\.weight .*moved into a parametrization"), \
                torch.no_grad():
            model(x)


def test_a_users_hooks_on_the_device_path_see_the_weights_where_the_message_says(stack):
    """A forward hook registered after the manager's runs once the layer is released; the refusal says
    which hooks see the weights (a pre-hook registered after offloading, a hook registered before it)."""
    path, x, want = stack
    model = mapped(path)
    seen = {}
    model.blocks[5].register_forward_hook(lambda mod, a, o: seen.__setitem__("hook before", mod.weight.sum()))
    with LayerwiseOffloadManager(model, "blocks", device="cpu", **PATHS["twin"]) as mgr:
        mgr.register_forward_hooks()
        model.blocks[5].register_forward_pre_hook(lambda mod, a: seen.__setitem__("pre-hook after", mod.weight.sum()))
        with torch.no_grad():
            model(x)
        assert seen["hook before"] == seen["pre-hook after"] == x.new_tensor(0) + _plain_sum(path)
        model.blocks[5].register_forward_hook(lambda mod, a, o: mod.weight.sum())
        words = "forward pre-hook registered after offloading, or a forward hook registered before it"
        with pytest.raises(mapoffload.WeightNotLoadedError, match=words), torch.no_grad():
            model(x)


def _plain_sum(path) -> torch.Tensor:
    return mapped(path).blocks[5].weight.detach().sum()


def test_a_tie_made_on_the_device_path_is_refused_then_given_back_tied(stack):
    """Between forwards the slot holds the other weight's placeholder: refused by name (it said the values
    were gone), and close() gave the model back holding a placeholder (it could not run, nor be saved)."""
    path, x, ref = stack
    model = mapped(path)
    with LayerwiseOffloadManager(model, "blocks", device="cpu", **PATHS["twin"]) as mgr:
        mgr.register_forward_hooks()
        with torch.no_grad():
            model(x)
        model.blocks[1].weight = model.blocks[0].weight
        with pytest.raises(ReplacedWeightError, match=r"blocks\.1\.weight .* with blocks\.0\.weight's placeholder"), \
                torch.no_grad():
            model(x)
    assert model.blocks[1].weight is model.blocks[0].weight and type(model.blocks[0].weight) is nn.Parameter
    plain = copy.deepcopy(ref)
    plain.blocks[1].weight = plain.blocks[0].weight
    with torch.no_grad():
        assert torch.equal(model(x), plain(x))
