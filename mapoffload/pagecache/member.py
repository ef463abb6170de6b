"""One stack of layers as the page-cache coordinator plans it: a member.

The coordinator (``coordinator.py``) plans every stack of the process against one budget. What it
needs of a stack - its layers' mapped sizes and resident bytes, the file ranges they read, its
uncached buffers, the share it was given, where to carry a plan out - is this object, made and
registered by the stack's owner (a :class:`~mapoffload.LayerwiseOffloadManager`). The coordinator
talks to members only, never to the managers' insides; the page-cache layer imports nothing of the
offload parts: the stack's pages and load path are duck-typed here (:class:`StackPages`,
:class:`StackBuffers`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from .._log import logger
from .._runs import merge_runs

if TYPE_CHECKING:
    from .residency import ResidencyPlan

__all__ = ["StackBuffers", "StackMember", "StackPages", "always_read_of", "cached_lost", "file_ranges_of",
           "planned_buffers"]


class StackPages(Protocol):
    """What a member reads of its stack's pages (``layer_pages.LayerPages``)."""

    watch: bool

    def mapped_sizes(self) -> list[int]: ...
    def resident_bytes(self) -> list[int]: ...
    def file_ranges(self) -> list[tuple[tuple[int, int], int, int, str]]: ...
    def take_missing(self) -> int: ...
    def apply(self, plan: ResidencyPlan) -> None: ...


class StackBuffers(Protocol):
    """What a member reads of its stack's load path: the uncached window it holds
    (``window_bytes``) and, where it reads uncached, ``planned_bytes``; the host memory
    of its own machinery (``host_bytes`` now, ``planned_host_bytes`` at the most: an owned copier's
    ring, the CPU twin's buffers; 0 in place)."""

    window_bytes: int
    planned_bytes: int
    host_bytes: int
    planned_host_bytes: int


class StackMember:
    """A stack under the page-cache plan.

    Parameters
    ----------
    name
        The stack's name, for logs and :meth:`PageCacheCoordinator.layer_residency`.
    model, layers
        The model and its managed layers (the weights outside every stack of a model that each
        forward reads are counted once: ``always_read(model, layers)``).
    pages
        The stack's pages (:class:`StackPages`).
    loads
        The stack's load path now (:class:`StackBuffers`); its owner sets it again when it changes.
    prefetch_layers
        How deep the stack reads ahead (its streaming window).
    given
        Page-cache bytes of its own (``page_cache_bytes=``); None: measured with the others.
    always_read
        ``(model, layers) -> [(tensor, bytes)]``: the mapped weights outside ``layers`` that every
        forward reads.
    owner
        Who registered it (kept weakly; :meth:`PageCacheCoordinator.managers`).
    parts
        ``() -> bytes`` of the largest part of a layer, where the stack can read its streamed layers
        part by part (in place); None: a layer at a time only.
    """

    def __init__(self, *, name: str, model: Any, layers: Sequence[Any], pages: StackPages, loads: StackBuffers,
                 prefetch_layers: int, given: int | None,
                 always_read: Callable[[Any, list], list[tuple[Any, int]]], owner: object,
                 parts: Callable[[], int] | None = None) -> None:
        self.name = name
        self.model = model
        self.layers = layers
        self.pages = pages
        self.loads = loads
        self.prefetch_layers = prefetch_layers
        self.given = given
        self.always_read = always_read
        self._parts = parts
        self.residency: ResidencyPlan | None = None
        self._owner = weakref.ref(owner)

    @property
    def owner(self) -> object | None:
        return self._owner()

    # -- what the plan is made from -----------------------------------------------------------
    def sizes(self) -> list[int]:
        """Mapped bytes of each layer."""
        return self.pages.mapped_sizes()

    @property
    def part_bytes(self) -> int:
        """Mapped bytes of the largest part of a layer (0: the stack is read a layer at a time only)."""
        return self._parts() if self._parts is not None else 0

    def resident_bytes(self) -> list[int]:
        """Bytes of each layer's mapped weights resident now (``mincore``)."""
        return self.pages.resident_bytes()

    def file_ranges(self) -> list[tuple[tuple[int, int], int, int, str]]:
        """``((dev, inode), first, end, path)`` of every file range the layers read."""
        return self.pages.file_ranges()

    @property
    def window_bytes(self) -> int:
        """Uncached buffers the stack holds (the streaming window in anonymous memory)."""
        return self.loads.window_bytes

    @property
    def buffer_bytes(self) -> int:
        """Uncached buffers the plan charges now (0 where the stack reads through the mapping)."""
        return self.loads.planned_bytes

    @property
    def host_bytes(self) -> tuple[int, int]:
        """``(held now, charged)``: host memory of the load path's own machinery beside the page-cache
        window - an owned copier's staging ring, the CPU twin's "device" buffers (0 in place)."""
        return self.loads.host_bytes, self.loads.planned_host_bytes

    def take_missing(self) -> int:
        """Bytes of cached layers found missing at their use since the last call."""
        return self.pages.take_missing()

    def watch(self, on: bool) -> None:
        """Check (or stop checking) that the cached layers stay resident between uses (the thin margin)."""
        self.pages.watch = on

    # -- the plan ----------------------------------------------------------------------------
    def apply(self, plan: ResidencyPlan, why: str) -> None:
        """Carry ``plan`` out from the next layer on."""
        if plan == self.residency:
            return
        self.residency = plan
        self.pages.apply(plan)
        logger.info("residency of %s: %s; %s", self.name, plan.describe(), why)


def cached_lost(members: Sequence[StackMember]) -> int:
    """Bytes of cached layers the kernel took since the last check, as their uses found them.

    A cached layer used before under its stack's plan must find its
    pages resident at its next use (``LayerPages.watch``, checked before
    the layer faults them back in), and so must a part read ahead (its
    window may take the thin share too). Missing pages beyond 1 MiB + 1 %
    of what a stack caches (the kernel's own slack: pages of a layer's ends
    shared with streamed neighbours) count.
    """
    lost = 0
    for m in members:
        missing = m.take_missing()
        plan = m.residency
        if m.given is not None or plan is None or not (plan.cached or (plan.parts and plan.depth)):
            continue
        if missing > (1 << 20) + plan.cached_bytes // 100:
            lost += missing
    return lost


def planned_buffers(members: Sequence[StackMember]) -> int:
    """Uncached buffers of ``members`` as the plan charges them (``StackMember.buffer_bytes``)."""
    return sum(m.buffer_bytes for m in members)


def file_ranges_of(measured: Sequence[StackMember]) -> tuple[tuple[int, int, int, int], ...]:
    """(dev, inode, first, end) of every file range the members' mapped layers read, merged per file."""
    per_file: dict[tuple[int, int], list[list[int]]] = {}
    for m in measured:
        for ident, first, end, _ in m.file_ranges():
            per_file.setdefault(ident, []).append([first, end])
    out = []
    for (dev, ino), spans in sorted(per_file.items()):
        out.extend((dev, ino, a, b) for a, b in merge_runs(spans))
    return tuple(out)


def always_read_of(measured: Sequence[StackMember]) -> list[tuple[object, int]]:
    """The mapped weights outside the members' stacks that each forward reads, once each."""
    by_model: dict[int, tuple[object, list, object]] = {}
    for m in measured:
        entry = by_model.setdefault(id(m.model), (m.model, [], m.always_read))
        entry[1].extend(m.layers)
    seen: set[int] = set()
    out = []
    for model, layers, always_read in by_model.values():
        for t, n in always_read(model, layers):
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                out.append((t, n))
    return out
