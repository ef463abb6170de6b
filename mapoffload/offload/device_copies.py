"""The device target: each layer copied into device buffers through the native copier (CUDA, or the CPU twin).

Through the mapping (the source :data:`~mapoffload.pagecache.read_source.MAPPING`, and every layer an
uncached source declines), a load copies the layer's host stores into device buffers from the
device pool, on a copy stream; a release gives the buffers back to the pool.

Read uncached (a :class:`~mapoffload.offload.loads.UncachedSource`): under a host
cap too tight for the streaming window, copying a streamed layer out of its mapping makes the kernel
evict pages of the layers in use and read them again, as on the CPU (issue 18). Then a streamed
layer's file bytes are read with ``O_DIRECT`` into one of the source's ``1 + depth`` reused buffers -
page-locked on CUDA (``cudaHostRegister``) - and the copier copies each mapped weight's bytes from that
buffer into the layer's device buffers with ``unstaged=True``: on CUDA a DMA straight from the pinned
buffer (disk -> pinned buffer -> device, no page cache and no staging slot), on the CPU twin a plain
``memcpy`` from the (pageable) buffer. Cached layers, and a layer that finds no buffer free (more layers
loaded than the window: ``load_all_layers``), keep the mapping path.

Buffer lifetime: the read runs on the reader's worker thread; the copies from its buffer are submitted
from there as soon as it completes, so they overlap the compute of the layer before, as the mapping
path's copies do. The buffer goes back to the reader only once those copies are *done* (``wait()`` on
the copy job: on CUDA the device copies completed, not merely enqueued), because the next read
overwrites it from the CPU, which no stream orders: at ``ready`` when the copies are done already
(always on the CPU twin), else at ``release``. The copier's keepalive holds the buffer as well, so a
buffer whose holder went away is never freed, or unregistered, under a copy.

Stream order on CUDA: the device buffers (new, or recycled from the pool) may still be read by compute
queued before the load started. ``start`` makes the copy stream wait for the compute stream right then -
the point the mapping path's ``wait_for`` takes - and not when the read completes, which would hold the
copies behind the compute queued meanwhile.

Autograd: unlike in place, a layer run with autograd recording is not sent back to the mapping: its
weights are device buffers on either path (the device pool's recycling rule refuses a recorded graph
there), and the uncached buffer itself never reaches autograd.

Device buffers (:class:`DevicePool`): a pool per size. A buffer given back is reused by the next layer of
the same size; reuse is ordered by the copier, not the pool: every prefetch's copies wait for the work
already queued on the compute stream (``wait_for``), which includes every read of a buffer given back
before it, and the copier holds the buffers of a copy in flight until it is done.
"""

from __future__ import annotations

import functools
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from .._log import log_once, logger
from .._runs import merge_copies
from ..pagecache.layer_pages import LayerPages
from .loads import Load, Target, wait_quietly
from .stores import CONSOLIDATED, MAPPED, LayerStore, Weight, device_view

if TYPE_CHECKING:
    import torch

    from ..copier import Copier, CopyHandle
    from ..pagecache.uncached_read import UncachedBuffer

__all__ = ["DeviceCopies", "DevicePool"]


class DeviceCopies(Target):
    """Copy each layer into device buffers through a copier (see the module).

    Parameters
    ----------
    stores, pages
        The stack's layer stores and its pages.
    device, copier
        Where the layers compute, and the copier onto it.
    owns_copier
        Close the copier at :meth:`close`.
    side_stream
        Enqueue copies on a stream of their own (on CUDA); False: on the compute stream (the seed
        runtime's path, which a copier in ``"direct"`` mode runs, for comparison).
    pool
        The device buffers' pool (default: one on ``device``, its buffers recorded on the copy stream).
    buffer_layers
        The most layers loaded at once (resident ones, the one computing and the prefetched ones):
        on the CPU twin the plan charges that many layers' buffers as host memory.
    """

    copies = True

    def __init__(self, stores: list[LayerStore], pages: LayerPages, device: torch.device, copier: Copier, *,
                 owns_copier: bool, side_stream: bool = True, pool: Any = None, buffer_layers: int = 1) -> None:
        import torch

        self._stores, self._pages, self.device, self.copier = stores, pages, device, copier
        self._owns_copier = owns_copier
        self._cuda = device.type == "cuda"
        self.copy_stream = None
        if self._cuda and side_stream:
            self.copy_stream = torch.cuda.Stream(device)
        self.pool = DevicePool(device, self.copy_stream) if pool is None else pool
        self._buffer_layers = buffer_layers

    @property
    def bytes(self) -> int:
        """Device buffers held now (in use or pooled for reuse)."""
        return self.pool.bytes

    @property
    def peak_bytes(self) -> int:
        return self.pool.peak_bytes

    def _ring_bytes(self) -> int:
        """The copier's staging ring, where this target owns the copier (a shared one is its maker's)."""
        return self.copier.ring_bytes if self._owns_copier else 0

    @property
    def host_bytes(self) -> int:
        """Host memory held now: the owned copier's ring (pinned on CUDA) and, on the CPU twin, the
        "device" buffers (``manager.held_buffers`` lists the same for ``summary()``)."""
        return self._ring_bytes() + (0 if self._cuda else self.pool.bytes)

    @property
    def planned_host_bytes(self) -> int:
        """What the page-cache plan charges for it: the ring, and on the CPU twin the buffers of
        ``buffer_layers`` buffers of each size the layers use (or what the pool holds, when more)."""
        if self._cuda:
            return self._ring_bytes()
        # The pool keeps given-back buffers by exact size: of each size, at most as many as a window
        # of layers takes at once, and never fewer than the layers of that size need.
        sizes = Counter(n for s in self._stores for n in s.dev_bytes.values())
        most = sum(n * min(count, self._buffer_layers) for n, count in sizes.items())
        return self._ring_bytes() + max(self.pool.bytes, most)

    @property
    def pin_device(self) -> int | None:
        """The CUDA device an uncached source's buffers are page-locked for (None: the CPU twin)."""
        return self.device.index if self._cuda else None

    def compute_stream(self):
        import torch

        return torch.cuda.current_stream(self.device) if self._cuda else None

    # -- through the mapping -------------------------------------------------------------------
    def start(self, i: int) -> Load:
        if self.source.takes(i):
            return self._start_uncached(i)
        self._pages.spans(i)  # MADV_HUGEPAGE + MADV_RANDOM before the copier reads the pages
        if self._pages.streams(i):
            self._pages.before_streamed_read(i)
        else:
            self._pages.before_cached_copy(i)
        store = self._stores[i]
        buffers = {dtype: self.pool.take(n) for dtype, n in store.dev_bytes.items()}
        spans = store.spans()
        compute = self.compute_stream()
        try:
            handle = self.copier.copy_spans(
                [buffers[d].data_ptr() + off for d, off, _, _, _ in spans],
                [src for _, _, src, _, _ in spans],
                [n for _, _, _, n, _ in spans],
                stream=self.copy_stream or compute,
                keepalive=(store.host_tensors(), buffers),
                unstaged=[pinned for *_, pinned in spans] if self._cuda else None,
                # New or recycled buffers: the compute stream may still read them.
                wait_for=compute if self.copy_stream is not None else None,
            )
        except BaseException:
            for buf in buffers.values():
                self.pool.give(buf)
            raise
        return Load(buffers, handle)

    def ready(self, i: int, load: Load) -> None:
        job = load.uncached
        if job is not None:
            self._pages.check(i)
            self._wait(job)
            if job.done():
                self._give_back(job)  # the copies are done: the next read may have the buffer now
            return
        if load.handle is None:
            return
        self._wait(load.handle)
        # Its mapped pages were read into the device buffers: let them go.
        self._pages.let_go(i)

    def _wait(self, job: Any) -> None:
        if self._cuda:
            # Stream-ordered: compute waits for this layer's copies only.
            job.wait_stream(self.compute_stream())
        else:
            job.wait()

    def value(self, w: Weight, load: Load) -> torch.Tensor:
        return device_view(w, load.buffers[w.dtype])

    def release(self, i: int, load: Load) -> None:
        job = load.uncached
        if job is None:
            # Never recycle a buffer a copy may still write.
            wait_quietly(load, i)
            self.drop_in_flight(load)
            return
        try:
            job.wait()  # never reuse a buffer (ours or the pool's) a copy may still read or write
        except Exception:
            logger.debug("released layer %d after a failed load", i, exc_info=True)
        self._give_back(job)
        load.uncached = None
        for buf in load.buffers.values():
            self.pool.give(buf)
        # The read left the page cache alone, but others may have filled it
        # with this layer's bytes (the mapping path before the switch, the
        # weights outside the layers): let those go too.
        self._pages.let_go(i)

    def drop_in_flight(self, load: Load) -> None:
        """Give ``load``'s buffers back (in a forked child: nothing writes them here)."""
        job = load.uncached
        if job is not None and not job.returned:
            # In a forked child: neither the parent's read nor its copies run
            # here. A buffer the read handed over is an ordinary lease here
            # (nothing reads it): give it back; one still being read was the
            # worker's, which the reader forgot.
            job.returned = True
            self.source.done()
            if job.buffer is not None:
                job.buffer.release()
        for buf in load.buffers.values():
            self.pool.give(buf)

    # -- uncached -----------------------------------------------------------------------------
    def _start_uncached(self, i: int) -> Load:
        store = self._stores[i]
        buffers = {dtype: self.pool.take(n) for dtype, n in store.dev_bytes.items()}
        compute = self.compute_stream()
        try:
            if self.copy_stream is not None:
                # New or recycled buffers: the compute queued so far may still read them (see the module).
                self.copy_stream.wait_stream(compute)
            read = self.source.read(i)
        except BaseException:
            for buf in buffers.values():
                self.pool.give(buf)
            raise
        copy_from = functools.partial(self._copy_from, store, self.source.places(i), buffers,
                                      self.copy_stream or compute)
        job = ReadThenCopy(read, copy_from)
        return Load(buffers, job, uncached=job)

    def _copy_from(self, store: LayerStore, where: list, buffers: dict, stream: Any,
                   buf: UncachedBuffer) -> CopyHandle:
        """Submit layer ``store``'s copies: mapped weights from ``buf``, the others from their host stores.

        Runs on the reader's worker thread when the read completed.
        """
        spans: list[list] = []  # [dst, src, nbytes, unstaged]
        base = buf.data.data_ptr()
        from_buffer = buf.pinned or not self._cuda  # DMA from pinned memory; on the CPU twin a plain memcpy
        for w, k, offset in where:
            src = base + buf.offsets[k] + offset - buf.extents[k][1]
            spans.append([buffers[w.dtype].data_ptr() + w.dev_offset, src, w.nbytes, from_buffer])
        pinned_store = self._cuda and store.pinned
        for w in store.weights:
            if w.store != MAPPED:
                spans.append([buffers[w.dtype].data_ptr() + w.dev_offset, w.host.data_ptr(), w.nbytes,
                              pinned_store and w.store == CONSOLIDATED])
        spans.sort(key=lambda s: s[0])
        merged = merge_copies(spans)  # spans that continue each other on both sides, one copy
        return self.copier.copy_spans(
            [s[0] for s in merged], [s[1] for s in merged], [s[2] for s in merged], stream=stream,
            keepalive=(store.host_tensors(), buffers, buf), unstaged=[s[3] for s in merged],
        )

    def _give_back(self, job: ReadThenCopy) -> None:
        """The load is done with its uncached buffer (copies done, or the read or its copies failed)."""
        if job.returned:
            return
        job.returned = True
        self.source.done()
        if job.buffer is not None:
            job.buffer.release()

    # -- the rest of the target interface ------------------------------------------------------
    def recycles(self, i: int) -> bool:
        return True

    def reuses(self, load: Load) -> bool:
        return False

    def write_back(self, w: Weight, load: Load) -> None:
        """Copy a loaded weight's device value into its host store (never a mapped one)."""
        if w.store != MAPPED:
            w.host.copy_(device_view(w, load.buffers[w.dtype]))

    def close(self) -> None:
        import torch

        try:
            self.source.close()  # reads queued still run (their copies submitted), then the buffers go
        finally:
            if self._cuda:
                torch.cuda.synchronize(self.device)
            self.pool.clear()
            if self._owns_copier:
                self.copier.close()


class ReadThenCopy:
    """A layer's file bytes read into a reader buffer, then copied from it.

    The copies are submitted (``copy_from(buffer)``) on the thread that
    completes the read. ``wait``/``wait_stream``/``done`` mean the copies',
    as a :class:`~mapoffload.CopyHandle`'s do; a failed read or submission is
    raised by them.
    """

    __slots__ = ("buffer", "copy", "error", "returned", "_copy_from", "_submitted")

    def __init__(self, read: Future, copy_from: Callable[[UncachedBuffer], CopyHandle]) -> None:
        self.buffer: UncachedBuffer | None = None
        self.copy: CopyHandle | None = None
        self.error: BaseException | None = None
        self.returned = False  # the target is done with the buffer (DeviceCopies._give_back)
        self._copy_from: Callable | None = copy_from
        self._submitted = threading.Event()
        read.add_done_callback(self._then_copy)

    def _then_copy(self, read: Future) -> None:
        try:
            self.buffer = read.result()
            self.copy = self._copy_from(self.buffer)
        except BaseException as e:  # raised by whoever waits
            self.error = e
        finally:
            self._copy_from = None
            self._submitted.set()

    def _wait_submitted(self) -> CopyHandle:
        self._submitted.wait()
        if self.error is not None:
            raise self.error
        return self.copy

    def wait(self) -> None:
        self._wait_submitted().wait()

    def wait_stream(self, stream: Any) -> None:
        self._wait_submitted().wait_stream(stream)

    def done(self) -> bool:
        if not self._submitted.is_set():
            return False
        return self.error is not None or self.copy.done()


class DevicePool:
    """Flat ``uint8`` buffers on one device, pooled by size."""

    def __init__(self, device: torch.device, copy_stream: object | None) -> None:
        self.device = device
        self._copy_stream = copy_stream
        self._free: dict[int, list[torch.Tensor]] = {}
        self.bytes = 0  # held now: in use or pooled
        self.peak_bytes = 0

    def take(self, nbytes: int) -> torch.Tensor:
        import torch

        free = self._free.get(nbytes)
        if free:
            return free.pop()
        # A normal tensor even when the first forward runs under inference_mode:
        # an inference tensor could not be written (update_cpu_weights) outside it.
        with torch.inference_mode(False):
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        if self._copy_stream is not None:
            # Written on the copy stream: the caching allocator must not hand
            # this memory to another stream before that work is done.
            buf.record_stream(self._copy_stream)
        self.bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.bytes)
        return buf

    def pooled(self) -> list[torch.Tensor]:
        """The buffers given back and not taken again."""
        return [b for bufs in self._free.values() for b in bufs]

    def give(self, buf: torch.Tensor) -> None:
        """Pool ``buf`` for the next layer of its size, unless a view of it outlived its layer (a weight kept
        past its forward: a hook keeping ``weight.detach()``, a module caching ``weight.t()``): the next
        layer's copy would overwrite what that view holds. Then it is left to the view (its memory goes with
        it, as a plain model's weight would), and the pool makes another."""
        from ..memory.regions import storage_users

        if storage_users(buf) > 2:  # buf, and the storage made to ask
            self.bytes -= buf.numel()
            log_once(f"a view of a layer's {self.device} buffer outlived its layer (a weight kept past its "
                     "forward?): left to it, not reused")
            return
        self._free.setdefault(buf.numel(), []).append(buf)

    def clear(self) -> None:
        """Drop the pooled buffers (buffers in use stay with their holders)."""
        for bufs in self._free.values():
            self.bytes -= sum(b.numel() for b in bufs)
        self._free.clear()
