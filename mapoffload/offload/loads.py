"""A layer made ready to compute: the :class:`Load` record, the in-place target, and the uncached source.

A load *target* is where a layer computes: :class:`InPlace` (``device="cpu"``: from its host stores or
an uncached buffer, nothing copied) or :class:`~mapoffload.offload.device_copies.DeviceCopies` (CUDA,
or the CPU twin: device buffers the native copier fills). Each holds a *source*
(:mod:`~mapoffload.pagecache.read_source`: the mapping, or reads uncached) and answers one
interface, which the sequencer drives:

- ``start(i)`` begins loading layer ``i`` (a :class:`Load`); ``ready(i, load)`` waits until it can
  compute (raises on a failed read); ``value(w, load)`` is the tensor weight ``w`` computes with;
  ``release(i, load)`` gives its buffers back; ``drop_in_flight(load)`` forgets it in a forked child;
- ``recycles(i)`` / ``reuses(load)``: whether autograd must not keep what it computes from;
- ``source`` (swapped by the reads policy), ``window_bytes`` / ``planned_bytes`` (its uncached
  buffers, for the page-cache plan), ``bytes`` / ``peak_bytes`` (device buffers), ``forget(i)``,
  ``close()``.

Both read the stack's page cache through :class:`~mapoffload.pagecache.layer_pages.LayerPages`.

A target holds one *source* (:class:`~mapoffload.pagecache.read_source.Source`) and asks it, at each
load, whether it takes the layer (``takes``):

- :data:`~mapoffload.pagecache.read_source.MAPPING` takes none: every layer is read through its
  mapping (read in, or copied from it, and let go after use by the page-cache side).
- :class:`UncachedSource` takes a streamed layer when a buffer is free: its file bytes are read with
  ``O_DIRECT`` (:class:`~mapoffload.pagecache.uncached_read.UncachedReader`) into one of ``1 + depth``
  reused, page-aligned buffers (the plan's streaming window, in anonymous memory instead of the page
  cache; page-locked on CUDA), and the target computes from that buffer (in place) or copies from it
  (the device path). It declines a layer whose weights were written in place (its pages are no longer
  the file's: :func:`written_in_place`) or whose files are not held open, and every layer while paused.

Under a cap too tight for the streaming window, reading a streamed layer through its mapping makes the
kernel evict pages of the layer in use and read them again (issue 18); reading it uncached
reads it once. ``pagecache.member.StackMember`` (its reads policy) decides which source a stack's target holds.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from .._log import logger
from ..pagecache.file_places import MapsView
from ..pagecache.layer_pages import LayerPages
from ..pagecache.read_source import MAPPING, PauseReason, Source
from .stores import MAPPED, LayerStore, Weight

if TYPE_CHECKING:
    from concurrent.futures import Future

    import torch


__all__ = ["InPlace", "Load", "UncachedSource", "Target", "file_places", "layer_buffer_bytes", "wait_quietly", "written_in_place"]


class Load:
    """One layer being loaded or loaded: its device buffers per dtype, the work in flight.

    ``uncached`` is the layer's read uncached (None: read through its mapping), kept until
    the layer is released: in place a :class:`UncachedRead` (its ``buffer`` what the layer computes
    from), on the device path the read-then-copy job.
    """

    __slots__ = ("buffers", "uncached", "handle", "ready")

    def __init__(self, buffers: dict, handle: Any, uncached: Any = None) -> None:
        self.buffers = buffers
        self.handle = handle  # a CopyHandle, a page read or a read uncached (``wait()``), or None
        self.ready = False  # bound: its parameters hold the real weights
        self.uncached = uncached


class _PagesRead:
    """A layer's pages being read in by the page worker."""

    __slots__ = ("future",)

    def __init__(self, future) -> None:
        self.future = future

    def wait(self) -> None:
        self.future.result()


class UncachedRead:
    """A layer's bytes being read uncached (a Future of an UncachedBuffer); ``buffer`` once
    waited for."""

    __slots__ = ("buffer", "future", "stale")

    def __init__(self, future) -> None:
        self.future = future
        self.buffer = None
        self.stale = False  # the layer was written in place since: its buffer holds the file's bytes, not its weights

    def wait(self):
        self.buffer = self.future.result()
        return self.buffer

    def result_quietly(self):
        try:
            return self.future.result()
        except BaseException:
            return None


def wait_quietly(load: Load, i: int) -> None:
    """Wait for ``load``'s work in flight; a failure is the load's own business (reported by whoever
    waited for it)."""
    if load.handle is not None:
        try:
            load.handle.wait()
        except Exception:
            logger.debug("released layer %d after a failed load", i, exc_info=True)


class Target(ABC):
    """A load target: where a layer computes (:class:`InPlace`, ``device_copies.DeviceCopies``; made by
    ``targets.load_target``). Both hold a source (:data:`~mapoffload.pagecache.read_source.MAPPING`
    until the reads policy gives them another) and answer the page-cache plan what it reads of them.

    A load is ``start(i)`` (a :class:`Load`, maybe in flight), ``ready(i, load)`` (waited, bound),
    ``value(w, load)`` (the tensor weight ``w`` computes from), ``release(i, load)``;
    ``drop_in_flight`` forgets a load a fork cut short; ``recycles``/``reuses`` say whether a
    layer's load is kept between uses.
    """

    source: Source = MAPPING
    copies: bool  # True: it copies into device buffers (write_back then keeps them current)
    pin_device: int | None = None  # the CUDA device uncached buffers are page-locked for

    @property
    @abstractmethod
    def bytes(self) -> int:
        """Bytes of the layers' buffers now (0 in place)."""

    @property
    @abstractmethod
    def peak_bytes(self) -> int:
        """The most :attr:`bytes` reached."""

    @abstractmethod
    def start(self, i: int) -> Load: ...

    @abstractmethod
    def ready(self, i: int, load: Load) -> None: ...

    @abstractmethod
    def value(self, w: Weight, load: Load) -> torch.Tensor: ...

    @abstractmethod
    def release(self, i: int, load: Load) -> None: ...

    @abstractmethod
    def drop_in_flight(self, load: Load) -> None: ...

    @abstractmethod
    def recycles(self, i: int) -> bool: ...

    @abstractmethod
    def reuses(self, load: Load) -> bool: ...

    @abstractmethod
    def close(self) -> None: ...

    def write_back(self, w: Weight, load: Load) -> None:
        """A host weight changed while its layer is loaded: bring the loaded copy up to date (in place
        the layer computes from the host weight itself: nothing to do)."""

    @property
    def window_bytes(self) -> int:
        """Anonymous memory holding the streaming window instead of the page cache (uncached buffers)."""
        return self.source.window_bytes

    @property
    def planned_bytes(self) -> int:
        """The uncached buffers as the page-cache plan charges them (0: through the mapping)."""
        return self.source.planned_bytes

    @property
    def host_bytes(self) -> int:
        """Host memory the target's own machinery holds now, uncached buffers apart (0 in place)."""
        return 0

    @property
    def planned_host_bytes(self) -> int:
        """The most of it the page-cache plan charges (0 in place)."""
        return 0

    def forget(self, i: int) -> None:
        """Layer ``i``'s stores changed (a mapped weight became owned)."""
        self.source.forget(i)


class InPlace(Target):
    """Compute from the host stores (``device="cpu"``): loading reads mapped pages in.

    With an uncached source a streamed layer's file bytes are read into one of the source's reused
    buffers and its weights bind to views of the buffer; cached layers compute from their mapping. A
    layer that finds no buffer free (more layers loaded than the window: ``load_all_layers``), or that
    runs with autograd recording (a buffer reused by the next layer cannot be saved for a backward:
    exact gradients), is read through its mapping instead.
    """

    copies = False

    def __init__(self, stores: list[LayerStore], pages: LayerPages) -> None:
        self._stores, self._pages = stores, pages

    @property
    def bytes(self) -> int:
        return 0

    @property
    def peak_bytes(self) -> int:
        return 0

    def start(self, i: int) -> Load:
        import torch

        if not torch.is_grad_enabled() and self.source.takes(i):
            read = UncachedRead(self.source.read(i))
            return Load({}, read, uncached=read)
        read = self._pages.read_in(i)
        return Load({}, None if read is None else _PagesRead(read))

    def ready(self, i: int, load: Load) -> None:
        self._pages.check(i)
        if load.handle is not None:
            load.handle.wait()
        if load.uncached is not None and load.uncached.buffer is not None and self.source.written(i):
            # Written in place since its read began (a write through ``.data`` moves no version counter):
            # the file's bytes are not its weights; it computes from its host store (the buffer goes at release).
            load.uncached.stale = True

    def value(self, w: Weight, load: Load) -> torch.Tensor:
        if load.uncached is not None and load.uncached.buffer is not None and not load.uncached.stale:
            view = self.source.view(w, load.uncached.buffer)
            if view is not None:
                return view
        return w.host

    def release(self, i: int, load: Load) -> None:
        wait_quietly(load, i)
        if load.uncached is not None:
            self.source.done()
            buf = load.uncached.result_quietly()
            if buf is not None:
                buf.release()
        # Computed from its mapping: let its pages go before they push a cached layer out. Read uncached,
        # the read left the page cache alone, but others may have filled it with this layer's bytes
        # (the weights outside the layers fault with readahead; the mapping path before a switch).
        self._pages.let_go(i)

    def drop_in_flight(self, load: Load) -> None:
        """In a forked child: forget a load the parent had in flight."""
        if load.uncached is not None:
            self.source.done()  # the parent's read: its buffer is the parent's worker's

    def recycles(self, i: int) -> bool:
        """Whether layer ``i`` computes from memory reused after it (autograd must not keep it)."""
        return False

    def reuses(self, load: Load) -> bool:
        """Whether this load computes from a buffer the next loads reuse (read again for autograd)."""
        return load.uncached is not None

    def close(self) -> None:
        self.source.close()


class UncachedSource:
    """Streamed layers read uncached (``O_DIRECT``) into ``buffers`` reused buffers.

    While paused (``paused``, a :class:`~mapoffload.pagecache.read_source.PauseReason`: replicas share
    the page cache, the plan's room no longer holds the buffers) it takes no layer - they are read through the mapping - and loads already read uncached
    finish as they are. Pausing drops the reader's free buffers (they would hold the window in anonymous
    memory beside the page cache that now holds it); resumed, it makes new ones.

    Parameters
    ----------
    stores, pages
        The stack's layer stores and its pages (files held open, extents, the plan).
    buffers
        Uncached buffers (the plan's window, ``1 + depth``), each of the largest layer's bytes.
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

    reads_uncached = True

    @property
    def mode(self) -> str:
        """``"uncached"`` while it takes layers, ``"mapping"`` while paused."""
        return "mapping" if self.paused else "uncached"

    @property
    def buffers(self) -> int:
        """The uncached buffers the reader may hold at once (the plan's window)."""
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
        """Whether layer ``i`` is read uncached now (streamed, a buffer free, its files
        held open, its pages the file's)."""
        return not (self.paused or not self._pages.streams(i) or getattr(self._pages, "in_parts", False)
                    or self.outstanding >= self.reader.buffers
                    or not self.places(i) or written_in_place(self._stores[i], self._written))

    def written(self, i: int) -> bool:
        """Whether layer ``i``'s mapped pages were written in place (:func:`written_in_place`)."""
        return written_in_place(self._stores[i], self._written)

    def read(self, i: int) -> Future:
        """Start reading layer ``i``'s file bytes into a buffer (a Future of an ``UncachedBuffer``); give it
        back with :meth:`done`."""
        extents = [(e.file, e.first, e.end) for e in self._pages.extents(i)]
        future = self.reader.read_extents_async(extents)
        self.outstanding += 1
        return future

    def done(self) -> None:
        """A read of :meth:`read` is finished with (its buffer released, or the read forgotten)."""
        self.outstanding -= 1

    def view(self, w: Weight, buf: Any) -> torch.Tensor | None:
        """Weight ``w``'s tensor in ``buf`` (its layer's buffer); None when it is not read uncached."""
        placed = self._placed.get(id(w))
        if w.store != MAPPED or placed is None:
            return None
        k, offset = placed
        pos = buf.offsets[k] + offset - buf.extents[k][1]  # in the buffer, from its first byte
        if pos % w.dtype.itemsize:
            return None  # not at a multiple of its element size (a file packed unaligned): from its mapping
        base = buf.data.view(w.dtype)  # a view itself: as_strided counts from its storage's start
        return base.as_strided(w.shape, w.stride, base.storage_offset() + pos // w.dtype.itemsize)

    def forget(self, i: int) -> None:
        """Layer ``i``'s stores changed (a mapped weight became owned)."""
        for w, _, _ in self._where.pop(i, ()):
            self._placed.pop(id(w), None)

    def close(self) -> None:
        self.reader.close()


def layer_buffer_bytes(stores: list[LayerStore], pages: LayerPages) -> int:
    """Bytes of the uncached buffer the largest layer's mapped weights take (0: none mapped)."""
    from ..pagecache.uncached_read import buffer_capacity

    return max((buffer_capacity([(e.first, e.end) for e in pages.extents(i)])
                for i, s in enumerate(stores) if s.bytes_in(MAPPED)), default=0)


def written_in_place(store: LayerStore, said: set[str]) -> bool:
    """True when a mapped weight of the layer has pages the process wrote in place
    (copy-on-write: a LoRA merged with ``+=``, an edit before offloading).

    Those bytes are no longer the file's, so reading the file uncached
    (``O_DIRECT``) would compute with the file's values: such a layer is
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
