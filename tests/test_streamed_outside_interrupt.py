"""A KeyboardInterrupt (or another BaseException that is not an Exception) raised inside a module outside
the layers whose always-read weights the plan streams (a head read in whole before it runs): torch runs
no always-call hook for it, and the weights stayed in the page cache, over the plan, until the module's
next run. They are let go as the exception leaves the module, as an Exception's are."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mapoffload import LayerwiseOffloadManager, drop_page_cache, resident_bytes

from fake_cgroups import fake_cap
from room_stack import Stack
from test_attack_room import BLOCKS, IN_USE, MARGIN, MIB, checkpoint, given_back, mapped, streamed_head

HEAD = 768  # 1.5 MiB: read in whole in the 2 MiB window of a part
EDGES = 2 * 4 << 10  # a page at each end of the head may stay


@pytest.fixture
def cap(tmp_path, monkeypatch):
    """``cap(bytes)``: a fake cgroup v2 cap with 10 MiB in use and an 8 MiB margin (test_attack_room's)."""
    return fake_cap(tmp_path, monkeypatch, margin=MARGIN, in_use=IN_USE)


class Head(nn.Linear):
    """A head of its own class: its forward is the one the test makes raise."""


class SmallHead(Stack):
    def __init__(self) -> None:
        super().__init__(BLOCKS, HEAD, head_cls=Head)


@pytest.mark.parametrize("error", [KeyboardInterrupt, SystemExit, RuntimeError])
def test_an_interrupt_inside_a_streamed_head_lets_its_weights_go(tmp_file_dir, cap, monkeypatch, error):
    path, x, want = checkpoint(tmp_file_dir, SmallHead)
    drop_page_cache(str(path))  # written back: a dirty page is neither paged out nor dropped by a let-go
    cap(IN_USE + MARGIN + 3 * MIB)  # a part's window, not the head beside it
    model = mapped(path, SmallHead)
    head = model.head
    with LayerwiseOffloadManager(model, "blocks", device="cpu") as mgr, torch.no_grad():
        assert mgr.residency.always_streamed, mgr.residency.describe()
        mgr.register_forward_hooks()
        assert torch.equal(model(x), want)
        assert streamed_head(head) and sum(resident_bytes([head.weight])) <= EDGES
        seen = []

        def forward(inp):
            seen.append(sum(resident_bytes([head.weight])))
            raise error("inside the head")

        monkeypatch.setattr(Head, "forward", lambda self, inp: forward(inp))
        with pytest.raises(error):
            model(x)
        assert seen == [head.weight.nbytes]  # read in whole before it ran
        assert sum(resident_bytes([head.weight])) <= EDGES  # let go as the exception left it
        monkeypatch.undo()
        assert torch.equal(model(x), want)
    given_back(model)


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_an_interrupt_while_the_head_is_read_in_lets_it_go(tmp_file_dir, cap, monkeypatch, error):
    from mapoffload.pagecache.pages import PageWorker

    path, x, want = checkpoint(tmp_file_dir, SmallHead)
    drop_page_cache(str(path))
    cap(IN_USE + MARGIN + 3 * MIB)
    model = mapped(path, SmallHead)
    head = model.head
    with LayerwiseOffloadManager(model, "blocks", device="cpu") as mgr, torch.no_grad():
        mgr.register_forward_hooks()
        assert torch.equal(model(x), want)
        real = PageWorker.read_in

        def read_in(worker, spans, *args, **kwargs):
            done = real(worker, spans, *args, **kwargs)
            if spans.total_bytes >= head.weight.nbytes:  # the head's (the parts' are 1 MiB)
                done.result()
                raise error("while the head is read in")
            return done

        monkeypatch.setattr(PageWorker, "read_in", read_in)
        with pytest.raises(error):
            model(x)
        monkeypatch.undo()
        assert sum(resident_bytes([head.weight])) <= EDGES
        assert torch.equal(model(x), want)
    given_back(model)


def test_an_interrupt_in_a_user_s_hook_around_the_head_is_let_go_as_the_next_forward_starts(
        tmp_file_dir, cap, monkeypatch):
    """A user's pre-hook raising after the head was read in: torch runs neither its always-call hook nor
    its forward. What it read is let go as the model's next forward starts (not when the head next runs,
    after every layer has read its parts in beside it)."""
    path, x, want = checkpoint(tmp_file_dir, SmallHead)
    drop_page_cache(str(path))
    cap(IN_USE + MARGIN + 3 * MIB)
    model = mapped(path, SmallHead)
    head = model.head
    armed, at_first_layer = [], []

    def interrupt(module, args):
        if armed:
            armed.clear()
            raise KeyboardInterrupt("in a user's hook")

    with LayerwiseOffloadManager(model, "blocks", device="cpu") as mgr, torch.no_grad():
        mgr.register_forward_hooks()
        assert torch.equal(model(x), want)
        head.register_forward_pre_hook(interrupt)  # after the manager's: the head is read in first
        model.blocks[0].register_forward_pre_hook(
            lambda m, a: at_first_layer.append(sum(resident_bytes([head.weight]))))
        armed.append(1)
        with pytest.raises(KeyboardInterrupt):
            model(x)
        assert sum(resident_bytes([head.weight])) > EDGES  # torch ran nothing of ours after it
        at_first_layer.clear()
        assert torch.equal(model(x), want)
        assert at_first_layer and at_first_layer[0] <= EDGES, at_first_layer


def test_a_streamed_module_s_forward_keeps_its_signature(tmp_file_dir, cap):
    """Its forward is wrapped while streamed: ``inspect.signature`` (transformers asks it of forwards, as
    ``logits_to_keep``) still sees the module's own, not ``(*args, **kwargs)``."""
    import inspect

    path, x, want = checkpoint(tmp_file_dir, SmallHead)
    cap(IN_USE + MARGIN + 3 * MIB)
    model = mapped(path, SmallHead)
    with LayerwiseOffloadManager(model, "blocks", device="cpu") as mgr, torch.no_grad():
        mgr.register_forward_hooks()
        assert torch.equal(model(x), want)
        assert "forward" in vars(model.head)  # wrapped
        assert inspect.signature(model.head.forward) == inspect.signature(nn.Linear(2, 2).forward)


class ScaledTop(SmallHead):
    """The model holds a weight of its own (a scale on the output, as some architectures' logit scale)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.rand(HEAD) + 0.5)

    def forward(self, x):
        return super().forward(x) * self.scale


def test_the_model_s_own_streamed_weight_leaves_its_forward_unwrapped(tmp_file_dir, cap):
    """The model itself streams its own weight (read in before it runs, let go after), but its forward,
    which runs the layers, is not wrapped: the layers' guards see its interrupts, and torch.compile still
    compiles it."""
    from mapoffload.offload.hooks import patched

    path, x, want = checkpoint(tmp_file_dir, ScaledTop)
    cap(IN_USE + MARGIN + 3 * MIB)
    model = mapped(path, ScaledTop)
    with LayerwiseOffloadManager(model, "blocks", device="cpu") as mgr, torch.no_grad():
        mgr.register_forward_hooks()
        for _ in range(2):
            assert torch.equal(model(x), want)
        assert mgr.residency.always_streamed and streamed_head(model.head)
        assert "forward" in patched(model.head) and "forward" not in patched(model)
    given_back(model)
