"""What a :class:`~mapoffload.pagecache.uncached_read.UncachedReader` reads into: files, buffers, leases.

:class:`UncachedFile` is one file opened for reading uncached (``O_DIRECT``, or buffered
where the filesystem has none); a slab is one page-aligned buffer the reader owns (page-locked on
the device path); a :class:`UncachedBuffer` is a slab leased to one read, with the file bytes it holds
and views of them. Layout: the byte at file offset ``x`` lands at a buffer address congruent to ``x``
modulo :data:`O_DIRECT_ALIGN`, so a tensor aligned in the file is aligned in the buffer
(:meth:`UncachedBuffer.view`). :func:`buffer_capacity` is the bytes one read of given file ranges takes.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from .._log import format_bytes, logger
from .._native import _core
from ..memory.regions import storage_users

__all__ = ["O_DIRECT_ALIGN", "GROW_QUANTUM", "BufferOwner", "UncachedBuffer", "UncachedFile", "Slab", "buffer_capacity",
           "round_up"]


class BufferOwner(Protocol):
    """What a buffer needs of the reader that made it (an ``UncachedReader``): to take its slab back."""

    def _give_back(self, slab: Slab) -> None: ...

O_DIRECT_ALIGN: int = _core.O_DIRECT_ALIGN
GROW_QUANTUM = 2 << 20  # buffers grow to the next multiple: layers of nearly one size share one capacity


def round_up(n: int, q: int) -> int:
    return -(-n // q) * q


def buffer_capacity(ranges: Sequence[tuple[int, int]]) -> int:
    """Bytes one read of these ``(first, end)`` file ranges takes in a buffer (each range from its
    first page to its last): the ``buffer_bytes`` a reader of them needs at the least."""
    return max(sum(_core.uncached_span(a, b - a) for a, b in ranges), O_DIRECT_ALIGN)


class UncachedFile:
    """One file opened for reading uncached.

    Attributes
    ----------
    path
        The file's name, for messages (what the caller said, or what
        ``/proc/self/fd`` said when it was opened).
    fd
        The reader's own descriptor on the inode (reopened through
        ``/proc/self/fd``, so it is the inode the caller held, whatever the
        path names since).
    method
        ``"uncached"`` (``O_DIRECT``) or ``"buffered"`` (``pread``, then
        ``POSIX_FADV_DONTNEED``). A file read with ``O_DIRECT`` whose reads the filesystem
        refuses turns buffered on the first one.
    why
        Why the file is read buffered (``""`` when uncached).
    """

    __slots__ = ("path", "fd", "method", "why", "key")

    def __init__(self, path: str, fd: int, method: str, why: str, key: tuple[int, int]) -> None:
        self.path, self.fd, self.method, self.why, self.key = path, fd, method, why, key

    def size(self) -> int:
        """The inode's size now (``fstat``)."""
        return os.fstat(self.fd).st_size

    def __repr__(self) -> str:
        return f"UncachedFile({self.path!r}, {self.method}{', ' + self.why if self.why else ''})"


class Slab:
    """A page-aligned uint8 tensor of ``capacity`` bytes (over-allocated, then offset), pinned or not."""

    __slots__ = ("raw", "data", "capacity", "pin", "_own")

    def __init__(self, capacity: int) -> None:
        import torch

        self.raw = torch.empty(capacity + O_DIRECT_ALIGN, dtype=torch.uint8)
        lead = -self.raw.data_ptr() % O_DIRECT_ALIGN
        self.data = self.raw[lead:lead + capacity]
        self.capacity = capacity
        self.pin: Any = None  # a HostPin while page-locked (it holds ``raw``: unregistered before it is freed)
        self._own = storage_users(self.raw)  # raw and data

    def viewed(self) -> bool:
        """Whether a tensor beside the slab's own two shares its memory now (a view of a buffer's bytes
        kept past the buffer's release: the next read would overwrite what it holds)."""
        return storage_users(self.raw) > self._own

    @property
    def pinned(self) -> bool:
        return self.pin is not None and self.pin.registered

    def lock(self, device: int) -> None:
        """Page-lock the buffer for ``device`` (raises CudaError when the runtime refuses)."""
        self.pin = _core.HostPin(self.data.data_ptr(), self.capacity, device=device, owner=self.raw)

    def unpin(self) -> int:
        """Unregister now (before the memory can go); the bytes that were pinned."""
        pin, self.pin = self.pin, None
        if pin is None:
            return 0
        pinned = pin.registered
        try:
            pin.unregister()
        except Exception:
            logger.debug("cudaHostUnregister of an uncached buffer failed", exc_info=True)
        return self.capacity if pinned else 0


class UncachedBuffer:
    """A leased buffer holding the file bytes of one read.

    Views of it (:meth:`tensor`, :meth:`view`) share its memory: once
    :meth:`release` gives it back, the next read overwrites them. Release it
    when the views are no longer used (a ``with`` block does). A buffer
    released while a view of it is still alive, or dropped without
    ``release()``, is not reused: its memory stays with whatever views are
    left, and the reader allocates another.

    Attributes
    ----------
    data
        The whole buffer (uint8; ``data.data_ptr()`` is O_DIRECT_ALIGN-aligned).
    extents
        ``(UncachedFile, first, end)`` of each extent read.
    offsets
        Where each extent's ``first`` byte lies in ``data``.
    methods
        ``"uncached"`` or ``"buffered"``: the path each extent took.
    bytes_read
        Bytes the reads transferred (``O_DIRECT`` reads read whole aligned blocks).
    pinned
        The buffer is page-locked with the CUDA runtime (a reader made with
        ``pin_device``): a device copy may DMA straight from it.
    """

    __slots__ = ("data", "extents", "offsets", "methods", "bytes_read", "pinned", "_slab", "_reader", "_finalizer",
                 "__weakref__")

    def __init__(self, reader: BufferOwner, slab: Slab, extents: list[tuple[UncachedFile, int, int]],
                 offsets: list[int], methods: list[str], bytes_read: int, *,
                 lost: Callable[[weakref.ref, int, int], None]) -> None:
        self.data = slab.data
        self.extents, self.offsets, self.methods, self.bytes_read = extents, offsets, methods, bytes_read
        self.pinned = slab.pinned
        self._slab: Slab | None = slab
        self._reader = reader
        # Dropped without release(): the slab goes with it (its HostPin unregisters, then lets go of the memory).
        self._finalizer = weakref.finalize(self, lost, weakref.ref(reader), slab.capacity,
                                           slab.capacity if self.pinned else 0)

    @property
    def offset(self) -> int:
        """Where the first extent's ``first`` byte lies in :attr:`data`."""
        return self.offsets[0]

    @property
    def method(self) -> str:
        """``"uncached"`` when every extent was read uncached, else ``"buffered"``."""
        return "uncached" if all(m == "uncached" for m in self.methods) else "buffered"

    @property
    def released(self) -> bool:
        return self._slab is None

    def tensor(self, i: int = 0) -> Any:
        """The bytes of extent ``i`` (uint8 view of :attr:`data`)."""
        _, first, end = self.extents[i]
        return self.view(first, end, i)

    def view(self, start: int, stop: int, i: int = 0) -> Any:
        """The file bytes ``[start, stop)`` of extent ``i``, as a uint8 view of the buffer.

        The view's address is congruent to ``start`` modulo O_DIRECT_ALIGN:
        ``.view(dtype)`` of a tensor stored aligned in the file works.
        """
        if self._slab is None:
            raise RuntimeError("this UncachedBuffer was released: its bytes may already be another read's")
        _, first, end = self.extents[i]
        if not first <= start <= stop <= end:
            raise ValueError(f"[{start}, {stop}) is not within the extent read, [{first}, {end})")
        base = self.offsets[i] + start - first
        return self.data[base:base + stop - start]

    def release(self) -> None:
        """Give the buffer back to the reader for the next read. Idempotent."""
        slab, self._slab = self._slab, None
        if slab is not None:
            self._finalizer.detach()
            reader, self._reader = self._reader, None  # a released buffer does not keep its reader alive
            reader._give_back(slab)

    def __enter__(self) -> UncachedBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self._slab is None else f"{format_bytes(self.data.numel())}"
        return f"UncachedBuffer({len(self.extents)} extent(s), {self.method}, {state})"
