"""A layer made ready to compute: the :class:`Load` record, and the in-place target.

A load *target* is where a layer computes: :class:`InPlace` (``device="cpu"``: from its host stores or
a read-around buffer, nothing copied) or :class:`~mapoffload.offload.device_copies.DeviceCopies` (CUDA,
or the CPU twin: device buffers the native copier fills). Each holds a *source*
(:mod:`~mapoffload.pagecache.read_source`: the mapping, or reads around the page cache) and answers one
interface, which the sequencer drives:

- ``start(i)`` begins loading layer ``i`` (a :class:`Load`); ``ready(i, load)`` waits until it can
  compute (raises on a failed read); ``value(w, load)`` is the tensor weight ``w`` computes with;
  ``release(i, load)`` gives its buffers back; ``drop_in_flight(load)`` forgets it in a forked child;
- ``recycles(i)`` / ``reuses(load)``: whether autograd must not keep what it computes from;
- ``source`` (swapped by the reads policy), ``window_bytes`` / ``planned_bytes`` (its read-around
  buffers, for the page-cache plan), ``bytes`` / ``peak_bytes`` (device buffers), ``forget(i)``,
  ``close()``.

The page cache is :class:`~mapoffload.pagecache.layer_pages.LayerPages`'.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from .._log import logger
from ..pagecache.layer_pages import LayerPages
from ..pagecache.read_source import MAPPING, Source
from .stores import LayerStore, Weight

if TYPE_CHECKING:
    import torch

__all__ = ["InPlace", "Load", "Target", "wait_quietly"]


class Load:
    """One layer being loaded or loaded: its device buffers per dtype, the work in flight.

    ``around`` is the layer's read around the page cache (None: read through its mapping), kept until
    the layer is released: in place a :class:`AroundRead` (its ``buffer`` what the layer computes
    from), on the device path the read-then-copy job.
    """

    __slots__ = ("around", "buffers", "handle", "ready")

    def __init__(self, buffers: dict, handle: Any, around: Any = None) -> None:
        self.buffers = buffers
        self.handle = handle  # a CopyHandle, a page read or a read around (``wait()``), or None
        self.ready = False  # bound: its parameters hold the real weights
        self.around = around


class _PagesRead:
    """A layer's pages being read in by the page worker."""

    __slots__ = ("future",)

    def __init__(self, future) -> None:
        self.future = future

    def wait(self) -> None:
        self.future.result()


class AroundRead:
    """A layer's bytes being read around the page cache (a Future of a UncachedBuffer); ``buffer`` once
    waited for."""

    __slots__ = ("buffer", "future")

    def __init__(self, future) -> None:
        self.future = future
        self.buffer = None

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
    pin_device: int | None = None  # the CUDA device read-around buffers are page-locked for

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
        """Anonymous memory holding the streaming window instead of the page cache (read-around buffers)."""
        return self.source.window_bytes

    @property
    def planned_bytes(self) -> int:
        """The read-around buffers as the page-cache plan charges them (0: through the mapping)."""
        return self.source.planned_bytes

    @property
    def host_bytes(self) -> int:
        """Host memory the target's own machinery holds now, read-around buffers apart (0 in place)."""
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

    With a read-around source a streamed layer's file bytes are read into one of the source's reused
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
            read = AroundRead(self.source.read(i))
            return Load({}, read, around=read)
        read = self._pages.read_in(i)
        return Load({}, None if read is None else _PagesRead(read))

    def ready(self, i: int, load: Load) -> None:
        self._pages.check(i)
        if load.handle is not None:
            load.handle.wait()

    def value(self, w: Weight, load: Load) -> torch.Tensor:
        if load.around is not None and load.around.buffer is not None:
            view = self.source.view(w, load.around.buffer)
            if view is not None:
                return view
        return w.host

    def release(self, i: int, load: Load) -> None:
        wait_quietly(load, i)
        if load.around is not None:
            self.source.done()
            buf = load.around.result_quietly()
            if buf is not None:
                buf.release()
        # Computed from its mapping: let its pages go before they push a cached layer out. Read around,
        # the read left the page cache alone, but others may have filled it with this layer's bytes
        # (the weights outside the layers fault with read-around; the mapping path before a switch).
        self._pages.let_go(i)

    def drop_in_flight(self, load: Load) -> None:
        """In a forked child: forget a load the parent had in flight."""
        if load.around is not None:
            self.source.done()  # the parent's read: its buffer is the parent's worker's

    def recycles(self, i: int) -> bool:
        """Whether layer ``i`` computes from memory reused after it (autograd must not keep it)."""
        return False

    def reuses(self, load: Load) -> bool:
        """Whether this load computes from a buffer the next loads reuse (read again for autograd)."""
        return load.around is not None

    def close(self) -> None:
        self.source.close()
