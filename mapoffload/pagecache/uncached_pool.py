"""The buffers a :class:`~mapoffload.pagecache.uncached_read.UncachedReader` reads into: a bounded pool of slabs.

A :class:`SlabPool` makes, keeps and leases the reader's slabs (:class:`~.uncached_buffers.Slab`): at most
``buffers`` exist at once, leased or free, and a lease waits for a release when all are out. Slabs grow
to the largest read so far (to a multiple of :data:`~.uncached_buffers.GROW_QUANTUM`) unless their size is
fixed, and are reused from then on.

Pinning (``pin_device``): each slab is page-locked with the CUDA runtime when it is made
(``cudaHostRegister`` through the native loader, :class:`mapoffload._core.HostPin`). It stays
registered while the pool keeps it and is unregistered before its memory can be freed: a slab grown,
:meth:`SlabPool.trim`, :meth:`SlabPool.close`, the pool collected (with its reader), a leased slab
given back after close, or its buffer dropped without ``release()``. A forked child unregisters
nothing (page locks are not inherited). A refused registration leaves the slab pageable (logged
once; :attr:`SlabPool.pin_why` says why, :attr:`~.uncached_buffers.UncachedBuffer.pinned` which).

Locking: the pool's Condition guards its slabs and counters only. It is taken alone: the reader never
calls into the pool while it holds its own lock, and the pool knows nothing of the reader.
"""

from __future__ import annotations

import threading
import time

from .._log import format_bytes, logger
from .uncached_buffers import GROW_QUANTUM, Slab, round_up

__all__ = ["SlabPool"]


class SlabPool:
    """At most ``buffers`` page-aligned slabs, free or leased, made when first needed and reused.

    Parameters
    ----------
    buffers
        How many slabs may exist at once (leased or free).
    buffer_bytes
        Fixed capacity of each slab (O_DIRECT_ALIGN-aligned), or None: slabs
        grow to the largest lease so far.
    pin_device
        A CUDA device index to page-lock each new slab for, or None.

    Attributes
    ----------
    pin_why
        Why slabs are not pinned (a refused registration), once one was.
    allocations, pin_failures
        Slabs made, and registrations the CUDA runtime refused.
    """

    def __init__(self, buffers: int, buffer_bytes: int | None, pin_device: int | None) -> None:
        self.buffers, self.buffer_bytes, self.pin_device = buffers, buffer_bytes, pin_device
        self.pin_why = ""
        self.allocations = 0
        self.pin_failures = 0
        self._cond = threading.Condition()
        self._free: list[Slab] = []
        self._slab_bytes = 0  # bytes of the slabs made and not lost (free or leased)
        self._pinned_bytes = 0  # of those, page-locked now
        self._leased = 0  # slabs out (leased, or held by a read in flight)
        self._worker_leases = 0  # of those, held by the reader's worker for a read in flight
        self._closed = False
        self._draining = False  # the reader is closing: a lease that would have to wait is refused

    def acquire(self, need: int, timeout: float | None, worker: bool = False) -> Slab:
        """Lease a slab of at least ``need`` bytes, waiting up to ``timeout`` s for one to be given back.

        The smallest free slab that fits, else the largest free one grown, else a new one while fewer
        than ``buffers`` exist. ``worker``: the lease is the worker's (written off in a forked child)
        until :meth:`worker_done` or ``give_back(slab, worker=True)``; a refused lease is none.

        Raises
        ------
        ValueError
            ``need`` exceeds a fixed ``buffer_bytes``.
        TimeoutError
            None was given back within ``timeout``.
        RuntimeError
            The pool is closed (also while waiting).
        """
        if self.buffer_bytes is not None and need > self.buffer_bytes:
            raise ValueError(f"a read of {need} bytes (aligned) does not fit buffers of {self.buffer_bytes} bytes")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                if self._closed:
                    raise RuntimeError("this UncachedReader is closed")
                if self._free:
                    # The smallest free buffer that fits, else the largest (it grows).
                    fits = [s for s in self._free if s.capacity >= need]
                    slab = min(fits, key=lambda s: s.capacity) if fits else max(self._free, key=lambda s: s.capacity)
                    self._free.remove(slab)
                    break
                if self._leased < self.buffers:
                    slab = None
                    break
                if self._draining:  # only a holder could give one back, and it may be the closer
                    raise RuntimeError("this UncachedReader is closed")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"no UncachedReader buffer was released within {timeout} s "
                                       f"({self.buffers} leased)")
                self._cond.wait(left)
            self._leased += 1
            self._worker_leases += worker  # falls in worker_done() or give_back(), or below
        try:
            if slab is None or slab.capacity < need:
                cap = self.buffer_bytes or round_up(need, GROW_QUANTUM)
                if slab is not None:
                    logger.debug("UncachedReader buffer grows from %s to %s", format_bytes(slab.capacity),
                                 format_bytes(cap))
                old = 0 if slab is None else slab.capacity
                unpinned = 0 if slab is None else slab.unpin()  # free: no copy reads it
                slab = None  # let the old one go before the new one is made
                with self._cond:
                    self._slab_bytes -= old
                    self._pinned_bytes -= unpinned
                slab = Slab(cap)
                with self._cond:
                    self.allocations += 1
                    self._slab_bytes += cap
                self._pin(slab)
        except BaseException:
            with self._cond:
                self._leased -= 1
                self._worker_leases -= worker
                self._cond.notify_all()
            raise
        return slab

    def worker_done(self) -> None:
        """The worker's lease from :meth:`acquire` is handed over (in its Future): a lease like any other."""
        with self._cond:
            self._worker_leases -= 1

    def _pin(self, slab: Slab) -> None:
        """Page-lock a new slab for ``pin_device`` (a refusal leaves it pageable, logged once)."""
        if self.pin_device is None:
            return
        try:
            slab.lock(self.pin_device)
        except Exception as e:
            with self._cond:
                first = not self.pin_failures
                self.pin_failures += 1
                self.pin_why = f"cudaHostRegister refused: {e}"
            log = logger.warning if first else logger.debug
            log("an uncached buffer of %s could not be page-locked (%s): copies from it are staged",
                format_bytes(slab.capacity), e)
            return
        with self._cond:
            self._pinned_bytes += slab.capacity

    def give_back(self, slab: Slab, worker: bool = False) -> None:
        """End a lease (``worker``: the worker's, not handed over): the slab is free for the next, or
        dropped (unregistered now) once closed."""
        with self._cond:
            self._leased -= 1
            self._worker_leases -= worker
            closed = self._closed
            if not closed:
                self._free.append(slab)
            self._cond.notify_all()
        if closed:  # dropped: unregistered now, whoever still holds a view of it
            unpinned = slab.unpin()
            with self._cond:
                self._slab_bytes -= slab.capacity
                self._pinned_bytes -= unpinned

    def lost(self, capacity: int, pinned: int) -> None:
        """A leased slab will not come back (its buffer was dropped): its slot is free, its bytes not ours."""
        with self._cond:
            self._leased -= 1
            self._slab_bytes -= capacity  # its holders' now
            self._pinned_bytes -= pinned  # unregistered with its slab
            self._cond.notify_all()

    def trim(self) -> int:
        """Drop (and unregister) the free slabs; returns the bytes dropped. Leased ones stay theirs."""
        with self._cond:
            free, self._free = self._free, []
        return self._drop(free)

    def _drop(self, free: list[Slab]) -> int:
        dropped = 0
        for slab in free:
            unpinned = slab.unpin()
            with self._cond:
                self._slab_bytes -= slab.capacity
                self._pinned_bytes -= unpinned
            dropped += slab.capacity
        return dropped

    def drain(self) -> None:
        """The reader is closing: leases that can be had now still are, one that would wait raises
        (waiters wake and raise too)."""
        with self._cond:
            self._draining = True
            self._cond.notify_all()

    def close(self) -> None:
        """Refuse leases from now on, wake those waiting for one (they raise RuntimeError), drop the
        free slabs. Leased slabs are dropped when given back. Idempotent."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            free, self._free = self._free, []
        self._drop(free)

    @property
    def held_bytes(self) -> int:
        """Bytes of every slab made and not lost, free or leased."""
        with self._cond:
            return self._slab_bytes

    @property
    def pinned_bytes(self) -> int:
        """Bytes of those slabs that are page-locked now."""
        with self._cond:
            return self._pinned_bytes

    @property
    def capacity_bytes(self) -> int:
        """Bytes of the free slabs."""
        with self._cond:
            return sum(s.capacity for s in self._free)

    @property
    def leased(self) -> int:
        """Slabs out now (leased, or being read into)."""
        with self._cond:
            return self._leased

    def counters(self) -> dict[str, int]:
        """``allocations`` and ``pin_failures``, read together."""
        with self._cond:
            return {"allocations": self.allocations, "pin_failures": self.pin_failures}

    def after_fork_in_child(self) -> None:
        """In a forked child: a fresh lock (a parent thread may have held it), the worker's lease in
        flight written off (its thread does not exist here), nothing pinned (page locks are the parent's)."""
        self._cond = threading.Condition()
        self._leased -= self._worker_leases
        self._worker_leases = 0
        self._pinned_bytes = 0  # HostPin knows it is in a child: it unregisters nothing
