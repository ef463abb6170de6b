"""LayerwiseOffloadManager: stream a model's layers to the device one at a time - a facade.

Each layer's weights are held on the host in the store the budget allows (``mapped`` /
``consolidated`` pinned or pageable / ``strided``: ``plan.py``, ``stores.py``), and made ready to
compute by a load target - in place from the host stores (``device="cpu"``: nothing to copy to, and a
second copy in anonymous memory would only cost RAM), or copied into device buffers through the native
copier (CUDA; ``cpu_twin=True`` runs that pipeline on the CPU) - reading the streamed layers through the
mapping or around the page cache (``stream_reads``). The page cache the layers may fill is planned for
every manager of the process by ``pagecache/coordinator.py``: a cached set stays in memory across
forwards, the streamed set is read once per forward at most the plan's ``depth`` ahead and let go right
after use. The manager validates its options (``options.py``), plans the stores and holds its parts
(``parts.py``: the pages, the load target, the slots, the sequencer, the page-cache member, the reads
policy, the turn and the hooks); every method below is one of theirs.

Lifetime: in place the model stays a normal model (its parameters the mapped tensors themselves); on
the device path a released layer's slots hold placeholders (``slots.py``, ``placeholder.py``).
``remove_forward_hooks()`` and ``close()`` give the model back whole. The manager is a context manager.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from .._log import format_bytes
from ..pagecache.coordinator import coordinator
from . import host_edits
from .options import HOST_STORES, check_page_cache_bytes, make_copier, resolve
from .parts import Parts
from .stores import MAPPED, LayerStore, Weight, host_bytes
from .stream_reads import STREAM_READS

if TYPE_CHECKING:
    import torch

    from ..copier import Copier
    from ..pagecache.residency import ResidencyPlan
    from .layer_pages import LayerPages
    from .rest import RestGuard
    from .sequencer import Sequencer
    from .stream_reads import StreamReads

__all__ = ["HOST_STORES", "LayerwiseOffloadManager", "STREAM_READS"]


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
    device
        ``"cuda"``, ``"cuda:N"`` or ``"cpu"`` (layers compute from their host
        stores; see ``cpu_twin``).
    prefetch_layers
        How many following layers each pre-hook starts copying.
    resident_layers
        The first N layers stay on the device once loaded.
    host_store
        ``"auto"`` (mapped when copies would not fit, pinned while the budget
        covers it, pageable for the rest), or force ``"mapped"``, ``"pinned"``,
        ``"pageable"`` where possible.
    copier
        A :class:`~mapoffload.Copier` for the device; one is made otherwise.
        Its copies run on a side stream, except a copier in ``"direct"`` mode
        (the seed runtime's path, kept for comparison): on the compute stream.
    available_bytes
        Host budget to plan against (default: :func:`host_memory_available_bytes`).
        It is the host's, shared by every local rank.
    local_ranks
        Ranks sharing this host, each with its own manager (None detects:
        ``LOCAL_WORLD_SIZE``, else ``torch.distributed``'s world size, else
        1). Host copies and pinned buffers are planned against this rank's
        share of the budget, and a copier the manager makes has its staging
        ring shrunk when ``local_ranks`` rings would take more than 1/8 of
        the budget (:func:`mapoffload.ranks.staging_ring_settings`).
    cpu_twin
        With ``device="cpu"``: run the device pipeline's CPU twin (layers
        copied through the copier into separate CPU buffers), to exercise
        the pipeline without a GPU. Off by default: on the CPU, layers
        compute from their host stores and nothing is copied.
    page_cache_bytes
        Page cache these layers' mapped weights may fill. Default: measured
        (:func:`mapoffload.budget.page_cache_budget`), less the mapped
        weights outside the layers that every forward reads (a head). Decides
        the residency plan (``residency``): which layers stay cached across
        forwards and which are read once per forward and let go after use.
    stream_reads
        How streamed layers are read: ``"mapping"`` (through the mapping -
        read in, or copied from it - and let go after use), ``"direct"``
        (read around the page cache, ``O_DIRECT``, into ``1 + depth`` reused
        buffers; cached layers stay on the mapping), or ``"auto"``: direct as
        soon as the plan streams layers and their files take ``O_DIRECT``
        (measured on the CPU: a forward 3.7x faster than through the mapping
        at base + 50 %, reads at the bound; docs/benchmarks.md) - except while
        the page-cache coordinator knows replicas (processes of this cgroup
        mapping the same bytes): then through the shared page cache, where
        one replica's read serves the other (two replicas streaming in step
        read 0.72x the bound, against 1.25-1.31x each reading around); where they
        do not (tmpfs, some overlays), the mapping, until two warm forwards
        in a row read more than 1.2x what the plan streams - then buffered
        reads around the cache. ``stream_reads_why`` says why. In place a
        layer read around computes from its buffer (with autograd recording,
        from its mapping: exact gradients); on the device path it is copied
        from the buffer, on CUDA by DMA from the page-locked buffer
        (``offload/sources.py``, ``offload/device_copies.py``).
    kernel_caps
        What to assume of the kernel's page-cache behaviour instead of
        measuring it (``pagecache/kernel.py``): text as for the variable
        ``MAPOFFLOAD_KERNEL_CAPS`` (``"no-large-folios"``,
        ``"no-populate-read"``, ``"no-pageout"``, ...), which it replaces.
        Default: the variable, then a run-time probe per device.

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
        *,
        device: str | torch.device,
        prefetch_layers: int = 1,
        resident_layers: int = 0,
        host_store: str = "auto",
        copier: Copier | None = None,
        available_bytes: int | None = None,
        local_ranks: int | None = None,
        cpu_twin: bool = False,
        page_cache_bytes: int | None = None,
        kernel_caps: str | None = None,
        stream_reads: str = "auto",
    ) -> None:
        import torch

        from . import plan as _plan  # imports torch (the placeholders subclass nn.Parameter)

        o = resolve(device=device, prefetch_layers=prefetch_layers, resident_layers=resident_layers,
                    host_store=host_store, copier=copier, available_bytes=available_bytes, local_ranks=local_ranks, cpu_twin=cpu_twin,
                    page_cache_bytes=page_cache_bytes, kernel_caps=kernel_caps, stream_reads=stream_reads)
        self.model = model
        self.layers = _plan.resolve_layers(model, layers)
        self.device = o.device
        self.prefetch_layers = prefetch_layers
        self.resident_layers = resident_layers
        self.host_store = host_store
        self.local_ranks = o.local_ranks
        # Host stores are normal tensors even when made under inference_mode:
        # an inference tensor cannot be written outside it (update_cpu_weights).
        with torch.inference_mode(False):
            self._stores, self.unmanaged = _plan.collect(model, self.layers, self.device)
            self._by_name = {n: (s, w) for s in self._stores for w in s.weights for n in w.names}
            _plan.plan(self._stores, host_store, o.available_bytes, cuda=o.cuda, device=self.device,
                       local_ranks=self.local_ranks, in_place=o.in_place)
        owns_copier = copier is None
        if not o.in_place:
            copier = copier or make_copier(o)
        self.copier = copier
        name = _plan.stack_name(model, layers, self.layers)
        parts = self._parts = Parts.build(o, model=model, layers=self.layers, stores=self._stores, name=name,
                                          copier=copier, owns_copier=owns_copier, owner=self)
        self._seq, self._pages, self._member, self._slots = parts.sequencer, parts.pages, parts.member, parts.slots
        self._reads, self._turn, self._hooks = parts.reads, parts.turn, parts.hooks
        try:
            self._engage()
        except BaseException:
            parts.abandon()  # nothing half-made stays behind
            raise
        parts.forget_at_fork()  # copies in flight at a fork() never complete in the child
        from .placeholder import ManagerMark

        me, mark = weakref.ref(self), ManagerMark(self)
        for s in self._stores:
            for w in s.weights:
                w.param._mapoffload_manager = mark  # a second manager on these weights is refused
                w.placeholder._mo_manager = me  # named when a second offload meets the placeholder

    # -- the parts (for tools and tests: their interfaces, not the manager's insides) ----------------
    @property
    def sequencer(self) -> Sequencer:
        """What is loaded and kept, and what a step loads (``offload/sequencer.py``)."""
        return self._seq

    @property
    def loads(self) -> Any:
        """The load path now: in place or device copies, read through the mapping or around the page cache."""
        return self._seq.loads

    @property
    def pages(self) -> LayerPages:
        """The page-cache side of the layers: spans, files, page reads and let-gos (``offload/layer_pages.py``)."""
        return self._pages

    @property
    def rest(self) -> RestGuard:
        """The mapped weights outside the layers, checked before each forward (``offload/rest.py``)."""
        return self._parts.rest

    @property
    def reads(self) -> StreamReads:
        """The ``stream_reads`` setting and its ``auto`` policy (``offload/stream_reads.py``)."""
        return self._reads

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
    def device_bytes(self) -> int:
        """Bytes of device buffers held now (in use or pooled for reuse)."""
        return self.loads.bytes

    @property
    def peak_device_bytes(self) -> int:
        return self.loads.peak_bytes

    def layer_bytes(self, i: int) -> int:
        """Bytes one prefetch of layer ``i`` moves."""
        return self._stores[self._check_index(i)].nbytes

    def store_of(self, name: str) -> str:
        """The host store of a managed weight: ``mapped``, ``consolidated`` or ``strided``."""
        self._adopt_all()
        return self._weight(name)[1].store

    # -- residency -------------------------------------------------------------------------
    def replan(self, page_cache_bytes: int | None = None) -> ResidencyPlan:
        """Plan again which layers stay cached and which stream; returns the plan (also ``residency``).

        ``page_cache_bytes`` gives these layers a share of their own from now
        on (the other managers plan around it); None measures: the process's
        page-cache coordinator plans every measured manager together against
        one budget, and follows the cgroup's cap from then on (when the cap
        changes, the next forward plans again).
        """
        check_page_cache_bytes(page_cache_bytes)
        self._member.given = page_cache_bytes
        coordinator().replan()
        return self.residency

    @property
    def residency(self) -> ResidencyPlan | None:
        """The page-cache plan for these layers: which stay cached, which stream (the coordinator's)."""
        return self._member.residency if self._member is not None else None

    def resident_layer_bytes(self) -> list[int]:
        """Bytes of each layer's mapped weights resident in RAM now (``mincore``)."""
        return self._pages.resident_bytes()

    # -- loading (the sequencer's) -----------------------------------------------------------
    def _engage(self) -> None:
        self._seq.engage()

    def _check_index(self, i: int) -> int:
        if not -len(self.layers) <= i < len(self.layers):
            raise IndexError(f"layer {i} out of range (model has {len(self.layers)} managed layers)")
        return i % len(self.layers)

    def prefetch_layer(self, i: int, non_blocking: bool = True) -> None:
        """Start loading layer ``i`` (no-op when loaded or in flight).

        With ``non_blocking=False`` it also waits until the layer is usable.
        """
        i = self._check_index(i)
        self._seq.prefetch(i)
        if not non_blocking:
            self._seq.ensure(i)

    def release_layer(self, i: int) -> None:
        """Drop layer ``i``'s device copy (its parameters become placeholders; in place, their host tensors)."""
        self._seq.release(self._check_index(i))

    def release_all(self) -> None:
        self._seq.release_all()

    def load_all_layers(self) -> None:
        """Load every layer and keep it on the device until released explicitly."""
        self._seq.load_all()

    def is_loaded(self, i: int) -> bool:
        return self._seq.is_loaded(self._check_index(i))

    # -- hooks (turn.py, steps.py) ------------------------------------------------------------
    def register_forward_hooks(self) -> None:
        """Load each layer before it runs, prefetch the next ones, release it after."""
        self._engage()
        self._hooks.register(self.model, self.layers)

    def remove_forward_hooks(self) -> None:
        """Remove the hooks and give the model back whole: real parameters, host data.

        Safe while other threads run forwards: it takes the layer turn, so no
        layer is half-way through its hooks when the model is given back, and
        a hook that a forward already started runs as a no-op afterwards.
        """
        self._turn.enter()
        try:
            self._hooks.remove()
            self._disengage()
        finally:
            self._turn.leave()

    def _disengage(self) -> None:
        """Release everything and give the model its real parameters back (host data)."""
        if self._slots.engaged:
            # What the user replaced is adopted first (or, refused, left as they made it): the model is
            # given back with the weights that last computed, or theirs - never the old ones silently.
            self._seq.adopt_all(strict=False)
            self._seq.release_all(strict=False)
            self._slots.disengage()

    @property
    def stream_reads(self) -> str:
        """How streamed layers are read now: ``"mapping"`` or ``"direct"`` (see ``stream_reads=``)."""
        return self._reads.mode

    @property
    def stream_reads_why(self) -> str:
        """Why streamed layers are read as they are."""
        return self._reads.why

    # -- host weights (host_edits.py) ------------------------------------------------------
    def _weight(self, name: str) -> tuple[LayerStore, Weight]:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"{name} is not a weight managed by this LayerwiseOffloadManager") from None

    def _adopt_all(self) -> None:
        """A weight the user replaced in the model is the weight from now on (refused ones logged), under
        the layer turn: no forward of another thread is half-way through a layer meanwhile."""
        self._turn.enter()
        try:
            self._seq.adopt_all(strict=False)
        finally:
            self._turn.leave()

    def iter_cpu_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, host tensor)`` for every managed weight, mapped ones included (a weight the user
        replaced in the model is adopted first: see :func:`~mapoffload.offload.host_edits.adopt_edits`)."""
        self._adopt_all()
        return host_edits.iter_cpu_weights(self._stores)

    def cpu_weights_checksum(self) -> str:
        """SHA-256 over names and host bytes: the same whether a weight is mapped or copied."""
        return host_edits.checksum(self.iter_cpu_weights())

    def sync_layer_to_cpu(self, i: int) -> None:
        """Write layer ``i``'s device weights back to its host stores (never a mapped one: see
        :func:`~mapoffload.offload.host_edits.sync_layer_to_cpu`)."""
        host_edits.sync_layer_to_cpu(self._seq, self._check_index(i))

    def update_cpu_weights(self, named_tensors: Mapping[str, torch.Tensor] | Iterator) -> None:
        """Replace host weights; a mapped entry becomes an owned tensor, the file is never written.

        A loaded layer's device copy is updated as well; a value of another dtype is converted when
        that loses no kind of information (``torch.can_cast``). Raises ``KeyError`` (not a managed
        weight), ``ValueError`` (another shape, a meta value), ``TypeError`` (not a tensor, a dtype
        that cannot be cast): see :func:`~mapoffload.offload.host_edits.update_cpu_weights`.
        """
        host_edits.update_cpu_weights(named_tensors, seq=self._seq, pages=self._pages, weight=self._weight,
                                      device=self.device)

    # -- teardown --------------------------------------------------------------------------
    def close(self) -> None:
        """Remove hooks, give the model back whole, free device buffers, stop an owned copier.

        Idempotent; never raises for a copy that failed earlier.
        """
        if self._slots.closed:
            return
        # Under the layer turn (see remove_forward_hooks): once closed, no
        # hook or prefetch engages the placeholders again.
        self._turn.enter()
        try:
            self.remove_forward_hooks()
            self._disengage()
            self._slots.closed = True
        finally:
            self._turn.leave()
        try:
            self._parts.close()
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
