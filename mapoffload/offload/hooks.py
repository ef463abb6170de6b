"""What a manager puts on a model's modules, and the refusals it raises there (no imports of torch).

**Hooks** (:class:`Hook`). A layer's weights change identity between forwards (placeholders, then buffers
recycled from a pool): a graph traced through them would bake in one forward's tensors. So the hooks and
the layers' forwards always run eagerly; what lies outside the layers is compiled as usual. A model is not
copied or pickled while its hooks are on (``copy.deepcopy``, ``pickle.dumps``, ``torch.save``): the hooks
and the guarded forwards belong to this process's manager, and a copy would run them - the original's
layers and weights - instead of its own. Each hook refuses (:class:`OffloadedCopyError`), saying how to
give the model back first (:func:`copy_refusal`).

**Patches**, in one registry (:func:`install`, :func:`uninstall`, :func:`patched`). torch's hook API
carries the rest (forward pre-hooks and always-call forward hooks, ``runtime.py``); what it has no hook
for is patched on the instance, and only here:

- a layer's ``forward``, wrapped (:func:`wrap_forward`): torch runs no hook when a ``KeyboardInterrupt``,
  ``SystemExit`` or ``GeneratorExit`` leaves a layer, and the layer's turn must still finish;
- a module's ``_apply`` (``placeholder.guard_conversions``): torch converts children first and has no
  hook before a conversion, so ``model.to(torch.float16)`` would half convert a model before the first
  placeholder refuses; and its ``share_memory`` (``placeholder.guard_conversions``), refused while
  offloaded.

The registry counts the managers sharing a patch (the stacks of one model guard it once each), puts back
what was there when the last lets go (or leaves alone what someone set since), and answers
:func:`patched`: a model given back carries nothing of mapoffload's.

**Errors** more than one part raises: :class:`ReplacedWeightError`, and :class:`CallNames` (what the
refusals tell a user to call, as the entry point that made the manager names them).
"""

from __future__ import annotations

import importlib.abc
import os
import sys
import threading
import weakref
from dataclasses import dataclass
from typing import Any

__all__ = [
    "CallNames", "Hook", "OffloadedCopyError", "Patch", "ReplacedWeightError", "copy_refusal", "install", "patched",
    "uninstall", "wrap_forward",
]


_DYNAMO = "torch._dynamo"
_WAITING_LOCK = threading.RLock()
# The Hooks not marked yet (a set: a table whose values held their functions, and they the modules, kept
# every hooked module alive).
_WAITING: weakref.WeakSet = weakref.WeakSet()


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
    """TorchDynamo was imported: every :class:`Hook` made so far is marked."""
    with _WAITING_LOCK:
        waiting = list(_WAITING)
        _WAITING.clear()
    for hook in waiting:
        hook.fn = _disable(hook.__wrapped__)


class _DynamoWatch(importlib.abc.MetaPathFinder):
    """Runs :func:`_dynamo_imported` once ``torch._dynamo`` is imported (its module executed); answers
    nothing else. Installed at most once, at the first :class:`Hook` made without TorchDynamo."""

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


class Hook:
    """A hook (or guarded forward) of a manager: calls ``fn``, eagerly under ``torch.compile``
    (TorchDynamo skips it, and what it calls); refuses to be copied or pickled.

    Marking a function for TorchDynamo imports it: 68 MiB of anonymous memory a process holds from
    then on (torch 2.13), in a library whose point is anonymous memory. So the mark waits for
    TorchDynamo: where it is imported already (torch.compile, or a library that imports it, as
    transformers does), ``fn`` is marked now; else it is marked when TorchDynamo is imported
    (:class:`_DynamoWatch`), which comes before anything can be compiled.
    """

    __slots__ = ("fn", "owner", "__wrapped__", "__weakref__")

    def __init__(self, fn, owner=None) -> None:
        self.fn = fn
        self.owner = owner  # a weak reference to the manager, for the words of the refusal
        self.__wrapped__ = fn
        with _WAITING_LOCK:
            if not _dynamo_ready():
                _WAITING.add(self)
                _DynamoWatch.install()
                return
        self.fn = _disable(fn)

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def _refuse(self, what: str):
        raise OffloadedCopyError(copy_refusal(self.owner() if self.owner is not None else None, what))

    def __reduce_ex__(self, protocol):
        self._refuse("pickled")

    def __deepcopy__(self, memo):
        self._refuse("copied (copy.deepcopy)")


_MISSING = object()


@dataclass
class Patch:
    """One attribute set on a module's instance: the value, what it replaced, how many hold it."""

    name: str
    value: Any
    previous: Any  # _MISSING: the class's own
    holders: int = 1


_LOCK = threading.Lock()
# Each module's patches live in its own __dict__: a process-wide table (even a weak-keyed one, whose values
# held the wrapped forwards, and they the module) kept every offloaded module alive after its model was
# dropped without close(): its mapping, its stack's threads and its place in the page-cache plan with it.
_PATCHES = "_mapoffload_patches"


def _patches(module: Any, make: bool = False) -> dict[str, Patch] | None:
    patches = module.__dict__.get(_PATCHES)
    if patches is None and make:
        patches = module.__dict__[_PATCHES] = {}
    return patches


def _after_fork_in_child() -> None:
    """A fork() while another thread held the lock leaves it held in the child: the child starts
    with a fresh one (the registry itself was consistent: every change is made under the lock)."""
    global _LOCK
    _LOCK = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def install(module: Any, name: str, value: Any) -> Patch:
    """Set ``module.<name>`` to ``value`` on the instance, or count one more holder of the patch
    already there (the first value stays)."""
    with _LOCK:
        patches = _patches(module, make=True)
        patch = patches.get(name)
        if patch is not None:
            patch.holders += 1
            return patch
        patch = patches[name] = Patch(name, value, module.__dict__.get(name, _MISSING))
        module.__dict__[name] = value
        return patch


def uninstall(module: Any, name: str) -> None:
    """One holder lets go of ``module``'s patch ``name``; the last puts back what it replaced,
    unless the attribute was set since by someone else (theirs stays)."""
    with _LOCK:
        patches = _patches(module)
        patch = patches.get(name) if patches else None
        if patch is None:
            return
        patch.holders -= 1
        if patch.holders > 0:
            return
        del patches[name]
        if not patches:
            del module.__dict__[_PATCHES]
        if module.__dict__.get(name, _MISSING) is not patch.value:
            return
        if patch.previous is _MISSING:
            del module.__dict__[name]
        else:
            module.__dict__[name] = patch.previous


def patched(module: Any) -> tuple[str, ...]:
    """The attributes mapoffload has patched on ``module`` now (empty once given back)."""
    with _LOCK:
        return tuple(sorted(_patches(module) or ()))


class _ForwardPatch:
    """A layer's wrapped forward as a hook handle: ``remove()`` puts the previous one back."""

    __slots__ = ("layer",)

    def __init__(self, layer: Any) -> None:
        self.layer = layer

    def remove(self) -> None:
        uninstall(self.layer, "forward")


def wrap_forward(layer: Any, guarded: Any) -> _ForwardPatch:
    """``layer.forward`` replaced by ``guarded`` until the handle's ``remove()``."""
    install(layer, "forward", guarded)
    return _ForwardPatch(layer)


class ReplacedWeightError(ValueError):
    """A weight of an offloaded layer was replaced by something its manager cannot compute with
    (another shape, dtype or device, a meta or offloaded tensor, a weight tied in some of its places
    only, or none): raised by the next forward (or ``register_forward_hooks``), naming the weight."""


class WeightNotLoadedError(RuntimeError):
    """An offloaded weight's placeholder (what a layer's slot holds between its forwards on the device path)
    was used where its values are needed: its layer is not loaded. The message names the weight, and the
    call or hook that sees its values."""


@dataclass(frozen=True)
class CallNames:
    """What the placeholders' errors tell a user to call, as the entry point that made the manager
    names them (a manager's ``calls``): ``close`` gives the model back
    (``"model.mapoffload_handle.close()"`` after from_pretrained), ``reload`` (with ``{dtype}``)
    loads it in another dtype. None for a manager made directly."""

    close: str | None = None
    reload: str | None = None


class OffloadedCopyError(RuntimeError, TypeError):
    """An offloaded model (or one of its layers or placeholders) copied, pickled or moved into shared
    memory (``share_memory()``): refused, naming the call that gives the model back first. A
    ``TypeError`` (what ``pickle`` raises for what it cannot pickle) and a ``RuntimeError``."""


def copy_refusal(manager: object | None, what: str, w: Any = None) -> str:
    """The one message for a copy or pickle of an offloaded model (its hooks or placeholders met)."""
    close = (manager.calls.close if manager is not None else None) or "manager.close()"
    where = f" ({w._mo_name} is one of its weights)" if w is not None else ""
    return (f"an offloaded model was {what}{where}: its layers' weights are loaded by this process's offload "
            f"hooks, which a copy would share. Call {close} first: the model is then a plain model with its "
            "own weights to copy or save, and offload the copy afterwards (in place, on the CPU, state_dict() "
            "and save_pretrained() work while offloaded)")
