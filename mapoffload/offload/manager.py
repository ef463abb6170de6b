"""LayerwiseOffloadManager: stream a model's layers to the device one at a time - a facade.

Each layer's weights are held on the host in the store the budget allows (``mapped`` /
``consolidated`` pinned or pageable / ``strided``: ``plan.py``, ``stores.py``), and made ready to
compute by a load target - in place from the host stores (``device="cpu"``: nothing to copy to, and a
second copy in anonymous memory would only cost RAM), or copied into device buffers through the native
copier (CUDA; ``cpu_twin=True`` runs that pipeline on the CPU) - reading the streamed layers through the
mapping or around the page cache (``reads``, see :class:`~mapoffload.OffloadOptions`). The page cache
the layers may fill is planned for every manager of the process by ``pagecache/coordinator.py``: a
cached set stays in memory across forwards, the streamed set is read once per forward at most the
plan's ``depth`` ahead and let go right after use.

The manager takes its options whole (``mapoffload.OffloadOptions``), completed by :func:`resolve` with
what the host measures (the host budget, the local ranks; the copier it makes for itself,
:func:`make_copier`, has its staging ring shrunk for the local ranks). It plans the stores and holds
its parts as ``manager.parts`` (``parts.py``: the pages, the load target, the sequencer and its holders, the
page-cache member, the reads policy, the runtime: the layer turn and the hooks); every method below is
one of theirs. The facade has the fixed names only; what it does not say (a layer's bytes, whether it is
loaded, a weight's store, the device buffers, how streamed layers are read, a share of the page cache given
now) tools and tests ask ``manager.parts``.

Lifetime: in place the model stays a normal model (its parameters the mapped tensors themselves); on
the device path a released layer's holders hold placeholders (``sequencer.py``, ``placeholder.py``).
``remove_forward_hooks()`` and ``close()`` give the model back whole. The manager is a context manager.

The host memory its machinery holds besides the weights' stores (:func:`held_buffers`, counted by
``summary()``): the uncached buffers (anonymous; page-locked on CUDA), the copier's staging slots
(pinned on CUDA; anonymous for the CPU twin) and the CPU twin's "device" buffers, each entry with the
identity of its holder so that a copier several managers share is counted once.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._log import format_bytes, logger
from ..options import HOST_STORES, READS, OffloadOptions, gather, shows_option_keywords
from .hooks import CallNames
from .parts import Parts, layer_index
from .sequencer import iter_cpu_weights, sync_layer_to_cpu, update_cpu_weights
from .stores import MAPPED, host_bytes

if TYPE_CHECKING:
    import torch

    from ..copier import Copier
    from ..pagecache.residency import ResidencyPlan
    from .loads import Target

__all__ = ["HOST_STORES", "HeldBuffers", "LayerwiseOffloadManager", "READS", "held_buffers", "make_copier", "resolve"]


@shows_option_keywords
class LayerwiseOffloadManager:
    """Keep a model's layers on the host and stream each to the device when it runs.

    Parameters
    ----------
    model
        The model; parameters outside ``layers`` and all buffers are left alone.
        Weights of the layers that are shared with modules outside them (a
        tied embedding, say) are left alone too (see ``unmanaged``).
    layers
        An ``nn.ModuleList`` or its attribute path (``"blocks"``, ``"encoder.layer"``).
    options
        An :class:`~mapoffload.OffloadOptions` (each field documented there);
        its ``layers`` and ``rest`` are :func:`~mapoffload.offload`'s, a manager
        streams the ``layers`` it is given.
    copier
        A :class:`~mapoffload.Copier` for the device; one is made otherwise.
        Its copies run on a side CUDA stream, except a copier in ``"direct"``
        mode (the seed runtime's path, kept for comparison): on the compute stream.
    **keywords
        The fields of :class:`~mapoffload.OffloadOptions` (``device=``,
        ``prefetch_layers=``, ``host_store=``, ...), laid over ``options``.

    Notes
    -----
    ``torch.compile`` works on a model with registered hooks: the managed
    layers (their hooks and forwards) always run eagerly - their weights
    change identity between forwards, so a graph traced through them would
    bake in one forward's tensors - and the rest of the model is compiled.
    """

    __module__ = "mapoffload.offload"  # where it is imported from (the package), and pickled by

    def __init__(
        self,
        model: torch.nn.Module,
        layers: Any,
        options: OffloadOptions | None = None,
        *,
        copier: Copier | None = None,
        **keywords: Any,
    ) -> None:
        import torch

        from . import plan as _plan  # imports torch (the placeholders subclass nn.Parameter)

        if keywords or not isinstance(options, OffloadOptions):  # else taken whole, as the entry points hand it
            options = gather("LayerwiseOffloadManager", options, keywords, others=("copier",))
        o = resolve(options, copier)
        self.options = o
        # What the placeholders' errors name (the entry point that made this manager names its calls).
        self.calls = CallNames()
        self.model = model
        self.layers = _plan.resolve_layers(model, layers)
        self.device = o.device
        # Host stores are normal tensors even when made under inference_mode:
        # an inference tensor cannot be written outside it (update_cpu_weights).
        with torch.inference_mode(False):
            self._stores, self.unmanaged = _plan.collect(model, self.layers, self.device)
            _plan.plan(self._stores, o.host_store, o.available_bytes, cuda=o.cuda, device=self.device,
                       local_ranks=o.local_ranks, in_place=o.in_place)
        owns_copier = copier is None
        if not o.in_place:
            copier = copier or make_copier(o)
        self.copier = copier
        name = _plan.stack_name(model, layers, self.layers)
        # The stack's parts (for tools and tests: the sequencer, the load target, the pages, the outside weights'
        # guard, the page-cache member, the reads policy, the runtime); every method below is one of theirs.
        parts = self.parts = Parts.build(o, model=model, layers=self.layers, stores=self._stores, name=name,
                                         copier=copier, owns_copier=owns_copier, owner=self)
        try:
            parts.sequencer.engage()
        except BaseException:
            parts.abandon()  # nothing half-made stays behind
            raise
        parts.forget_at_fork()  # copies in flight at a fork() never complete in the child
        from .placeholder import ManagerMark

        mark = ManagerMark(self)
        for s in self._stores:
            for w in s.weights:
                # One mark on a weight's two forms: a second manager on these weights is refused, and named.
                w.param._mapoffload_manager = w.placeholder._mapoffload_manager = mark

    # -- accounting ------------------------------------------------------------------------
    @property
    def mapped_bytes(self) -> int:
        """Bytes of weights kept on their file mapping."""
        return host_bytes(self._stores)[MAPPED]

    @property
    def pinned_bytes(self) -> int:
        return host_bytes(self._stores)["pinned"]

    @property
    def pageable_bytes(self) -> int:
        """Consolidated pageable plus strided host bytes."""
        return host_bytes(self._stores)["pageable"]

    @property
    def peak_device_bytes(self) -> int:
        return self.parts.loads.peak_bytes

    # -- residency -------------------------------------------------------------------------
    @property
    def residency(self) -> ResidencyPlan | None:
        """The page-cache plan for these layers: which stay cached, which stream (the coordinator's)."""
        return self.parts.member.residency

    # -- loading (the sequencer's) -----------------------------------------------------------

    def prefetch_layer(self, i: int, non_blocking: bool = True) -> None:
        """Start loading layer ``i`` (no-op when loaded or in flight).

        With ``non_blocking=False`` it also waits until the layer is usable.
        """
        i = layer_index(i, self.layers)
        self.parts.sequencer.prefetch(i)
        if not non_blocking:
            self.parts.sequencer.ensure(i)

    def release_layer(self, i: int) -> None:
        """Drop layer ``i``'s device copy (its parameters become placeholders; in place, their host tensors)."""
        self.parts.sequencer.release(layer_index(i, self.layers))
        self.parts.pages.settle()  # its let-go done before the caller can write a weight in place

    def release_all(self) -> None:
        self.parts.sequencer.release_all()
        self.parts.pages.settle()

    def load_all_layers(self) -> None:
        """Load every layer and keep it on the device until released explicitly."""
        self.parts.sequencer.load_all()

    # -- hooks (runtime.py) ---------------------------------------------------------------------
    def register_forward_hooks(self) -> None:
        """Load each layer before it runs, prefetch the next ones, release it after."""
        self.parts.sequencer.engage()
        self.parts.runtime.register(self.model, self.layers)

    def remove_forward_hooks(self) -> None:
        """Remove the hooks and give the model back whole: real parameters, host data.

        Safe while other threads run forwards: it takes the layer turn, so no
        layer is half-way through its hooks when the model is given back, and
        a hook that a forward already started runs as a no-op afterwards.
        """
        turn = self.parts.runtime.turn
        turn.enter()
        try:
            self.parts.runtime.remove()
            self.parts.give_back()
        finally:
            turn.leave()

    # -- host weights (sequencer.py) -------------------------------------------------------
    def iter_cpu_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, host tensor)`` for every managed weight, mapped ones included (a weight the user
        replaced in the model is adopted first: see :func:`~mapoffload.offload.sequencer.adopt_edits`)."""
        self.parts.adopt_all()
        return iter_cpu_weights(self._stores)

    def sync_layer_to_cpu(self, i: int) -> None:
        """Write layer ``i``'s device weights back to its host stores (never a mapped one: see
        :func:`~mapoffload.offload.sequencer.sync_layer_to_cpu`)."""
        sync_layer_to_cpu(self.parts.sequencer, layer_index(i, self.layers))

    def update_cpu_weights(self, named_tensors: Mapping[str, torch.Tensor] | Iterator) -> None:
        """Replace host weights; a mapped entry becomes an owned tensor, the file is never written.

        A loaded layer's device copy is updated as well; a value of another dtype is converted when
        that loses no kind of information (``torch.can_cast``). Raises ``KeyError`` (not a managed
        weight), ``ValueError`` (another shape, a meta value), ``TypeError`` (not a tensor, a dtype
        that cannot be cast): see :func:`~mapoffload.offload.sequencer.update_cpu_weights`.
        """
        update_cpu_weights(named_tensors, seq=self.parts.sequencer, pages=self.parts.pages, weight=self.parts.weight,
                           device=self.device)

    # -- teardown --------------------------------------------------------------------------
    def close(self) -> None:
        """Remove hooks, give the model back whole, free device buffers, stop an owned copier.

        Idempotent; never raises for a copy that failed earlier.
        """
        parts = self.parts
        if parts.sequencer.closed:
            return
        # Under the layer turn (see remove_forward_hooks): once closed, no
        # hook or prefetch engages the placeholders again.
        parts.runtime.turn.enter()
        try:
            self.remove_forward_hooks()
            parts.give_back()
            parts.sequencer.closed = True
        finally:
            parts.runtime.turn.leave()
        try:
            parts.close()
        finally:
            for s in self._stores:
                for w in s.weights:
                    w.param.__dict__.pop("_mapoffload_manager", None)

    def __enter__(self) -> LayerwiseOffloadManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"LayerwiseOffloadManager({len(self.layers)} layers on {self.device}: "
            f"{format_bytes(self.mapped_bytes)} mapped, {format_bytes(self.pinned_bytes)} pinned, "
            f"{format_bytes(self.pageable_bytes)} pageable)"
        )


def start_stacks(model: torch.nn.Module, stacks: Iterable[tuple[Any, OffloadOptions]], *,
                 calls: CallNames | None = None) -> list[LayerwiseOffloadManager]:
    """The one front door: a manager per stack of ``model``, each with its forward hooks registered.

    Every entry point that offloads starts its stacks here (``offload``, ``offload_pipeline``,
    ``from_pretrained``, ``pipeline_from_pretrained``, vLLM's streamed and offloaded layers).
    ``stacks`` yields ``(layers, options)``: the layers as :class:`LayerwiseOffloadManager` takes them
    (a ``ModuleList``, its attribute path, or a list of modules), the options that stack runs with.
    ``calls`` is what the placeholders' errors name (the entry point's own ``close()``).

    When one fails to start (or the start is interrupted), the managers started before it are closed,
    newest first, and the first error is the one raised: a start that fails half-way leaves nothing
    running on a model nobody holds.
    """
    managers: list[LayerwiseOffloadManager] = []
    try:
        for layers, options in stacks:
            options = less_copies(options, managers)
            manager = LayerwiseOffloadManager(model, layers, options)
            managers.append(manager)
            if calls is not None:
                manager.calls = calls
            manager.register_forward_hooks()
    except BaseException:
        for manager in reversed(managers):
            try:
                manager.close()
            except Exception:  # the first error is the one to see
                logger.debug("closing a manager after a failed start", exc_info=True)
        raise
    return managers


def less_copies(options: OffloadOptions, managers: Iterable[LayerwiseOffloadManager]) -> OffloadOptions:
    """``options`` with the host copies ``managers`` made (pinned and pageable stores) taken from its host
    budget: the units of one offload weigh their copies against one figure, measured once, and each one's
    copies are memory the next cannot have. Unchanged where the budget is left to the environment (None)."""
    copied = sum(m.pinned_bytes + m.pageable_bytes for m in managers)
    if not copied or options.available_bytes is None:
        return options
    return options.filled(available_bytes=max(0, options.available_bytes - copied))


def resolve(options: OffloadOptions, copier: Copier | None) -> OffloadOptions:
    """``options`` with the host budget and the local ranks measured where they were left to the
    environment (None), after checking that ``copier`` goes with them.

    Raises
    ------
    ValueError
        A copier for in-place layers (``device="cpu"`` copies nothing) or for another device.
    """
    from ..memory.budget import host_memory_available_bytes
    from ..memory.ranks import local_world

    if options.in_place and copier is not None:
        raise ValueError(
            "device='cpu' computes from the host stores and copies nothing: a copier is for the device "
            "pipeline (cpu_twin=True runs it on the CPU)"
        )
    if copier is not None and copier.device != options.device:
        raise ValueError(f"copier is on {copier.device}, the manager on {options.device}")
    available = options.available_bytes
    if available is None:
        available = host_memory_available_bytes()
    return options.filled(local_ranks=local_world(options.local_ranks).size, available_bytes=available)


def make_copier(options: OffloadOptions) -> Copier:
    """A copier with the default settings, its ring shrunk when the local ranks' rings would not fit."""
    from ..copier import Copier, resolve_settings

    if options.local_ranks is None or options.local_ranks <= 1:
        return Copier(options.device)
    from ..memory.ranks import staging_ring_settings

    threads, slot_bytes, slots = resolve_settings()
    threads, slot_bytes, slots = staging_ring_settings(
        threads=threads, slot_bytes=slot_bytes, slots=slots, local_ranks=options.local_ranks,
        available_bytes=options.available_bytes,
    )
    return Copier(options.device, threads=threads, staging_bytes=slot_bytes, slots=slots)


@dataclass(frozen=True)
class HeldBuffers:
    """Bytes of one kind of working buffer: ``anonymous`` and ``pinned`` host
    bytes; ``owner`` the id of the object that holds them (count each once)."""

    what: str
    anonymous: int
    pinned: int
    owner: int

    @property
    def nbytes(self) -> int:
        return self.anonymous + self.pinned


def held_buffers(loads: Target, copier: Copier | None, device: torch.device) -> list[HeldBuffers]:
    """What a manager holds now besides its weights (entries with bytes only): its load target ``loads``
    (``manager.parts.loads``), its ``copier`` (None in place), on ``device``."""
    out: list[HeldBuffers] = []
    source = loads.source
    held, pinned = source.held_bytes, source.pinned_bytes
    out.append(HeldBuffers("uncached buffers", held - pinned, pinned, id(source)))
    ring = copier.ring_bytes if copier is not None else 0
    if ring:
        cuda = copier.device.type == "cuda"
        out.append(HeldBuffers("staging slots", 0 if cuda else ring, ring if cuda else 0, id(copier)))
    if copier is not None and device.type == "cpu":
        out.append(HeldBuffers("device buffers on the CPU", loads.bytes, 0, id(loads)))
    return [b for b in out if b.nbytes]
