"""No exception leaks the layer turn: a KeyboardInterrupt (or any
BaseException) raised inside a layer or in the manager's own pre-hook leaves
the manager usable from the same thread and from another one.

torch runs ``always_call`` forward hooks only for ``Exception``; the manager
must not rely on them for the rest."""

from __future__ import annotations

import threading

import pytest
import torch

from mapoffload import LayerwiseOffloadManager

from models import TinyModel

IDS = torch.arange(24).reshape(3, 8) % 64
BOUND_S = 120  # a hang fails the test instead of blocking the suite; not a timing assertion


class Interrupt:
    """A forward pre-hook that raises ``exc`` inside layer ``layer`` once, when armed."""

    def __init__(self, exc: type[BaseException]) -> None:
        self.exc = exc
        self.armed = False

    def __call__(self, module, args):
        if self.armed:
            self.armed = False
            raise self.exc("interrupted inside the layer")


def run_in_thread(fn) -> list:
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(BOUND_S)
    assert not t.is_alive(), "a forward from another thread blocked: the layer turn leaked"
    return out


def forward(model):
    with torch.no_grad():
        return model(IDS)


@pytest.mark.parametrize("twin", [False, True], ids=["in-place", "twin"])
@pytest.mark.parametrize("where", ["forward", "pre_hook"])
@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit, GeneratorExit])
def test_a_base_exception_inside_a_layer_leaves_the_turn_free(exc, where, twin):
    torch.manual_seed(0)
    ref = TinyModel(width=32, layers=4)
    want = forward(ref)
    model = TinyModel(width=32, layers=4)
    model.load_state_dict(ref.state_dict())
    mgr = LayerwiseOffloadManager(model, "blocks", device="cpu", cpu_twin=twin)
    mgr.register_forward_hooks()
    interrupt = Interrupt(exc)
    if where == "forward":
        # Inside the layer's computation, after the manager's pre-hook loaded it.
        inner = model.blocks[2].fc1.register_forward_pre_hook(interrupt)
    else:
        # In the manager's own pre-hook, holding the turn: Ctrl-C while it waits for the layer's pages or copy.
        ensure = mgr.parts.sequencer.ensure

        def interrupted_ensure(i):
            if i == 2:
                interrupt(None, ())
            ensure(i)

        mgr.parts.sequencer.ensure = interrupted_ensure
        inner = None
    interrupt.armed = True
    with pytest.raises(exc):
        forward(model)
    assert not mgr.parts.is_loaded(2)  # released, not held for good
    assert torch.equal(forward(model), want)  # the same thread
    assert torch.equal(run_in_thread(lambda: forward(model))[0], want)  # another thread
    interrupt.armed = True
    out = run_in_thread(lambda: pytest.raises(exc, forward, model))  # interrupted on another thread
    assert out and out[0].type is exc
    assert torch.equal(forward(model), want)
    if inner is not None:
        inner.remove()
    mgr.close()
    assert torch.equal(forward(model), want)
