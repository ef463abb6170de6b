"""The parts one :class:`~mapoffload.LayerwiseOffloadManager` is a facade over, and their lifetime.

For one stack of layers: its pages (``pagecache.layer_pages``: spans, files, page reads and let-gos), its load
path (``loads``: in place or device copies), the sequencer (``sequencer``: loaded, kept, what the weights'
holders hold), the mapped weights outside the layers (``runtime.OutsideWeights``), its
page-cache member (``pagecache.member``: what the process's coordinator plans, and how streamed
layers are read), and its runtime (``runtime``: the layer turn, the hooks torch
calls and what they do). :meth:`Parts.build` makes
them in order and, when one fails, closes what was made; :meth:`Parts.close` and
:meth:`Parts.after_fork_in_child` are the stack's end and a forked child's start.

What the manager's facade does not say - a layer's bytes, whether it is loaded, a weight's store, the
device buffers held, a share of the page cache given now - tools and tests ask ``manager.parts``.

The load target is chosen in one place, :func:`load_target`: in place (``device="cpu"`` without the CPU
twin), else device copies (CUDA, or the CPU twin's separate CPU buffers).
"""

from __future__ import annotations

import functools
import os
import weakref
from typing import TYPE_CHECKING, Any

from .._log import logger
from ..pagecache.coordinator import coordinator
from ..pagecache.layer_pages import LayerPages
from ..pagecache.member import StackMember
from .device_copies import DeviceCopies
from .loads import InPlace, UncachedSource, Target, layer_buffer_bytes
from .runtime import OutsideWeights, StackRuntime
from .sequencer import Sequencer

if TYPE_CHECKING:
    from ..copier import Copier
    from ..options import OffloadOptions
    from ..pagecache.residency import ResidencyPlan
    from .stores import LayerStore, Weight

__all__ = ["Parts", "Target", "layer_index", "load_target"]

# Live stacks, for fork(): copies a parent had in flight never complete in
# the child (its copier's workers stayed in the parent), so the child forgets
# them and loads those layers afresh instead of failing a forward per layer.
_LIVE: weakref.WeakSet[Parts] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for parts in list(_LIVE):
        parts.after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _uncached_source(stores: list[LayerStore], pages: LayerPages, buffers: int,
                     pin_device: int | None) -> UncachedSource:
    """The stack's uncached source, as its :class:`~mapoffload.pagecache.member.StackMember` asks for one."""
    return UncachedSource(stores, pages, buffers, pin_device=pin_device)


class Parts:
    """One stack's parts (see the module); made by :meth:`build`."""

    pages: LayerPages
    sequencer: Sequencer
    outside: OutsideWeights
    member: StackMember
    runtime: StackRuntime
    stores: list[LayerStore]  # one a layer
    by_name: dict[str, tuple[LayerStore, Weight]]  # every managed weight's names

    @classmethod
    def build(cls, o: OffloadOptions, *, model: Any, layers: list, stores: list[LayerStore], name: str,
              copier: Copier | None, owns_copier: bool, owner: object) -> Parts:
        """Make every part; registers the member with the process's coordinator (which plans it).

        Raises whatever a part raised, with nothing half-made left behind (the plan, threads, files, an
        owned copier).
        """
        from . import plan as _plan

        self = cls()
        self.stores = stores
        self.by_name = {n: (s, w) for s in stores for w in s.weights for n in w.names}
        self.pages = self.outside = self.member = self.sequencer = None  # type: ignore[assignment]
        loads = None
        try:
            self.pages = LayerPages(stores, o.kernel_caps)  # opens the files behind the mapped weights now
            loads = load_target(o, stores, self.pages, copier, owns_copier=owns_copier)
            self.sequencer = Sequencer(stores, loads, model=model, in_place=o.in_place,
                                       resident_layers=o.resident_layers, pages=self.pages, device=o.device)
            # The mapped weights outside the layers: checked before each forward, streamed where the plan says.
            self.outside = OutsideWeights(model, layers, self.pages.files, self.pages.worker)
            # The page-cache plan is the process's (every stack under one budget): this stack's
            # part of it, and how its streamed layers are read, is its member.
            host = coordinator()
            self.member = StackMember(name=name, model=model, layers=layers, pages=self.pages, loads=loads,
                                      prefetch_layers=o.prefetch_layers, given=o.page_cache_bytes,
                                      always_read=_plan.always_read_tensors, owner=owner,
                                      parts=self.pages.parts.largest if o.in_place else None,
                                      reads=o.reads, cuda=o.cuda,
                                      uncached_source=functools.partial(_uncached_source, stores, self.pages),
                                      layer_buffer_bytes=functools.partial(layer_buffer_bytes, stores, self.pages),
                                      host=host)
            self.runtime = StackRuntime(self.sequencer, self.member, self.outside, in_place=o.in_place,
                                        owner=weakref.ref(owner))
            host.join(self.member)  # plans the page cache for every manager, this one included
            if o.reads == "uncached":
                self.member.read_uncached("reads='uncached'")
                host.place_buffers()  # its buffers are charged before they are made
        except BaseException:
            self.abandon(loads, copier if owns_copier else None)
            raise
        return self

    @property
    def loads(self) -> Target:
        """The load path now (the sequencer's)."""
        return self.sequencer.loads

    # -- for tools and tests (the facade says none of it) ----------------------------------------
    def layer_bytes(self, i: int) -> int:
        """Bytes one load of layer ``i`` moves (negative from the end)."""
        return self.stores[layer_index(i, self.stores)].nbytes

    def is_loaded(self, i: int) -> bool:
        """Whether layer ``i`` is loaded now (on the device, or in place: ready to compute)."""
        return self.sequencer.is_loaded(layer_index(i, self.stores))

    def store_of(self, name: str) -> str:
        """The host store of a managed weight: ``mapped``, ``consolidated`` or ``strided`` (a weight the user
        replaced is adopted first)."""
        self.adopt_all()
        return self.weight(name)[1].store

    def weight(self, name: str) -> tuple[LayerStore, Weight]:
        """The store and the weight behind ``name``, or a ``KeyError`` naming it."""
        try:
            return self.by_name[name]
        except KeyError:
            raise KeyError(f"{name} is not a weight managed by this LayerwiseOffloadManager") from None

    def adopt_all(self) -> None:
        """A weight the user replaced in the model is the weight from now on (refused ones logged), under
        the layer turn: no forward of another thread is half-way through a layer meanwhile."""
        self.runtime.turn.enter()
        try:
            self.sequencer.adopt_all(strict=False)
        finally:
            self.runtime.turn.leave()

    @property
    def device_bytes(self) -> int:
        """Bytes of device buffers held now (in use or pooled for reuse)."""
        return self.loads.bytes

    def replan(self, page_cache_bytes: int | None = None) -> ResidencyPlan | None:
        """Plan again which layers stay cached and which stream; returns this stack's plan.

        ``page_cache_bytes`` gives these layers a share of their own from now on (the other stacks plan
        around it); None measures: the process's coordinator plans every measured stack together against
        one budget, and follows the cgroup's cap from then on.
        """
        from .._checks import check_count

        check_count("page_cache_bytes", page_cache_bytes, none=True)
        self.member.given = page_cache_bytes
        coordinator().replan()
        return self.member.residency

    def abandon(self, loads: Target | None = None, owned_copier: Copier | None = None) -> None:
        """A start that failed: leave the coordinator, close what was opened."""
        loads = self.sequencer.loads if self.sequencer is not None else loads
        try:
            if self.member is not None:
                coordinator().leave(self.member)
        except Exception:
            logger.debug("leaving the page-cache plan after a failed start", exc_info=True)
        if loads is not None:
            loads.close()
        elif owned_copier is not None:
            owned_copier.close()
        if self.pages is not None:
            self.pages.close()
        if self.outside is not None:
            self.outside.close()

    def close(self) -> None:
        """Leave the page-cache plan, then close the load path, the pages and the outside weights' advice.

        The model was given back before (released, holders disengaged).
        """
        try:
            coordinator().leave(self.member)  # the other stacks share what these layers leave
        finally:  # a plan for the others cut short (Ctrl-C) leaves nothing of this one running
            self.loads.close()
            self.pages.close()
            self.outside.close()  # the lookup tables' advice

    def give_back(self) -> None:
        """Release every layer and give the model its real parameters back (host data); nothing once given
        back. What the user replaced is adopted first (or, refused, left as they made it): the model is given
        back with the weights that last computed, or theirs - never the old ones silently."""
        if self.sequencer.engaged:
            self.sequencer.adopt_all(strict=False)
            self.sequencer.release_all(strict=False)
            self.sequencer.disengage()

    def forget_at_fork(self) -> None:
        """From now on, a forked child runs :meth:`after_fork_in_child` (while these parts live)."""
        _LIVE.add(self)

    def after_fork_in_child(self) -> None:
        """In a forked child: drop layers whose copy was in flight at the fork.

        Nothing writes their buffers here (the copies ran in the parent), so
        they go back to the pool; their holders hold placeholders already. The
        layer turn may have been held by a parent thread that does not exist
        here: it starts free, with a fresh lock.
        """
        self.runtime.turn.after_fork_in_child()
        self.pages.after_fork_in_child()
        self.sequencer.forget_in_flight()


def layer_index(i: int, layers: list) -> int:
    """Layer ``i`` of ``layers`` (negative from the end), or an ``IndexError`` naming how many there are."""
    if not -len(layers) <= i < len(layers):
        raise IndexError(f"layer {i} out of range (model has {len(layers)} managed layers)")
    return i % len(layers)


def load_target(o: OffloadOptions, stores: list[LayerStore], pages: LayerPages, copier: Copier | None, *,
                owns_copier: bool) -> Target:
    """The target for options ``o``: in place, or device buffers holding the most layers loaded at once
    (resident, the one computing, the prefetched ones) copied by ``copier``."""
    if o.in_place:
        return InPlace(stores, pages)
    assert copier is not None, "a device target needs a copier"
    return DeviceCopies(stores, pages, o.device, copier, owns_copier=owns_copier,
                        side_stream=copier.mode != "direct",  # direct: the seed's path, on the compute stream
                        buffer_layers=o.resident_layers + 1 + o.prefetch_layers)
