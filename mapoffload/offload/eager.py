"""The hooks' objects: eager under ``torch.compile``, and never copied or pickled.

A layer's weights change identity between forwards (placeholders, then buffers recycled from a pool):
a graph traced through them would bake in one forward's tensors. So the hooks and the layers'
forwards always run eagerly (:class:`Hook`); what lies outside the layers is compiled as usual.

A model is not copied or pickled while its hooks are on (``copy.deepcopy``, ``pickle.dumps``,
``torch.save``): the hooks and the guarded forwards belong to this process's manager, and a copy
would run them - the original's layers and weights - instead of its own. Each is a :class:`Hook`
that refuses, saying how to give the model back first (:func:`~mapoffload.offload.placeholder.copy_refusal`).
"""

from __future__ import annotations

import importlib.abc
import sys
import threading
import weakref

__all__ = ["Hook"]


_DYNAMO = "torch._dynamo"
_WAITING_LOCK = threading.RLock()
_WAITING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # a Hook not marked yet -> its function


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
        waiting = list(_WAITING.items())
        _WAITING.clear()
    for hook, fn in waiting:
        hook.fn = _disable(fn)


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
                _WAITING[self] = fn
                _DynamoWatch.install()
                return
        self.fn = _disable(fn)

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def _refuse(self, what: str):
        from .placeholder import OffloadedCopyError, copy_refusal

        raise OffloadedCopyError(copy_refusal(self.owner() if self.owner is not None else None, what))

    def __reduce_ex__(self, protocol):
        self._refuse("pickled")

    def __deepcopy__(self, memo):
        self._refuse("copied (copy.deepcopy)")
