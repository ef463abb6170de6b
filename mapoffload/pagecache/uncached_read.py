"""Reading file bytes around the page cache into bounded, reused buffers.

Under a memory cap too tight for the streaming window, reading streamed
layers through their mapping (``MADV_POPULATE_READ``, then ``MADV_PAGEOUT``)
makes the kernel read much of the checkpoint twice: readahead and reclaim
evict pages of the layer in use, whose next touch reads them again. A
:class:`UncachedReader` reads "the bytes ``[first, end)`` of file F" with
``O_DIRECT`` straight into one of a few page-aligned CPU buffers: nothing
passes through the page cache, so nothing of it is evicted or read twice, and
the memory it uses is the buffers, bounded and reused from one forward to the
next.

Where a filesystem has no ``O_DIRECT`` (ramfs, overlay or FUSE setups,
tmpfs before Linux 6.6; tmpfs is read buffered on purpose everywhere: its
pages are the file), the same call reads with ``pread`` and drops the pages
after it (``POSIX_FADV_DONTNEED``); :attr:`UncachedFile.method` and
:attr:`UncachedBuffer.methods` say which path was taken.

Layout: the byte at file offset ``x`` lands at a buffer address congruent to
``x`` modulo :data:`O_DIRECT_ALIGN` (4096), whichever path was taken, so a
tensor aligned in the file is aligned in the buffer and views of its dtype
bind to the buffer without a copy (:meth:`UncachedBuffer.view`).

Pinning (``pin_device=``, the device path): each buffer is page-locked with
the CUDA runtime when it is made, so that a device copy DMAs straight from it;
:mod:`~mapoffload.pagecache.uncached_pool` (the buffers) says when it is
unregistered. A refused registration leaves the buffer pageable
(:attr:`UncachedBuffer.pinned` says which).
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from .._log import format_bytes, log_once, logger
from .._native import _core
from .uncached_buffers import O_DIRECT_ALIGN, UncachedBuffer, UncachedFile, Slab, buffer_capacity, round_up
from .uncached_pool import SlabPool

__all__ = ["O_DIRECT_ALIGN", "UncachedBuffer", "UncachedFile", "UncachedReader", "buffer_capacity"]

_READERS: weakref.WeakSet[UncachedReader] = weakref.WeakSet()


class UncachedReader:
    """Reads file byte ranges around the page cache into a bounded pool of buffers.

    Parameters
    ----------
    buffers
        How many buffers may exist at once (leased or free). A read waits
        for one to be released when all are leased: this bounds the memory
        to ``buffers`` times the largest read.
    buffer_bytes
        Fixed capacity of each buffer; a larger read raises ValueError. None:
        buffers grow to the largest read so far (to a multiple of 2 MiB) and
        are reused from then on.
    io_bytes
        Largest single ``pread`` (a multiple of O_DIRECT_ALIGN).
    threads
        Reads in flight at once within one call (the calling thread and
        ``threads - 1`` threads started for the call and joined before it
        returns).
    o_direct
        False reads every file buffered (``pread`` + ``POSIX_FADV_DONTNEED``),
        for comparison.
    pin_device
        A CUDA device index: page-lock each buffer for it when it is made
        (``cudaHostRegister``, see the module's notes), so that device copies
        DMA straight from the buffers. None (default): pageable buffers.

    Notes
    -----
    Fork: the native reads start no thread that outlives a call; the
    reader's one Python worker (for :meth:`read_async`) is forgotten in a
    child, which makes its own on its first asynchronous read. A Future
    obtained in the parent never completes in the child. Descriptors are
    inherited (``O_CLOEXEC``: not across ``exec``).
    """

    def __init__(self, *, buffers: int = 2, buffer_bytes: int | None = None, io_bytes: int = 4 << 20,
                 threads: int = 2, o_direct: bool = True, pin_device: int | None = None) -> None:
        if buffers < 1:
            raise ValueError(f"buffers must be >= 1, not {buffers}")
        if io_bytes < O_DIRECT_ALIGN or io_bytes % O_DIRECT_ALIGN:
            raise ValueError(f"io_bytes must be a positive multiple of {O_DIRECT_ALIGN}, not {io_bytes}")
        if not 1 <= threads <= 16:
            raise ValueError(f"threads must be 1..16, not {threads}")
        if buffer_bytes is not None and buffer_bytes < O_DIRECT_ALIGN:
            raise ValueError(f"buffer_bytes must be >= {O_DIRECT_ALIGN}, not {buffer_bytes}")
        self.buffers = buffers
        self.buffer_bytes = None if buffer_bytes is None else round_up(buffer_bytes, O_DIRECT_ALIGN)
        self.io_bytes, self.threads, self.o_direct = io_bytes, threads, o_direct
        self.pin_device = pin_device
        self._slabs = SlabPool(buffers, self.buffer_bytes, pin_device)  # its own lock, never taken inside ours
        self._cond = threading.Condition()  # guards what follows (reads in flight, files, stats, the worker)
        self._active = 0  # reads using descriptors now
        self._closing = False  # close() began: no new reads are taken
        self._closed = False
        self._files: dict[tuple[int, int], UncachedFile] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._stats = {"reads": 0, "wanted_bytes": 0, "uncached_bytes": 0, "buffered_bytes": 0, "seconds": 0.0}
        _READERS.add(self)

    # --- files -----------------------------------------------------------------------------------

    def open(self, file: Any, path: str | None = None) -> UncachedFile:
        """The :class:`UncachedFile` for ``file``; one per inode, opened on first use.

        Parameters
        ----------
        file
            A descriptor the caller holds open (an int, or an object with
            ``fd`` and ``path`` attributes such as ``MappedFile``): it is
            reopened through ``/proc/self/fd``, so the inode read is the one
            the caller holds even after its path was renamed over. Or a path
            (str, bytes, os.PathLike), opened now.
        path
            The name to use in messages (default: the object's ``path``, or
            what ``/proc/self/fd`` says).
        """
        if isinstance(file, UncachedFile) and self._files.get(file.key) is file:
            return file
        own = None
        if isinstance(file, int):
            fd = file
        elif hasattr(file, "fd"):
            fd = file.fd
            path = path if path is not None else getattr(file, "path", None)
        else:
            own = fd = os.open(file, os.O_RDONLY | os.O_CLOEXEC)
            path = path if path is not None else os.fsdecode(file)
        try:
            st = os.fstat(fd)
            key = (st.st_dev, st.st_ino)
            with self._cond:
                self._check_open()
                f = self._files.get(key)
                if f is not None:
                    return f
            if path is None:
                try:
                    path = os.readlink(f"/proc/self/fd/{fd}")
                except OSError:
                    path = f"<fd {fd}>"
            nfd, method, why = _core.open_for_reading(fd, self.o_direct)
        finally:
            if own is not None:
                os.close(own)
        f = UncachedFile(path, nfd, method, why, key)
        with self._cond:
            closing = self._closing
            other = None if closing else self._files.setdefault(key, f)
        if other is not f:  # closed meanwhile, or another thread opened the inode first
            os.close(nfd)
            if closing:
                self._check_open()
            return other
        if method != "uncached":
            logger.info("%s is read with plain reads, its pages dropped after them: %s", path, why)
        else:
            logger.debug("%s is read uncached (O_DIRECT)", path)
        return f

    # --- reads ----------------------------------------------------------------------------------

    def read(self, file: Any, first: int, end: int, *, timeout: float | None = None) -> UncachedBuffer:
        """Read the bytes ``[first, end)`` of ``file`` into a free buffer.

        Parameters
        ----------
        file
            A :class:`UncachedFile`, or anything :meth:`open` takes.
        first, end
            File offsets; any alignment.
        timeout
            Seconds to wait for a free buffer (None: as long as it takes).

        Returns
        -------
        UncachedBuffer
            ``buf.data[buf.offset : buf.offset + end - first]`` are the bytes
            (``buf.tensor()``); release it when done.

        Raises
        ------
        MappingFaultError
            The file ends before ``end`` (truncated): names the path and offsets.
        TimeoutError
            No buffer was released within ``timeout``.
        """
        return self.read_extents([(file, first, end)], timeout=timeout)

    def read_extents(self, extents: Sequence[tuple[Any, int, int]], *, timeout: float | None = None
                     ) -> UncachedBuffer:
        """Read several ``(file, first, end)`` extents into one buffer (a layer across two shards).

        Each extent starts at its own O_DIRECT_ALIGN-aligned place in the buffer
        (:attr:`UncachedBuffer.offsets`); the reads run in one native call.
        """
        with self._cond:
            self._check_open()
        files = [(self.open(f), int(a), int(b)) for f, a, b in extents]
        return self._read(files, timeout, worker=False)

    def read_async(self, file: Any, first: int, end: int, *, timeout: float | None = None
                   ) -> Future[UncachedBuffer]:
        """:meth:`read` on the reader's worker thread; the Future's result is the buffer.

        Reads run one after another in the order asked (each with its own
        ``threads`` I/Os in flight), so a prefetch queue reads in order.
        """
        return self.read_extents_async([(file, first, end)], timeout=timeout)

    def read_extents_async(self, extents: Sequence[tuple[Any, int, int]], *, timeout: float | None = None
                           ) -> Future[UncachedBuffer]:
        """:meth:`read_extents` on the reader's worker thread."""
        files = [(self.open(f), int(a), int(b)) for f, a, b in extents]
        return self._executor().submit(self._read, files, timeout, True)

    def _read(self, files: list[tuple[UncachedFile, int, int]], timeout: float | None, worker: bool
              ) -> UncachedBuffer:
        for f, a, b in files:
            if not 0 <= a <= b:
                raise ValueError(f"{f.path}: bad extent [{a}, {b})")
        spans = [_core.uncached_span(a, b - a) for _, a, b in files]
        slab = self._slabs.acquire(max(sum(spans), O_DIRECT_ALIGN), timeout, worker)
        try:
            buf = self._read_into(slab, files, spans)
        except BaseException:
            self._slabs.give_back(slab, worker)
            raise
        if worker:
            self._slabs.worker_done()  # handed over in the Future
        return buf

    def _read_into(self, slab: Slab, files: list[tuple[UncachedFile, int, int]], spans: list[int]) -> UncachedBuffer:
        base = slab.data.data_ptr()
        dsts, offsets, slot = [], [], 0
        for (_, a, _), n in zip(files, spans):
            dsts.append(base + slot)
            offsets.append(slot + a % O_DIRECT_ALIGN)
            slot += n
        with self._cond:
            if self._closed:
                raise RuntimeError("this UncachedReader is closed")
            self._active += 1
        t0 = time.perf_counter()
        try:
            res = _core.read_ranges([f.fd for f, _, _ in files], [a for _, a, _ in files],
                                    [b - a for _, a, b in files], dsts, io_bytes=self.io_bytes,
                                    threads=self.threads, paths=[f.path for f, _, _ in files])
        finally:
            with self._cond:
                self._active -= 1
                self._cond.notify_all()
        seconds = time.perf_counter() - t0
        methods = [m for m, _ in res]
        for (f, _, _), m in zip(files, methods):
            if m != f.method:  # the filesystem refused a direct read: the descriptor lost O_DIRECT
                f.method, f.why = m, "the filesystem refused an O_DIRECT read"
                logger.info("%s: the filesystem refused an O_DIRECT read; plain reads from now on", f.path)
        with self._cond:
            s = self._stats
            s["reads"] += 1
            s["wanted_bytes"] += sum(b - a for _, a, b in files)
            for m, n in res:
                s["uncached_bytes" if m == "uncached" else "buffered_bytes"] += n
            s["seconds"] += seconds
        return UncachedBuffer(self, slab, files, offsets, methods, sum(n for _, n in res), lost=UncachedReader._lost)

    # --- buffers (the pool's) -------------------------------------------------------------------

    def _give_back(self, slab: Slab) -> None:
        """:class:`~.uncached_buffers.BufferOwner`: a released buffer's slab goes back to the pool, unless
        a view of it outlived the release (a view of a weight kept past its forward: a hook recording
        ``weight.detach()``, a module caching ``weight.t()``): then its memory stays with that view,
        unregistered now, and the reader makes another."""
        if not slab.viewed():
            self._slabs.give_back(slab)
            return
        log_once("a view of an uncached buffer outlived its release (a view of a weight kept past its forward?): "
                 "left to it, not reused")
        self._slabs.lost(slab.capacity, slab.unpin())

    @staticmethod
    def _lost(reader_ref: weakref.ref, capacity: int, pinned: int) -> None:
        """A UncachedBuffer was dropped without release(): its slot is free, its memory is not reused."""
        reader = reader_ref()
        if reader is None:
            return
        logger.debug("an UncachedBuffer of %s was dropped without release(); not reused", format_bytes(capacity))
        reader._slabs.lost(capacity, pinned)

    def trim(self) -> int:
        """Drop the free buffers (leased ones stay theirs); returns the bytes dropped.

        The reader makes new ones when it reads again."""
        return self._slabs.trim()

    # --- state ----------------------------------------------------------------------------------

    @property
    def pin_why(self) -> str:
        """Why buffers are not pinned (a refused registration), once one was; ``""`` otherwise."""
        return self._slabs.pin_why

    @pin_why.setter
    def pin_why(self, why: str) -> None:
        self._slabs.pin_why = why

    @property
    def held_bytes(self) -> int:
        """Bytes of every buffer the reader made and still owns, free or leased (anonymous memory)."""
        return self._slabs.held_bytes

    @property
    def pinned_bytes(self) -> int:
        """Bytes of the buffers the reader owns that are page-locked now (``pin_device``)."""
        return self._slabs.pinned_bytes

    @property
    def capacity_bytes(self) -> int:
        """Bytes of the free buffers the reader keeps (leased ones are the callers')."""
        return self._slabs.capacity_bytes

    @property
    def leased(self) -> int:
        """Buffers out now (leased, or being read into)."""
        return self._slabs.leased

    def stats(self) -> dict[str, float]:
        """Counters: ``reads``, ``wanted_bytes``, ``uncached_bytes`` and ``buffered_bytes`` (bytes the
        reads transferred by each path), ``seconds`` in native reads, buffer ``allocations``,
        ``pin_failures`` (registrations the CUDA runtime refused)."""
        with self._cond:
            stats: dict[str, float] = dict(self._stats)
        stats.update(self._slabs.counters())  # after ours, not inside: the two locks are never nested
        return stats

    def files(self) -> list[UncachedFile]:
        """The files opened so far."""
        with self._cond:
            return list(self._files.values())

    def _check_open(self) -> None:
        if self._closing:
            raise RuntimeError("this UncachedReader is closed")

    def _executor(self) -> ThreadPoolExecutor:
        with self._cond:
            self._check_open()
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mapoffload-uncached")
            return self._pool

    def _after_fork_in_child(self) -> None:
        # The parent's threads do not exist here: a lock one of them held
        # stays held, and the worker's read in flight never finishes.
        self._cond = threading.Condition()
        self._pool = None
        self._active = 0
        self._slabs.after_fork_in_child()  # the worker's buffer in flight is unreachable here

    def close(self) -> None:
        """Finish asynchronous reads (one that would wait for a buffer raises ``RuntimeError``: only a
        holder could give one back), wait for reads in flight, close the descriptors, drop (and
        unregister) the free buffers. Leased buffers stay valid for their holders, and are dropped
        when released. Idempotent."""
        with self._cond:
            if self._closing:
                return
            self._closing = True  # open(), read*() and read*_async() refuse from here on
            pool, self._pool = self._pool, None
        self._slabs.drain()  # a queued read that would wait for a buffer raises: its holder may be us
        if pool is not None:
            pool.shutdown(wait=True)  # reads queued before close() still run, where a buffer is free
        with self._cond:
            self._closed = True  # a read that has its buffer refuses before it starts
        # Reads waiting for a buffer raise; the free buffers are dropped (unregistered now, whoever
        # still holds a view of them), leased ones when released. Outside our lock: never nested.
        self._slabs.close()
        with self._cond:
            while self._active:
                self._cond.wait()
            files, self._files = list(self._files.values()), {}
        for f in files:
            fd, f.fd = f.fd, -1
            if fd >= 0:
                os.close(fd)

    def __enter__(self) -> UncachedReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # Nothing can be reading (a read holds the reader); the worker, if
        # any, is idle. Close the descriptors without waiting for anything.
        try:
            if self._pool is not None:
                self._pool.shutdown(wait=False)
            for f in self._files.values():
                if f.fd >= 0:
                    os.close(f.fd)
                    f.fd = -1
        except Exception:
            pass


def _after_fork_in_child() -> None:
    for reader in list(_READERS):
        reader._after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)
