"""The read-around source: a streamed layer's bytes read around the page cache.

A load target (``loads.InPlace``, ``device_copies.DeviceCopies``) holds one source
(:class:`~mapoffload.pagecache.read_source.Source`) and asks it, at each load, whether it takes the
layer (:meth:`takes`):

- :data:`~mapoffload.pagecache.read_source.MAPPING` takes none: every layer is read through its
  mapping (read in, or copied from it, and let go after use by the page-cache side).
- :class:`ReadAroundSource` takes a streamed layer when a buffer is free: its file bytes are read with
  ``O_DIRECT`` (:class:`~mapoffload.pagecache.uncached_read.UncachedReader`) into one of ``1 + depth``
  reused, page-aligned buffers (the plan's streaming window, in anonymous memory instead of the page
  cache; page-locked on CUDA), and the target computes from that buffer (in place) or copies from it
  (the device path). It declines a layer whose weights were written in place (its pages are no longer
  the file's: :func:`written_in_place`) or whose files are not held open, and every layer while paused.

Under a cap too tight for the streaming window, reading a streamed layer through its mapping makes the
kernel evict pages of the layer in use and read them again (issue 18: 2.3x the checkpoint per forward
at +6 %); reading it around the page cache reads it once. ``pagecache.read_policy.ReadPolicy`` decides which
source a stack's target holds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._log import logger
from ..pagecache.file_places import MapsView
from ..pagecache.read_source import PauseReason
from .stores import MAPPED, LayerStore, Weight

if TYPE_CHECKING:
    from concurrent.futures import Future

    import torch

    from ..pagecache.layer_pages import LayerPages

__all__ = ["ReadAroundSource", "file_places", "layer_buffer_bytes", "written_in_place"]


class ReadAroundSource:
    """Streamed layers read around the page cache (``O_DIRECT``) into ``buffers`` reused buffers.

    While paused (``paused``, a :class:`~mapoffload.pagecache.read_source.PauseReason`: replicas share
    the page cache, the plan's room no longer holds the buffers) it takes no layer - they are read through the mapping - and loads already read around
    finish as they are. Pausing drops the reader's free buffers (they would hold the window in anonymous
    memory beside the page cache that now holds it); resumed, it makes new ones.

    Parameters
    ----------
    stores, pages
        The stack's layer stores and its pages (files held open, extents, the plan).
    buffers
        Read-around buffers (the plan's window, ``1 + depth``), each of the largest layer's bytes.
    pin_device
        The CUDA device to page-lock the buffers for (DMA straight from them); None: pageable.
    """

    def __init__(self, stores: list[LayerStore], pages: LayerPages, buffers: int, *,
                 pin_device: int | None = None) -> None:
        from ..pagecache.uncached_read import UncachedReader

        self._stores, self._pages = stores, pages
        # Buffers of the largest layer's bytes, made so: what the plan charges (planned_bytes).
        self.reader = UncachedReader(buffers=max(1, buffers), buffer_bytes=layer_buffer_bytes(stores, pages) or None,
                                   pin_device=pin_device)
        self._where: dict[int, list] = {}  # layer -> (weight, extent index, byte offset in its file)
        self._placed: dict[int, tuple[int, int]] = {}  # id(weight) -> (extent index, byte offset in its file)
        # Reads started and not given back (done()): at most one per buffer. Counted here, not by the
        # reader, whose count grows only once its worker takes a buffer: a read never waits for a
        # buffer that only a later release on the compute thread would give back.
        self.outstanding = 0
        self._written: set[str] = set()  # layers logged as written in place (written_in_place)
        self.paused: PauseReason | None = None

    reads_around = True

    @property
    def mode(self) -> str:
        """``"uncached"`` while it takes layers, ``"mapping"`` while paused."""
        return "mapping" if self.paused else "uncached"

    @property
    def buffers(self) -> int:
        """The read-around buffers the reader may hold at once (the plan's window)."""
        return self.reader.buffers

    @property
    def held_bytes(self) -> int:
        """Host bytes of the reader's buffers now (paused or not)."""
        return self.reader.held_bytes

    @property
    def pinned_bytes(self) -> int:
        """Of :attr:`held_bytes`, the page-locked ones."""
        return self.reader.pinned_bytes

    def pause(self, reason: PauseReason) -> None:
        """Take no layer until :meth:`resume`."""
        self.paused = reason
        self.reader.trim()

    def resume(self) -> None:
        self.paused = None

    @property
    def window_bytes(self) -> int:
        """The reader's buffers (the window in anonymous, on CUDA pinned, memory); 0 while paused."""
        return 0 if self.paused else self.reader.held_bytes

    @property
    def planned_bytes(self) -> int:
        """The buffers as the page-cache plan charges them: the ``1 + depth`` the reader may make, each
        of the largest layer's bytes, or what it holds if more (buffers are made at the first reads,
        after the plan); 0 while paused."""
        if self.paused:
            return 0
        per_layer = self.reader.buffer_bytes or layer_buffer_bytes(self._stores, self._pages)
        return max(self.reader.held_bytes, self.reader.buffers * per_layer)

    def places(self, i: int) -> list:
        """``(weight, extent index, byte offset in its file)`` of layer ``i``'s mapped weights (empty:
        a weight's file is not held open, the layer is read through its mapping)."""
        where = self._where.get(i)
        if where is None:
            where = file_places(self._stores[i], self._pages.extents(i))
            if not where:
                return []
            self._where[i] = where
            self._placed.update((id(w), (k, off)) for w, k, off in where)
        return where

    def takes(self, i: int) -> bool:
        """Whether layer ``i`` is read around the page cache now (streamed, a buffer free, its files
        held open, its pages the file's)."""
        return not (self.paused or not self._pages.streams(i) or getattr(self._pages, "in_parts", False)
                    or self.outstanding >= self.reader.buffers
                    or not self.places(i) or written_in_place(self._stores[i], self._written))

    def read(self, i: int) -> Future:
        """Start reading layer ``i``'s file bytes into a buffer (a Future of a ``UncachedBuffer``); give it
        back with :meth:`done`."""
        extents = [(e.file, e.first, e.end) for e in self._pages.extents(i)]
        future = self.reader.read_extents_async(extents)
        self.outstanding += 1
        return future

    def done(self) -> None:
        """A read of :meth:`read` is finished with (its buffer released, or the read forgotten)."""
        self.outstanding -= 1

    def view(self, w: Weight, buf: Any) -> torch.Tensor | None:
        """Weight ``w``'s tensor in ``buf`` (its layer's buffer); None when it is not read around."""
        placed = self._placed.get(id(w))
        if w.store != MAPPED or placed is None:
            return None
        k, offset = placed
        pos = buf.offsets[k] + offset - buf.extents[k][1]  # in the buffer, from its first byte
        base = buf.data.view(w.dtype)  # a view itself: as_strided counts from its storage's start
        return base.as_strided(w.shape, w.stride, base.storage_offset() + pos // w.dtype.itemsize)

    def forget(self, i: int) -> None:
        """Layer ``i``'s stores changed (a mapped weight became owned)."""
        for w, _, _ in self._where.pop(i, ()):
            self._placed.pop(id(w), None)

    def close(self) -> None:
        self.reader.close()


def layer_buffer_bytes(stores: list[LayerStore], pages: LayerPages) -> int:
    """Bytes of the read-around buffer the largest layer's mapped weights take (0: none mapped)."""
    from ..pagecache.uncached_read import buffer_capacity

    return max((buffer_capacity([(e.first, e.end) for e in pages.extents(i)])
                for i, s in enumerate(stores) if s.bytes_in(MAPPED)), default=0)


def written_in_place(store: LayerStore, said: set[str]) -> bool:
    """True when a mapped weight of the layer has pages the process wrote in place
    (copy-on-write: a LoRA merged with ``+=``, an edit before offloading).

    Those bytes are no longer the file's, so reading the file around the page
    cache (``O_DIRECT``) would compute with the file's values: such a layer is
    read through its mapping. Checked at each load (pagemap, a few
    microseconds a MiB), so an edit made between forwards counts too; where
    pagemap cannot be read the layer takes the mapping (always right). Logged
    once per layer (``said`` holds the names already logged)."""
    from .._native import _core
    from ..memory.regions import tensor_spans

    hosts = [w.host for w in store.weights if w.store == MAPPED and w.nbytes]
    if not hosts:
        return False
    got = _core.private_page_bytes(tensor_spans(hosts))
    if got == 0:
        return False
    if store.name not in said:
        said.add(store.name)
        if got > 0:
            logger.info("%s: %d bytes of its mapped weights were written in place (copy-on-write): read through "
                        "its mapping, not around the page cache (the file holds other bytes)", store.name, got)
        else:
            logger.info("%s: read through its mapping (/proc/self/pagemap unreadable, errno %d: whether its "
                        "weights were written in place is unknown)", store.name, -got)
    return True


def file_places(store: LayerStore, extents: list, maps: MapsView | None = None) -> list[tuple[Weight, int, int]]:
    """``(weight, extent index, byte offset in its file)`` of each mapped weight of a layer.

    ``extents`` are the layer's (``LayerPages.extents``: byte runs, several
    per file where its tensors are apart). Empty when a mapped weight's
    bytes are in none of them or its file is not held open: such a layer
    cannot be read around its mapping. ``maps``: the snapshot to look the
    weights up in (one is taken when None).
    """
    maps = MapsView() if maps is None else maps
    runs: dict[str, list[tuple[int, int, int]]] = {}
    for k, e in enumerate(extents):
        runs.setdefault(e.path, []).append((e.first, e.end, k))
    where = []
    for w in store.weights:
        if w.store != MAPPED or w.nbytes == 0:
            continue  # an empty weight reads nothing: it stays on its mapping
        place = maps.place(w.host.data_ptr())
        if place is None:
            return []
        offset = place.offset
        k = next((k for first, end, k in runs.get(place.path, ()) if first <= offset < end), None)
        if k is None or extents[k].file is None:
            return []
        where.append((w, k, offset))
    return where
