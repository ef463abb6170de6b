"""Hostile tests of replaced weights and copies of an offloaded model (issue 36): each was a defect an
attack on the first fix reproduced - a replacement undone while its layer's load was in flight, queries
and summary() blind to it until a forward, pickling failing on the manager's weak reference, a view of
another weight accepted in place, an inference-mode parameter, a closed manager's error. Each compares
with a plain model holding the same weights."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from torch import nn

import mapoffload
from mapoffload.offload.sequencer import checksum
from mapoffload import LayerwiseOffloadManager, ReplacedWeightError
from mapoffload.offload.hooks import OffloadedCopyError
from stacks import IN, OUT, mapped

PATHS = {"in-place": {}, "twin": {"cpu_twin": True, "host_store": "mapped"}}


@pytest.fixture
def stack(ckpt):
    path, x, want = ckpt
    return path, x, want, mapped(path)  # the last: the plain model (same checkpoint, no manager)


def _plain_with(ref: nn.Module, edits: dict[str, torch.Tensor]) -> nn.Module:
    plain = copy.deepcopy(ref)
    for name, value in edits.items():
        mod, attr = name.rsplit(".", 1)
        setattr(plain.get_submodule(mod), attr, nn.Parameter(value.clone()))
    return plain


# -- 1. a replacement of a layer whose load is in flight is undone silently --------------------------

@pytest.mark.parametrize("path_kind", PATHS)
@pytest.mark.parametrize("i", [0, 3], ids=["ensure-binds-over-it", "release-skips-it"])
def test_a_layer_replaced_while_its_prefetch_is_in_flight_computes(stack, path_kind, i):
    """prefetch_layer(i) (non-blocking) then a replacement of layer i: the next forward computes with the
    OLD weight, and the user's parameter is dropped from the model (Sequencer.ensure binds a load that
    was not ready without adopt_edits; Sequencer.release adopts only ready loads)."""
    path, x, want, ref = stack
    model = mapped(path)
    new = torch.randn(OUT, IN)
    with LayerwiseOffloadManager(model, "blocks", device="cpu", **PATHS[path_kind]) as mgr:
        mgr.register_forward_hooks()
        with torch.no_grad():
            model(x)
            mgr.prefetch_layer(i)  # in flight
            model.blocks[i].weight = nn.Parameter(new.clone())
            got = model(x)
    assert not torch.equal(got, want), "the replacement was undone: the old weight computed"
    assert torch.equal(got, _plain_with(ref, {f"blocks.{i}.weight": new})(x))


@pytest.mark.parametrize("path_kind", PATHS)
def test_a_replacement_from_an_earlier_layers_forward_hook_computes(stack, path_kind):
    """A user's forward hook on layer 0 replaces layer 1's weight (layer 1 is being read ahead,
    prefetch_layers=1): lost silently, in this forward and every later one."""
    path, x, want, ref = stack
    model = mapped(path)
    new = torch.randn(OUT, IN)
    with LayerwiseOffloadManager(model, "blocks", device="cpu", prefetch_layers=1, **PATHS[path_kind]) as mgr:
        mgr.register_forward_hooks()
        done = []

        def hook(module, args, output):
            if not done:
                done.append(1)
                model.blocks[1].weight = nn.Parameter(new.clone())

        model.blocks[0].register_forward_hook(hook)
        with torch.no_grad():
            model(x)
            second = model(x)  # between forwards: nothing in flight, still the old weight
    assert torch.equal(second, _plain_with(ref, {"blocks.1.weight": new})(x))


# -- 2. reads of the host weights before a forward adopted the replacement ---------------------------

@pytest.mark.parametrize("path_kind", PATHS)
def test_iter_cpu_weights_and_checksum_see_a_replacement_before_a_forward(stack, path_kind):
    """iter_cpu_weights / its checksum / store_of answer the OLD mapped weight until a forward
    happens to adopt the replacement."""
    path, x, want, ref = stack
    model = mapped(path)
    new = torch.randn(OUT, IN)
    with LayerwiseOffloadManager(model, "blocks", device="cpu", **PATHS[path_kind]) as mgr:
        mgr.register_forward_hooks()
        model.blocks[3].weight = nn.Parameter(new.clone())
        before = (torch.equal(dict(mgr.iter_cpu_weights())["blocks.3.weight"], new), checksum(mgr.iter_cpu_weights()),
                  mgr.parts.store_of("blocks.3.weight"))
        with torch.no_grad():
            model(x)
        after = (torch.equal(dict(mgr.iter_cpu_weights())["blocks.3.weight"], new), checksum(mgr.iter_cpu_weights()),
                 mgr.parts.store_of("blocks.3.weight"))
    assert before == after


def test_summary_counts_a_replaced_weight_once(stack):
    """offload(): after replacing every layer's weight (before a forward) the summary counts them twice,
    as the stack's mapped bytes and as anonymous bytes of the placed rest ('a full host copy of these
    50.05 MiB' for a 26.05 MiB model)."""
    path, x, want, ref = stack
    model = mapped(path).eval()
    with mapoffload.offload(model, device="cpu", layers="blocks") as h:
        total = sum(r.nbytes for r in h.rows)
        for b in model.blocks:
            b.weight = nn.Parameter(torch.randn(OUT, IN))
        assert sum(r.nbytes for r in h.rows) == total, h.summary()


# -- 3. copies: raw TypeErrors instead of the refusal --------------------------------------------------

@pytest.mark.parametrize("path_kind", PATHS)
def test_pickle_after_remove_forward_hooks_is_not_a_weakref_error(stack, path_kind):
    """remove_forward_hooks() gives the model back whole, but pickle/torch.save then fail with
    "TypeError: cannot pickle 'weakref.ReferenceType' object" (the _mapoffload_manager mark on every
    parameter), neither a copy nor the refusal naming close()."""
    path, x, want, ref = stack
    model = mapped(path)
    with LayerwiseOffloadManager(model, "blocks", device="cpu", **PATHS[path_kind]) as mgr:
        mgr.register_forward_hooks()
        mgr.remove_forward_hooks()
        try:
            torch.save(model, io.BytesIO())
        except OffloadedCopyError:
            pass  # a refusal naming the close call would be fine too


def test_torch_save_of_an_adopted_parameter_is_refused_as_the_others(stack):
    """In place, torch.save of a managed weight is refused with OffloadedCopyError; of a weight the user
    replaced (adopted) it was a raw "cannot pickle 'weakref.ReferenceType'" TypeError (the manager's mark)."""
    path, x, want, ref = stack
    model = mapped(path)
    with LayerwiseOffloadManager(model, "blocks", device="cpu") as mgr:
        mgr.register_forward_hooks()
        with pytest.raises(OffloadedCopyError):
            torch.save(model.blocks[5].weight, io.BytesIO())
        model.blocks[3].weight = nn.Parameter(torch.randn(OUT, IN))
        with torch.no_grad():
            model(x)  # adopted
        with pytest.raises(OffloadedCopyError, match=r"Call manager\.close\(\) first"):
            pickle.dumps(model.blocks[3].weight)


# -- 4. a replacement sharing another managed weight's storage ---------------------------------------

@pytest.mark.parametrize("way", ["parameter", "data"])
def test_update_of_a_weight_replaced_by_a_view_of_another_leaves_the_other(stack, way):
    """In place, `blocks[3].weight = blocks[2].weight` is refused ('offloads already'); so is
    nn.Parameter(blocks[2].weight.detach()) or `.data = blocks[2].weight.data`, which were adopted as a
    'strided' owned tensor while they were blocks[2]'s mapped view: update_cpu_weights({'blocks.3.weight': v})
    then wrote v into blocks[2]'s weight (and into its mapped pages). A copy is taken."""
    path, x, want, ref = stack
    model = mapped(path)
    v = torch.randn(OUT, IN)
    with LayerwiseOffloadManager(model, "blocks", device="cpu") as mgr:
        mgr.register_forward_hooks()
        if way == "parameter":
            model.blocks[3].weight = nn.Parameter(model.blocks[2].weight.detach())
        else:
            model.blocks[3].weight.data = model.blocks[2].weight.data
        with pytest.raises(ReplacedWeightError, match=r"blocks\.3\.weight.*shares its bytes with blocks\.2\.weight"):
            with torch.no_grad():
                model(x)
        copy_of_2 = model.blocks[2].weight.detach().clone()
        model.blocks[3].weight = nn.Parameter(copy_of_2)  # what the refusal says to do
        with torch.no_grad():
            assert torch.equal(model(x), _plain_with(ref, {"blocks.3.weight": copy_of_2})(x))
        mgr.update_cpu_weights({"blocks.3.weight": v})
        assert torch.equal(model.blocks[2].weight.detach(), ref.blocks[2].weight.detach()), "blocks.2 was written"
        with torch.no_grad():
            assert torch.equal(model(x), _plain_with(ref, {"blocks.3.weight": v})(x))


# -- 5. a parameter made under inference_mode, on the twin -------------------------------------------

def test_a_parameter_made_under_inference_mode_computes_on_the_twin(stack):
    """A plain model computes with a Parameter made under torch.inference_mode(); on the twin the adopted
    parameter gets .data set to the host store / device buffer and the forward fails inside F.linear
    with an untyped "Inference tensors do not track version counter" (no weight named)."""
    path, x, want, ref = stack
    model = mapped(path)
    with torch.inference_mode():
        p = nn.Parameter(torch.randn(OUT, IN))
    with LayerwiseOffloadManager(model, "blocks", device="cpu", cpu_twin=True, host_store="mapped") as mgr:
        mgr.register_forward_hooks()
        model.blocks[3].weight = p
        try:
            with torch.no_grad():
                got = model(x)
        except ReplacedWeightError as e:  # a refusal naming the weight would be acceptable
            assert "blocks.3.weight" in str(e)
            return
    assert torch.equal(got, _plain_with(ref, {"blocks.3.weight": p.detach().clone()})(x))


# -- 6. a closed manager meets a replacement -----------------------------------------------------------

def test_a_closed_manager_says_closed_whatever_was_replaced(stack):
    """After close(), a replacement and another manager on the model, the old manager's
    register_forward_hooks() raises ReplacedWeightError ('offloads already'): Sequencer.engage adopts
    edits before Holders.engage checks closed."""
    path, x, want, ref = stack
    model = mapped(path)
    old = LayerwiseOffloadManager(model, "blocks", device="cpu")
    old.close()
    model.blocks[3].weight = nn.Parameter(torch.randn(OUT, IN))
    with LayerwiseOffloadManager(model, "blocks", device="cpu"):
        with pytest.raises(RuntimeError, match="closed"):
            old.register_forward_hooks()


def test_requires_grad_set_between_forwards_on_the_twin_is_the_weights(stack):
    """On the device path ``model.requires_grad_(False)`` between forwards reaches the placeholders: the
    real parameters follow (the gradient rule lets the forward run; close() gives them back frozen)."""
    path, x, want, _ = stack
    model = mapped(path)
    with LayerwiseOffloadManager(model, "blocks", device="cpu", cpu_twin=True, host_store="mapped") as mgr:
        mgr.register_forward_hooks()
        model.requires_grad_(False)
        assert torch.equal(model(x), want)  # autograd on: refused before, as 'weights require grad'
    assert not any(p.requires_grad for p in model.blocks.parameters())


@pytest.mark.parametrize("path_kind", PATHS)
def test_a_query_meets_a_replacement_while_the_layers_load_is_in_flight(stack, path_kind):
    """iter_cpu_weights with layer 4's prefetch in flight and its weight replaced: the load lands, is let
    go, the replacement is taken once and the layer loads afresh (no adoption inside the landing load)."""
    path, x, want, ref = stack
    model = mapped(path)
    new = torch.randn(OUT, IN)
    with LayerwiseOffloadManager(model, "blocks", device="cpu", **PATHS[path_kind]) as mgr:
        mgr.register_forward_hooks()
        mgr.prefetch_layer(4)
        model.blocks[4].weight = nn.Parameter(new.clone())
        hosts = dict(mgr.iter_cpu_weights())
        assert torch.equal(hosts["blocks.4.weight"], new)
        with torch.no_grad():
            assert torch.equal(model(x), _plain_with(ref, {"blocks.4.weight": new})(x))
