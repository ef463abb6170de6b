"""The device path with the streamed layers read around the page cache (``O_DIRECT``).

Under a host cap too tight for the streaming window, copying a streamed layer
out of its mapping makes the kernel evict pages of the layers in use and read
them again, as on the CPU (:class:`~mapoffload.offload.loads.ReadAround`;
issue 18). Here a streamed layer's file bytes are read with ``O_DIRECT`` into
one of ``1 + depth`` reused, page-aligned buffers of a
:class:`~mapoffload.pagecache.direct_read.DirectReader` - page-locked on CUDA
(``cudaHostRegister``) - and the copier copies each mapped weight's bytes
from that buffer into the layer's device buffers with ``direct=True``: on
CUDA a DMA straight from the pinned buffer (disk -> pinned buffer -> device,
no page cache and no staging slot), on the CPU twin a plain ``memcpy`` from
the (pageable) buffer. Cached layers, and a layer that finds no buffer free
(more layers loaded than the window: ``load_all_layers``), keep the mapping
path.

Buffer lifetime: the read runs on the reader's worker thread; the copies from
its buffer are submitted from there as soon as it completes, so they overlap
the compute of the layer before, as the mapping path's copies do. The buffer
goes back to the reader only once those copies are *done* (``wait()`` on the
copy job: on CUDA the device copies completed, not merely enqueued), because
the next read overwrites it from the CPU, which no stream orders: at
``ready`` when the copies are done already (always on the CPU twin), else at
``release``. The copier's keepalive holds the buffer as well, so a buffer
whose holder went away is never freed, or unregistered, under a copy.

Stream order on CUDA: the device buffers (new, or recycled from the pool) may
still be read by compute queued before the load started. ``start`` makes the
copy stream wait for the compute stream right then - the point the mapping
path's ``wait_for`` takes - and not when the read completes, which would hold
the copies behind the compute queued meanwhile.

Autograd: unlike ``ReadAround``, a layer run with autograd recording is not
sent back to the mapping: its weights are device buffers on either path (the
device pool's recycling rule refuses a recorded graph there), and the
read-around buffer itself never reaches autograd.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from .._log import logger
from .._runs import merge_copies
from .loads import DeviceCopies, Loaded, ReadsAround, file_places, layer_buffer_bytes, written_in_place
from .stores import CONSOLIDATED, MAPPED, LayerStore

if TYPE_CHECKING:
    from ..copier import CopyHandle
    from ..pagecache.direct_read import DirectBuffer

__all__ = ["DeviceReadAround"]


class DeviceReadAround(ReadsAround, DeviceCopies):
    """:class:`DeviceCopies` with the streamed layers read around the page cache (see the module).

    Parameters
    ----------
    base
        The device path in use: its pool, copy stream and copier are taken
        over (layers it loaded are released here as usual); it is not used
        afterwards.
    buffers
        Read-around buffers (the plan's window, ``1 + depth``).
    """

    def __init__(self, base: DeviceCopies, buffers: int) -> None:
        from ..pagecache.direct_read import DirectReader

        # The same stores, pool, streams and copier (one device path, now reading around).
        self.__dict__.update(base.__dict__)
        self.reader = DirectReader(buffers=max(1, buffers), buffer_bytes=layer_buffer_bytes(self._stores, self._pages)
                                   or None, pin_device=self.device.index if self._cuda else None)
        self._where: dict[int, list] = {}  # layer -> (weight, extent index, byte offset in its file)
        self._outstanding = 0  # direct loads holding (or reading into) a buffer: at most one per buffer
        self._written: set[str] = set()  # layers logged as written in place (written_in_place)

    def _layout(self, i: int) -> list:
        where = self._where.get(i)
        if where is None:
            where = self._where[i] = file_places(self._stores[i], self._pages.extents(i))
        return where

    def start(self, i: int) -> Loaded:
        # Counted here, not by the reader (whose count grows once its worker
        # takes a buffer): a read never waits for a buffer that only a later
        # release on this thread would give back.
        if (self.paused or not self._pages.streams(i) or self._outstanding >= self.reader.buffers
                or not self._layout(i) or written_in_place(self._stores[i], self._written)):
            return super().start(i)
        store = self._stores[i]
        extents = [(e.file, e.first, e.end) for e in self._pages.extents(i)]
        buffers = {dtype: self._pool.take(n) for dtype, n in store.dev_bytes.items()}
        compute = self._compute_stream()
        try:
            if self._copy_stream is not None:
                # New or recycled buffers: the compute queued so far may still read them (see the module).
                self._copy_stream.wait_stream(compute)
            read = self.reader.read_extents_async(extents)
        except BaseException:
            for buf in buffers.values():
                self._pool.give(buf)
            raise
        self._outstanding += 1
        copy_from = functools.partial(self._copy_from, store, self._layout(i), buffers,
                                      self._copy_stream or compute)
        job = _ReadThenCopy(read, copy_from)
        return Loaded(buffers, job, read=job)

    def _copy_from(self, store: LayerStore, where: list, buffers: dict, stream: Any,
                   buf: DirectBuffer) -> CopyHandle:
        """Submit layer ``store``'s copies: mapped weights from ``buf``, the others from their host stores.

        Runs on the reader's worker thread when the read completed.
        """
        spans: list[list] = []  # [dst, src, nbytes, direct]
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
            keepalive=(store.host_tensors(), buffers, buf), direct=[s[3] for s in merged],
        )

    def ready(self, i: int, loaded: Loaded) -> None:
        job = loaded.read
        if job is None:
            return super().ready(i, loaded)
        self._pages.check(i)
        if self._cuda:
            job.wait_stream(self._compute_stream())  # compute waits for this layer's copies only
        else:
            job.wait()
        if job.done():
            self._give_back(job)  # the copies are done: the next read may have the buffer now

    def release(self, i: int, loaded: Loaded) -> None:
        job = loaded.read
        if job is None:
            return super().release(i, loaded)
        try:
            job.wait()  # never reuse a buffer (ours or the pool's) a copy may still read or write
        except Exception:
            logger.debug("released layer %d after a failed load", i, exc_info=True)
        self._give_back(job)
        loaded.read = None
        for buf in loaded.buffers.values():
            self._pool.give(buf)
        # The read left the page cache alone, but others may have filled it
        # with this layer's bytes (the mapping path before the switch, the
        # weights outside the layers): let those go too.
        self._pages.let_go(i)

    def _give_back(self, job: _ReadThenCopy) -> None:
        """The load is done with its read-around buffer (copies done, or the read or its copies failed)."""
        if job.returned:
            return
        job.returned = True
        self._outstanding -= 1
        if job.buffer is not None:
            job.buffer.release()

    def drop_in_flight(self, loaded: Loaded) -> None:
        job = loaded.read
        if job is not None and not job.returned:
            # In a forked child: neither the parent's read nor its copies run
            # here. A buffer the read handed over is an ordinary lease here
            # (nothing reads it): give it back; one still being read was the
            # worker's, which the reader forgot.
            job.returned = True
            self._outstanding -= 1
            if job.buffer is not None:
                job.buffer.release()
        super().drop_in_flight(loaded)

    def forget(self, i: int) -> None:
        self._where.pop(i, None)

    def close(self) -> None:
        try:
            self.reader.close()  # reads queued still run (their copies submitted), then the buffers go
        finally:
            super().close()


class _ReadThenCopy:
    """A layer's file bytes read into a reader buffer, then copied from it.

    The copies are submitted (``copy_from(buffer)``) on the thread that
    completes the read. ``wait``/``wait_stream``/``done`` mean the copies',
    as a :class:`~mapoffload.CopyHandle`'s do; a failed read or submission is
    raised by them.
    """

    __slots__ = ("buffer", "copy", "error", "returned", "_copy_from", "_submitted")

    def __init__(self, read: Future, copy_from: Callable[[DirectBuffer], CopyHandle]) -> None:
        self.buffer: DirectBuffer | None = None
        self.copy: CopyHandle | None = None
        self.error: BaseException | None = None
        self.returned = False  # the manager is done with the buffer (DeviceReadAround._give_back)
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
