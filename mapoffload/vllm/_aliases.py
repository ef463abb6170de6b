"""Which parameters vLLM's weight loaders fill from one checkpoint tensor unchanged.

vLLM's model classes decide what each parameter holds: their ``load_weights``
copies checkpoint tensors into parameters (``param.data.copy_(w)``), stacks
q/k/v and gate/up into slices of one parameter, pads vocabularies, narrows
tensor-parallel shards. :class:`AliasRecorder` runs that code unchanged, with
every parameter bound to a shared mapping of a conversion file (so whatever is
written lands in the file, never in anonymous memory), and watches it through
a ``TorchFunctionMode``:

* a ``copy_`` that overwrites a whole parameter with a contiguous slice of a
  checkpoint mapping, same dtype and shape, is *not* done: the parameter is
  recorded as an alias of that slice (and later rebound to it);
* any other operation that reads or writes a recorded parameter first does
  the copy it skipped, so the code sees exactly what vLLM's loader would have
  given it (the parameter is then a converted one, correct either way);
* operations that only look (shapes, ``.data``, ``narrow``, views) run as
  they are.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from ..memory.regions import tensor_bytes

# Operations that never read a tensor's bytes (metadata, property getters, views).
_LOOK = frozenset({
    "__get__", "__set__", "narrow", "view", "view_as", "t", "transpose", "permute", "unsqueeze", "squeeze",
    "select", "chunk", "split", "unbind", "expand", "expand_as", "as_strided", "detach", "size", "stride",
    "dim", "numel", "element_size", "is_contiguous", "data_ptr", "storage_offset", "untyped_storage",
    "requires_grad_", "__len__", "nbytes", "itemsize", "get_device", "is_floating_point", "is_complex",
})
# Operations that return a view when they can and a copy (a read) when they cannot.
_MAYBE_VIEW = frozenset({"__getitem__", "contiguous", "reshape", "flatten", "movedim", "unflatten"})


@dataclass
class Alias:
    """A parameter that is a checkpoint tensor's bytes, unchanged."""

    key: str  # the checkpoint tensor's name
    byte_offset: int  # where the parameter starts inside that tensor
    source: torch.Tensor  # the contiguous slice of the mapping it equals


class SourceIndex:
    """The checkpoint's mapped tensors, by address: which one a pointer lies in."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        spans = []
        for key, t in tensors.items():
            if t.numel() and t.device.type == "cpu" and t.is_contiguous():
                start = t.data_ptr()
                spans.append((start, start + tensor_bytes(t), key))
        spans.sort()
        self._starts = [s[0] for s in spans]
        self._spans = spans

    def find(self, t: torch.Tensor) -> tuple[str, int] | None:
        """``(key, byte offset)`` when ``t`` is a contiguous run of one checkpoint tensor's bytes."""
        if not t.is_contiguous() or t.numel() == 0 or t.device.type != "cpu":
            return None
        ptr = t.data_ptr()
        i = bisect.bisect_right(self._starts, ptr) - 1
        if i < 0:
            return None
        start, end, key = self._spans[i]
        if ptr + tensor_bytes(t) > end:
            return None
        return key, ptr - start


class AliasRecorder(TorchFunctionMode):
    """Record, instead of copying, whole-parameter copies from the checkpoint (see the module).

    ``params``: name -> parameter, each bound to its own contiguous run of the conversion file.
    """

    def __init__(self, params: dict[str, torch.Tensor], sources: SourceIndex) -> None:
        super().__init__()
        spans = sorted((p.data_ptr(), p.data_ptr() + tensor_bytes(p), name)
                       for name, p in params.items() if p.numel())
        self._starts = [s[0] for s in spans]
        self._spans = spans
        self._params = params
        self._sources = sources
        self.aliases: dict[str, Alias] = {}
        self.materialized: set[str] = set()  # recorded, then read or partly written: converted after all

    def _owner(self, t: torch.Tensor) -> str | None:
        """The parameter whose bytes ``t`` starts in, if any."""
        if t.device.type != "cpu" or t.numel() == 0:
            return None
        ptr = t.data_ptr()
        i = bisect.bisect_right(self._starts, ptr) - 1
        if i >= 0 and ptr < self._spans[i][1]:
            return self._spans[i][2]
        return None

    def _whole(self, t: torch.Tensor, name: str) -> bool:
        p = self._params[name]
        return (t.data_ptr() == p.data_ptr() and t.numel() == p.numel() and t.is_contiguous()
                and t.dtype == p.dtype)

    def _materialize(self, name: str) -> None:
        alias = self.aliases.pop(name)
        p = self._params[name]
        with torch.no_grad():
            p.data.view(-1).copy_(alias.source.view(-1))
        self.materialized.add(name)

    def _touched(self, args: Any, kwargs: Any) -> list[str]:
        found = []
        for leaf in tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor) and not leaf.is_meta:
                name = self._owner(leaf)
                if name is not None and name in self.aliases:
                    found.append(name)
        return found

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _LOOK or not self.aliases and name != "copy_":
            return func(*args, **kwargs)
        if name == "copy_" and len(args) >= 2 and isinstance(args[0], torch.Tensor) \
                and isinstance(args[1], torch.Tensor):
            dst, src = args[0], args[1]
            owner = self._owner(dst)
            if owner is not None and self._whole(dst, owner):
                found = self._sources.find(src) if src.dtype == dst.dtype and src.shape == dst.shape else None
                # a copy from anywhere else overwrites the whole parameter: nothing recorded matters any more
                self.aliases.pop(owner, None)
                if found is not None and self._owner(src) is None:
                    self.aliases[owner] = Alias(found[0], found[1], src)
                    self.materialized.discard(owner)
                    return dst
                return func(*args, **kwargs)
        touched = self._touched(args, kwargs)
        if not touched:
            return func(*args, **kwargs)
        if name in _MAYBE_VIEW:
            out = func(*args, **kwargs)
            if isinstance(out, torch.Tensor) and (out.numel() == 0 or self._owner(out) is not None):
                return out  # a view (or nothing at all, as an empty padding tail): nothing was read
        for t in touched:
            if t in self.aliases:
                self._materialize(t)
        return func(*args, **kwargs)
