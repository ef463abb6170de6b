"""Streamed layers read part by part, with the next parts read ahead while one computes.

Where the page-cache plan holds less than one layer (``ResidencyPlan.parts``), a streamed layer is read
in part by part: each part (a submodule holding some of the layer's weights, ``PagedLayer.parts``) is read
in before it runs and let go after. While a part computes, the reads of the parts that ran after it the
last time run on the page worker, as many as fit the plan's window beside it (issue 43). The order is
learnt as the parts run: a forward that goes another way reads on demand, as without read-ahead, and a
part read ahead that is not among the next ones now is let go first. The page worker runs the reads in
the order asked, after the let-go of the part that ran before, so no more than the plan's window
(``1 + depth`` of the largest part, in bytes) is in the page cache at once. At depth 0 (the window is
one largest part) the smaller parts are still read ahead within it, unless ``prefetch_layers`` is 0; a
part that reads itself in chunks of its rows (``offload.runtime.RowChunks``) and does not fit whole has
its first chunk read ahead where that fits, and behind the last chunk of a part the next parts that fit
are read, the next layer's first ones included (:meth:`PartReads.read_next_head`).
"""

from __future__ import annotations

import threading
import weakref
from concurrent.futures import Future
from typing import Any, Callable, Protocol

from .._native import _core
from .file_places import MapsView
from .mapped_file import MappedFiles
from .pages import PageWorker, file_extents, folio_edges, layer_spans
from .residency import ResidencyPlan

__all__ = ["MAPPED", "LayersPaged", "PartReads"]

MAPPED = "mapped"  # the host store of a weight kept on its file mapping (``offload.stores.MAPPED``)


class LayersPaged(Protocol):
    """What part-by-part reads take of a manager's layer pages (``layer_pages.LayerPages``)."""

    stores: Any  # the layer stores (``PagedLayer``), each with its ``parts``
    files: MappedFiles
    worker: PageWorker
    plan: ResidencyPlan | None
    watch: bool  # the thin share is watched: parts read ahead are checked to be resident when they run
    letting_go: Future | None  # the last let-go

    def spans(self, i: int) -> Any: ...

    def streams(self, i: int) -> bool: ...


class PartReads:
    """The part-by-part reads of one manager's streamed layers (see the module).

    Parameters
    ----------
    pages
        The manager's :class:`~mapoffload.pagecache.layer_pages.LayerPages` (:class:`LayersPaged`): its
        stores, files, page worker and plan.
    """

    def __init__(self, pages: LayersPaged) -> None:
        # Not a cycle: the pages hold the layers' stores, and so the model's mapped weights, which a
        # cycle would keep mapped after the manager closed, until the garbage collector ran.
        self._pages = weakref.proxy(pages)
        self._geometry: dict[int, list] = {}  # layer -> (spans, extents, edges) of each part, found once
        # The parts whose reads started before they ran, the part that ran after each the last time, and
        # the one that ran last in this forward.
        self._ahead: dict[tuple[int, int], Future | None] = {}
        self._after: dict[tuple[int, int], tuple[int, int]] = {}
        self._last: tuple[int, int] | None = None
        self._lock = threading.Lock()
        self._missing = 0  # bytes of parts read ahead found missing when they ran (the thin share watched)
        # Parts that read themselves in chunks of their rows: (spans, extents, edges) of each one's first chunk;
        # the parts in _ahead whose first chunk only was read (behind the last chunk of the part before).
        self._heads: dict[tuple[int, int], tuple] = {}
        self._head_only: set[tuple[int, int]] = set()

    # -- what each part is -------------------------------------------------------------------
    def sizes(self, i: int) -> list[int]:
        """Mapped bytes of each part of layer ``i`` (``PagedLayer.parts``)."""
        layer = self._pages.stores[i]
        return [sum(w.nbytes for w in p.weights if w.store == MAPPED) for p in getattr(layer, "parts", ())]

    def largest(self) -> int:
        """Mapped bytes of the largest part of any layer: the room a stack read part by part needs."""
        return max((max(self.sizes(i), default=0) for i in range(len(self._pages.stores))), default=0)

    def _part(self, i: int, k: int):
        """``(spans, extents, edges)`` of part ``k`` of layer ``i`` (its mapped weights), found once."""
        parts = self._geometry.get(i)
        if parts is None:
            pages = self._pages
            pages.spans(i)  # the layer's files opened and advised first (the parts' bytes are among them)
            maps = MapsView()
            parts = []
            for part in pages.stores[i].parts:
                spans = layer_spans([(w.host.data_ptr(), w.nbytes) for w in part.weights if w.store == MAPPED])
                parts.append((spans, file_extents(spans, pages.files, maps), folio_edges(spans, maps)))
            self._geometry[i] = parts
        return parts[k]

    # -- reading and letting go --------------------------------------------------------------
    def read(self, i: int, k: int) -> Future | None:
        """Start reading part ``k`` of streamed layer ``i`` in (None: nothing of it is mapped)."""
        spans, extents, edges = self._part(i, k)
        if not len(spans):
            return None
        what = f"layer {i} ({self._pages.stores[i].parts[k].name})"
        return self._pages.worker.read_in(spans, what, edges, extents)

    def let_go(self, i: int, k: int) -> Future | None:
        """Let part ``k`` of streamed layer ``i`` go (checked there; None: nothing of it is mapped)."""
        spans, extents, _ = self._part(i, k)
        if not len(spans):
            return None
        self._pages.letting_go = self._pages.worker.let_go(spans, extents)
        return self._pages.letting_go

    def enter(self, i: int, k: int, read: bool = True) -> Future | None:
        """Part ``k`` of streamed layer ``i`` is about to run: its read (started ahead, or now; not now
        where ``read`` is False: it reads itself, chunk by chunk), and the reads of the parts that ran
        after it the last time and fit the window beside it (:meth:`_next`) started behind it; a part
        read ahead that is not among those now is let go first."""
        key = (i, k)
        with self._lock:
            if self._last is not None and self._last != key:
                self._after[self._last] = key
            self._last = key
            nexts = self._next(key, self._room(key))
            # A part read ahead for a forward that went another way: let go before this part's read is
            # asked, which waits for it.
            self._drop_ahead(lambda p: p not in nexts and p != key)
            started = None
            if key in self._ahead:
                started = self._ahead.pop(key)
                if key in self._head_only:  # its first chunk only
                    self._head_only.discard(key)
                    if read:  # it computes whole after all: the rest is read too
                        started = self.read(i, k)
                elif self._pages.watch and started is not None and started.done() and started.exception() is None:
                    self._missing += self._not_resident(i, k)  # read ahead into the thin share: kept?
            elif read:
                started = self.read(i, k)
            self._start(nexts)
        return started

    def chunked(self, i: int, k: int, head: tuple | None) -> None:
        """Part ``k`` of layer ``i`` reads itself in chunks of its rows, ``head`` its first chunk's ``(spans,
        extents, edges)``; None: it does not (any more)."""
        with self._lock:
            if head is None:
                self._heads.pop((i, k), None)
            else:
                self._heads[(i, k)] = head

    def is_chunked(self, i: int, k: int) -> bool:
        """Whether part ``k`` of layer ``i`` has its first chunk registered (:meth:`chunked`; dropped by
        :meth:`forget` when the layer's stores change)."""
        return (i, k) in self._heads

    def read_next_head(self, i: int, k: int, held: int) -> None:
        """Part ``k`` of layer ``i`` computes its last chunk, ``held`` bytes of it in the page cache: the parts
        that ran after it the last time start reading behind it, as many as the plan's window holds beside
        it and what is read ahead already (:meth:`_next`: whole parts, then the first chunk of one that
        reads itself in chunks), the next layer's first parts included. At depth 0 (the window one largest
        part) nothing else could be read while this one computed (issue 43)."""
        with self._lock:
            room = self._room((i, k), held) - sum(self._bytes(p) for p in self._ahead)
            self._start(self._next((i, k), room, passing=set(self._ahead)), keep=True)

    def _not_resident(self, i: int, k: int) -> int:
        """Bytes of part ``k`` of layer ``i`` not resident now (read ahead, and taken by the kernel since)."""
        spans = self._part(i, k)[0]
        return max(0, spans.total_bytes - sum(_core.resident_bytes(spans))) if len(spans) else 0

    def _room(self, key: tuple[int, int], held: int | None = None) -> int:
        """Bytes of the plan's window left beside part ``key`` (``held`` of it in the page cache; None: all
        of it); -1 where nothing is read ahead (no plan by parts, or no read-ahead)."""
        plan = self._pages.plan
        if plan is None or not plan.parts or not plan.readahead:
            return -1
        return plan.window_bytes - (self._bytes(key) if held is None else held)

    def _next(self, key: tuple[int, int], room: int, passing: set = frozenset()) -> dict[tuple[int, int], bool]:
        """The parts to read ahead of ``key`` within ``room`` bytes: those that ran after it the last time,
        in that order, streamed ones only, each whole while it fits, then the first chunk of one that reads
        itself in chunks (:meth:`chunked`) where that fits; part -> whether its first chunk only. Parts in
        ``passing`` are walked over, their bytes counted by the caller. The window is counted in bytes
        (``1 + depth`` of the largest part): behind a small part (a norm, an attention projection) more than
        ``depth`` parts fit, so the read of a large one begins while the small ones before it compute."""
        out: dict[tuple[int, int], bool] = {}
        p, seen = key, {key}
        while room >= 0:
            p = self._after.get(p)
            if p is None or p in seen or not self._pages.streams(p[0]):
                break
            seen.add(p)
            if p in passing:
                continue
            room -= self._bytes(p)
            if room >= 0:
                out[p] = False
            elif p in self._heads and room + self._bytes(p) >= self._heads[p][0].total_bytes:
                out[p] = True
        return out

    def _drop_ahead(self, which: Callable[[tuple[int, int]], bool]) -> None:
        """Let go the parts read ahead that ``which`` names, and forget them (the lock held)."""
        for p in [p for p in self._ahead if which(p)]:
            del self._ahead[p]
            self._head_only.discard(p)
            self.let_go(*p)

    def _start(self, nexts: dict[tuple[int, int], bool], keep: bool = False) -> None:
        """Read ``nexts`` ahead (:meth:`_next`; the lock held): the parts read ahead that are not among them
        let go first (unless ``keep``), a part whose first chunk only was read read whole where it now fits."""
        if not keep:
            self._drop_ahead(lambda p: p not in nexts)
        for p, head in nexts.items():
            if p in self._ahead and (head or p not in self._head_only):
                continue  # read as it is asked (a part read whole stays so: it was counted whole)
            if head:
                spans, extents, edges = self._heads[p]
                what = f"layer {p[0]} ({self._pages.stores[p[0]].parts[p[1]].name}) (its first chunk)"
                self._ahead[p] = self._pages.worker.read_in(spans, what, edges, extents)
                self._head_only.add(p)
            else:
                self._ahead[p] = self.read(*p)
                self._head_only.discard(p)

    def _bytes(self, p: tuple[int, int]) -> int:
        """Mapped bytes of part ``p`` (as its reads count them)."""
        return self._part(*p)[0].total_bytes

    def let_go_ahead(self) -> None:
        """Let go the parts read ahead that did not run (a forward that ended, or raised, before them),
        and start the next forward's order afresh."""
        with self._lock:
            ahead, self._ahead, self._last = self._ahead, {}, None
            self._head_only.clear()
            for p in ahead:
                self.let_go(*p)

    @property
    def reading_ahead(self) -> bool:
        """Whether any part's read ahead is outstanding (read, not yet run or let go)."""
        return bool(self._ahead)

    def take_missing(self) -> int:
        """Bytes of parts read ahead found missing when they ran, since the last call."""
        missing, self._missing = self._missing, 0
        return missing

    # -- lifetime ----------------------------------------------------------------------------
    def forget(self, i: int) -> None:
        """Layer ``i``'s stores changed: its parts read ahead let go (by the spans they were read by), its
        parts measured again at their next read."""
        with self._lock:
            self._drop_ahead(lambda p: p[0] == i)
            for p in [p for p in self._heads if p[0] == i]:
                del self._heads[p]  # cut from the weights as they were
        self._geometry.pop(i, None)

    def after_fork_in_child(self) -> None:
        self._lock = threading.Lock()
        self._ahead, self._last = {}, None  # the parent's reads: the pages are the parent's to let go
        self._head_only = set()
