"""Page-cache work of the layerwise offload manager, off the compute thread:
read a layer's mapped pages in before it runs (``MADV_POPULATE_READ``, in
2 MiB folios), let a streamed layer's pages go after it ran (``MADV_PAGEOUT``,
checked with ``mincore`` and completed when the kernel left pages behind).

The advice follows what the kernel can do (``kernel.py``, measured at run
time, per device): where a fault does not read a whole 2 MiB window (kernels
before 5.18), a layer is read ahead whole in large I/Os (``read_ahead``) and
only then mapped, instead of faulted in 4 KiB at a time; without
``MADV_POPULATE_READ`` its pages are touched a byte each under the SIGBUS
guard; without ``MADV_PAGEOUT`` a let-go is ``POSIX_FADV_DONTNEED`` only.

Two worker threads per manager run the native calls (``madvise``; the GIL
is released while the kernel works): one reads, one lets go, each in the
order asked. A read starts only once every let-go asked before it is done, so
a streamed layer is let go before the next one is read under a tight budget,
as with one queue; a let-go waits only for the reads asked before it that
touch its bytes. The let-go's CPU (``MADV_PAGEOUT`` of a part's small folios,
~0.6 ms for 15 MiB) then runs beside the reads already queued instead of
between them (issue 43).
"""

from __future__ import annotations

import errno
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait

from .._log import log_once, logger
from .._runs import merge_runs
from .file_places import MapsView
from .kernel import KernelCaps, kernel_caps, overrides
from .mapped_file import MappedFile, MappedFiles
from .._native import _core

__all__ = ["Extent", "PageWorker", "check_extents", "file_extents", "folio_edges", "inner_pages", "layer_spans"]


class Extent:
    """The bytes ``[first, end)`` of one file that a layer's mapped weights read."""

    __slots__ = ("file", "path", "first", "end")

    def __init__(self, file: MappedFile | None, path: str, first: int, end: int) -> None:
        self.file, self.path, self.first, self.end = file, path, first, end


def layer_spans(addr_sizes: list[tuple[int, int]]) -> _core.SpanArray:
    """Spans of a layer's mapped weights, sorted, those that touch or overlap merged."""
    merged = merge_runs((a, a + n) for a, n in addr_sizes)
    return _core.SpanArray([a for a, _ in merged], [end - a for a, end in merged])


def _fault_error(addr: int, what: str) -> OSError:
    """MappingFaultError naming the file behind ``addr`` and the offset in it."""
    place = MapsView().place(addr)
    if place is None:
        return _core.MappingFaultError(errno.EFAULT, f"{what}: address {addr:#x} is not mapped")
    return _core.MappingFaultError(
        errno.EIO,
        f"{what}: the file behind the mapping cannot be read at byte {place.offset} (truncated or gone under "
        "the mapping?); computing with it would be a SIGBUS",
        place.path,
    )


PAGE_BYTES = 4096


def file_extents(spans: _core.SpanArray, files: MappedFiles, maps: MapsView | None = None) -> list[Extent]:
    """The byte runs in each file behind ``spans``: one per run of bytes no other bytes interrupt.

    Spans whose file bytes share or touch a page are one run; a gap of a
    page or more splits them. A layer's tensors are not always together in
    its file: safetensors orders them by dtype first, so an fp8 layer's
    float32 scales sit with every other layer's scales at the file's start,
    its bf16 norms in the middle, its codes at the end. One range from the
    first to the last would hold most of the file: a let-go dropping it
    dropped the cached layers, an uncached read read it all (issue 17
    at base + 50 %: 1.1 GB read a forward for 73 MiB streamed).

    Each file is held open (``files``) from here on, so that later checks
    and page drops reach the inode that is mapped, whatever the path names
    by then. ``maps``: the snapshot to look the spans up in (one is taken
    when None).
    """
    maps = MapsView() if maps is None else maps
    by_path: dict[str, list[list[int]]] = {}
    ident: dict[str, tuple[tuple[int, int], int]] = {}
    for a, n in zip(spans.addrs, spans.sizes):
        stop = a + n
        while a < stop:  # a span merged across two mappings (two files side by side) is cut at the seam
            place = maps.place(a)
            if place is None:
                break
            upto = min(stop, a + place.room)
            if place.path.startswith("/"):
                by_path.setdefault(place.path, []).append([place.offset, place.offset + upto - a])
                ident[place.path] = (place.dev, place.inode)
            a = upto
    out: list[Extent] = []
    for path, ranges in by_path.items():
        f = files.get(path, *ident[path])
        # Runs in or right after another's last page are one run of pages.
        out.extend(Extent(f, path, first, end) for first, end in merge_runs(ranges, align=PAGE_BYTES))
    return out


def check_extents(extents: list[Extent], what: str) -> None:
    """Refuse to compute from a file that no longer reaches the bytes mapped from it.

    A read past the end of a file through its mapping is a SIGBUS that kills
    the process; a file truncated under a mapped checkpoint is caught here,
    before the layer runs, by the size of the open file (``fstat``): the
    inode that is mapped, not whatever the path names now (a file renamed
    over the path leaves the mapped one whole). A file that could not be
    opened is not checked.
    """
    for e in extents:
        if e.file is None:
            continue
        size = e.file.size()
        if size < e.end:
            raise _core.MappingFaultError(
                errno.EIO,
                f"{what}: the file is {size} bytes, its mapped weights reach byte {e.end} (from byte "
                f"{e.first}): it was truncated under the mapping; computing with it would be a SIGBUS",
                e.path,
            )


FOLIO_BYTES = 2 << 20  # the aligned window a MADV_HUGEPAGE fault reads (one PMD folio)
EDGE_CHUNK = 128 << 10  # MADV_WILLNEED per call: the kernel reads at most its readahead size per call


def folio_edges(spans: _core.SpanArray, maps: MapsView | None = None) -> _core.SpanArray:
    """The parts of each span that share an aligned 2 MiB file window with bytes outside it.

    A fault on a ``MADV_HUGEPAGE`` mapping reads the whole aligned window of
    the file that holds it, into one large folio: at a span's ends that folio
    holds a neighbouring layer's bytes too. Reading a streamed layer that way
    brings in up to 2 MiB of each neighbour, and letting it go cannot reach
    them (the folio is still mapped by the neighbour, or must be split).
    Alignment is in file offsets (the page cache's index), not addresses.
    ``maps``: the snapshot to look the spans up in (one is taken when None).
    """
    maps = MapsView() if maps is None else maps
    addrs, sizes = [], []
    for a, n in zip(spans.addrs, spans.sizes):
        place = maps.place(a)
        if place is None:
            continue
        off = place.offset
        end = off + n
        head_end = min(end, -(-off // FOLIO_BYTES) * FOLIO_BYTES)
        tail_start = max(head_end, end // FOLIO_BYTES * FOLIO_BYTES)
        for lo, hi in ((off, head_end), (tail_start, end)):
            if hi > lo:
                addrs.append(a + lo - off)
                sizes.append(hi - lo)
    return _core.SpanArray(addrs, sizes)


def read_in(spans: _core.SpanArray, what: str = "weights", edges: _core.SpanArray | None = None,
            caps: KernelCaps | None = None) -> int:
    """Read the span's pages in and map them (``MADV_POPULATE_READ``).

    Where faults read whole 2 MiB windows (``caps.large_folios``; None: as
    if), the spans are ``MADV_HUGEPAGE`` + ``MADV_RANDOM`` (the manager sets
    it): each fault reads the aligned 2 MiB folio that holds it, no more, so
    this reads in 2 MiB I/Os into large folios. ``edges``
    (:func:`folio_edges`) are read first with ``MADV_WILLNEED``, into small
    folios of exactly the span's bytes: a fault that finds its page present
    reads nothing more, so no large folio reaches into a neighbouring layer.

    Where a fault reads its own 4 KiB page only, the faults are not relied
    on: the spans are read ahead whole first (``_core.read_ahead``:
    ``MADV_WILLNEED`` calls as large as the kernel takes, exactly the span's
    pages), so that populating only maps pages already in the cache. Without
    ``MADV_POPULATE_READ`` a byte of each page is read under the SIGBUS guard.
    Returns the ``MADV_WILLNEED`` calls the read-ahead made (0 on the fault path).

    Raises
    ------
    MappingFaultError
        A page cannot be read (the file was truncated under its mapping): the
        forward would die of SIGBUS on it, so it is refused before it runs.
    """
    calls = 0
    if caps is None or caps.large_folios:
        if edges is not None and len(edges):
            _core.advise_willneed(edges, EDGE_CHUNK)
    else:
        calls = _core.read_ahead(spans)
    if caps is None or caps.populate_read:
        err, addr = _core.populate_read(spans)
        if err == errno.EINVAL:
            logger.debug("MADV_POPULATE_READ refused (EINVAL); a byte of each page is read instead")
            err, addr = _core.touch_pages(spans)
    else:
        err, addr = _core.touch_pages(spans)
    if err == errno.EFAULT:
        raise _fault_error(addr, what)
    if err:
        # Not a missing page: the compute's own faults read the pages.
        logger.debug("reading pages in failed (errno %d); the forward faults the pages in", err)
    return calls


def before_copy(spans: _core.SpanArray, edges: _core.SpanArray | None, caps: KernelCaps | None) -> int:
    """Before the copier reads a layer's mapped pages (it faults them in itself).

    With window faults: the file-window edges are read first into small
    folios (see :func:`read_in`). Without: the whole layer is read ahead in
    large I/Os, so that the copier's faults find its pages in the cache
    instead of reading them 4 KiB at a time. Returns the ``MADV_WILLNEED``
    calls of the read-ahead.
    """
    if caps is None or caps.large_folios:
        if edges is not None and len(edges):
            _core.advise_willneed(edges, EDGE_CHUNK)
        return 0
    return _core.read_ahead(spans)


def inner_pages(spans: _core.SpanArray) -> _core.SpanArray:
    """The whole pages inside each span.

    A span's first and last page are shared with the bytes beside it in the
    file, another layer's: paging them out unmaps them under that layer, whose
    next touch faults, and on a ``MADV_HUGEPAGE`` mapping that fault reads its
    whole aligned 2 MiB window back in - the tail of the layer just let go
    among it. So a let-go leaves them: at most one page at each end of a span.
    """
    ps = _core.page_size()
    addrs, sizes = [], []
    for a, n in zip(spans.addrs, spans.sizes):
        lo, hi = -(-a // ps) * ps, (a + n) // ps * ps
        if hi > lo:
            addrs.append(lo)
            sizes.append(hi - lo)
    return _core.SpanArray(addrs, sizes)


# How a let-go ended (PageWorker.let_go_counts):
PAGEOUT = "pageout"  # MADV_COLD + MADV_PAGEOUT took every page
DRAINED = "drained"  # pages were left; after POSIX_FADV_DONTNEED (drains every CPU's batch), PAGEOUT took them
UNMAPPED = "unmapped"  # pages were still left; after unmapping them here (MADV_DONTNEED of this process's
# clean file pages) POSIX_FADV_DONTNEED dropped them: another process had them mapped too (a replica)
KEPT = "kept"  # the kernel kept some pages all the same (another process maps them still, say)
REFUSED = "refused"  # MADV_PAGEOUT refused (a kernel before 5.4): pages stay until reclaim takes them
DROPPED = "dropped"  # no MADV_PAGEOUT (kernel caps): POSIX_FADV_DONTNEED took every page


def let_go(spans: _core.SpanArray, extents: list[Extent] = (), caps: KernelCaps | None = None) -> tuple[str, int]:
    """Let a streamed layer's pages go and check (``mincore``) that they went.

    ``MADV_PAGEOUT`` can leave pages in place: a page read a moment ago may
    still wait in another CPU's LRU-add batch, where the kernel can neither
    isolate it nor split the large folio it is part of (``madvise`` drains only
    the calling CPU's batch). When pages are left, ``POSIX_FADV_DONTNEED`` over
    the layer's bytes of each file drains every CPU's batch (and drops what
    nobody maps), and ``MADV_PAGEOUT`` runs again. Pages another process
    maps too (a replica) are skipped by ``MADV_PAGEOUT``: this process's
    mappings of them are then dropped (``unmap_file_pages``: clean file
    pages only) and the file's pages dropped again - the last process to
    let a layer go drops it. Returns how it ended (``PAGEOUT``, ``DRAINED``,
    ``UNMAPPED``, ``KEPT``, ``REFUSED``) and the bytes still resident.

    Where the kernel has no ``MADV_PAGEOUT`` (``caps.pageout`` False), only
    ``POSIX_FADV_DONTNEED`` is asked (``DROPPED`` when it took every page).
    It drops no page that a process maps: this process's own clean pages
    are unmapped first when pages are left; pages another process maps stay
    (``KEPT``) until it lets them go or reclaim takes them.
    """
    inner = inner_pages(spans)
    if not len(inner):
        return PAGEOUT, 0
    if caps is not None and not caps.pageout:
        for e in extents:
            if e.file is not None:
                e.file.drop(e.first, e.end)
        left = sum(_core.resident_bytes(inner))
        if left and _core.unmap_file_pages(inner) > 0:
            # The pages this process maps: unmapped (clean file pages only), they can be dropped.
            for e in extents:
                if e.file is not None:
                    e.file.drop(e.first, e.end)
            left = sum(_core.resident_bytes(inner))
        return (KEPT, left) if left else (DROPPED, 0)
    err = _core.advise_pageout(inner)
    if err:
        logger.debug("MADV_PAGEOUT refused (errno %d) for %d bytes", err, inner.total_bytes)
        return REFUSED, sum(_core.resident_bytes(inner))
    left = sum(_core.resident_bytes(inner))
    if not left:
        return PAGEOUT, 0

    def drop() -> bool:
        dropped = False
        for e in extents:
            if e.file is not None:
                e.file.drop(e.first, e.end)
                dropped = True
        return dropped

    if drop():
        _core.advise_pageout(inner)
        left = sum(_core.resident_bytes(inner))
        if not left:
            return DRAINED, 0
        # Still there: MADV_PAGEOUT skips a page more than one process maps
        # (replicas streaming the same file). Unmap this process's clean
        # pages of the layer; whichever process lets them go last drops them.
        if _core.unmap_file_pages(inner) > 0:
            drop()
            left = sum(_core.resident_bytes(inner))
            if not left:
                return UNMAPPED, 0
    logger.debug("let go of %d bytes: the kernel kept %d of them", inner.total_bytes, left)
    return KEPT, left


def _ranges(spans: _core.SpanArray) -> list[tuple[int, int]]:
    """Each span's ``[start, end)``, in address order."""
    return sorted((a, a + n) for a, n in zip(spans.addrs, spans.sizes) if n)


def _touch(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> bool:
    """Whether two sorted lists of ranges share a byte (a part's weights may lie far apart in a file - an
    fp8 weight's scales and codes - so their bounds alone would overlap other parts' reads)."""
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i][0] < b[j][1] and b[j][0] < a[i][1]:
            return True
        if a[i][1] <= b[j][1]:
            i += 1
        else:
            j += 1
    return False


def _after(deps: list[Future], work, *args) -> None:
    """Run ``work(*args)`` once ``deps`` are done (how they ended is theirs to report)."""
    if deps:
        wait(deps)
    work(*args)


class PageWorker:
    """Two worker threads for page-cache calls, one that reads and one that lets go; made again after a fork.

    A read waits for every let-go asked before it (the page cache never holds more than the order of
    the calls allows, as with one queue); a let-go waits for the reads asked before it whose bytes
    it touches (what it lets go is in the cache by then), and for nothing else: it runs while the
    reads queued before it do (see the module).

    Parameters
    ----------
    kernel_caps
        What to assume of the kernel instead of finding it out (text as for
        ``MAPOFFLOAD_KERNEL_CAPS``, e.g. ``"no-large-folios"``, or a whole
        :class:`~mapoffload.pagecache.kernel.KernelCaps`); None: the variable,
        then the run-time probe. Validated here.

    Attributes
    ----------
    let_go_counts
        How many let-gos ended each way (:func:`let_go`): the record of which
        mechanism the kernel needed.
    kept_bytes
        Bytes the kernel kept resident after let-gos, summed.
    read_ahead_calls
        ``MADV_WILLNEED`` calls made to read layers ahead where faults read
        4 KiB pages (0 where they read 2 MiB windows).
    """

    def __init__(self, kernel_caps: str | KernelCaps | None = None) -> None:
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None  # the reads
        self._letter: ThreadPoolExecutor | None = None  # the let-gos
        self._letting: list[Future] = []  # let-gos asked, not seen done
        self._reading: list[tuple[list, Future]] = []  # reads asked, not seen done: (their ranges, future)
        # How each let-go ended (PAGEOUT, DRAINED, KEPT, REFUSED, DROPPED), and the bytes kept in all.
        self.let_go_counts: dict[str, int] = {}
        self.kept_bytes = 0
        self.read_ahead_calls = 0
        self._counting = threading.Lock()  # read_ahead_calls: counted by the reader and the copier's threads
        self._given = kernel_caps if isinstance(kernel_caps, KernelCaps) else overrides(kernel_caps)
        self._caps: dict[int | None, KernelCaps] = {}  # device (st_dev) -> its capabilities

    def caps(self, extents: list[Extent] = ()) -> KernelCaps:
        """The kernel capabilities for the file system of a layer's files (probed once per device)."""
        fd = next((e.file.fd for e in extents if e.file is not None and e.file.fd >= 0), None)
        dev = None
        if fd is not None:
            try:
                dev = os.fstat(fd).st_dev
            except OSError:
                fd = None
        caps = self._caps.get(dev)
        if caps is None:
            caps = kernel_caps(fd, self._given)
            self._caps[dev] = caps
            log_once(f"page-cache advice: {caps.advice()}; {caps.describe()}")
        return caps

    def advise(self, spans: _core.SpanArray, extents: list[Extent] = ()) -> KernelCaps | None:
        """Set a layer's spans ``MADV_RANDOM`` (+ ``MADV_HUGEPAGE`` where faults read 2 MiB windows).

        Returns the capabilities that chose it; None for a layer with no
        mapped bytes (nothing is probed for it).
        """
        if not len(spans):
            return None
        caps = self.caps(extents)
        # The manager reads these pages itself (populate, 2 MiB folios, or a
        # read-ahead first): a fault's readahead would bring a neighbouring
        # layer back in, unmapped, where letting it go cannot reach it.
        _core.advise_random(spans, True, caps.large_folios)
        return caps

    def read_in(self, spans: _core.SpanArray, what: str = "weights", edges: _core.SpanArray | None = None,
                extents: list[Extent] = ()) -> Future:
        """Read ``spans`` in on the reader thread, after every let-go asked before (see :func:`read_in`)."""
        caps = self.caps(extents)
        with self._lock:
            pool, _ = self._pools()
            self._letting = [f for f in self._letting if not f.done()]
            fut = pool.submit(_after, list(self._letting), self._read_in, spans, what, edges, caps)
            self._reading = [r for r in self._reading if not r[1].done()]
            self._reading.append((_ranges(spans), fut))
        return fut

    def _read_in(self, spans: _core.SpanArray, what: str, edges: _core.SpanArray | None, caps: KernelCaps) -> None:
        self._count(read_in(spans, what, edges, caps))

    def before_copy(self, spans: _core.SpanArray, edges: _core.SpanArray | None, extents: list[Extent] = ()) -> None:
        """On the calling thread, before the copier reads a layer: see :func:`before_copy`."""
        self._count(before_copy(spans, edges, self.caps(extents)))

    def _count(self, calls: int) -> None:
        with self._counting:
            self.read_ahead_calls += calls

    def _pools(self) -> tuple[ThreadPoolExecutor, ThreadPoolExecutor]:
        """The reader's and the let-go's threads, made at first use (the lock held)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mapoffload-pages")
            self._letter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mapoffload-letgo")
        return self._pool, self._letter

    def let_go(self, spans: _core.SpanArray, extents: list[Extent] = ()) -> Future:
        """Let ``spans`` go on the let-go thread, after the reads asked before that touch them."""
        caps = self.caps(extents)
        mine = _ranges(spans)
        with self._lock:
            _, letter = self._pools()
            self._reading = [r for r in self._reading if not r[1].done()]
            deps = [f for theirs, f in self._reading if _touch(mine, theirs)]
            fut = letter.submit(_after, deps, self._let_go, spans, extents, caps)
            self._letting = [f for f in self._letting if not f.done()]
            self._letting.append(fut)
        return fut

    def _let_go(self, spans: _core.SpanArray, extents: list[Extent], caps: KernelCaps | None = None) -> None:
        how, left = let_go(spans, extents, caps)
        self.let_go_counts[how] = self.let_go_counts.get(how, 0) + 1
        self.kept_bytes += left

    @property
    def running(self) -> bool:
        """The worker's threads exist (made at the first read-in or let-go, gone at close)."""
        return self._pool is not None

    def drain(self) -> None:
        """Wait until the work asked of the worker so far is done (letting go is asynchronous); no-op
        when the worker has no thread (nothing asked, or closed).

        A let-go reads which pages of a span are the file's and then drops them (``unmap_file_pages``:
        ``MADV_DONTNEED``, no atomic "file pages only" exists); a weight written in place between the
        two would be dropped with its write. So what lets go is drained before control goes back to
        the user's code: at the end of a forward, after a module streamed on its own, after a release.
        """
        with self._lock:
            pools = (self._pool, self._letter)
        for pool in pools:
            if pool is None:
                continue
            try:
                pool.submit(lambda: None).result()
            except RuntimeError:  # shut down meanwhile (closed): close() finished what was asked
                pass

    def after_fork_in_child(self) -> None:
        """The parent's threads do not exist here: forget them (their queued work never runs)."""
        self._lock, self._counting = threading.Lock(), threading.Lock()
        self._pool = self._letter = None
        self._letting, self._reading = [], []

    def close(self) -> None:
        """Finish what was asked, stop the threads. Idempotent."""
        with self._lock:
            pools = (self._pool, self._letter)
            self._pool = self._letter = None
        for pool in pools:
            if pool is not None:
                pool.shutdown(wait=True)
