"""Adversarial tests of issue 35's change (the plan fits the room): part-by-part streaming, the rest
(head) streamed, the measured margin and NoRoomError.

A small stack (3 blocks of a norm and two 2 MiB projections) and a 3 MiB head under a fake cgroup v2
cap that leaves the layers less than a layer and the head no room beside the smallest window: the
layers are read part by part and the head, larger than its window (a part), read by its own faults
as it computes (one matmul: until issue 41 it was computed 1024 rows at a time, not bit-equal with
more than one thread on some CPUs).
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

from mapoffload import LayerwiseOffloadManager, NoRoomError
from mapoffload.memory.budget import ENV_PAGE_CACHE_MARGIN_MIB
from mapoffload.offload.hooks import patched
from mapoffload.pagecache import coordinator as coordinator_module
from mapoffload.pagecache.residency import LAYER, PART

from fake_cgroups import fake_cap
from room_stack import LAYER_BYTES, PART_BYTES, W, Block, Stack
from room_stack import mapped as mapped_from
from stacks import save_reference

MIB, KIB = 1 << 20, 1 << 10
BLOCKS = 3
HEAD = 1536  # 3 MiB: larger than a part (2 MiB), smaller than a layer (4 MiB)
HEAD_BYTES = W * HEAD * 4
IN_USE, MARGIN = 10 * MIB, 8 * MIB


class Model(Stack):
    def __init__(self, head_bias: bool = False, head_cls=nn.Linear, block_cls=Block) -> None:
        super().__init__(BLOCKS, HEAD, head_bias, head_cls, block_cls)


def checkpoint(tmp_file_dir, make=Model, dtype=torch.float32, name="model.safetensors"):
    torch.manual_seed(0)
    ref = make().to(dtype)
    x = torch.randn(3, W, dtype=dtype)
    return save_reference(ref, x, tmp_file_dir / name)


def mapped(path, make=Model) -> nn.Module:
    return mapped_from(path, make)


def plain(path, make=Model, dtype=torch.float32) -> nn.Module:
    from safetensors.torch import load_file

    model = make().to(dtype)
    model.load_state_dict(load_file(str(path)))
    return model


@pytest.fixture
def cap(tmp_path, monkeypatch):
    """``cap(bytes)``: a fake cgroup v2 cap with 10 MiB in use and an 8 MiB margin (the user's)."""
    return fake_cap(tmp_path, monkeypatch, margin=MARGIN, in_use=IN_USE)


def streamed_head(head: nn.Module) -> bool:
    """The head is streamed: read in (or by its faults) before it runs, let go after, by hooks."""
    return bool(head._forward_pre_hooks)


def row_chunks(head: nn.Module):
    """The head's :class:`~mapoffload.offload.runtime.RowChunks` (its streamed forward computes over them), or
    None."""
    forward = vars(head).get("forward")
    streamed = getattr(getattr(forward, "__wrapped__", None), "_streamed", None) if "forward" in patched(head) else None
    return getattr(streamed, "rows", None)


def tight(head_bytes: int = HEAD_BYTES) -> int:
    """A cap that leaves half a MiB beside the head: the head streamed, the layers part by part."""
    return IN_USE + MARGIN + head_bytes + MIB // 2


def roomy() -> int:
    """A cap where everything fits: nothing streamed."""
    return IN_USE + MARGIN + HEAD_BYTES + 4 * BLOCKS * LAYER_BYTES


def given_back(model: nn.Module) -> None:
    """No mapoffload patch nor hook left on any module."""
    for name, m in model.named_modules():
        assert patched(m) == (), (name, patched(m))
        assert "forward" not in vars(m), name
        assert not m._forward_pre_hooks and not m._forward_hooks, (name, m._forward_pre_hooks, m._forward_hooks)


def part_hooks(model: nn.Module) -> int:
    return sum(len(b.up._forward_pre_hooks) for b in model.blocks)


# --- the baseline ------------------------------------------------------------------------------------


def test_part_mode_and_streamed_head_give_the_plain_output(tmp_file_dir, cap):
    path, x, want = checkpoint(tmp_file_dir)
    cap(tight())
    model = mapped(path)
    with LayerwiseOffloadManager(model, "blocks", device="cpu") as mgr:
        plan = mgr.residency
        assert plan.unit == PART and plan.always_streamed, plan.describe()
        mgr.register_forward_hooks()
        with torch.no_grad():
            for _ in range(2):
                assert torch.equal(model(x), want)
        assert streamed_head(model.head)  # streamed: 3 MiB over a 2 MiB window, by its faults
        assert part_hooks(model) == BLOCKS
    given_back(model)
    with torch.no_grad():
        assert torch.equal(model(x), want)


def engaged(path, cap, make=Model, limit=None, **kw):
    """A manager in part mode with the head chunked, hooks on (closed by the caller)."""
    cap(tight() if limit is None else limit)
    model = mapped(path, make)
    mgr = LayerwiseOffloadManager(model, "blocks", device="cpu", **kw)
    mgr.register_forward_hooks()
    return model, mgr


# --- parts called twice, outside their layer, nested ----------------------------------------------


class TwiceBlock(Block):
    """Calls its ``up`` twice and its norm twice (a part run twice inside its layer)."""

    def forward(self, x):
        h = self.norm(self.norm(x))
        a = self.up(h)
        b = self.up(h * 0.5)
        return x + self.down(torch.tanh(a + b))


class TwiceModel(Model):
    def __init__(self) -> None:
        super().__init__(block_cls=TwiceBlock)


def test_a_part_called_twice_in_its_layer(tmp_file_dir, cap):
    path, x, want = checkpoint(tmp_file_dir, TwiceModel)
    model, mgr = engaged(path, cap, TwiceModel)
    with mgr, torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(x), want)
    given_back(model)


class OutsideModel(Model):
    """Runs a block's part outside its layer (before the stack, and after it)."""

    def forward(self, x):
        x = x + 0.01 * self.blocks[1].down(torch.tanh(self.blocks[2].up(x)))
        for b in self.blocks:
            x = b(x)
        x = self.blocks[0].norm(x)
        return self.head(x)


def test_a_part_called_outside_its_layer(tmp_file_dir, cap):
    path, x, want = checkpoint(tmp_file_dir, OutsideModel)
    model, mgr = engaged(path, cap, OutsideModel)
    with mgr, torch.no_grad():
        assert mgr.residency.unit == PART
        for _ in range(3):
            assert torch.equal(model(x), want)
        # A layer called on its own (not through the model: no model pre-hook).
        h = torch.randn(2, W)
        ref = plain(path, OutsideModel)
        assert torch.equal(model.blocks[1](h), ref.blocks[1](h))
        assert torch.equal(model.blocks[1].up(h), ref.blocks[1].up(h))
    given_back(model)


class NestedBlock(nn.Module):
    """A part that holds a weight of its own and runs a child part (nested parts), and a weight on the
    layer itself."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(W))
        self.mlp = nn.Sequential(nn.Linear(W, 2 * W, bias=False), nn.Tanh(), nn.Linear(2 * W, W, bias=False))
        self.mlp.register_parameter("gate", nn.Parameter(torch.randn(W)))  # held by the Sequential itself

    def forward(self, x):
        return x + self.scale * self.mlp(x * self.mlp.gate)


class NestedModel(Model):
    def __init__(self) -> None:
        super().__init__(block_cls=NestedBlock)


def test_nested_parts_and_a_weight_held_by_the_layer_itself(tmp_file_dir, cap):
    path, x, want = checkpoint(tmp_file_dir, NestedModel)
    model, mgr = engaged(path, cap, NestedModel)
    with mgr, torch.no_grad():
        assert mgr.residency.unit == PART
        for _ in range(3):
            assert torch.equal(model(x), want)
    given_back(model)


class TiedInLayerBlock(Block):
    """``down`` shares ``up``'s weight (transposed use): a weight tied between two parts of one layer."""

    def __init__(self) -> None:
        super().__init__()
        self.down.weight = self.up.weight

    def forward(self, x):
        h = torch.tanh(self.up(self.norm(x)))
        return x + nn.functional.linear(h, self.down.weight.t())


class TiedInLayerModel(Model):
    def __init__(self) -> None:
        super().__init__(block_cls=TiedInLayerBlock)


def test_a_weight_tied_between_two_parts_of_a_layer(tmp_file_dir, cap):
    torch.manual_seed(0)
    ref = TiedInLayerModel()
    x = torch.randn(3, W)
    from safetensors.torch import save_model

    path = tmp_file_dir / "tied.safetensors"
    save_model(ref, str(path))
    with torch.no_grad():
        want = ref(x)
    model, mgr = engaged(path, cap, TiedInLayerModel)
    with mgr, torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(x), want)
    given_back(model)


def test_a_module_shared_by_two_layers_is_refused_and_leaves_nothing(tmp_file_dir, cap):
    path, x, want = checkpoint(tmp_file_dir)
    cap(tight())
    model = mapped(path)
    model.blocks[1].up = model.blocks[0].up
    ref = plain(path)
    ref.blocks[1].up = ref.blocks[0].up
    with pytest.raises(ValueError, match="shared by layers"):
        LayerwiseOffloadManager(model, "blocks", device="cpu")
    given_back(model)
    assert not coordinator_module.coordinator().managers()
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))


# --- weights replaced or written between forwards -----------------------------------------------------


def test_a_part_weight_replaced_between_forwards(tmp_file_dir, cap):
    path, x, want = checkpoint(tmp_file_dir)
    model, mgr = engaged(path, cap)
    ref = plain(path)
    with mgr, torch.no_grad():
        assert torch.equal(model(x), want)
        new = torch.randn(2 * W, W)
        model.blocks[1].up.weight = nn.Parameter(new.clone())
        ref.blocks[1].up.weight = nn.Parameter(new.clone())
        for _ in range(2):
            assert torch.equal(model(x), ref(x))
    given_back(model)
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))


def test_a_part_weight_written_in_place_between_forwards(tmp_file_dir, cap):
    path, x, want = checkpoint(tmp_file_dir)
    model, mgr = engaged(path, cap)
    ref = plain(path)
    with mgr, torch.no_grad():
        assert torch.equal(model(x), want)
        model.blocks[1].up.weight.mul_(2)
        ref.blocks[1].up.weight.mul_(2)
        for _ in range(2):
            assert torch.equal(model(x), ref(x))
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))


def test_the_head_weight_replaced_while_it_is_streamed(tmp_file_dir, cap):
    path, x, want = checkpoint(tmp_file_dir)
    model, mgr = engaged(path, cap)
    ref = plain(path)
    with mgr, torch.no_grad():
        assert torch.equal(model(x), want)
        assert streamed_head(model.head)
        new = torch.randn(HEAD, W)
        model.head.weight = nn.Parameter(new.clone())
        ref.head.weight = nn.Parameter(new.clone())
        for _ in range(2):
            assert torch.equal(model(x), ref(x))
        # Replaced by a smaller one (a vocabulary cut): its own shape, not the old chunks'.
        small = torch.randn(700, W)
        model.head.weight = nn.Parameter(small.clone())
        ref.head.weight = nn.Parameter(small.clone())
        assert torch.equal(model(x), ref(x))
    given_back(model)


def test_the_head_weight_data_swapped_while_it_is_streamed(tmp_file_dir, cap):
    path, x, want = checkpoint(tmp_file_dir)
    model, mgr = engaged(path, cap)
    ref = plain(path)
    with mgr, torch.no_grad():
        assert torch.equal(model(x), want)
        new = torch.randn(HEAD, W)
        model.head.weight.data = new.clone()
        ref.head.weight.data = new.clone()
        assert torch.equal(model(x), ref(x))
        model.head.weight.data = torch.randn(600, W)  # another shape behind the same Parameter
        ref.head.weight.data = model.head.weight.data.clone()
        assert torch.equal(model(x), ref(x))
    given_back(model)


def test_the_head_weight_written_in_place_while_it_is_streamed(tmp_file_dir, cap):
    path, x, want = checkpoint(tmp_file_dir)
    model, mgr = engaged(path, cap)
    ref = plain(path)
    with mgr, torch.no_grad():
        assert torch.equal(model(x), want)
        model.head.weight.mul_(3)
        ref.head.weight.mul_(3)
        for _ in range(2):
            assert torch.equal(model(x), ref(x))
    given_back(model)


def test_no_let_go_is_in_flight_when_a_forward_returns(tmp_file_dir, cap, monkeypatch):
    """A let-go drops this process's clean pages of a span with MADV_DONTNEED (after reading which are
    clean): a weight written in place meanwhile - by the user's code right after the forward returned -
    was dropped with its write (the test above failed 2 in 25 runs on a busy machine: rows of the head
    back to the checkpoint's values, silently). So a forward returns only once its let-gos are done, and
    the head's own forward, called on its own, too."""
    import time

    from mapoffload.pagecache import pages as pages_module

    real = pages_module.let_go
    done: list[float] = []

    def slow_let_go(*args, **kwargs):
        time.sleep(0.05)
        out = real(*args, **kwargs)
        done.append(time.monotonic())
        return out

    monkeypatch.setattr(pages_module, "let_go", slow_let_go)
    path, x, want = checkpoint(tmp_file_dir)
    model, mgr = engaged(path, cap)
    with mgr, torch.no_grad():
        assert torch.equal(model(x), want)
        returned = time.monotonic()
        assert done and max(done) <= returned  # the head's and the layers' let-gos, all done
        done.clear()
        h = torch.randn(3, W)
        model.head(h)
        returned = time.monotonic()
        assert done and max(done) <= returned


def test_the_head_weight_replaced_inside_a_forward(tmp_file_dir, cap):
    """A pre-hook of the head (after the model's) swaps its weight: the forward uses the new one."""
    path, x, want = checkpoint(tmp_file_dir)
    model, mgr = engaged(path, cap)
    ref = plain(path)
    torch.manual_seed(5)
    small = torch.randn(700, W)
    swapped = []

    def swap(module, args):
        if not swapped:
            swapped.append(1)
            module.weight = nn.Parameter(small.clone())

    with mgr, torch.no_grad():
        assert torch.equal(model(x), want)
        h = model.head.register_forward_pre_hook(swap)
        got = model(x)
        h.remove()
        ref.head.weight = nn.Parameter(small.clone())
        assert torch.equal(got, ref(x))
    given_back(model)


def test_the_head_weight_grown_then_the_head_called_on_its_own(tmp_file_dir, cap):
    """The head's weight replaced by a larger one (a vocabulary grown) and the head called directly
    (no model forward in between, as a generation loop may): every row of the new weight computed."""
    path, x, want = checkpoint(tmp_file_dir)
    model, mgr = engaged(path, cap)
    ref = plain(path)
    torch.manual_seed(7)
    big = torch.randn(2048, W)
    h = torch.randn(3, W)
    with mgr, torch.no_grad():
        assert torch.equal(model(x), want)
        assert streamed_head(model.head)
        model.head.weight = nn.Parameter(big.clone())
        ref.head.weight = nn.Parameter(big.clone())
        got = model.head(h)
        assert got.shape == (3, 2048)
        assert torch.equal(got, ref.head(h))
    given_back(model)


def test_the_head_weight_grown_inside_a_forward(tmp_file_dir, cap):
    path, x, want = checkpoint(tmp_file_dir)
    model, mgr = engaged(path, cap)
    ref = plain(path)
    torch.manual_seed(5)
    big = torch.randn(2048, W)

    def swap(module, args):
        module.weight = nn.Parameter(big.clone())

    with mgr, torch.no_grad():
        assert torch.equal(model(x), want)
        handle = model.head.register_forward_pre_hook(swap)
        got = model(x)
        handle.remove()
        ref.head.weight = nn.Parameter(big.clone())
        assert torch.equal(got, ref(x))
    given_back(model)


# --- heads of other shapes ---------------------------------------------------------------------------


class BiasModel(Model):
    def __init__(self) -> None:
        super().__init__(head_bias=True)


def test_a_head_with_a_bias(tmp_file_dir, cap):
    path, x, want = checkpoint(tmp_file_dir, BiasModel)
    model, mgr = engaged(path, cap, BiasModel)
    with mgr, torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(x), want)
        assert streamed_head(model.head)
    given_back(model)


class ScaledLinear(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 0.5 + 1.0


class SubclassModel(Model):
    def __init__(self) -> None:
        super().__init__(head_cls=ScaledLinear)


def test_a_head_that_is_a_linear_subclass_with_its_own_forward(tmp_file_dir, cap):
    path, x, want = checkpoint(tmp_file_dir, SubclassModel)
    model, mgr = engaged(path, cap, SubclassModel)
    with mgr, torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(x), want)
        assert row_chunks(model.head) is None  # its own forward runs: not computed over chunks
    given_back(model)


class PlainSubclass(nn.Linear):
    """A subclass with nothing of its own but an attribute."""

    tag = "lm_head"


def test_a_head_that_is_a_linear_subclass_without_its_own_forward(tmp_file_dir, cap):
    make = lambda: Model(head_cls=PlainSubclass)  # noqa: E731
    path, x, want = checkpoint(tmp_file_dir, make)
    model, mgr = engaged(path, cap, make)
    with mgr, torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(x), want)
    given_back(model)


def test_a_head_whose_forward_the_user_set_on_the_instance(tmp_file_dir, cap):
    """``head.forward = ...`` on the instance (a user's wrapper, a logit soft-cap, another library's
    hook): the class's forward is nn.Linear's, but the instance's is what the model runs."""
    path, x, _ = checkpoint(tmp_file_dir)
    ref = plain(path)

    def capped(module):
        inner = module.forward
        return lambda h: 30.0 * torch.tanh(inner(h) / 30.0)

    ref.head.forward = capped(ref.head)
    with torch.no_grad():
        want = ref(x)
    cap(tight())
    model = mapped(path)
    model.head.forward = capped(model.head)
    with LayerwiseOffloadManager(model, "blocks", device="cpu") as mgr:
        mgr.register_forward_hooks()
        with torch.no_grad():
            assert mgr.residency.always_streamed
            for _ in range(2):
                assert torch.equal(model(x), want)
    with torch.no_grad():
        assert torch.equal(model(x), want)


class TiedModel(nn.Module):
    """An embedding tied to the head (a language model's): the table read whole by the head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(HEAD, W)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(W, HEAD, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        x = self.embed(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def test_a_head_tied_to_the_embedding(tmp_file_dir, cap):
    from safetensors.torch import save_model

    torch.manual_seed(0)
    ref = TiedModel()
    ids = torch.randint(0, HEAD, (2, 5))
    path = tmp_file_dir / "tied_head.safetensors"
    save_model(ref, str(path))
    with torch.no_grad():
        want = ref(ids)
    model, mgr = engaged(path, cap, TiedModel)
    with mgr, torch.no_grad():
        assert mgr.residency.always_streamed
        for _ in range(2):
            assert torch.equal(model(ids), want)
        assert streamed_head(model.head)
    given_back(model)
    with torch.no_grad():
        assert torch.equal(model(ids), want)


def test_a_non_contiguous_head_weight(tmp_file_dir, cap):
    """The head's weight a strided view of the mapping (every other half-row): streamed, not chunked."""
    path, x, _ = checkpoint(tmp_file_dir)
    ref = plain(path)
    model = mapped(path)
    for m in (ref, model):
        view = m.head.weight.data.view(HEAD // 2, 2 * W)[:, :W]
        assert not view.is_contiguous()
        m.head.weight = nn.Parameter(view)
    with torch.no_grad():
        want = ref(x)
    cap(tight())
    with LayerwiseOffloadManager(model, "blocks", device="cpu") as mgr:
        mgr.register_forward_hooks()
        with torch.no_grad():
            for _ in range(2):
                assert torch.equal(model(x), want)
            assert row_chunks(model.head) is None  # not computed over chunks
            assert mgr.residency.always_streamed and model.head._forward_pre_hooks, mgr.residency.describe()
    given_back(model)
    with torch.no_grad():
        assert torch.equal(model(x), want)


# --- gradients, dtypes -------------------------------------------------------------------------------


def test_gradients_through_the_streamed_head_equal_the_plain_models(tmp_file_dir, cap):
    path, x, want = checkpoint(tmp_file_dir)
    ref = plain(path)
    for p in ref.blocks.parameters():
        p.requires_grad_(False)
    xr = x.clone().requires_grad_(True)
    ref(xr).pow(2).sum().backward()
    model, mgr = engaged(path, cap)
    for p in model.blocks.parameters():
        p.requires_grad_(False)
    with mgr:
        xm = x.clone().requires_grad_(True)
        out = model(xm)
        assert streamed_head(model.head)
        assert torch.equal(out.detach(), want)
        out.pow(2).sum().backward()
        assert torch.allclose(xm.grad, xr.grad, rtol=0, atol=1e-6 * xr.grad.abs().max().item())
        assert model.head.weight.grad is not None
        assert torch.equal(model.head.weight.grad, ref.head.weight.grad)
    given_back(model)


def test_the_input_gradient_through_the_streamed_head_is_bit_equal(tmp_file_dir, cap):
    path, x, want = checkpoint(tmp_file_dir)
    ref = plain(path).requires_grad_(False)
    xr = x.clone().requires_grad_(True)
    ref(xr).pow(2).sum().backward()
    model, mgr = engaged(path, cap)
    model.requires_grad_(False)
    with mgr:
        xm = x.clone().requires_grad_(True)
        out = model(xm)
        assert streamed_head(model.head) and torch.equal(out.detach(), want)
        out.pow(2).sum().backward()
        diff = (xm.grad - xr.grad).abs().max().item()
        assert torch.equal(xm.grad, xr.grad), f"the input's gradient differs by up to {diff}"


def test_a_bf16_head_too_large_for_the_window_computes_as_the_plain_one(tmp_file_dir, cap):
    """Chunks of a bf16 head's rows were not bit-equal to the whole matmul (oneDNN blocks a narrower output
    otherwise): the first call of a kind of input finds out, and where they are not, the head computes
    whole - read by its own faults, let go after - from then on. Either way, as the plain model's."""
    path, x, want = checkpoint(tmp_file_dir, dtype=torch.bfloat16)
    ref = plain(path, dtype=torch.bfloat16)
    cap(IN_USE + MARGIN + HEAD_BYTES // 2 + MIB // 4)
    model = mapped(path, lambda: Model().to(torch.bfloat16))
    with LayerwiseOffloadManager(model, "blocks", device="cpu") as mgr:
        mgr.register_forward_hooks()
        with torch.no_grad():
            got = [model(x) for _ in range(2)]
            hs = [torch.randn(300, W, dtype=torch.bfloat16) for _ in range(2)]
            head_got = [model.head(h) for h in hs]
        rows = row_chunks(model.head)
        assert mgr.residency.always_streamed and rows is not None, mgr.residency.describe()
        assert len(rows.exact) == 2 and rows.chunked_calls == sum(rows.exact.values()), rows.exact
    with torch.no_grad():
        for h, hg in zip(hs, head_got):
            head_want = ref.head(h)
            diff = (hg.float() - head_want.float()).abs().max().item()
            assert torch.equal(hg, head_want), f"bf16 head differs from the whole head by {diff}"
    assert all(torch.equal(g, want) for g in got)


# --- exceptions inside a part, inside the chunked head ----------------------------------------------


class Boom(Exception):
    pass


@pytest.mark.parametrize("error", [Boom, KeyboardInterrupt])
def test_an_error_inside_a_part(tmp_file_dir, cap, error):
    path, x, want = checkpoint(tmp_file_dir)
    model, mgr = engaged(path, cap)
    calls = []

    def hook(module, args, output):
        if not calls:
            calls.append(1)
            raise error("inside the up projection")

    with mgr, torch.no_grad():
        assert torch.equal(model(x), want)
        handle = model.blocks[1].up.register_forward_hook(hook)
        with pytest.raises(error):
            model(x)
        handle.remove()
        for _ in range(2):
            assert torch.equal(model(x), want)
        handle = model.blocks[2].up.register_forward_hook(hook)
        calls.clear()
        with pytest.raises(error):
            model(x)
        handle.remove()
    given_back(model)
    with torch.no_grad():
        assert torch.equal(model(x), want)


@pytest.mark.parametrize("error", [Boom, KeyboardInterrupt])
def test_an_error_inside_the_streamed_head(tmp_file_dir, cap, error):
    from torch.overrides import TorchFunctionMode

    path, x, want = checkpoint(tmp_file_dir)
    model, mgr = engaged(path, cap)

    class RaiseOnSecondChunk(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.nn.functional.linear and args[1].shape[0] in (1024, 512):
                self.n += 1
                if self.n == 2:
                    raise error("inside the head's second chunk")
            return func(*args, **(kwargs or {}))

    with mgr, torch.no_grad():
        assert torch.equal(model(x), want)
        with pytest.raises(error), RaiseOnSecondChunk():
            model(x)
        for _ in range(2):
            assert torch.equal(model(x), want)
        with pytest.raises(RuntimeError):
            model.head(torch.randn(2, W + 1))  # a wrong shape, raised by the first chunk's matmul
        assert torch.equal(model(x), want)
    given_back(model)
    with torch.no_grad():
        assert torch.equal(model(x), want)


# --- close, remove, re-register in part mode --------------------------------------------------------


def test_remove_and_register_again_in_part_mode(tmp_file_dir, cap):
    path, x, want = checkpoint(tmp_file_dir)
    model, mgr = engaged(path, cap)
    with mgr, torch.no_grad():
        assert torch.equal(model(x), want)
        assert part_hooks(model) == BLOCKS
        mgr.remove_forward_hooks()
        given_back(model)
        assert torch.equal(model(x), want)
        mgr.register_forward_hooks()
        for _ in range(2):
            assert torch.equal(model(x), want)
        assert part_hooks(model) == BLOCKS and streamed_head(model.head)
        mgr.close()
        given_back(model)
        mgr.close()
        assert torch.equal(model(x), want)
    given_back(model)


def test_close_from_inside_a_part(tmp_file_dir, cap):
    """The manager closed by a part's hook mid-forward: the forward ends right, nothing left behind."""
    path, x, want = checkpoint(tmp_file_dir)
    model, mgr = engaged(path, cap)

    def close(module, args):
        mgr.close()

    with torch.no_grad():
        assert torch.equal(model(x), want)
        handle = model.blocks[1].up.register_forward_pre_hook(close)
        got = model(x)
        handle.remove()
        assert torch.equal(got, want)
    given_back(model)
    with torch.no_grad():
        assert torch.equal(model(x), want)


def test_remove_from_inside_the_streamed_head(tmp_file_dir, cap):
    path, x, want = checkpoint(tmp_file_dir)
    model, mgr = engaged(path, cap)

    def remove(module, args):
        mgr.remove_forward_hooks()

    with mgr, torch.no_grad():
        assert torch.equal(model(x), want)
        handle = model.head.register_forward_pre_hook(remove)
        got = model(x)
        handle.remove()
        assert torch.equal(got, want)
        given_back(model)
    given_back(model)


# --- the plan switching between forwards ------------------------------------------------------------


def test_the_plan_switches_between_parts_layers_and_whole(tmp_file_dir, cap):
    path, x, want = checkpoint(tmp_file_dir)
    model, mgr = engaged(path, cap)
    layer_room = IN_USE + MARGIN + HEAD_BYTES + 2 * LAYER_BYTES + MIB  # layers whole, the head cached
    seen = []
    with mgr, torch.no_grad():
        for limit in (tight(), layer_room, roomy(), tight(), roomy(), layer_room, tight()):
            cap(limit)
            for _ in range(2):
                assert torch.equal(model(x), want), (limit, mgr.residency.describe())
            plan = mgr.residency
            seen.append((plan.unit, plan.always_streamed))
            assert part_hooks(model) == (BLOCKS if plan.unit == PART and plan.streamed else 0), plan.describe()
            assert (streamed_head(model.head)) == plan.always_streamed, plan.describe()
        assert (PART, True) in seen and (LAYER, False) in seen, seen
    given_back(model)


@pytest.mark.parametrize("reads", ["mapping", "uncached"])
def test_the_plan_switches_under_each_read_path(tmp_file_dir, cap, reads):
    path, x, want = checkpoint(tmp_file_dir)
    model, mgr = engaged(path, cap, reads=reads)
    layer_room = IN_USE + MARGIN + HEAD_BYTES + 2 * LAYER_BYTES + MIB
    with mgr, torch.no_grad():
        for limit in (tight(), layer_room, tight(), roomy(), tight()):
            cap(limit)
            for _ in range(2):
                assert torch.equal(model(x), want), (limit, mgr.residency.describe())
    given_back(model)


# --- two managers over one model ----------------------------------------------------------------------


class TwoStacks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.ModuleList(Block() for _ in range(2))
        self.dec = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(W, HEAD, bias=False)

    def forward(self, x):
        for b in self.enc:
            x = b(x)
        for b in self.dec:
            x = b(x)
        return self.head(x)


@pytest.mark.parametrize("first_closed", ["enc", "dec"])
def test_two_managers_over_one_model_one_closed(tmp_file_dir, cap, first_closed):
    path, x, want = checkpoint(tmp_file_dir, TwoStacks)
    cap(tight())
    model = mapped(path, TwoStacks)
    enc = LayerwiseOffloadManager(model, "enc", device="cpu")
    dec = LayerwiseOffloadManager(model, "dec", device="cpu")
    mgrs = {"enc": enc, "dec": dec}
    try:
        enc.register_forward_hooks()
        dec.register_forward_hooks()
        with torch.no_grad():
            for _ in range(2):
                assert torch.equal(model(x), want)
            assert enc.residency.always_streamed and streamed_head(model.head), enc.residency.describe()
            mgrs[first_closed].close()
            for _ in range(2):
                assert torch.equal(model(x), want)
            assert torch.equal(model.head(x), plain(path, TwoStacks).head(x))
    finally:
        enc.close()
        dec.close()
    given_back(model)
    with torch.no_grad():
        assert torch.equal(model(x), want)


def test_two_managers_over_one_model_one_removed_then_the_head_called(tmp_file_dir, cap):
    """The manager whose chunked forward the head runs removes its hooks; the other still streams it."""
    path, x, want = checkpoint(tmp_file_dir, TwoStacks)
    cap(tight())
    model = mapped(path, TwoStacks)
    ref = plain(path, TwoStacks)
    with LayerwiseOffloadManager(model, "enc", device="cpu") as enc, \
            LayerwiseOffloadManager(model, "dec", device="cpu") as dec:
        enc.register_forward_hooks()
        dec.register_forward_hooks()
        with torch.no_grad():
            assert torch.equal(model(x), want)
            for m in (enc, dec):
                m.remove_forward_hooks()
                h = torch.randn(2, W)
                assert torch.equal(model.head(h), ref.head(h))
                m.register_forward_hooks()
                assert torch.equal(model(x), want)
    given_back(model)


# --- fork ------------------------------------------------------------------------------------------------


def test_a_forked_child_runs_a_forward_in_part_mode(tmp_file_dir, tmp_path):
    from child import describe, run_python

    path, x, want = checkpoint(tmp_file_dir)
    torch.save({"x": x, "want": want}, tmp_path / "io.pt")
    proc = run_python(f"""
import os, torch
from mapoffload import LayerwiseOffloadManager
from mapoffload.offload.hooks import patched
from mapoffload.pagecache import coordinator as coordinator_module
from mapoffload.pagecache.residency import PART
from fake_cgroups import v2_cap
import test_attack_room as t
root = {str(tmp_path / "cg")!r}
coordinator_module.CGROUP_ROOT = root
v2_cap(root, t.tight(), t.IN_USE, 0, 0)
io = torch.load({str(tmp_path / "io.pt")!r})
x, want = io["x"], io["want"]
model = t.mapped({str(path)!r})
mgr = LayerwiseOffloadManager(model, "blocks", device="cpu")
mgr.register_forward_hooks()
with torch.no_grad():
    assert torch.equal(model(x), want)
assert mgr.residency.unit == PART and t.streamed_head(model.head), mgr.residency.describe()
pid = os.fork()
if pid == 0:
    code = 0
    try:
        with torch.no_grad():
            for _ in range(2):
                if not torch.equal(model(x), want):
                    code = 3
        mgr.close()
        if patched(model.head) or not torch.equal(model(x), want):
            code = 5
    except BaseException as e:
        print("child:", type(e).__name__, e, flush=True)
        code = 4
    os._exit(code)
from child import reap
code = reap(pid, 60)
with torch.no_grad():
    assert torch.equal(model(x), want)
mgr.close()
assert not patched(model.head)
print("child", code)
""", timeout=120, env={"OMP_NUM_THREADS": "1", "MAPOFFLOAD_PAGE_CACHE_MARGIN_MIB": str(MARGIN // MIB),
                       "MAPOFFLOAD_PEERS_DIR": str(tmp_path / "peers")})
    assert proc.returncode == 0 and "child 0" in proc.stdout, describe(proc)


# --- the refusal ------------------------------------------------------------------------------------------


def test_no_room_leaves_the_model_whole_and_a_later_manager_works(tmp_file_dir, cap):
    path, x, want = checkpoint(tmp_file_dir)
    cap(IN_USE + 9 * MIB)  # 9 MiB - 8.01 MiB margin: under a 2 MiB part
    model = mapped(path)
    for _ in range(2):
        with pytest.raises(NoRoomError):
            LayerwiseOffloadManager(model, "blocks", device="cpu")
    given_back(model)
    assert not coordinator_module.coordinator().managers()
    with torch.no_grad():
        assert torch.equal(model(x), want)
    cap(tight())
    with LayerwiseOffloadManager(model, "blocks", device="cpu") as mgr:
        mgr.register_forward_hooks()
        with torch.no_grad():
            assert torch.equal(model(x), want)
    given_back(model)


def test_no_room_for_a_second_manager_leaves_the_first_working(tmp_file_dir, cap):
    path, x, want = checkpoint(tmp_file_dir, TwoStacks)
    cap(tight())
    model = mapped(path, TwoStacks)
    with LayerwiseOffloadManager(model, "enc", device="cpu") as enc:
        enc.register_forward_hooks()
        with torch.no_grad():
            assert torch.equal(model(x), want)
        cap(IN_USE + 9 * MIB)
        with pytest.raises(NoRoomError):
            LayerwiseOffloadManager(model, "dec", device="cpu")
        assert len(coordinator_module.coordinator().managers()) == 1
        cap(tight())
        with torch.no_grad():
            for _ in range(2):
                assert torch.equal(model(x), want)
    given_back(model)


# --- more: copies, autocast, a tied table's reads, the user's margin, recomputed layers ----------------


def test_the_streamed_head_copied_or_pickled_is_refused_or_plain(tmp_file_dir, cap):
    """The layers refuse copy.deepcopy and pickle while hooked (OffloadedCopyError); the streamed
    head's chunked forward is the manager's too: a copy must not carry it (nor a pickle fail obscurely)."""
    from mapoffload.offload.hooks import OffloadedCopyError

    path, x, want = checkpoint(tmp_file_dir)
    model, mgr = engaged(path, cap)
    with mgr, torch.no_grad():
        assert torch.equal(model(x), want)
        assert streamed_head(model.head)
        try:
            c = copy.deepcopy(model.head)
        except OffloadedCopyError:
            pass
        else:
            assert "forward" not in vars(c), "the copy carries the manager's chunked forward"
        try:
            pickle.dumps(model.head)
        except OffloadedCopyError:
            pass


def test_the_streamed_head_pickled_is_refused_clearly(tmp_file_dir, cap):
    """The head streamed whole (a Linear subclass: hooks, not a chunked forward)."""
    from mapoffload.offload.hooks import OffloadedCopyError

    path, x, want = checkpoint(tmp_file_dir, SubclassModel)
    model, mgr = engaged(path, cap, SubclassModel)
    with mgr, torch.no_grad():
        assert torch.equal(model(x), want)
        assert model.head._forward_pre_hooks
        try:
            pickle.dumps(model.head)
        except OffloadedCopyError:
            pass


def test_the_streamed_head_under_bf16_autocast(tmp_file_dir, cap):
    path, x, want = checkpoint(tmp_file_dir)
    model, mgr = engaged(path, cap)
    ref = plain(path)
    torch.manual_seed(3)
    with mgr, torch.no_grad():
        assert torch.equal(model(x), want)
        assert streamed_head(model.head)
        for n in (3, 64, 300, 1000):
            h = torch.randn(n, W)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                got, exp = model.head(h), ref.head(h)
            diff = (got.float() - exp.float()).abs().max().item()
            assert torch.equal(got, exp), f"batch {n}: differs by up to {diff} (outputs up to {exp.abs().max()})"


def test_a_bf16_streamed_head_over_larger_batches(tmp_file_dir, cap):
    path, x, want = checkpoint(tmp_file_dir, dtype=torch.bfloat16)
    ref = plain(path, dtype=torch.bfloat16)
    cap(IN_USE + MARGIN + HEAD_BYTES // 2 + MIB // 4)
    model = mapped(path, lambda: Model().to(torch.bfloat16))
    torch.manual_seed(3)
    with LayerwiseOffloadManager(model, "blocks", device="cpu") as mgr:
        mgr.register_forward_hooks()
        with torch.no_grad():
            assert torch.equal(model(x), want)
            for n in (3, 64, 300, 1000):
                for _ in range(2):  # the second call of a kind takes the chunks where the first found them exact
                    h = torch.randn(n, W, dtype=torch.bfloat16)
                    assert torch.equal(model.head(h), ref.head(h)), n


def test_a_table_tied_to_the_head_is_read_once_a_forward_and_within_the_window(tmp_file_dir, cap, monkeypatch):
    """A language model's embedding tied to its head, streamed: the embedding looks up a few rows, the
    head reads the table a window at a time. Reading the whole table in before the lookup (and letting
    it go after, for the head to read it again) reads it twice a forward, and all at once - more than
    the window the plan keeps room for."""
    from safetensors.torch import save_model

    from mapoffload.offload.runtime import WHAT
    from mapoffload.pagecache.pages import PageWorker

    torch.manual_seed(0)
    ref = TiedModel()
    ids = torch.randint(0, HEAD, (2, 5))
    path = tmp_file_dir / "tied_head.safetensors"
    save_model(ref, str(path))
    with torch.no_grad():
        want = ref(ids)
    reads: list[int] = []
    real = PageWorker.read_in

    def counted(self, spans, what="weights", *args, **kwargs):
        if what == WHAT:
            reads.append(spans.total_bytes)
        return real(self, spans, what, *args, **kwargs)

    monkeypatch.setattr(PageWorker, "read_in", counted)
    model, mgr = engaged(path, cap, TiedModel)
    with mgr, torch.no_grad():
        assert torch.equal(model(ids), want)
        reads.clear()
        assert torch.equal(model(ids), want)
        window = mgr.residency.window_bytes
        assert mgr.residency.always_streamed and HEAD_BYTES > window
        # Larger than the window: read by the head's own faults, never in one read of the table.
        assert all(r <= window for r in reads), (reads, window)
        assert sum(reads) <= 1.1 * HEAD_BYTES, (reads, HEAD_BYTES)


def test_the_refusal_keeps_to_the_users_margin(tmp_file_dir, cap, monkeypatch):
    """MAPOFFLOAD_PAGE_CACHE_MARGIN_MIB=1: the plan has room for a part beside the process; the
    refusal must not use a margin of its own that the user overrode."""
    path, x, want = checkpoint(tmp_file_dir)
    monkeypatch.setenv(ENV_PAGE_CACHE_MARGIN_MIB, "1")
    cap(IN_USE + 1 * MIB + HEAD_BYTES + PART_BYTES + MIB)  # a part and a MiB of room beside the head
    model = mapped(path)
    with LayerwiseOffloadManager(model, "blocks", device="cpu") as mgr:
        assert mgr.residency.unit == PART
        mgr.register_forward_hooks()
        with torch.no_grad():
            assert torch.equal(model(x), want)


class CheckpointedModel(Model):
    def forward(self, x):
        from torch.utils.checkpoint import checkpoint as recompute

        for b in self.blocks:
            x = recompute(b, x, use_reentrant=False)
        return self.head(x)


def test_part_mode_with_recomputed_layers(tmp_file_dir, cap):
    path, x, want = checkpoint(tmp_file_dir, CheckpointedModel)
    ref = plain(path, CheckpointedModel).requires_grad_(False)
    xr = x.clone().requires_grad_(True)
    ref(xr).sum().backward()
    model, mgr = engaged(path, cap, CheckpointedModel)
    model.requires_grad_(False)
    with mgr:
        xm = x.clone().requires_grad_(True)
        out = model(xm)
        assert torch.equal(out.detach(), want) and mgr.residency.unit == PART
        out.sum().backward()
        assert torch.allclose(xm.grad, xr.grad, rtol=0, atol=1e-5 * xr.grad.abs().max().item())
    given_back(model)
