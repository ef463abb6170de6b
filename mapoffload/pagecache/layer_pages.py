"""The page-cache side of one manager's layers.

What the page cache holds of each layer (its mapped spans), the files behind
them (held open: checks and drops reach the mapped inode), reading a layer's
pages in before it computes, letting a streamed layer's pages go after it
ran, and the residency plan that says which layers stream. The plan itself
is made by the process's page-cache coordinator (``coordinator.py``), which
weighs every registered manager against one budget; ``LayerPages`` carries
it out.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any, Protocol

from .._log import logger
from .._native import _core
from .file_places import MapsView
from .mapped_file import MappedFiles
from .pages import PageWorker, check_extents, file_extents, folio_edges, layer_spans
from .residency import ResidencyPlan

__all__ = ["MAPPED", "LayerPages", "PagedLayer", "PagedPart", "PagedWeight"]

MAPPED = "mapped"  # the host store of a weight kept on its file mapping (``offload.stores.MAPPED``)


class PagedWeight(Protocol):
    """What the page cache reads of one weight (``offload.stores.Weight``)."""

    store: str  # MAPPED: its host tensor is a view of a file mapping
    host: Any  # the host tensor (``data_ptr()``)
    nbytes: int  # the byte extent its strides reach


class PagedPart(Protocol):
    """What the page cache reads of one part of a layer (``offload.stores.Part``): a submodule's weights."""

    name: str
    weights: Sequence[PagedWeight]


class PagedLayer(Protocol):
    """What the page cache reads of one layer (``offload.stores.LayerStore``)."""

    name: str
    weights: Sequence[PagedWeight]
    parts: Sequence[PagedPart]  # its weights by the submodule that holds them (read part by part)

    def bytes_in(self, store: str) -> int: ...


class LayerPages:
    """Mapped spans, files, page reads and let-gos of a manager's layers.

    Parameters
    ----------
    stores
        The manager's layer stores (weights with their host tensors).
    kernel_caps
        What to assume of the kernel instead of probing it (``kernel.py``).
    """

    def __init__(self, stores: Sequence[PagedLayer], kernel_caps: str | None = None) -> None:
        self._stores = stores
        self.files = MappedFiles()  # the files behind the spans, held open
        self.worker = PageWorker(kernel_caps)
        self.plan: ResidencyPlan | None = None
        self._spans: dict[int, Any] = {}
        self._extents: dict[int, list] = {}  # layer -> Extents (file, first, end) its mapped weights read
        self._edges: dict[int, Any] = {}  # layer -> its bytes in 2 MiB file windows shared with a neighbour
        self._parts: dict[int, list] = {}  # layer -> (spans, extents, edges) of each part (read part by part)
        self._warm: set[int] = set()  # cached layers read in once
        # The coordinator's check of the cached set's thin margin: a cached layer
        # used before under this plan must find its pages resident at its next use.
        self.watch = False  # the thin share is in use: note what is missing
        self._used: set[int] = set()  # cached layers used since the plan
        self._missing = 0  # bytes of cached layers (and parts read ahead) found missing at a use, since take_missing()
        self._advised: list = []  # spans given MADV_RANDOM, set back to normal on close
        self._letting_go: Future | None = None  # the device path's last let-go (see before_streamed_read)
        # Part by part, read ahead (enter_part): the parts whose reads started before they ran, the part
        # that ran after each the last time, and the one that ran last in this forward.
        self._ahead: dict[tuple[int, int], Future | None] = {}
        self._after: dict[tuple[int, int], tuple[int, int]] = {}
        self._last: tuple[int, int] | None = None
        self._ahead_lock = threading.Lock()
        maps = MapsView()  # one snapshot of the maps for every layer's lookups
        for i in range(len(stores)):
            self.spans(i, maps)  # open the files now, before a path can come to name another file

    # -- what the page cache holds of each layer -------------------------------------------
    def spans(self, i: int, maps: MapsView | None = None):
        """Merged spans of layer ``i``'s mapped weights (what the page cache holds of it).

        ``maps``: the maps snapshot to find their files in (one is taken when needed and None).
        """
        spans = self._spans.get(i)
        if spans is None:
            spans = layer_spans([(w.host.data_ptr(), w.nbytes) for w in self._stores[i].weights if w.store == MAPPED])
            maps = MapsView() if maps is None else maps
            self._extents[i] = file_extents(spans, self.files, maps)
            # The manager reads these pages itself: a fault's read-around would
            # bring a neighbouring layer back in, unmapped, where letting it go
            # cannot reach it. MADV_RANDOM (+ MADV_HUGEPAGE), by kernel capability.
            self.worker.advise(spans, self._extents[i])
            self._advised.append(spans)
            self._spans[i] = spans
            self._edges[i] = folio_edges(spans, maps)
        return spans

    def extents(self, i: int) -> list:
        """``Extent`` (file held open, path, first, end) of each file layer ``i``'s mapped weights read."""
        self.spans(i)
        return self._extents[i]

    def forget(self, i: int) -> None:
        """Layer ``i``'s stores changed (a mapped weight became owned): measure its spans again (its parts
        read ahead let go first, by the spans they were read by)."""
        with self._ahead_lock:
            for p in [p for p in self._ahead if p[0] == i]:
                del self._ahead[p]
                self.let_go_part(*p)
        self._spans.pop(i, None)
        self._extents.pop(i, None)
        self._edges.pop(i, None)
        self._parts.pop(i, None)

    # -- part by part ----------------------------------------------------------------------
    def part_sizes(self, i: int) -> list[int]:
        """Mapped bytes of each part of layer ``i`` (``PagedLayer.parts``)."""
        return [sum(w.nbytes for w in p.weights if w.store == MAPPED) for p in getattr(self._stores[i], "parts", ())]

    def largest_part(self) -> int:
        """Mapped bytes of the largest part of any layer: the room a stack read part by part needs."""
        return max((max(self.part_sizes(i), default=0) for i in range(len(self._stores))), default=0)

    @property
    def in_parts(self) -> bool:
        """The plan reads streamed layers part by part (the room does not hold one layer)."""
        return self.plan is not None and self.plan.parts

    def _part(self, i: int, k: int):
        """``(spans, extents, edges)`` of part ``k`` of layer ``i`` (its mapped weights), found once."""
        parts = self._parts.get(i)
        if parts is None:
            self.spans(i)  # the layer's files opened and advised first (the parts' bytes are among them)
            maps = MapsView()
            parts = []
            for part in self._stores[i].parts:
                spans = layer_spans([(w.host.data_ptr(), w.nbytes) for w in part.weights if w.store == MAPPED])
                parts.append((spans, file_extents(spans, self.files, maps), folio_edges(spans, maps)))
            self._parts[i] = parts
        return parts[k]

    def read_part(self, i: int, k: int) -> Future | None:
        """Start reading part ``k`` of streamed layer ``i`` in (None: nothing of it is mapped)."""
        spans, extents, edges = self._part(i, k)
        if not len(spans):
            return None
        what = f"layer {i} ({self._stores[i].parts[k].name})"
        return self.worker.read_in(spans, what, edges, extents)

    def enter_part(self, i: int, k: int) -> Future | None:
        """Part ``k`` of streamed layer ``i`` is about to run: its read (started ahead, or now), and the
        reads of the ``plan.depth`` parts that ran after it the last time started behind it.

        The order is the one the parts ran in (learnt as they run: a forward that goes another way reads
        on demand, as without read-ahead). A part read ahead that is not among the next ones now (the
        forward went another way) is let go first. The page worker runs these in the order asked, after
        the let-go of the part that ran before, so no more than ``1 + depth`` parts are in the page cache
        at once: the plan's window.
        """
        key = (i, k)
        with self._ahead_lock:
            if self._last is not None and self._last != key:
                self._after[self._last] = key
            self._last = key
            if key in self._ahead:
                read = self._ahead.pop(key)
                if self.watch and read is not None and read.done() and read.exception() is None:
                    self._missing += self._part_missing(i, k)  # read ahead into the thin share: kept?
            else:
                read = self.read_part(i, k)
            nexts = self._next_parts(key)
            for stale in [p for p in self._ahead if p not in nexts]:
                del self._ahead[stale]
                self.let_go_part(*stale)
            for p in nexts:
                if p not in self._ahead:
                    self._ahead[p] = self.read_part(*p)
        return read

    def _part_missing(self, i: int, k: int) -> int:
        """Bytes of part ``k`` of layer ``i`` not resident now (read ahead, and taken by the kernel since)."""
        spans = self._part(i, k)[0]
        return max(0, spans.total_bytes - sum(_core.resident_bytes(spans))) if len(spans) else 0

    def _next_parts(self, key: tuple[int, int]) -> list[tuple[int, int]]:
        """The parts to read ahead of ``key``: the ``plan.depth`` that ran after it, streamed ones only."""
        out: list[tuple[int, int]] = []
        p = key
        for _ in range(self.plan.depth if self.plan is not None and self.plan.parts else 0):
            p = self._after.get(p)
            if p is None or p == key or p in out or not self.streams(p[0]):
                break
            out.append(p)
        return out

    def let_go_ahead(self) -> None:
        """Let go the parts read ahead that did not run (a forward that ended, or raised, before them),
        and start the next forward's order afresh."""
        with self._ahead_lock:
            ahead, self._ahead, self._last = self._ahead, {}, None
            for p in ahead:
                self.let_go_part(*p)

    def let_go_part(self, i: int, k: int) -> Future | None:
        """Let part ``k`` of streamed layer ``i`` go (checked there; None: nothing of it is mapped)."""
        spans, extents, _ = self._part(i, k)
        if not len(spans):
            return None
        self._letting_go = self.worker.let_go(spans, extents)
        return self._letting_go

    def mapped_sizes(self) -> list[int]:
        """Mapped bytes of each layer: what the plan places."""
        return [s.bytes_in(MAPPED) for s in self._stores]

    def resident_bytes(self) -> list[int]:
        """Bytes of each layer's mapped weights resident in RAM now (``mincore``)."""
        return self.resident_of(range(len(self._stores)))

    def resident_of(self, layers) -> list[int]:
        """:meth:`resident_bytes` of the given layers only."""
        return [sum(_core.resident_bytes(self.spans(i))) for i in layers]

    def file_ranges(self) -> list[tuple[tuple[int, int], int, int, str]]:
        """``((device, inode), first, end, path)`` of every file range the layers' mapped weights read."""
        import os

        out = []
        for i in range(len(self._stores)):
            self.spans(i)
            for e in self._extents[i]:
                if e.file is None or e.file.fd < 0:
                    continue
                st = os.fstat(e.file.fd)
                out.append(((st.st_dev, st.st_ino), e.first, e.end, e.path))
        return out

    def streams(self, i: int) -> bool:
        """Whether layer ``i`` is read from the file each forward and let go after use."""
        return self.plan is not None and self.plan.is_streamed(i) and self._stores[i].bytes_in(MAPPED) > 0

    def apply(self, plan: ResidencyPlan) -> None:
        """Carry out ``plan`` from the next layer on."""
        self.plan = plan
        self._warm.intersection_update(plan.cached)
        self._used.clear()

    def _before_cached_use(self, i: int) -> None:
        """Cached layer ``i`` is about to be read: used before under this plan, its pages must be resident.

        Checked here, before the layer faults them back in, and not at the
        forward's start: the kernel's LRU takes the cached pages used longest
        ago, which mid-forward are the layers still to run - back in RAM by
        the forward's end, read again every forward.
        """
        if i not in self._used:
            self._used.add(i)  # its first use since the plan: it may be cold
            return
        if self.watch:
            size = self._stores[i].bytes_in(MAPPED)
            self._missing += max(0, size - sum(_core.resident_bytes(self.spans(i))))

    def take_missing(self) -> int:
        """Bytes of cached layers found missing at their use since the last call (see ``watch``)."""
        missing, self._missing = self._missing, 0
        return missing

    # -- reading in ------------------------------------------------------------------------
    def _read_ahead(self, i: int) -> bool:
        """Whether layer ``i``'s pages are to be read in before it runs (and note the cached ones)."""
        if not self._stores[i].bytes_in(MAPPED):
            return False
        if self.streams(i) and self.in_parts:
            return False  # read part by part as its parts run (read_part)
        if not self.streams(i):
            self._before_cached_use(i)
            if i in self._warm:
                return False
            self._warm.add(i)
        return True

    def read_in(self, i: int) -> Future | None:
        """Start reading layer ``i``'s pages in on the page worker (None: nothing to read)."""
        if not self._read_ahead(i):
            return None
        what = f"layer {i} ({self._stores[i].name})"
        return self.worker.read_in(self.spans(i), what, self._edges[i], self._extents[i])

    def check(self, i: int) -> None:
        """Raise ``MappingFaultError`` when a file behind layer ``i`` no longer holds its bytes."""
        self.spans(i)
        check_extents(self._extents[i], f"layer {i} ({self._stores[i].name})")

    def before_streamed_read(self, i: int) -> None:
        """Before a copier reads streamed layer ``i``: the last let-go done, the edges read small.

        The page worker lets layers go off the compute thread; the copier
        reads on threads of its own. Waiting for the last let-go keeps the
        order the in-place path gets from the worker's queue: a streamed layer
        is read only after the one before it went, so no more than the plan's
        ``1 + depth`` are ever in the page cache. The layer's file-window
        edges are read first into small folios (``pages.folio_edges``), or,
        where faults read 4 KiB pages, the whole layer ahead in large I/Os.
        """
        self.spans(i)
        pending, self._letting_go = self._letting_go, None
        if pending is not None:
            try:
                pending.result()
            except Exception:
                logger.debug("letting a layer go failed", exc_info=True)
        self.worker.before_copy(self.spans(i), self._edges[i], self._extents[i])

    def before_cached_copy(self, i: int) -> None:
        """Before a copier reads cached layer ``i``: read it ahead where faults read 4 KiB pages."""
        if self._stores[i].bytes_in(MAPPED):
            self._before_cached_use(i)
            self.worker.before_copy(self.spans(i), None, self._extents[i])

    # -- letting go ------------------------------------------------------------------------
    def let_go(self, i: int) -> Future | None:
        """Let streamed layer ``i``'s pages go on the page worker (checked there; None: cached)."""
        if not self.streams(i):
            return None
        self._letting_go = self.worker.let_go(self.spans(i), self._extents[i])
        return self._letting_go

    def settle(self) -> None:
        """Wait for the page work asked so far: no let-go is left in flight when control goes back
        to the user's code, who may write a weight in place (see :meth:`PageWorker.drain`)."""
        self.worker.drain()

    # -- lifetime --------------------------------------------------------------------------
    def after_fork_in_child(self) -> None:
        self.worker.after_fork_in_child()
        self._letting_go = None  # the parent's page worker: it never completes here
        self._ahead_lock = threading.Lock()
        self._ahead, self._last = {}, None  # the parent's reads: the pages are the parent's to let go

    def close(self) -> None:
        """Let go the parts read ahead, finish queued page work, close the files, set the spans' advice
        back. Idempotent."""
        if self._ahead and self.worker.running:
            self.let_go_ahead()
        self.worker.close()
        self.files.close()
        for spans in self._advised:
            _core.advise_random(spans, False)
        self._advised.clear()
