"""The layer turn and the hooks: a manager's layers run one at a time, whatever thread runs them.

One layer runs at a time: from its pre-hook to its post-hook (an always-call hook, run when the
forward raises too) the layer owns the manager's loaded layers and device pool. Without that, one
thread's hooks would release and recycle buffers another thread's layer is computing with. Another
thread's layer waits; the owning thread may nest (a model run re-entrantly); a dead owner does not
block anyone.

torch runs always-call post-hooks for an ``Exception`` only: a KeyboardInterrupt (the manager's own
interruptible wait included), SystemExit or GeneratorExit inside a layer skips them. The layer's
forward is wrapped (through ``patches``, the one registry of what mapoffload sets on a module), and the
pre-hook guards itself, so that whatever leaves the layer finishes its
turn; a per-thread record of the turns held (:meth:`LayerTurn.held`) makes finishing twice harmless.

A model is not copied or pickled while its hooks are on (``copy.deepcopy``, ``pickle.dumps``,
``torch.save``): the hooks and the guarded forwards belong to this process's manager, and a copy
would run them - the original's layers and weights - instead of its own. Each is a :class:`_Hook`
that refuses, saying how to give the model back first (:func:`~mapoffload.offload.placeholder.copy_refusal`).
"""

from __future__ import annotations

import functools
import importlib.abc
import sys
import threading
import weakref
from typing import Any

from .patches import wrap_forward

__all__ = ["LayerTurn", "StackHooks"]


def _eager(fn):
    """``fn``, run eagerly under ``torch.compile`` (TorchDynamo skips it, and what it calls).

    A layer's weights change identity between forwards (placeholders, then buffers recycled from a
    pool): a graph traced through them would bake in one forward's tensors. So the hooks and the
    layers' forwards always run eagerly; what lies outside the layers is compiled as usual.

    Marking a function for TorchDynamo imports it: 68 MiB of anonymous memory a process holds from
    then on (torch 2.13), in a library whose point is anonymous memory. So the mark waits for
    TorchDynamo: where it is imported already (torch.compile, or a library that imports it, as
    transformers does), the function is marked now; else it is marked when TorchDynamo is imported
    (:class:`_DynamoWatch`), which comes before anything can be compiled.
    """
    box = [fn]

    @functools.wraps(fn)
    def eager(*args, **kwargs):
        return box[0](*args, **kwargs)

    with _WAITING_LOCK:
        if not _dynamo_ready():
            _WAITING[eager] = (fn, box)
            _DynamoWatch.install()
            return eager
    box[0] = _disable(fn)
    return eager


_DYNAMO = "torch._dynamo"
_WAITING_LOCK = threading.RLock()
_WAITING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # eager wrapper -> (fn, its box)


def _disable(fn):
    import torch

    return torch.compiler.disable(fn, recursive=True)


def _dynamo_ready() -> bool:
    """TorchDynamo is imported whole (not absent, nor still executing under :class:`_NotifyingLoader`,
    whose end marks what waits)."""
    module = sys.modules.get(_DYNAMO)
    if module is None:
        return False
    loader = getattr(getattr(module, "__spec__", None), "loader", None)
    return not isinstance(loader, _NotifyingLoader) or loader.done


def _dynamo_imported() -> None:
    """TorchDynamo was imported: every function :func:`_eager` made so far is marked."""
    with _WAITING_LOCK:
        waiting = list(_WAITING.values())
        _WAITING.clear()
    for fn, box in waiting:
        box[0] = _disable(fn)


class _DynamoWatch(importlib.abc.MetaPathFinder):
    """Runs :func:`_dynamo_imported` once ``torch._dynamo`` is imported (its module executed); answers
    nothing else. Installed at most once, at the first :func:`_eager` made without TorchDynamo."""

    _installed = False

    @classmethod
    def install(cls) -> None:
        with _WAITING_LOCK:
            if cls._installed:
                return
            cls._installed = True
            sys.meta_path.insert(0, cls())

    def find_spec(self, name, path, target=None):
        if name != _DYNAMO:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _NotifyingLoader(spec.loader)
                return spec
        return None


class _NotifyingLoader(importlib.abc.Loader):
    """A module's own loader, then :func:`_dynamo_imported`."""

    def __init__(self, loader) -> None:
        self._loader = loader
        self.done = False

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        self.done = True
        _dynamo_imported()

    def __getattr__(self, name):  # get_source, is_package, get_filename... as the module's loader has them
        return getattr(self._loader, name)


class _Hook:
    """A hook (or guarded forward) of a manager: calls ``fn``; refuses to be copied or pickled."""

    __slots__ = ("fn", "owner", "__wrapped__")

    def __init__(self, fn, owner) -> None:
        self.fn = fn
        self.owner = owner  # a weak reference to the manager, for the words of the refusal
        self.__wrapped__ = fn

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def _refuse(self, what: str):
        from .placeholder import OffloadedCopyError, copy_refusal

        raise OffloadedCopyError(copy_refusal(self.owner() if self.owner is not None else None, what))

    def __reduce_ex__(self, protocol):
        self._refuse("pickled")

    def __deepcopy__(self, memo):
        self._refuse("copied (copy.deepcopy)")


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


class StackHooks:
    """The hooks on one stack's layers and on its model, taking the layer turn; ``steps`` does the work.

    Parameters
    ----------
    turn
        The stack's :class:`LayerTurn`.
    steps
        What the hooks run (``steps.Steps``): ``before_forward(module, args)`` once per forward of the
        model, ``start(i)`` before layer ``i``, ``finish(i)`` once it is done, ``after(i, output)``
        after it computed.
    """

    def __init__(self, turn: LayerTurn, steps: Any, owner: Any = None) -> None:
        self.turn = turn
        self.steps = steps
        self.owner = owner  # a weak reference to the manager (named when a copy is refused)
        self.handles: list = []  # each with remove()
        self.part_handles: list = []  # the layers' parts' hooks, while streamed layers are read part by part

    @property
    def active(self) -> bool:
        """Registered (a hook that a forward already started runs as a no-op once removed)."""
        return bool(self.handles)

    def register(self, model: Any, layers: list) -> None:
        """Hook ``layers`` (load before, release after, a guarded forward) and ``model`` (once per
        forward, before anything reads the mapping). No-op when registered."""
        if self.handles:
            return
        hooks: list = []
        for i, layer in enumerate(layers):
            hooks.append(layer.register_forward_pre_hook(_Hook(self._pre_hook(i), self.owner)))
            hooks.append(layer.register_forward_hook(_Hook(self._post_hook(i), self.owner), always_call=True))
            hooks.append(wrap_forward(layer, _Hook(self._guarded_forward(i, layer.forward), self.owner)))
        # Before anything of a forward reads the mapping (the embedding first).
        hooks.append(model.register_forward_pre_hook(_Hook(_eager(self._before_forward), self.owner),
                                                     prepend=True))
        hooks.append(model.register_forward_hook(_Hook(_eager(self._after_forward), self.owner), always_call=True))
        self.handles = hooks

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self._remove_parts()
        self.steps.rest.stream(False)

    # -- part by part ------------------------------------------------------------------------
    def _before_forward(self, module: Any, args: Any) -> None:
        self.steps.before_forward(module, args)
        if self.steps.wants_parts:
            self._register_parts()
        else:
            self._remove_parts()

    def _after_forward(self, module: Any, args: Any, output: Any) -> None:
        self.steps.after_forward()

    def _register_parts(self) -> None:
        """Hook each layer's parts (the submodules holding its weights): read in before each runs, let
        go after, while the plan reads streamed layers part by part. No-op when registered."""
        if self.part_handles or not self.handles:
            return
        hooks: list = []
        for i, store in enumerate(self.steps.sequencer.stores):
            for k, part in enumerate(store.parts):
                hooks.append(part.module.register_forward_pre_hook(_Hook(self._part_pre_hook(i, k), self.owner)))
                hooks.append(part.module.register_forward_hook(_Hook(self._part_post_hook(i, k), self.owner),
                                                               always_call=True))
        self.part_handles = hooks

    def _remove_parts(self) -> None:
        for h in self.part_handles:
            h.remove()
        self.part_handles = []

    def _part_pre_hook(self, i: int, k: int):
        def pre_hook(module, args):
            if i in self.turn.held():  # inside layer i's turn (a part called on its own is no layer's)
                self.steps.start_part(i, k)

        return _eager(pre_hook)

    def _part_post_hook(self, i: int, k: int):
        def post_hook(module, args, output):
            if i in self.turn.held():
                self.steps.finish_part(i, k)

        return _eager(post_hook)

    def finish_layer(self, i: int) -> None:
        """Finish layer ``i`` and leave its turn, once, if this thread holds it."""
        held = self.turn.held()
        if i not in held:
            return
        del held[len(held) - 1 - held[::-1].index(i)]
        try:
            self.steps.finish(i)
        finally:
            self.turn.leave()

    def _guarded_forward(self, i: int, forward):
        @functools.wraps(forward)
        def guarded_forward(*args, **kwargs):
            try:
                return forward(*args, **kwargs)
            except Exception:
                raise  # torch runs the always-call post-hook
            except BaseException:
                self.finish_layer(i)  # torch runs no hook for these
                raise

        return _eager(guarded_forward)

    def _pre_hook(self, i: int):
        def pre_hook(module, args):
            self.turn.enter()
            if not self.handles:
                # Removed (or closed) by another thread while this forward
                # was on its way here: the model is whole, nothing to load.
                self.turn.leave()
                return
            self.turn.held().append(i)
            try:
                self.steps.start(i)
            except Exception:
                raise  # torch runs the always-call post-hook, which finishes the turn
            except BaseException:
                self.finish_layer(i)
                raise

        return _eager(pre_hook)

    def _post_hook(self, i: int):
        def post_hook(module, args, output):
            self.finish_layer(i)
            self.steps.after(i, output)

        return _eager(post_hook)
