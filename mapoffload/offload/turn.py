"""The layer turn and the hooks: a manager's layers run one at a time, whatever thread runs them.

One layer runs at a time: from its pre-hook to its post-hook (an always-call hook, run when the
forward raises too) the layer owns the manager's loaded layers and device pool. Without that, one
thread's hooks would release and recycle buffers another thread's layer is computing with. Another
thread's layer waits; the owning thread may nest (a model run re-entrantly); a dead owner does not
block anyone.

torch runs always-call post-hooks for an ``Exception`` only: a KeyboardInterrupt (the manager's own
interruptible wait included), SystemExit or GeneratorExit inside a layer skips them. The layer's
forward is wrapped, and the pre-hook guards itself, so that whatever leaves the layer finishes its
turn; a per-thread record of the turns held (:meth:`LayerTurn.held`) makes finishing twice harmless.
"""

from __future__ import annotations

import functools
import threading
from typing import TYPE_CHECKING

from .grads import refuse_recorded_graph

if TYPE_CHECKING:
    from .manager import LayerwiseOffloadManager

__all__ = ["LayerTurn", "register_hooks"]


def _eager(fn):
    """``fn`` run eagerly under ``torch.compile`` (TorchDynamo skips it, and what it calls).

    A layer's weights change identity between forwards (placeholders, then
    buffers recycled from a pool): a graph traced through them would bake in
    one forward's tensors. So the hooks and the layers' forwards always run
    eagerly; what lies outside the layers is compiled as usual.
    """
    import torch

    return torch.compiler.disable(fn, recursive=True)


class _ForwardGuard:
    """A layer's forward replaced by a guarded one; ``remove()`` puts the previous one back (a hook handle)."""

    __slots__ = ("layer", "guarded", "had", "previous")

    def __init__(self, layer, guarded) -> None:
        self.layer, self.guarded = layer, guarded
        self.had = "forward" in layer.__dict__
        self.previous = layer.__dict__.get("forward")
        layer.forward = guarded

    def remove(self) -> None:
        if self.layer.__dict__.get("forward") is not self.guarded:
            return  # replaced since by someone else: theirs stays
        if self.had:
            self.layer.forward = self.previous
        else:
            del self.layer.forward


class LayerTurn:
    """Whose turn it is to run one of a manager's layers (a thread, nesting), and the turns each thread holds."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._held = threading.local()  # .layers: the turns this thread holds, innermost last
        self._owner: threading.Thread | None = None
        self._depth = 0

    def after_fork_in_child(self) -> None:
        """The turn may have been held by a parent thread that does not exist here: it starts free,
        with a fresh lock."""
        self._cond = threading.Condition()
        self._owner, self._depth = None, 0

    def enter(self) -> None:
        me = threading.current_thread()
        with self._cond:
            while self._owner is not None and self._owner is not me and self._owner.is_alive():
                self._cond.wait()
            if self._owner is not me:
                self._owner, self._depth = me, 0
            self._depth += 1

    def leave(self) -> None:
        with self._cond:
            if self._owner is threading.current_thread():
                self._depth -= 1
                if self._depth <= 0:
                    self._owner = None
                    self._cond.notify_all()

    def held(self) -> list[int]:
        """The layers whose turn this thread holds, innermost last."""
        held = getattr(self._held, "layers", None)
        if held is None:
            held = self._held.layers = []
        return held


def register_hooks(m: LayerwiseOffloadManager) -> list:
    """Hook ``m``'s layers (load before, release after, a guarded forward) and its model (once per
    forward, before anything reads the mapping); the handles, each with ``remove()``."""
    hooks: list = []
    for i, layer in enumerate(m.layers):
        hooks.append(layer.register_forward_pre_hook(_pre_hook(m, i)))
        hooks.append(layer.register_forward_hook(_post_hook(m, i), always_call=True))
        hooks.append(_ForwardGuard(layer, _guarded_forward(m, i, layer.forward)))
    # Before anything of a forward reads the mapping (the embedding first).
    hooks.append(m.model.register_forward_pre_hook(_eager(m._before_forward), prepend=True))
    return hooks


def finish_layer(m: LayerwiseOffloadManager, i: int) -> None:
    """Release layer ``i`` and leave its turn, once, if this thread holds it."""
    held = m._turn.held()
    if i not in held:
        return
    del held[len(held) - 1 - held[::-1].index(i)]
    try:
        if m._releasable(i):
            m.release_layer(i)
    finally:
        m._turn.leave()

def _guarded_forward(m: LayerwiseOffloadManager, i: int, forward):
    @functools.wraps(forward)
    def guarded_forward(*args, **kwargs):
        try:
            return forward(*args, **kwargs)
        except Exception:
            raise  # torch runs the always-call post-hook
        except BaseException:
            finish_layer(m, i)  # torch runs no hook for these
            raise

    return _eager(guarded_forward)

def _pre_hook(m: LayerwiseOffloadManager, i: int):
    def pre_hook(module, args):
        m._turn.enter()
        if not m._hooks:
            # Removed (or closed) by another thread while this forward
            # was on its way here: the model is whole, nothing to load.
            m._turn.leave()
            return
        m._turn.held().append(i)
        try:
            m._start_layer(i)
        except Exception:
            raise  # torch runs the always-call post-hook, which finishes the turn
        except BaseException:
            finish_layer(m, i)
            raise

    return _eager(pre_hook)

def _post_hook(m: LayerwiseOffloadManager, i: int):
    def post_hook(module, args, output):
        finish_layer(m, i)
        if m._loads.recycles(i):
            refuse_recorded_graph(m._stores[i], output)  # autograd saved views of reused device buffers

    return _eager(post_hook)
