"""The two ways a layer is made ready to compute, behind one interface.

``InPlace`` (``device="cpu"``): a layer computes from its host stores; a load
reads its mapped pages in (when the plan says so) and a release lets a
streamed layer's pages go. Nothing is copied.

``DeviceCopies`` (CUDA, or the CPU twin): a load copies the layer's host
stores into device buffers through the native copier, on a copy stream; a
release gives the buffers back to the pool.

Both answer ``start(i)`` (begin loading layer ``i``: a :class:`Loaded`),
``ready(i, loaded)`` (wait until it can compute; raises on a failed read),
``value(w, loaded)`` (the tensor weight ``w`` computes with) and
``release(i, loaded)``. ``ReadAround`` is ``InPlace`` with the streamed
layers read around the page cache (``O_DIRECT``) into reused buffers;
``DeviceReadAround`` (``device_read_around.py``) is ``DeviceCopies`` with
the same reads, copied from those buffers (pinned on CUDA). The manager
sequences them; the page cache is
:class:`~mapoffload.offload.layer_pages.LayerPages`'.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._log import logger
from .device_pool import DevicePool
from ..pagecache.file_places import MapsView
from .layer_pages import LayerPages
from .stores import MAPPED, LayerStore, Weight, device_view

if TYPE_CHECKING:
    import torch

    from ..copier import Copier

__all__ = ["DeviceCopies", "InPlace", "Loaded", "ReadAround", "ReadsAround", "file_places"]


class Loaded:
    """One layer being loaded or loaded: its buffers per dtype, the work in flight."""

    __slots__ = ("buffers", "handle", "ready", "read")

    def __init__(self, buffers: dict, handle: Any, read: Any = None) -> None:
        self.buffers = buffers
        self.handle = handle  # a CopyHandle, a page read (``wait()``), or None
        self.ready = False  # bound: its parameters hold the real weights
        self.read = read  # DeviceReadAround: the read its copies come from, kept until release


class _PagesRead:
    """A layer's pages being read in by the page worker."""

    __slots__ = ("future",)

    def __init__(self, future) -> None:
        self.future = future

    def wait(self) -> None:
        self.future.result()


def _wait_quietly(loaded: Loaded, i: int) -> None:
    # A failure is the load's own business (reported by whoever waited for it).
    if loaded.handle is not None:
        try:
            loaded.handle.wait()
        except Exception:
            logger.debug("released layer %d after a failed load", i, exc_info=True)


class InPlace:
    """Compute from the host stores (``device="cpu"``): loading reads mapped pages in."""

    copies = False

    def __init__(self, stores: list[LayerStore], pages: LayerPages) -> None:
        self._stores, self._pages = stores, pages

    @property
    def bytes(self) -> int:
        return 0

    @property
    def peak_bytes(self) -> int:
        return 0

    def start(self, i: int) -> Loaded:
        read = self._pages.read_in(i)
        return Loaded({}, None if read is None else _PagesRead(read))

    def ready(self, i: int, loaded: Loaded) -> None:
        self._pages.check(i)
        if loaded.handle is not None:
            loaded.handle.wait()

    def value(self, w: Weight, loaded: Loaded) -> torch.Tensor:
        return w.host

    def release(self, i: int, loaded: Loaded) -> None:
        _wait_quietly(loaded, i)
        # Computed from its mapping: let its pages go before they push a cached layer out.
        self._pages.let_go(i)

    def drop_in_flight(self, loaded: Loaded) -> None:
        """In a forked child: forget a load the parent had in flight."""

    def recycles(self, i: int) -> bool:
        """Whether layer ``i`` computes from memory reused after it (autograd must not keep it)."""
        return False

    def reuses(self, loaded: Loaded) -> bool:
        """Whether this load computes from a buffer the next loads reuse (read again for autograd)."""
        return False

    @property
    def window_bytes(self) -> int:
        """Anonymous memory holding the streaming window instead of the page cache (read-around buffers)."""
        return 0

    def forget(self, i: int) -> None:
        """Layer ``i``'s stores changed (a mapped weight became owned)."""

    def close(self) -> None:
        pass


class DeviceCopies:
    """Copy each layer into device buffers through a copier (CUDA, or the CPU twin)."""

    copies = True

    def __init__(self, stores: list[LayerStore], pages: LayerPages, device: torch.device, copier: Copier, *,
                 owns_copier: bool, copy_on_compute_stream: bool) -> None:
        import torch

        self._stores, self._pages, self.device, self.copier = stores, pages, device, copier
        self._owns_copier = owns_copier
        self._cuda = device.type == "cuda"
        self._copy_stream = None
        if self._cuda and not copy_on_compute_stream:
            self._copy_stream = torch.cuda.Stream(device)
        self._pool = DevicePool(device, self._copy_stream)

    @property
    def bytes(self) -> int:
        """Device buffers held now (in use or pooled for reuse)."""
        return self._pool.bytes

    @property
    def peak_bytes(self) -> int:
        return self._pool.peak_bytes

    def _compute_stream(self):
        import torch

        return torch.cuda.current_stream(self.device) if self._cuda else None

    def start(self, i: int) -> Loaded:
        self._pages.spans(i)  # MADV_HUGEPAGE + MADV_RANDOM before the copier reads the pages
        if self._pages.streams(i):
            self._pages.before_streamed_read(i)
        else:
            self._pages.before_cached_copy(i)
        store = self._stores[i]
        buffers = {dtype: self._pool.take(n) for dtype, n in store.dev_bytes.items()}
        spans = store.spans()
        compute = self._compute_stream()
        try:
            handle = self.copier.copy_spans(
                [buffers[d].data_ptr() + off for d, off, _, _, _ in spans],
                [src for _, _, src, _, _ in spans],
                [n for _, _, _, n, _ in spans],
                stream=self._copy_stream or compute,
                keepalive=(store.host_tensors(), buffers),
                direct=[pinned for *_, pinned in spans] if self._cuda else None,
                # New or recycled buffers: the compute stream may still read them.
                wait_for=compute if self._copy_stream is not None else None,
            )
        except BaseException:
            for buf in buffers.values():
                self._pool.give(buf)
            raise
        return Loaded(buffers, handle)

    def ready(self, i: int, loaded: Loaded) -> None:
        if loaded.handle is None:
            return
        if self._cuda:
            # Stream-ordered: compute waits for this layer's copies only.
            loaded.handle.wait_stream(self._compute_stream())
        else:
            loaded.handle.wait()
        # Its mapped pages were read into the device buffers: let them go.
        self._pages.let_go(i)

    def value(self, w: Weight, loaded: Loaded) -> torch.Tensor:
        return device_view(w, loaded.buffers[w.dtype])

    def release(self, i: int, loaded: Loaded) -> None:
        # Never recycle a buffer a copy may still write.
        _wait_quietly(loaded, i)
        self.drop_in_flight(loaded)

    def drop_in_flight(self, loaded: Loaded) -> None:
        """Give ``loaded``'s buffers back (in a forked child: nothing writes them here)."""
        for buf in loaded.buffers.values():
            self._pool.give(buf)

    def recycles(self, i: int) -> bool:
        return True

    @property
    def window_bytes(self) -> int:
        return 0

    def forget(self, i: int) -> None:
        pass

    def write_back(self, w: Weight, loaded: Loaded) -> None:
        """Copy a loaded weight's device value into its host store (never a mapped one)."""
        if w.store != MAPPED:
            w.host.copy_(device_view(w, loaded.buffers[w.dtype]))

    def close(self) -> None:
        import torch

        if self._cuda:
            torch.cuda.synchronize(self.device)
        self._pool.clear()
        if self._owns_copier:
            self.copier.close()


class ReadsAround:
    """What the two read-around paths share (:class:`ReadAround`, ``DeviceReadAround``):
    a reader whose buffers hold the streaming window, and a pause.

    While paused (``paused`` says why: replicas share the page cache) the
    streamed layers take the path underneath - through the mapping - and
    loads already read around finish as they are. Pausing drops the
    reader's free buffers (they would hold the window in anonymous memory
    beside the page cache that now holds it); resumed, it makes new ones.
    """

    reader: Any
    paused: str = ""

    def pause(self, why: str) -> None:
        """Read streamed layers through the mapping until :meth:`resume`."""
        self.paused = why
        self.reader.trim()

    def resume(self) -> None:
        self.paused = ""

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


class ReadAround(ReadsAround, InPlace):
    """In place, with the streamed layers read around the page cache (``O_DIRECT``).

    Under a cap too tight for the streaming window, reading a streamed layer
    through its mapping makes the kernel evict pages of the layer in use and
    read them again (issue 18: 2.3x the checkpoint per forward at +6 %).
    Here a streamed layer's file bytes are read into one of a few reused,
    page-aligned buffers (:class:`~mapoffload.pagecache.direct_read.DirectReader`,
    ``1 + depth`` of them: the plan's window, now anonymous instead of page
    cache) and its weights bind to views of the buffer; cached layers compute
    from their mapping as in :class:`InPlace`. A layer that finds no buffer
    free (more layers loaded than the window: ``load_all_layers``), or that
    runs with autograd recording, is read through its mapping instead.
    """

    def __init__(self, stores: list[LayerStore], pages: LayerPages, buffers: int) -> None:
        from ..pagecache.direct_read import DirectReader

        super().__init__(stores, pages)
        # Buffers of the largest layer's bytes, made so: what the plan charges (planned_bytes).
        self.reader = DirectReader(buffers=max(1, buffers), buffer_bytes=layer_buffer_bytes(stores, pages) or None)
        self._where: dict[int, list] = {}  # layer -> (weight, extent index, byte offset in its file)
        self._placed: dict[int, tuple[int, int]] = {}  # id(weight) -> (extent index, byte offset in its file)
        self._outstanding = 0  # direct loads started and not released: at most one per buffer
        self._written: set[str] = set()  # layers logged as written in place (written_in_place)

    def _layout(self, i: int) -> list:
        where = self._where.get(i)
        if where is None:
            where = file_places(self._stores[i], self._pages.extents(i))
            if not where:
                return []  # a weight whose file is not held open: read this layer through its mapping
            self._where[i] = where
            self._placed.update((id(w), (k, off)) for w, k, off in where)
        return where

    def start(self, i: int) -> Loaded:
        # Counted here, not by the reader: its count grows only once the worker
        # takes a buffer, and a read that waits for one the compute thread
        # would release only after waiting for that read never ends.
        import torch

        # Under autograd the layer computes from its mapping (exact gradients:
        # a buffer reused by the next layer cannot be saved for a backward).
        if (self.paused or not self._pages.streams(i) or torch.is_grad_enabled()
                or self._outstanding >= self.reader.buffers or not self._layout(i)
                or written_in_place(self._stores[i], self._written)):
            return super().start(i)
        extents = [(e.file, e.first, e.end) for e in self._pages.extents(i)]
        loaded = Loaded({"direct": None}, _DirectRead(self.reader.read_extents_async(extents)))
        self._outstanding += 1
        return loaded

    def ready(self, i: int, loaded: Loaded) -> None:
        if "direct" not in loaded.buffers:
            return super().ready(i, loaded)
        self._pages.check(i)
        loaded.buffers["direct"] = loaded.handle.wait()

    def value(self, w: Weight, loaded: Loaded) -> torch.Tensor:
        buf = loaded.buffers.get("direct")
        placed = self._placed.get(id(w))
        if buf is None or w.store != MAPPED or placed is None:
            return w.host
        k, offset = placed
        pos = buf.offsets[k] + offset - buf.extents[k][1]  # in the buffer, from its first byte
        base = buf.data.view(w.dtype)  # a view itself: as_strided counts from its storage's start
        return base.as_strided(w.shape, w.stride, base.storage_offset() + pos // w.dtype.itemsize)

    def release(self, i: int, loaded: Loaded) -> None:
        if "direct" not in loaded.buffers:
            return super().release(i, loaded)
        _wait_quietly(loaded, i)
        self._outstanding -= 1
        buf = loaded.buffers.pop("direct", None)
        if buf is None and isinstance(loaded.handle, _DirectRead):
            buf = loaded.handle.result_quietly()
        if buf is not None:
            buf.release()
        # The read left the page cache alone, but others may have filled it
        # with this layer's bytes (the weights outside the layers fault with
        # read-around; the mapping path before a switch): let those go too.
        self._pages.let_go(i)

    def reuses(self, loaded: Loaded) -> bool:
        return "direct" in loaded.buffers

    def drop_in_flight(self, loaded: Loaded) -> None:
        if "direct" in loaded.buffers:
            self._outstanding -= 1  # the parent's read: its buffer is the parent's worker's

    def forget(self, i: int) -> None:
        for w, _, _ in self._where.pop(i, ()):
            self._placed.pop(id(w), None)

    def close(self) -> None:
        self.reader.close()


class _DirectRead:
    """A layer's bytes being read around the page cache (a Future of a DirectBuffer)."""

    __slots__ = ("future",)

    def __init__(self, future) -> None:
        self.future = future

    def wait(self):
        return self.future.result()

    def result_quietly(self):
        try:
            return self.future.result()
        except BaseException:
            return None


def layer_buffer_bytes(stores: list[LayerStore], pages: LayerPages) -> int:
    """Bytes of the read-around buffer the largest layer's mapped weights take (0: none mapped)."""
    from ..pagecache.direct_read import buffer_capacity

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
