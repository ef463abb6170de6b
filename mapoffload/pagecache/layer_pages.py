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

from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any, Protocol

from .._log import logger
from .._native import _core
from .file_places import MapsView
from .mapped_file import MappedFiles
from .pages import PageWorker, check_extents, file_extents, folio_edges, layer_spans
from .part_reads import MAPPED, PartReads
from .residency import ResidencyPlan

__all__ = ["MAPPED", "LayerPages", "PagedLayer", "PagedPart", "PagedWeight"]


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
        self.stores = stores
        self.files = MappedFiles()  # the files behind the spans, held open
        self.worker = PageWorker(kernel_caps)
        self.plan: ResidencyPlan | None = None
        self._spans: dict[int, Any] = {}
        self._extents: dict[int, list] = {}  # layer -> Extents (file, first, end) its mapped weights read
        self._edges: dict[int, Any] = {}  # layer -> its bytes in 2 MiB file windows shared with a neighbour
        self._warm: set[int] = set()  # cached layers read in once
        # The coordinator's check of the cached set's thin margin: a cached layer
        # used before under this plan must find its pages resident at its next use.
        self.watch = False  # the thin share is in use: note what is missing
        self._used: set[int] = set()  # cached layers used since the plan
        self._missing = 0  # bytes of cached layers found missing at a use, since take_missing() (parts: PartReads)
        self._advised: list = []  # spans given MADV_RANDOM, set back to normal on close
        self.letting_go: Future | None = None  # the last let-go (see before_streamed_read)
        self.parts = PartReads(self)  # streamed layers read part by part, the next parts read ahead
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
            spans = layer_spans([(w.host.data_ptr(), w.nbytes) for w in self.stores[i].weights if w.store == MAPPED])
            maps = MapsView() if maps is None else maps
            self._extents[i] = file_extents(spans, self.files, maps)
            # The manager reads these pages itself: a fault's readahead would
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
        self.parts.forget(i)
        self._spans.pop(i, None)
        self._extents.pop(i, None)
        self._edges.pop(i, None)

    # -- what each layer is ---------------------------------------------------------------
    @property
    def in_parts(self) -> bool:
        """The plan reads streamed layers part by part (the room does not hold one layer): :attr:`parts`."""
        return self.plan is not None and self.plan.parts

    def mapped_sizes(self) -> list[int]:
        """Mapped bytes of each layer: what the plan places."""
        return [s.bytes_in(MAPPED) for s in self.stores]

    def resident_bytes(self, layers=None) -> list[int]:
        """Bytes of each layer's mapped weights resident in RAM now (``mincore``), or of ``layers`` only."""
        return [sum(_core.resident_bytes(self.spans(i))) for i in (range(len(self.stores)) if layers is None else layers)]

    def file_ranges(self) -> list[tuple[tuple[int, int], int, int, str]]:
        """``((device, inode), first, end, path)`` of every file range the layers' mapped weights read."""
        import os

        out = []
        for i in range(len(self.stores)):
            self.spans(i)
            for e in self._extents[i]:
                if e.file is None or e.file.fd < 0:
                    continue
                st = os.fstat(e.file.fd)
                out.append(((st.st_dev, st.st_ino), e.first, e.end, e.path))
        return out

    def streams(self, i: int) -> bool:
        """Whether layer ``i`` is read from the file each forward and let go after use."""
        return self.plan is not None and self.plan.is_streamed(i) and self.stores[i].bytes_in(MAPPED) > 0

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
            size = self.stores[i].bytes_in(MAPPED)
            self._missing += max(0, size - sum(_core.resident_bytes(self.spans(i))))

    def take_missing(self) -> int:
        """Bytes of cached layers found missing at their use since the last call (see ``watch``)."""
        missing, self._missing = self._missing, 0
        return missing + self.parts.take_missing()

    # -- reading in ------------------------------------------------------------------------
    def _read_ahead(self, i: int) -> bool:
        """Whether layer ``i``'s pages are to be read in before it runs (and note the cached ones)."""
        if not self.stores[i].bytes_in(MAPPED):
            return False
        if self.streams(i) and self.in_parts:
            return False  # read part by part as its parts run (PartReads.enter)
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
        what = f"layer {i} ({self.stores[i].name})"
        return self.worker.read_in(self.spans(i), what, self._edges[i], self._extents[i])

    def check(self, i: int) -> None:
        """Raise ``MappingFaultError`` when a file behind layer ``i`` no longer holds its bytes."""
        self.spans(i)
        check_extents(self._extents[i], f"layer {i} ({self.stores[i].name})")

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
        pending, self.letting_go = self.letting_go, None
        if pending is not None:
            try:
                pending.result()
            except Exception:
                logger.debug("letting a layer go failed", exc_info=True)
        self.worker.before_copy(self.spans(i), self._edges[i], self._extents[i])

    def before_cached_copy(self, i: int) -> None:
        """Before a copier reads cached layer ``i``: read it ahead where faults read 4 KiB pages."""
        if self.stores[i].bytes_in(MAPPED):
            self._before_cached_use(i)
            self.worker.before_copy(self.spans(i), None, self._extents[i])

    # -- letting go ------------------------------------------------------------------------
    def let_go(self, i: int) -> Future | None:
        """Let streamed layer ``i``'s pages go on the page worker (checked there; None: cached)."""
        if not self.streams(i):
            return None
        self.letting_go = self.worker.let_go(self.spans(i), self._extents[i])
        return self.letting_go

    def settle(self) -> None:
        """Wait for the page work asked so far: no let-go is left in flight when control goes back
        to the user's code, who may write a weight in place (see :meth:`PageWorker.drain`)."""
        self.worker.drain()

    # -- lifetime --------------------------------------------------------------------------
    def after_fork_in_child(self) -> None:
        self.worker.after_fork_in_child()
        self.letting_go = None  # the parent's page worker: it never completes here
        self.parts.after_fork_in_child()

    def close(self) -> None:
        """Let go the parts read ahead, finish queued page work, close the files, set the spans' advice
        back. Idempotent."""
        if self.parts.reading_ahead and self.worker.running:
            self.parts.let_go_ahead()
        self.worker.close()
        self.files.close()
        for spans in self._advised:
            _core.advise_random(spans, False)
        self._advised.clear()
