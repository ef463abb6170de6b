"""What the managers change on a model's modules, in one registry: the two patches torch has no hook for.

torch's hook API carries the rest (forward pre-hooks and always-call forward hooks, ``runtime.py``).
Two things it has no hook for are patched on the instance, and only through this registry:

- a layer's ``forward``, wrapped (:func:`wrap_forward`): torch runs no hook when a
  ``KeyboardInterrupt``, ``SystemExit`` or ``GeneratorExit`` leaves a layer, and the layer's turn
  must still finish;
- a module's ``_apply`` (``placeholder.guard_conversions``): torch converts children first and has
  no hook before a conversion, so ``model.to(torch.float16)`` would half convert a model before the
  first placeholder refuses.

The registry counts the managers sharing a patch (the stacks of one model guard it once each),
puts back what was there when the last lets go (or leaves alone what someone set since), and
answers :func:`patched`: a model given back carries nothing of mapoffload's.
"""

from __future__ import annotations

import os
import threading
import weakref
from dataclasses import dataclass
from typing import Any

__all__ = ["Patch", "install", "patched", "uninstall", "wrap_forward"]

_MISSING = object()


@dataclass
class Patch:
    """One attribute set on a module's instance: the value, what it replaced, how many hold it."""

    name: str
    value: Any
    previous: Any  # _MISSING: the class's own
    holders: int = 1


_LOCK = threading.Lock()
_REGISTRY: weakref.WeakKeyDictionary[Any, dict[str, Patch]] = weakref.WeakKeyDictionary()


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
        patches = _REGISTRY.setdefault(module, {})
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
        patches = _REGISTRY.get(module)
        patch = patches.get(name) if patches else None
        if patch is None:
            return
        patch.holders -= 1
        if patch.holders > 0:
            return
        del patches[name]
        if not patches:
            del _REGISTRY[module]
        if module.__dict__.get(name, _MISSING) is not patch.value:
            return
        if patch.previous is _MISSING:
            del module.__dict__[name]
        else:
            module.__dict__[name] = patch.previous


def patched(module: Any) -> tuple[str, ...]:
    """The attributes mapoffload has patched on ``module`` now (empty once given back)."""
    with _LOCK:
        return tuple(sorted(_REGISTRY.get(module, {})))


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
