"""LayerwiseOffloadManager: stream a model's layers to the device one at a time.

Each layer's weights are held on the host in the store the budget allows
(``mapped`` / ``consolidated`` pinned or pageable / ``strided``, see
``offload/stores.py``), copied into per-layer device buffers through the native
copier on a copy stream, and released after the layer ran. The manager
sequences layers and hooks; how a layer is made ready is one of two load
paths (``offload/loads.py``: in place, or device copies), each of which can
read the streamed layers around the page cache (``stream_reads``:
``ReadAround``, ``offload/device_read_around.py``).

With ``device="cpu"`` a layer computes from its host store directly: there
is nothing to copy it to, and a second copy in anonymous memory would only
cost RAM. ``cpu_twin=True`` runs the device pipeline instead, with separate
CPU buffers (the whole machinery runs and is tested without a GPU).

Residency (``pagecache/residency.py``, planned for every manager of the
process by ``pagecache/coordinator.py``): on every device, the layers' mapped
pages are planned against the page cache the host leaves
(:func:`~mapoffload.budget.page_cache_budget`): a cached set stays in
memory across forwards; the streamed set is read once per forward (on the
CPU, by a page worker, at most the plan's ``depth`` layers ahead of the
compute: room for them is part of the plan) and let go right after use,
checked with ``mincore`` (``pagecache/pages.let_go``), so it never evicts the cached
set.

Lifetime: in place (``device="cpu"``) nothing moves, so the model stays a
normal model: its parameter slots hold the real parameters, their data the
host tensors (the mapped views themselves), between forwards too -
``state_dict()``, ``save_pretrained()``, autograd (exact:
``offload/grads.py``) work. On the device path a layer's slots hold the real
parameters (their data on the device) when the layer is loaded, and
shape-correct placeholders that raise when computed with otherwise
(``offload/placeholder.py``); autograd through its reused device buffers is
refused (:class:`~mapoffload.OffloadedGradientError`).
``remove_forward_hooks()`` and ``close()`` put the real parameters back, with
their host data: the model is whole and usable again. The manager is a
context manager.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from .._log import format_bytes, logger
from ..pagecache.coordinator import coordinator
from ..pagecache.member import StackMember
from .grads import refuse_weight_gradients
from .layer_pages import LayerPages
from .loads import DeviceCopies, InPlace, Loaded
from .stream_reads import STREAM_READS, StreamReads
from .turn import LayerTurn, register_hooks
from . import host_edits
from ..pagecache.residency import ResidencyPlan
from .rest import RestGuard
from .stores import CONSOLIDATED, MAPPED, STRIDED, LayerStore, Weight
from ..copier import Copier, resolve_settings

if TYPE_CHECKING:
    import torch

__all__ = ["LayerwiseOffloadManager"]

HOST_STORES = ("auto", "mapped", "pinned", "pageable")


def _rank_copier(device: torch.device, local_ranks: int, available_bytes: int) -> Copier:
    """A copier with the default settings, its ring shrunk when the local ranks' rings would not fit."""
    if local_ranks <= 1:
        return Copier(device)
    from ..memory.ranks import staging_ring_settings

    threads, slot_bytes, slots = resolve_settings()
    threads, slot_bytes, slots = staging_ring_settings(
        threads=threads, slot_bytes=slot_bytes, slots=slots, local_ranks=local_ranks, available_bytes=available_bytes
    )
    return Copier(device, threads=threads, staging_bytes=slot_bytes, slots=slots)

# Live managers, for fork(): copies a parent had in flight never complete in
# the child (its copier's workers stayed in the parent), so the child forgets
# them and loads those layers afresh instead of failing a forward per layer.
_MANAGERS: weakref.WeakSet[LayerwiseOffloadManager] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for mgr in list(_MANAGERS):
        mgr._forget_copies_in_flight()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _name_of(model, layers) -> str:
    """The attribute path of ``layers`` in ``model`` (for logs and summaries)."""
    for name, module in model.named_modules():
        if module is layers:
            return name or type(model).__name__
    return f"{len(layers)} layers"


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
    copy_on_compute_stream
        Enqueue copies on the compute stream instead of a side stream (the
        seed runtime's path; for comparison).
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
        reads around the cache. ``stream_reads_why`` says why. In place
        (``device="cpu"``) a layer computes from its buffer, and one run with
        autograd recording reads through its mapping instead (exact
        gradients). On the device path (CUDA, the CPU twin) the layer is
        copied from the buffer into its device buffers: on CUDA the buffers
        are page-locked (``cudaHostRegister``) and the copies DMA straight
        from them (disk -> pinned buffer -> device, no page cache, no
        staging slot); a buffer is read into again only once the copies from
        it are done.
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
        copy_on_compute_stream: bool = False,
        available_bytes: int | None = None,
        local_ranks: int | None = None,
        cpu_twin: bool = False,
        page_cache_bytes: int | None = None,
        kernel_caps: str | None = None,
        stream_reads: str = "auto",
    ) -> None:
        import torch

        from ..memory.budget import host_memory_available_bytes
        from ..memory.ranks import local_world

        from . import plan as _plan  # imports torch (the placeholders subclass nn.Parameter)

        if host_store not in HOST_STORES:
            raise ValueError(f"host_store must be one of {HOST_STORES}, not {host_store!r}")
        if prefetch_layers < 0 or resident_layers < 0:
            raise ValueError("prefetch_layers and resident_layers must be >= 0")
        self.model = model
        self.layers = _plan.resolve_layers(model, layers)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.prefetch_layers = prefetch_layers
        self.resident_layers = resident_layers
        self.host_store = host_store
        self._cuda = self.device.type == "cuda"
        if cpu_twin and self.device.type != "cpu":
            raise ValueError(f"cpu_twin is for device='cpu', not {self.device}")
        # On the CPU a layer computes from its host store: no copy, no copier.
        in_place = self.device.type == "cpu" and not cpu_twin
        if in_place and copier is not None:
            raise ValueError(
                "device='cpu' computes from the host stores and copies nothing: a copier is for the device "
                "pipeline (cpu_twin=True runs it on the CPU)"
            )
        self.local_ranks = local_world(local_ranks).size
        if available_bytes is None:
            available_bytes = host_memory_available_bytes()
        # Host stores are normal tensors even when made under inference_mode:
        # an inference tensor cannot be written outside it (update_cpu_weights).
        with torch.inference_mode(False):
            self._stores, self.unmanaged = _plan.collect(model, self.layers, self.device)
            self._by_name = {n: (s, w) for s in self._stores for w in s.weights for n in w.names}
            _plan.plan(self._stores, host_store, available_bytes, cuda=self._cuda, device=self.device,
                       local_ranks=self.local_ranks, direct=in_place)
        if page_cache_bytes is not None and page_cache_bytes < 0:
            raise ValueError(f"page_cache_bytes must be >= 0, not {page_cache_bytes}")
        if stream_reads not in STREAM_READS:  # (before anything is built)
            raise ValueError(f"stream_reads must be one of {STREAM_READS}, not {stream_reads!r}")
        owns_copier = copier is None
        if not in_place:
            copier = copier or _rank_copier(self.device, self.local_ranks, available_bytes)
            if copier.device != self.device:
                raise ValueError(f"copier is on {copier.device}, the manager on {self.device}")
        self.copier = copier
        self._in_place = in_place  # the slots keep the real parameters: nothing moves
        self._stack_name = layers if isinstance(layers, str) else _name_of(model, self.layers)
        self._pages = self._loads = self._rest = self._member = None
        try:
            self._pages = LayerPages(self._stores, kernel_caps)  # opens the files behind the mapped weights now
            self._loads = InPlace(self._stores, self._pages) if in_place else DeviceCopies(
                self._stores, self._pages, self.device, copier, owns_copier=owns_copier,
                copy_on_compute_stream=copy_on_compute_stream)
            self._rest = RestGuard(model, self.layers, self._pages.files)  # the mapped weights outside the layers
            # The page-cache plan is the process's (every stack under one budget): this stack's
            # part of it is its member.
            self._member = StackMember(name=self._stack_name, model=model, layers=self.layers, pages=self._pages,
                                       loads=self._loads, prefetch_layers=prefetch_layers, given=page_cache_bytes,
                                       always_read=_plan.always_read_tensors, owner=self)
            self._reads = StreamReads(self, stream_reads)
            self._loaded: dict[int, Loaded] = {}
            self._kept: set[int] = set()  # loaded by load_all_layers: kept until released explicitly
            self._hooks: list = []
            self._turn = LayerTurn()
            self._engaged = False
            self._closed = False
            coordinator().join(self._member)  # plans the page cache for every manager, this one included
            if stream_reads == "direct":
                self._reads.read_around("stream_reads='direct'")
                coordinator().place_buffers()  # its buffers are charged before they are made
            self._engage()
        except BaseException:
            # Nothing half-made stays behind: the plan, threads, files, an owned copier.
            self._abandon(copier if owns_copier else None)
            raise
        _MANAGERS.add(self)
        me = weakref.ref(self)
        for s in self._stores:
            for w in s.weights:
                w.param._mapoffload_manager = me  # a second manager on these weights is refused
                w.placeholder._mo_manager = me  # named when a second offload meets the placeholder

    def _abandon(self, owned_copier) -> None:
        """A constructor that failed: leave the coordinator, close what was opened."""
        try:
            if self._member is not None:
                coordinator().leave(self._member)
        except Exception:
            logger.debug("leaving the page-cache plan after a failed start", exc_info=True)
        if self._loads is not None:
            self._loads.close()
        elif owned_copier is not None:
            owned_copier.close()
        if self._pages is not None:
            self._pages.close()
        if self._rest is not None:
            self._rest.close()

    # -- accounting ----------------------------------------------------------------------
    def _sum(self, pred) -> int:
        return sum(w.nbytes for s in self._stores for w in s.weights if pred(s, w))

    @property
    def mapped_bytes(self) -> int:
        """Bytes of weights kept on their file mapping."""
        return self._sum(lambda s, w: w.store == MAPPED)

    @property
    def pinned_bytes(self) -> int:
        return self._sum(lambda s, w: w.store == CONSOLIDATED and s.pinned)

    @property
    def pageable_bytes(self) -> int:
        """Consolidated pageable plus strided host bytes."""
        return self._sum(lambda s, w: (w.store == CONSOLIDATED and not s.pinned) or w.store == STRIDED)

    @property
    def device_bytes(self) -> int:
        """Bytes of device buffers held now (in use or pooled for reuse)."""
        return self._loads.bytes

    @property
    def peak_device_bytes(self) -> int:
        return self._loads.peak_bytes

    def layer_bytes(self, i: int) -> int:
        """Bytes one prefetch of layer ``i`` moves."""
        return self._stores[self._check_index(i)].nbytes

    def store_of(self, name: str) -> str:
        """The host store of a managed weight: ``mapped``, ``consolidated`` or ``strided``."""
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
        if page_cache_bytes is not None and page_cache_bytes < 0:
            raise ValueError(f"page_cache_bytes must be >= 0, not {page_cache_bytes}")
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

    # -- parameter slots -------------------------------------------------------------------
    def _bind(self, w: Weight, data: torch.Tensor | None) -> None:
        """Slots hold the real parameter with ``data``, or (None) with its host data in place, the placeholder
        on the device path."""
        if data is None:
            w.param.data = w.host  # never left pointing into a recycled device buffer
            target = w.param if self._in_place else w.placeholder
        else:
            w.param.data = data
            target = w.param
        for module, attr in w.slots:
            module._parameters[attr] = target

    def _engage(self) -> None:
        if self._closed:
            raise RuntimeError("this LayerwiseOffloadManager is closed")
        if self._engaged:
            return
        from .placeholder import guard_conversions, stand_in  # imports torch

        for s in self._stores:
            for w in s.weights:
                self._bind(w, None)
                if self._in_place:
                    stand_in(w.param, w.placeholder)  # answers conversions for the real parameter

        guard_conversions(self.model)  # model.to(dtype) refuses before converting anything
        self._engaged = True

    def _disengage(self) -> None:
        """Release everything and give the model its real parameters back (host data)."""
        self.release_all()
        from .placeholder import stand_in, unguard_conversions

        for s in self._stores:
            for w in s.weights:
                w.param.data = w.host
                stand_in(w.param, None)
                for module, attr in w.slots:
                    module._parameters[attr] = w.param

        unguard_conversions(self.model)
        self._engaged = False

    # -- loading ---------------------------------------------------------------------------
    def _check_index(self, i: int) -> int:
        if not -len(self.layers) <= i < len(self.layers):
            raise IndexError(f"layer {i} out of range (model has {len(self.layers)} managed layers)")
        return i % len(self.layers)

    def prefetch_layer(self, i: int, non_blocking: bool = True) -> None:
        """Start loading layer ``i`` (no-op when loaded or in flight).

        With ``non_blocking=False`` it also waits until the layer is usable.
        """
        i = self._check_index(i)
        self._engage()
        if i not in self._loaded:
            self._loaded[i] = self._loads.start(i)
        if not non_blocking:
            self._ensure(i)

    def _ensure(self, i: int) -> None:
        if i not in self._loaded:
            self.prefetch_layer(i)
        loaded = self._loaded[i]
        if loaded.ready:
            return
        try:
            self._loads.ready(i, loaded)
        except BaseException:
            # The layer is released (its buffers back once the failed load
            # stopped): the next attempt starts afresh, e.g. after the file
            # behind a mapping is whole again.
            self.release_layer(i)
            raise
        for w in self._stores[i].weights:
            self._bind(w, self._loads.value(w, loaded))
        loaded.ready = True
        loaded.handle = None

    def release_layer(self, i: int) -> None:
        """Drop layer ``i``'s device copy (its parameters become placeholders; in place, their host tensors)."""
        i = self._check_index(i)
        self._kept.discard(i)
        loaded = self._loaded.pop(i, None)
        if loaded is None:
            return
        if self._engaged:
            for w in self._stores[i].weights:
                self._bind(w, None)
        self._loads.release(i, loaded)

    def _forget_copies_in_flight(self) -> None:
        """In a forked child: drop layers whose copy was in flight at the fork.

        Nothing writes their buffers here (the copies ran in the parent), so
        they go back to the pool; their slots hold placeholders already. The
        layer turn may have been held by a parent thread that does not exist
        here: it starts free, with a fresh lock.
        """
        self._turn.after_fork_in_child()
        self._pages.after_fork_in_child()
        for i, loaded in list(self._loaded.items()):
            if not loaded.ready:
                del self._loaded[i]
                self._kept.discard(i)
                self._loads.drop_in_flight(loaded)

    def release_all(self) -> None:
        for i in list(self._loaded):
            self.release_layer(i)

    def load_all_layers(self) -> None:
        """Load every layer and keep it on the device until released explicitly."""
        for i in range(len(self.layers)):
            self.prefetch_layer(i)
        for i in range(len(self.layers)):
            self._ensure(i)
        self._kept.update(range(len(self.layers)))

    def is_loaded(self, i: int) -> bool:
        i = self._check_index(i)
        return i in self._loaded and self._loaded[i].ready

    # -- hooks ------------------------------------------------------------------------------
    def register_forward_hooks(self) -> None:
        """Load each layer before it runs, prefetch the next ones, release it after."""
        self._engage()
        if self._hooks:
            return
        self._hooks = register_hooks(self)

    def remove_forward_hooks(self) -> None:
        """Remove the hooks and give the model back whole: real parameters, host data.

        Safe while other threads run forwards: it takes the layer turn, so no
        layer is half-way through its hooks when the model is given back, and
        a hook that a forward already started runs as a no-op afterwards.
        """
        self._turn.enter()
        try:
            for h in self._hooks:
                h.remove()
            self._hooks.clear()
            if self._engaged:
                self._disengage()
        finally:
            self._turn.leave()

    @property
    def stream_reads(self) -> str:
        """How streamed layers are read now: ``"mapping"`` or ``"direct"`` (see ``stream_reads=``)."""
        return self._reads.mode

    @property
    def stream_reads_why(self) -> str:
        """Why streamed layers are read as they are."""
        return self._reads.why

    def _before_forward(self, module, args) -> None:
        """Once per forward of the model: follow the cap, check the mapped weights outside the layers."""
        coordinator().follow_cap()
        coordinator().note_forward(self._member)
        self._reads.choose()
        self._rest.check()

    def _releasable(self, j: int) -> bool:
        return j >= self.resident_layers and j not in self._kept

    def _start_layer(self, i: int) -> None:
        """The pre-hook's work, holding the turn: load layer ``i``, start the read-ahead."""
        import torch

        if torch.is_grad_enabled():
            if not self._in_place:
                refuse_weight_gradients(self._stores[i])
            elif i in self._loaded and self._loads.reuses(self._loaded[i]):
                self.release_layer(i)  # read ahead into a reused buffer: autograd reads it through its mapping
        # A streamed layer is read ahead only as deep as the plan keeps
        # room for (its depth): any deeper, its pages would evict the
        # layer in use or a cached one.
        plan = self.residency
        window = [j for j in range(i + 1, min(len(self.layers), i + 1 + self.prefetch_layers))
                  if j - i <= plan.depth or not plan.is_streamed(j) or not self._stores[j].bytes_in(MAPPED)]
        for j in list(self._loaded):  # stale prefetches (skipped or reordered layers)
            if j != i and j not in window and self._releasable(j):
                self.release_layer(j)
        self._ensure(i)
        for j in window:
            self.prefetch_layer(j)

    # -- host weights (host_edits.py) ------------------------------------------------------
    def _weight(self, name: str) -> tuple[LayerStore, Weight]:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"{name} is not a weight managed by this LayerwiseOffloadManager") from None

    def iter_cpu_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, host tensor)`` for every managed weight, mapped ones included."""
        return host_edits.iter_cpu_weights(self._stores)

    def cpu_weights_checksum(self) -> str:
        """SHA-256 over names and host bytes: the same whether a weight is mapped or copied."""
        return host_edits.checksum(self.iter_cpu_weights())

    def sync_layer_to_cpu(self, i: int) -> None:
        """Write layer ``i``'s device weights back to its host stores (never a mapped one: see
        :func:`~mapoffload.offload.host_edits.sync_layer_to_cpu`)."""
        host_edits.sync_layer_to_cpu(self, i)

    def update_cpu_weights(self, named_tensors: Mapping[str, torch.Tensor] | Iterator) -> None:
        """Replace host weights; a mapped entry becomes an owned tensor, the file is never written.

        A loaded layer's device copy is updated as well; a value of another dtype is converted when
        that loses no kind of information (``torch.can_cast``).

        Raises
        ------
        KeyError
            The name is not a managed weight.
        ValueError
            The shape differs, or the value is on the meta device (no data).
        TypeError
            The value is not a tensor, or its dtype cannot be cast to the weight's.
        """
        host_edits.update_cpu_weights(self, named_tensors)

    # -- teardown --------------------------------------------------------------------------
    def close(self) -> None:
        """Remove hooks, give the model back whole, free device buffers, stop an owned copier.

        Idempotent; never raises for a copy that failed earlier.
        """
        if self._closed:
            return
        # Under the layer turn (see remove_forward_hooks): once closed, no
        # hook or prefetch engages the placeholders again.
        self._turn.enter()
        try:
            self.remove_forward_hooks()
            if self._engaged:
                self._disengage()
            self._closed = True
        finally:
            self._turn.leave()
        try:
            coordinator().leave(self._member)  # the other stacks share what these layers leave
        finally:  # a plan for the others cut short (Ctrl-C) leaves nothing of this one running
            self._loads.close()
            self._pages.close()
            self._rest.close()  # the lookup tables' advice
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
