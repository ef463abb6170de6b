"""The sequencer: which of a stack's layers are loaded, which are kept, and what a step loads.

It holds the stack's loads (each a :class:`~mapoffload.offload.loads.Load`, in flight or ready), the
layers kept by ``load_all_layers`` and the streaming window a step reads ahead, and drives the load
path (``loads``: in place or device copies, each read through the mapping or around the page cache)
and the parameter slots (:class:`~mapoffload.offload.slots.Slots`) through their interfaces. No
hooks (``turn.py``), no policy (``steps.py``: autograd, the reads policy, once-per-forward checks).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .stores import MAPPED, LayerStore

if TYPE_CHECKING:
    import torch

    from ..pagecache.residency import ResidencyPlan
    from ..pagecache.layer_pages import LayerPages
    from .loads import Load, Target
    from .slots import Slots

__all__ = ["Sequencer"]


class Sequencer:
    """Load, keep and release a stack's layers.

    Parameters
    ----------
    stores
        One :class:`~mapoffload.offload.stores.LayerStore` per layer.
    loads
        The load path (``start``/``ready``/``value``/``release``/``drop_in_flight``).
    slots
        The stack's parameter slots: a ready layer's weights are bound to what they compute with.
    prefetch_layers
        How many following layers a step reads ahead (the streaming window, see :meth:`window`).
    resident_layers
        The first N layers are never released by a step once loaded.
    pages, device
        The stack's pages and where its layers compute: what a weight the user replaced is adopted
        with (:meth:`adopt_edits`).
    """

    def __init__(self, stores: list[LayerStore], loads: Target, slots: Slots, *, prefetch_layers: int,
                 resident_layers: int, pages: LayerPages, device: torch.device) -> None:
        self.stores = stores
        self.loads = loads
        self.slots = slots
        self.pages = pages
        self.device = device
        self.prefetch_layers = prefetch_layers
        self.resident_layers = resident_layers
        self.loaded: dict[int, Load] = {}  # layer -> its load, in flight or ready
        self.kept: set[int] = set()  # loaded by load_all: kept until released explicitly

    # -- the user's edits ------------------------------------------------------------------
    def adopt_edits(self, i: int, *, strict: bool = True) -> None:
        """Weights of layer ``i`` the user replaced since they were bound become the weights that compute,
        or are refused (:func:`~mapoffload.offload.host_edits.adopt_edits`): run before anything reads
        the layer's host stores or binds over its slots."""
        edits = self.slots.edits(self.stores[i])
        load = self.loaded.get(i)
        if edits and load is not None and not load.ready:
            self.ensure(i)  # in flight: it lands, is let go (the edit adopted then) and is loaded afresh
            return
        if edits:
            from .host_edits import adopt_edits

            adopt_edits(self, self.pages, self.stores[i], edits, device=self.device, strict=strict)

    def adopt_all(self, *, strict: bool = True) -> None:
        """:meth:`adopt_edits` for every layer (before the stores are read: a query, the model given back);
        nothing once closed (the model is the user's)."""
        if self.slots.closed:
            return
        for i in range(len(self.stores)):
            self.adopt_edits(i, strict=strict)

    def engage(self) -> None:
        """Engage the slots (idempotent; raises once closed), adopting what the user replaced while the
        model was whole."""
        if not self.slots.engaged and not self.slots.closed:
            self.adopt_all()
        self.slots.engage()

    # -- one layer -------------------------------------------------------------------------
    def prefetch(self, i: int) -> None:
        """Start loading layer ``i`` (no-op when loaded or in flight); engages the slots."""
        self.engage()
        if i not in self.loaded:
            self.adopt_edits(i)
            self.loaded[i] = self.loads.start(i)

    def ensure(self, i: int) -> None:
        """Layer ``i`` loaded and its weights bound (started here when it was not)."""
        if i not in self.loaded:
            self.prefetch(i)
        load = self.loaded[i]
        if load.ready:
            self.adopt_edits(i)  # a layer kept loaded (resident, load_all) can be edited between forwards
            return
        try:
            self.loads.ready(i, load)
        except BaseException:
            # The layer is released (its buffers back once the failed load
            # stopped): the next attempt starts afresh, e.g. after the file
            # behind a mapping is whole again.
            self.release(i)
            raise
        if self.slots.edits(self.stores[i]):
            # Replaced while it loaded (a prefetch, another layer's hook): what it read is the old
            # weight's. The edit is adopted as the layer is let go, and the layer loaded afresh.
            self.release(i)
            self.ensure(i)
            return
        for w in self.stores[i].weights:
            self.slots.bind(w, self.loads.value(w, load))
        load.ready = True
        load.handle = None

    def release(self, i: int, *, strict: bool = True) -> None:
        """Drop layer ``i``'s load (its slots bound as released) and un-keep it."""
        self.kept.discard(i)
        load = self.loaded.pop(i, None)
        if load is None:
            return
        try:
            if self.slots.engaged:  # not loaded now: an edit is written into the host store, not the load
                self.adopt_edits(i, strict=strict)
        finally:
            if self.slots.engaged:
                refused = {id(w) for w, _ in self.slots.edits(self.stores[i])}  # left as the user made them
                for w in self.stores[i].weights:
                    if id(w) not in refused:
                        self.slots.bind(w, None)
            self.loads.release(i, load)

    def is_loaded(self, i: int) -> bool:
        """Layer ``i`` is loaded and bound (not merely in flight)."""
        return i in self.loaded and self.loaded[i].ready

    def releasable(self, i: int) -> bool:
        """Whether a step may release layer ``i`` (not resident, not kept)."""
        return i >= self.resident_layers and i not in self.kept

    # -- every layer -----------------------------------------------------------------------
    def release_all(self, *, strict: bool = True) -> None:
        for i in list(self.loaded):
            self.release(i, strict=strict)

    def load_all(self) -> None:
        """Load every layer and keep it until released explicitly."""
        n = len(self.stores)
        for i in range(n):
            self.prefetch(i)
        for i in range(n):
            self.ensure(i)
        self.kept.update(range(n))

    def forget_in_flight(self) -> None:
        """In a forked child: drop the loads that were in flight at the fork (nothing completes them here)."""
        for i, load in list(self.loaded.items()):
            if not load.ready:
                del self.loaded[i]
                self.kept.discard(i)
                self.loads.drop_in_flight(load)

    # -- a step ----------------------------------------------------------------------------
    def window(self, i: int, plan: ResidencyPlan) -> list[int]:
        """The layers a step on layer ``i`` reads ahead: the next ``prefetch_layers``, a streamed one only
        as deep as the plan keeps room for (its depth) - any deeper, its pages would evict the layer in
        use or a cached one."""
        end = min(len(self.stores), i + 1 + self.prefetch_layers)
        return [j for j in range(i + 1, end)
                if j - i <= plan.depth or not plan.is_streamed(j) or not self.stores[j].bytes_in(MAPPED)]

    def enter(self, i: int, window: list[int]) -> None:
        """Layer ``i`` is about to run: release stale prefetches (skipped or reordered layers) outside
        ``window``, wait for ``i``, start ``window``."""
        for j in list(self.loaded):
            if j != i and j not in window and self.releasable(j):
                self.release(j)
        self.ensure(i)
        for j in window:
            self.prefetch(j)

    def exit(self, i: int) -> None:
        """Layer ``i`` ran: release it unless it stays (resident or kept)."""
        if self.releasable(i):
            self.release(i)
