"""Page-cache work of the layerwise offload manager, off the compute thread:
read a layer's mapped pages in before it runs (``MADV_POPULATE_READ``, in
2 MiB folios), let a streamed layer's pages go after it ran (``MADV_PAGEOUT``).

One worker thread per manager runs the native calls (``madvise``; the GIL
is released while the kernel works) in the order they were asked for, so a
streamed layer is let go before the next one is read under a tight budget.
"""

from __future__ import annotations

import errno
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

from ._log import logger
from ._native import _core

__all__ = ["PageWorker", "check_extents", "file_extents", "layer_spans"]


def layer_spans(addr_sizes: list[tuple[int, int]]) -> _core.SpanArray:
    """Spans of a layer's mapped weights, sorted, those that touch or overlap merged."""
    merged: list[list[int]] = []
    for a, n in sorted(addr_sizes):
        if n <= 0:
            continue
        if merged and a <= merged[-1][0] + merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], a + n - merged[-1][0])
        else:
            merged.append([a, n])
    return _core.SpanArray([a for a, _ in merged], [n for _, n in merged])


def _fault_error(addr: int, what: str) -> OSError:
    """MappingFaultError naming the file behind ``addr`` and the offset in it."""
    table = _core.snapshot()
    k = table.find(addr)
    if k < 0:
        return _core.MappingFaultError(errno.EFAULT, f"{what}: address {addr:#x} is not mapped")
    path = table.paths[k]
    offset = table.offsets[k] + addr - table.starts[k]
    return _core.MappingFaultError(
        errno.EIO,
        f"{what}: the file behind the mapping cannot be read at byte {offset} (truncated or gone under "
        "the mapping?); computing with it would be a SIGBUS",
        path,
    )


def file_extents(spans: _core.SpanArray) -> list[tuple[str, int, int]]:
    """``(path, first byte, end byte)`` in the files behind ``spans``, one entry per file."""
    table = _core.snapshot()
    paths, offsets, starts = table.paths, table.offsets, table.starts
    out: dict[str, list[int]] = {}
    for a, n in zip(spans.addrs, spans.sizes):
        k = table.find(a)
        if k < 0 or not paths[k].startswith("/"):
            continue
        first = offsets[k] + a - starts[k]
        lo_hi = out.setdefault(paths[k], [first, first + n])
        lo_hi[0], lo_hi[1] = min(lo_hi[0], first), max(lo_hi[1], first + n)
    return [(p, lo, hi) for p, (lo, hi) in out.items()]


def check_extents(extents: list[tuple[str, int, int]], what: str) -> None:
    """Refuse to compute from a file that no longer reaches the bytes mapped from it.

    A read past the end of a file through its mapping is a SIGBUS that kills
    the process; a file truncated under a mapped checkpoint (rewritten by a
    download, say) is caught here, before the layer runs, by its size.
    A file that cannot be stat'ed (deleted while mapped: its pages stay
    readable) is not checked.
    """
    for path, first, end in extents:
        try:
            size = os.stat(path).st_size
        except OSError:
            continue
        if size < end:
            raise _core.MappingFaultError(
                errno.EIO,
                f"{what}: the file is {size} bytes, its mapped weights reach byte {end} (from byte {first}): "
                "it was truncated under the mapping; computing with it would be a SIGBUS",
                path,
            )


def read_in(spans: _core.SpanArray, what: str = "weights") -> None:
    """Read the span's pages in and map them (``MADV_POPULATE_READ``).

    The spans are ``MADV_HUGEPAGE`` + ``MADV_RANDOM`` (the manager sets it):
    each fault reads the aligned 2 MiB folio that holds it, no more, so this
    reads in 2 MiB I/Os into large folios.

    Raises
    ------
    MappingFaultError
        A page cannot be read (the file was truncated under its mapping): the
        forward would die of SIGBUS on it, so it is refused before it runs.
    """
    err, addr = _core.populate_read(spans)
    if err == errno.EFAULT:
        raise _fault_error(addr, what)
    if err:
        # An old kernel (EINVAL): the compute's own faults read the pages.
        logger.debug("MADV_POPULATE_READ refused (errno %d); the forward faults the pages in", err)


def let_go(spans: _core.SpanArray) -> None:
    err = _core.advise_pageout(spans)
    if err:
        logger.debug("MADV_PAGEOUT refused (errno %d) for %d bytes", err, spans.total_bytes)


class PageWorker:
    """A single worker thread for page-cache calls; made again after a fork."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mapoffload-pages")
            return self._pool

    def read_in(self, spans: _core.SpanArray, what: str = "weights") -> Future:
        return self._executor().submit(read_in, spans, what)

    def let_go(self, spans: _core.SpanArray) -> Future:
        return self._executor().submit(let_go, spans)

    def after_fork_in_child(self) -> None:
        """The parent's thread does not exist here: forget it (its queued work never runs)."""
        self._lock = threading.Lock()
        self._pool = None

    def close(self) -> None:
        """Finish what was asked, stop the thread. Idempotent."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
