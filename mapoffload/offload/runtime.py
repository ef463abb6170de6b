"""One stack's forward: the hooks torch calls, and what each does, in the order a forward runs them.

Once per forward of the model (its pre-hook, before anything reads the mapping): follow the cap, count
the forward for the page-cache coordinator, let the ``reads`` policy choose, check the mapped weights
outside the layers and stream them where the plan has no room for them. Per layer (its pre-hook,
holding the layer turn): autograd's rule (refused on reused device buffers; in place, a layer read
ahead into a reused uncached buffer is read again through its mapping), then the step (:func:`read_ahead`):
the layer loaded (the load target's ``ready``: the copy, or the read in place), the window the plan
allows read ahead. After the layer (its always-call post-hook): its release and the recorded-graph
check. Where the plan reads streamed layers part by part, each part's hooks read it in (the next parts'
reads started behind it, to run while it computes, as deep as the plan's room) and let it go; a plain
linear part the window does not hold two of (depth 0) computes over chunks of its rows instead, each read
while the one before computes, where they compute its bits (:class:`RowChunks`, its forward wrapped).
Once the forward ended: what it added to the process's anonymous memory goes to the coordinator.

One layer runs at a time (:class:`LayerTurn`): from its pre-hook to its post-hook the layer owns the
manager's loaded layers and device pool. Without that, one thread's hooks would release and recycle
buffers another thread's layer is computing with. Another thread's layer waits; the owning thread may
nest (a model run re-entrantly); a dead owner does not block anyone.

torch runs always-call post-hooks for an ``Exception`` only: a KeyboardInterrupt (the manager's own
interruptible wait included), SystemExit or GeneratorExit inside a layer skips them. The layer's
forward is wrapped (through ``hooks``, the one registry of what mapoffload sets on a module), and the
pre-hook guards itself, so that whatever leaves the layer finishes its turn; a per-thread record of the
turns held (:meth:`LayerTurn.held`) makes finishing twice harmless.

**The weights outside the layers** (embedding, head, norms: :class:`OutsideWeights`; the ``rest=`` option
places them on a device or streams their modules there, a manager of their own). Every
forward reads them before the first layer's own check. A file truncated under the mapping would make that
read a SIGBUS that kills the process; a check of the mapped file's size turns it into a
:class:`~mapoffload.MappingFaultError` naming the file. Where the page-cache plan finds no room for the
weights every forward reads whole (a head, norms) beside the streaming window
(``ResidencyPlan.always_streamed``), each module holding them reads them in before it runs (where they fit
the room; else its own faults read them, 2 MiB folios at a time under ``MADV_HUGEPAGE`` +
``MADV_RANDOM``, or a linear head's chunks of rows where they compute its bits: :class:`RowChunks`) and
lets them go after it ran, so that they never push the layers' pages out. The lookup
tables (embeddings no head shares) are set ``MADV_RANDOM``: a lookup faults a few rows, and a fault's
readahead read 131-216 MiB of a 125 MiB table per forward under a tight cap.

**Autograd** (:func:`refuse_weight_gradients`, :func:`refuse_recorded_graph`). In place a layer computes
from its host tensors, which stay where they are after it ran: gradients are exact (a layer read ahead
into a reused uncached buffer is read again through its mapping when autograd records). On the device
path a layer computes from device buffers that later layers are copied into: a graph recorded through them
would compute a backward from other layers' weights, so such a forward is refused with
:class:`OffloadedGradientError`, naming the layer and why.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import TYPE_CHECKING, Any

from .._log import format_bytes, logger
from .._native import _core
from ..memory.budget import release_freed_memory, rss_anon_bytes
from ..memory.regions import same_bits as _same_bits  # a name of this module: the tests replace it
from ..pagecache import coordinator as _coordinator
from ..pagecache.coordinator import coordinator
from ..pagecache.mapped_file import MappedFiles
from ..pagecache.pages import FOLIO_BYTES, Extent, PageWorker, check_extents, file_extents, layer_spans
from .hooks import Hook, wrap_forward
from .stores import MAPPED

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    from ..pagecache.member import StackMember
    from ..pagecache.residency import ResidencyPlan
    from .sequencer import Sequencer
    from .stores import LayerStore

__all__ = [
    "LayerTurn", "OffloadedGradientError", "OutsideWeights", "RowChunks", "StackRuntime", "outside_tensors",
    "read_ahead", "refuse_recorded_graph", "refuse_weight_gradients",
]


class LayerTurn:
    """Whose turn it is to run one of a manager's layers (a thread, nesting), and the turns each thread holds."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._held = threading.local()  # .layers: the turns this thread holds, innermost last
        self._owner: threading.Thread | None = None
        self._depth = 0

    def after_fork_in_child(self) -> None:
        """The turn may have been held by a parent thread that does not exist here: it starts free,
        with a fresh lock."""
        self._cond = threading.Condition()
        self._owner, self._depth = None, 0

    def enter(self) -> None:
        me = threading.current_thread()
        with self._cond:
            while self._owner is not None and self._owner is not me and self._owner.is_alive():
                self._cond.wait()
            if self._owner is not me:
                self._owner, self._depth = me, 0
            self._depth += 1

    def leave(self) -> None:
        with self._cond:
            if self._owner is threading.current_thread():
                self._depth -= 1
                if self._depth <= 0:
                    self._owner = None
                    self._cond.notify_all()

    def held(self) -> list[int]:
        """The layers whose turn this thread holds, innermost last."""
        held = getattr(self._held, "layers", None)
        if held is None:
            held = self._held.layers = []
        return held


class StackRuntime:
    """The hooks on one stack's layers and on its model, and their work (see the module).

    Parameters
    ----------
    sequencer
        The stack's sequencer (its loads, stores, pages and window).
    member
        The stack's page-cache member (its plan, its forwards counted, its ``reads`` policy).
    outside
        The mapped weights outside the layers, checked once per forward.
    in_place
        The layers compute from their host stores (``device="cpu"``).
    owner
        A weak reference to the manager (named when a copy of the model is refused).
    """

    def __init__(self, sequencer: Sequencer, member: StackMember, outside: OutsideWeights, *,
                 in_place: bool, owner: Any = None) -> None:
        self.turn = LayerTurn()  # the stack's: the manager takes it too, to remove the hooks or close
        self.sequencer = sequencer
        self.member = member
        self.outside = outside
        self.in_place = in_place
        self.owner = owner
        self.handles: list = []  # each with remove()
        self.part_handles: list = []  # the layers' parts' hooks, while streamed layers are read part by part
        # Parts that may compute over chunks of their rows (plain linears, their forwards wrapped), their
        # RowChunks by the plan's step, those armed for the call their pre-hook precedes, and the checks'
        # verdicts (by the weight's geometry: kept across plans).
        self._chunkable: set[tuple[int, int]] = set()
        self._rows: dict[tuple[int, int], tuple[int, RowChunks | None]] = {}
        self._armed: dict[tuple[int, int], tuple[int, RowChunks]] = {}  # (the thread that armed it, the chunks)
        self._verdicts: dict[tuple, dict[tuple, bool]] = {}
        self._maps = None  # one /proc/self/maps snapshot for the parts' chunks a forward finds (a MapsView)
        self._forward = threading.local()  # .on: this thread is in a forward of the model
        self._anon: int | None = None  # RssAnon at this forward's start (None: not measuring)
        self._peak = 0  # the most sampled since

    @property
    def active(self) -> bool:
        """Registered (a hook that a forward already started runs as a no-op once removed)."""
        return bool(self.handles)

    def register(self, model: Any, layers: list) -> None:
        """Hook ``layers`` (load before, release after, a guarded forward) and ``model`` (once per
        forward, before anything reads the mapping). No-op when registered."""
        if self.handles:
            return
        hooks: list = []
        for i, layer in enumerate(layers):
            hooks.append(layer.register_forward_pre_hook(Hook(self._pre_hook(i), self.owner)))
            hooks.append(layer.register_forward_hook(Hook(self._post_hook(i), self.owner), always_call=True))
            hooks.append(wrap_forward(layer, Hook(self._guarded_forward(i, layer), self.owner)))
        # Before anything of a forward reads the mapping (the embedding first).
        hooks.append(model.register_forward_pre_hook(Hook(self._before_forward, self.owner), prepend=True))
        hooks.append(model.register_forward_hook(Hook(self._after_forward, self.owner), always_call=True))
        self.handles = hooks

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self._remove_parts()
        self.sequencer.pages.parts.let_go_ahead()  # removed inside a forward: what it read ahead
        self.outside.stream(False)

    # -- once per forward of the model -------------------------------------------------------
    def _before_forward(self, module: Any, args: Any) -> None:
        """Follow the cap (and what the process holds), check the mapped weights outside the layers,
        stream them where the plan has no room for them; hook the layers' parts while the plan reads
        streamed layers part by part."""
        c = coordinator()
        c.follow_cap()
        c.note_forward(self.member)
        self.member.choose_reads()
        self.outside.let_go_left()  # what an interrupt around a streamed module left cached
        self.outside.check()
        plan = self.member.residency
        if plan is None:
            self.outside.stream(False)
        else:  # the window, and the one unit it holds 1 + depth of (a layer or a part): the chunks' room
            self.outside.stream(plan.always_streamed, plan.window_bytes, plan.window_bytes // (1 + plan.depth))
        self._anon = self._peak = (_anon() or None) if c.samples_anon else None  # 0: unreadable, not measured
        self._forward.on = True  # in a forward of the model: parts read ahead may cross from layer to layer
        self._maps = None  # a snapshot of this forward's, made when a part's chunks are first found
        self.sequencer.pages.parts.let_go_ahead()  # what an interrupted forward read ahead; the order learnt afresh
        if self.sequencer.pages.in_parts:
            self._register_parts()
        else:
            self._remove_parts()

    def _after_forward(self, module: Any, args: Any, output: Any) -> None:
        """Once a forward of the model ended (or raised): what it added to the process's anonymous memory
        at its peak goes to the coordinator (the next plan's margin), and the memory its activations
        were freed from goes back to the kernel.

        glibc keeps freed blocks below its (growing) mmap threshold in its arenas, one per thread that
        allocated: tens of MiB the page cache, and so the layers, would lose at every forward (the
        measures: docs/design.md, "Freed memory given back"). Under a cap (while measuring)
        ``malloc_trim`` gives them back after each forward.

        The forward returns once its let-gos are done (:meth:`~mapoffload.pagecache.layer_pages.LayerPages.settle`):
        the user's code may write a weight in place next, which a let-go still in flight would drop.
        Parts read ahead that did not run (the forward went another way, or raised) are let go first."""
        self._forward.on = False
        self.sequencer.pages.parts.let_go_ahead()
        self.sequencer.pages.settle()
        if self._anon is not None:
            self._sample()
            coordinator().note_forward_growth(self._peak - self._anon)
            self._anon = None
            release_freed_memory()

    def _sample(self) -> None:
        """The process's anonymous memory now, into this forward's peak (sampled while measuring)."""
        if self._anon is not None:
            self._peak = max(self._peak, _anon())

    # -- one layer ----------------------------------------------------------------------------
    def _pre_hook(self, i: int):
        def pre_hook(module, args):
            """Layer ``i`` is about to run: take the turn, then autograd's rule, then the step (the layer
            loaded - its copy, or its read in place - and the layers :func:`read_ahead` names started)."""
            import torch

            self.turn.enter()
            if not self.handles:
                # Removed (or closed) by another thread while this forward
                # was on its way here: the model is whole, nothing to load.
                self.turn.leave()
                return
            self.turn.held().append(i)
            seq = self.sequencer
            try:
                if seq.pages.streams(i) and below_a_layer(self.member.residency):
                    # Under a room below one layer the allocator's freed blocks are the room: what the
                    # layers before freed goes back before this one reads its parts in (docs/design.md,
                    # "Freed memory given back"). Above it the trim and the faults it causes next
                    # (0.11-0.18 s of kernel CPU a forward) buy room the plan does not need.
                    release_freed_memory()
                self._sample()
                if torch.is_grad_enabled():
                    if not self.in_place:
                        seq.engage()
                        seq.adopt_edits(i)  # the weight a swap put in the slot is the one the rule asks about
                        refuse_weight_gradients(seq.stores[i])
                    elif i in seq.loaded and seq.loads.reuses(seq.loaded[i]):
                        seq.release(i)  # read ahead into a reused buffer: autograd reads it through its mapping
                # The step: stale reads ahead (a layer skipped or reordered) let go, this layer's load
                # started where nothing read it ahead (its copy, or its read in place: Target.start) and
                # waited for (Target.ready), the next ones read ahead.
                ahead = read_ahead(seq.stores, i, self.member.residency, self.member.prefetch_layers)
                for j in list(seq.loaded):
                    if j != i and j not in ahead and seq.releasable(j):
                        seq.release(j)
                seq.prefetch(i)
                seq.ensure(i)
                for j in ahead:
                    seq.prefetch(j)
            except Exception:
                raise  # torch runs the always-call post-hook, which finishes the turn
            except BaseException:
                self.finish_layer(i)
                raise

        return pre_hook

    def _post_hook(self, i: int):
        def post_hook(module, args, output):
            seq = self.sequencer
            load = seq.loaded.get(i)
            reused = seq.loads.recycles(i) or (load is not None and seq.loads.reuses(load))
            kept = copied_out(seq.stores[i], output) if reused and i in self.turn.held() else None
            self.finish_layer(i)
            if seq.loads.recycles(i):  # autograd must not have saved views of reused device buffers
                refuse_recorded_graph(seq.stores[i], output)
            return kept

        return post_hook

    def _guarded_forward(self, i: int, layer: Any):
        """Layer ``i``'s forward, finishing its turn on whatever leaves it (see the module). The forward
        is looked up at each call, as torch does: one the user sets on the layer's class after the hooks
        (a patch of the model's code) is the one that runs; one set on the instance before is kept."""
        own = vars(layer).get("forward")  # the instance's own forward, if it had one

        @functools.wraps(layer.forward)
        def guarded_forward(*args, **kwargs):
            forward = own if own is not None else _class_forward(layer)
            try:
                return forward(*args, **kwargs)
            except Exception:
                raise  # torch runs the always-call post-hook
            except BaseException:
                self.finish_layer(i)  # torch runs no hook for these (nor the model's after-forward):
                self._forward.on = False  # the forward is left: a layer called on its own next is one
                self.sequencer.pages.parts.let_go_ahead()  # what was read ahead is let go, nothing left in flight
                self.sequencer.pages.settle()
                raise

        return guarded_forward

    def finish_layer(self, i: int) -> None:
        """Finish layer ``i`` (released unless it stays) and leave its turn, once, if this thread holds it."""
        held = self.turn.held()
        if i not in held:
            return
        del held[len(held) - 1 - held[::-1].index(i)]
        try:
            if self.sequencer.releasable(i):  # released unless it stays (resident, or kept by load_all)
                self.sequencer.release(i)
        finally:
            self.turn.leave()
        if not held and not getattr(self._forward, "on", False):
            # A layer called on its own (not in a forward of the model): what it read ahead of the next
            # layer is let go, and its let-gos done, before the user's code runs again.
            self.sequencer.pages.parts.let_go_ahead()
            self.sequencer.pages.settle()

    # -- part by part -------------------------------------------------------------------------
    def _register_parts(self) -> None:
        """Hook each layer's parts (the submodules holding its weights): read in before each runs, let
        go after, while the plan reads streamed layers part by part. No-op when registered."""
        if self.part_handles or not self.handles:
            return
        hooks: list = []
        for i, store in enumerate(self.sequencer.stores):
            for k, part in enumerate(store.parts):
                hooks.append(part.module.register_forward_pre_hook(Hook(self._part_pre_hook(i, k), self.owner)))
                hooks.append(part.module.register_forward_hook(Hook(self._part_post_hook(i, k), self.owner),
                                                               always_call=True))
                if RowChunks.plain_weight(part.module) is not None:  # may compute over chunks of its rows
                    self._chunkable.add((i, k))
                    hooks.append(wrap_forward(part.module, Hook(self._part_forward(i, k, part.module), self.owner)))
        self.part_handles = hooks

    def _remove_parts(self) -> None:
        for h in self.part_handles:
            h.remove()
        self.part_handles = []
        for (i, k), (_, rows) in self._rows.items():
            if rows is not None:
                rows.stop()  # removed inside a chunk: the chunks left compute on, reading nothing
            self.sequencer.pages.parts.chunked(i, k, None)
        self._chunkable.clear()
        self._rows.clear()
        self._armed.clear()

    def _part_rows(self, i: int, k: int, module: Any) -> RowChunks | None:
        """Part ``k`` of layer ``i`` as chunks of its rows, where the plan's window does not hold two of it
        (at depth 0 the largest parts: nothing of the next is read while one computes, issue 43) and it is
        a plain linear; else None. Each chunk is half of the one part the window holds ``1 + depth`` of, so
        that the next chunk is read while one computes, within the window."""
        plan = self.member.residency
        pages = self.sequencer.pages
        if plan is None or not plan.readahead or 2 * pages.parts.sizes(i)[k] <= plan.window_bytes:
            if self._rows.pop((i, k), None) is not None:
                pages.parts.chunked(i, k, None)  # not in chunks now: its first chunk is read ahead no more
            return None
        step = plan.window_bytes // (1 + plan.depth)
        known = self._rows.get((i, k))
        if known is not None and known[1] is not None and not pages.parts.is_chunked(i, k):
            known = None  # its first chunk dropped (the layer's stores changed: PartReads.forget): cut again
        if known is None or known[0] != step:
            from ..pagecache.file_places import MapsView

            part = self.sequencer.stores[i].parts[k]
            mapped = [w.host for w in part.weights if w.store == MAPPED]
            self._maps = maps = self._maps or MapsView()  # one parse of /proc/self/maps a forward, not one a part
            rows = RowChunks.of(module, f"layer {i} ({part.name})", mapped, pages.worker, pages.files, maps,
                                step, self._verdicts, wrapped=True)
            if rows is not None:  # its last chunk reads the first of the part after it (PartReads.read_next_head)
                rows.on_last = functools.partial(pages.parts.read_next_head, i, k)
            pages.parts.chunked(i, k, rows.chunks[0][2] if rows is not None else None)
            known = self._rows[(i, k)] = (step, rows)
        return known[1]

    def _part_forward(self, i: int, k: int, module: Any):
        def forward(*args, **kwargs):
            """Part ``k`` of layer ``i``'s forward: over chunks of its rows where its pre-hook armed them
            (:meth:`_part_rows`; checked once per kind of input, :class:`RowChunks`), else its own."""
            armed = self._armed.pop((i, k), None)
            if armed is not None and (armed[0] != threading.get_ident() or i not in self.turn.held()):
                if armed[0] != threading.get_ident():
                    self._armed[(i, k)] = armed  # another thread's, for its call (this one holds no turn)
                armed = None  # armed for a call that never came (its layer left): this one computes as it is
            return (armed[1].forward if armed is not None else _class_forward(module))(*args, **kwargs)

        return forward

    def _part_pre_hook(self, i: int, k: int):
        def pre_hook(module, args):
            """Part ``k`` of layer ``i`` is about to run: read it in, when its layer streams part by part
            (inside layer ``i``'s turn: a part called on its own is no layer's)."""
            pages = self.sequencer.pages
            if i not in self.turn.held() or not pages.in_parts or not pages.streams(i):
                return
            load = self.sequencer.loaded.get(i)
            if load is None or load.uncached is not None:
                return  # not loaded by this stack's turn, or read uncached whole
            self._sample()
            rows = self._part_rows(i, k, module) if (i, k) in self._chunkable else None
            chunked = rows is not None and rows.will_chunk(args)  # then its chunks are read as they compute
            read = pages.parts.enter(i, k, read=not chunked)  # and the next parts' started behind it, as room allows
            if rows is not None:
                self._armed[(i, k)] = (threading.get_ident(), rows)
            if read is not None:
                read.result()

        return pre_hook

    def _part_post_hook(self, i: int, k: int):
        def post_hook(module, args, output):
            """Part ``k`` of layer ``i`` ran: let it go, when its layer streams part by part."""
            pages = self.sequencer.pages
            armed = self._armed.get((i, k))
            if armed is not None and armed[0] == threading.get_ident():
                del self._armed[(i, k)]  # this thread's, not run (its call went another way): not another's
            if i in self.turn.held() and pages.in_parts and pages.streams(i):
                pages.parts.let_go(i, k)

        return post_hook


def below_a_layer(plan: ResidencyPlan | None) -> bool:
    """Whether ``plan`` reads part by part because its window does not hold one layer (not merely two)."""
    return plan is not None and plan.parts and plan.window_bytes < max(plan.layer_bytes, default=0)


def read_ahead(stores: list[LayerStore], i: int, plan: ResidencyPlan | None, depth: int) -> list[int]:
    """The layers a step on layer ``i`` reads ahead: the next ``depth`` (the stack's ``prefetch_layers``), a
    streamed one only as deep as the plan keeps room for (its depth) - any deeper, its pages would evict
    the layer in use or a cached one."""
    end = min(len(stores), i + 1 + depth)
    return [j for j in range(i + 1, end)
            if plan is None or j - i <= plan.depth or not plan.is_streamed(j) or not stores[j].bytes_in(MAPPED)]


def _class_forward(layer: Any):
    """``layer.forward`` as its class gives it (what torch would call without our instance attribute): the
    class attribute, bound by its descriptor protocol where it has one (a function, a staticmethod, a
    classmethod), else the attribute itself (a callable object)."""
    for cls in type(layer).__mro__:
        if "forward" in cls.__dict__:
            found = cls.__dict__["forward"]
            get = getattr(type(found), "__get__", None)
            return get(found, layer, type(layer)) if get is not None else found
    raise AttributeError(f"{type(layer).__name__} has no forward")


def _anon() -> int:
    """RssAnon, read where the coordinator reads the cgroups (tests point both at a fake tree)."""
    return rss_anon_bytes(root=_coordinator.CGROUP_ROOT)


WEIGHTS_REQUIRE_GRAD = "weights require grad"
RECORDED = "autograd recorded"

_HOW = ("Run the model under torch.no_grad() or torch.inference_mode() (the device path is for inference), or "
        "take gradients with device='cpu', which computes in place from the host tensors (exact)")


class OffloadedGradientError(RuntimeError):
    """A forward on the device path that would record autograd through reused device buffers.

    ``layer`` is the layer's index, ``name`` its path in the model and
    ``reason`` one of ``"weights require grad"`` (autograd enabled and the
    layer's weights require grad: refused before the layer is loaded) or
    ``"autograd recorded"`` (its output requires grad: the inputs did, and
    autograd saved the layer's device weights for the backward).
    """

    def __init__(self, message: str, *, layer: int, name: str, reason: str) -> None:
        super().__init__(message)
        self.layer, self.name, self.reason = layer, name, reason


def refuse_weight_gradients(store: LayerStore) -> None:
    """On the device path with autograd enabled: refuse layer ``store`` when its weights require grad."""
    if any(w.param.requires_grad for w in store.weights):
        raise OffloadedGradientError(
            f"layer {store.index} ({store.name}) ran with autograd recording and weights that require grad: on "
            "the device pipeline its weights are device buffers that later layers overwrite, so gradients "
            f"through them would be wrong. {_HOW}",
            layer=store.index, name=store.name, reason=WEIGHTS_REQUIRE_GRAD,
        )


def copied_out(store: LayerStore, output: Any) -> Any:
    """``output`` with each tensor that is a view of one of the layer's weights (learned latents expanded,
    a weight returned) copied out of the buffer the layer computed from, which the next layers reuse; None
    where none is (the output as it is)."""
    import torch
    from torch.utils._pytree import tree_leaves, tree_map

    def storage(t: Any) -> int | None:
        try:
            return t.untyped_storage().data_ptr() if isinstance(t, torch.Tensor) else None
        except (RuntimeError, NotImplementedError):  # sparse, or no storage of its own
            return None

    leaves = [p for p in (storage(t) for t in tree_leaves(output)) if p]
    if not leaves:
        return None
    weights = {p for p in (storage(w.param) for w in store.weights) if p}
    if weights.isdisjoint(leaves):
        return None
    return tree_map(lambda t: t.clone() if storage(t) in weights else t, output)


def refuse_recorded_graph(store: LayerStore, output: Any) -> None:
    """On the device path: refuse a layer output autograd recorded (it saved views of device buffers)."""
    import torch
    from torch.utils._pytree import tree_leaves

    if not torch.is_grad_enabled():
        return
    if any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_leaves(output)):
        raise OffloadedGradientError(
            f"layer {store.index} ({store.name}) recorded autograd through the device pipeline: autograd saved "
            "its weights, views of device buffers that later layers overwrite, so a backward (input gradients "
            f"included) would compute from other layers' weights. {_HOW}",
            layer=store.index, name=store.name, reason=RECORDED,
        )


WHAT = "the weights outside the managed layers"


def outside_tensors(model: torch.nn.Module, layers: list[torch.nn.Module]) -> tuple[list[torch.Tensor], tuple]:
    """CPU parameters and buffers of the modules outside ``layers`` that no manager offloads, each once;
    and a key of where they are held (module and address of each place, a tensor held twice
    counted twice: tying a head to an embedding changes it, though no tensor is added)."""
    from .placeholder import managed  # imports torch (the placeholders subclass nn.Parameter)
    from .plan import modules_outside

    seen: set[int] = set()
    out = []
    held = []
    for m in modules_outside(model, layers):
        for t in (*m._parameters.values(), *m._buffers.values()):
            if t is None or managed(t) or t.device.type != "cpu" or t.numel() == 0:
                continue
            try:
                ptr = t.data_ptr()
            except RuntimeError:  # no storage: a torch.func transform's wrapper of a tensor lent for a call
                continue
            held.append((id(m), ptr))
            if id(t) in seen:
                continue
            seen.add(id(t))
            out.append(t.detach())
    return out, tuple(held)


class OutsideWeights:
    """Checks, before a forward, that the outside weights' mapped files still reach the bytes mapped from them."""

    def __init__(self, model: torch.nn.Module, layers: list[torch.nn.Module], files: MappedFiles,
                 worker: PageWorker | None = None) -> None:
        self._model = model
        self._layers = layers
        self._files = files
        self._worker = worker  # the stack's page worker: streams the always-read weights (stream())
        self._streamed: list[_StreamedModule] = []  # each streamed module (removed: its hooks put back)
        self._stream_key: tuple | None = None  # (the outside weights' key, the unit) it was streamed for
        self.streamed_bytes = 0
        self._key: tuple[int, ...] | None = None
        # What RowChunks found, by the weight's geometry and rows a chunk: kept when streaming starts afresh (a new plan).
        self._verdicts: dict[tuple, dict[tuple, bool]] = {}
        self._extents: list[Extent] = []
        self._advised = None  # the lookup tables' spans, MADV_RANDOM while the guard is open
        self.table_bytes = 0  # bytes of the lookup tables advised

    def _advise_tables(self) -> None:
        """``MADV_RANDOM`` (no huge pages) over the outside weights' lookup tables: a fault reads its own page."""
        from ..memory.regions import tensor_extent
        from .plan import lookup_tables

        self._unadvise()
        tables = lookup_tables(self._model, self._layers)
        if not tables:
            return
        spans = layer_spans([tensor_extent(t) for t in tables])
        err = _core.advise_random(spans, True, False)
        if err:
            logger.info("lookup tables keep the kernel's fault-around (madvise MADV_RANDOM: errno %d)", err)
            _core.advise_random(spans, False)
            return
        self._advised = spans
        self.table_bytes = spans.total_bytes

    def _unadvise(self) -> None:
        if self._advised is not None:
            _core.advise_random(self._advised, False)
            self._advised, self.table_bytes = None, 0

    def close(self) -> None:
        """Set the lookup tables' advice back, stop streaming the always-read weights. Idempotent."""
        self._unadvise()
        self.stream(False)

    # -- the always-read weights streamed --------------------------------------------------------
    @property
    def streaming(self) -> bool:
        """Whether the always-read weights are streamed now (see :meth:`stream`)."""
        return bool(self._streamed)

    def stream(self, on: bool, unit: int = 0, step: int = 0) -> None:
        """Stream the weights outside the layers that every forward reads whole (``on``), or keep them
        cached as the kernel does (``off``): each module holding them reads them in before it runs and
        lets them go after; one whose weights exceed ``unit`` bytes (the plan's streaming window) is read
        by its own faults instead of in one read, or in chunks of its rows (:class:`RowChunks`) two to a
        ``step`` (the one layer or part the window holds ``1 + depth`` of; 0: ``unit``): chunks that do
        not change with the depth, so that what their checks found holds when the depth does. Idempotent;
        hooks and advice are put back when it stops."""
        if not on:
            for job in self._streamed:
                job.remove()
            self._streamed, self.streamed_bytes = [], 0
            return
        if self._streamed and (self._key, unit) != self._stream_key:
            self.stream(False)  # the outside weights or the plan's unit changed since: streamed afresh
        if self._streamed or self._worker is None:
            return
        self._stream_key = (self._key, unit)
        from ..pagecache.file_places import MapsView
        from .placeholder import managed
        from .plan import _is_lookup, always_read_tensors, modules_outside

        whole = {t.data_ptr() for t, _ in always_read_tensors(self._model, self._layers)}
        names = {id(m): n for n, m in self._model.named_modules()}
        layer_ids = {id(layer) for layer in self._layers}
        maps = MapsView()
        for module in modules_outside(self._model, self._layers):
            if _is_lookup(module):
                continue  # a lookup reads its rows (MADV_RANDOM), not the table: a head it is tied to reads it
            # Another stack's weights (a placeholder on the device path: no data to point at) are its own.
            mine = [p.data for p in module._parameters.values()
                    if p is not None and not managed(p) and p.data_ptr() in whole]
            if mine:
                name = names.get(id(module)) or type(module).__name__
                # One that runs the layers (the model itself, holding a weight of its own) is not wrapped:
                # the layers' guards see its interrupts, and its forward stays what torch.compile compiles.
                holds_layers = any(id(m) in layer_ids for m in module.modules())
                job = _StreamedModule(module, name, mine, self._worker, self._files, maps, unit,
                                      (self._verdicts, step or unit), guard=not holds_layers)
                self._streamed.append(job)
                self.streamed_bytes += job.bytes
        if self._streamed:
            logger.info("%s: %s read every forward are streamed (read in as their modules run, let go after)",
                        WHAT, format_bytes(self.streamed_bytes))

    def let_go_left(self) -> None:
        """Let go what a streamed module read in and an interrupt left cached (a ``KeyboardInterrupt`` in a
        hook around it, which neither its always-call hook nor its guarded forward sees): called as the
        next forward of the model starts."""
        for job in self._streamed:
            if job.inside:
                job.after(job.module, (), None)

    def _refresh(self) -> None:
        from ..memory.regions import MappedRegions, tensor_extent  # one definition of a tensor's bytes

        tensors, key = outside_tensors(self._model, self._layers)  # the lookup tables depend on their holders too
        if key == self._key:
            return
        on_mapping = MappedRegions().classify(tensors)
        spans = layer_spans([tensor_extent(t) for t, m in zip(tensors, on_mapping) if m])
        self._extents = file_extents(spans, self._files)
        self._advise_tables()
        self._key = key

    def check(self) -> None:
        """Raise MappingFaultError when a mapped file of the rest was truncated under it."""
        self._refresh()
        check_extents(self._extents, WHAT)


class _StreamedModule:
    """One module's always-read weights streamed: read in before it runs, let go after.

    Where they are larger than ``unit`` (the plan's streaming window), reading them in whole would push
    out the pages the plan keeps: the module's own faults read them as it computes (advised by the page
    worker), and they are let go after. The module computes as it would without a manager (one matmul),
    except where a :class:`RowChunks` has found the matmul over chunks of its rows bit-equal to it.

    Its hooks are :class:`~.hooks.Hook` s: a model is not copied or pickled while they are on (as the
    layers' hooks)."""

    def __init__(self, module, name: str, tensors, worker: PageWorker, files: MappedFiles, maps, unit: int,
                 chunking: tuple[dict, int] | None = None, guard: bool = True) -> None:
        from ..memory.regions import tensor_extent
        from ..pagecache.pages import folio_edges

        self.module, self.worker, self.files, self.unit = module, worker, files, unit
        self.spans = layer_spans([tensor_extent(t) for t in tensors])
        self.extents = file_extents(self.spans, files, maps)
        self.edges = folio_edges(self.spans, maps)
        self.bytes = self.spans.total_bytes
        self.read_whole = not unit or self.bytes <= unit
        worker.advise(self.spans, self.extents)
        verdicts, step = chunking if chunking is not None else (None, unit)
        self._own = vars(module).get("forward")  # the instance's own forward, if it had one
        self.rows = (None if self.read_whole
                     else RowChunks.of(module, name, tensors, worker, files, maps, step, verdicts))
        if not self.read_whole:
            logger.info("%s (%s) does not fit the %s the page-cache plan streams in: read by its own faults as "
                        "it computes%s, let go after", name, format_bytes(self.bytes), format_bytes(unit),
                        "" if self.rows is None else f" (or in {len(self.rows.chunks)} chunks of its rows where "
                        "that computes bit-equal: RowChunks)")
        self.inside = False  # read in by its pre-hook, not let go yet

        @functools.wraps(self._own or _class_forward(module))  # its signature, for whoever inspects it
        def streamed_forward(*args, **kwargs):
            return self.forward(*args, **kwargs)

        streamed_forward._streamed = self  # what streams it (for tools and tests)
        self._undo = [module.register_forward_pre_hook(Hook(self.before)).remove,
                      module.register_forward_hook(Hook(self.after), always_call=True).remove]
        if guard or self.rows is not None:  # (rows: a Linear's own weight, never a module holding layers)
            self._undo.append(wrap_forward(module, Hook(streamed_forward)).remove)

    def remove(self) -> None:
        for undo in self._undo:
            undo()
        self._undo = []
        if self.rows is not None:
            self.rows.stop()  # removed inside a chunk: the chunks left compute on, reading nothing
        _core.advise_random(self.spans, False)

    def forward(self, *args, **kwargs):
        """The module's forward (over its row chunks where it has them), letting its weights go on a
        ``KeyboardInterrupt`` or another ``BaseException`` that is not an ``Exception``: torch runs no
        always-call hook for those, and the weights stayed cached, over the plan, until its next run."""
        forward = self.rows.forward if self.rows is not None else self._own or _class_forward(self.module)
        try:
            return forward(*args, **kwargs)
        except Exception:
            raise  # torch runs the always-call hook
        except BaseException:
            self.after(self.module, args, None)
            raise

    def before(self, module, args) -> None:
        self.inside = True
        if self.read_whole:
            try:
                self.worker.read_in(self.spans, WHAT, self.edges, self.extents).result()
            except Exception:
                raise  # torch runs the always-call hook
            except BaseException:  # interrupted while reading in: what was read is let go as its forward's
                self.after(module, args, None)
                raise

    def after(self, module, args, output) -> None:
        self.inside = False
        self.worker.let_go(self.spans, self.extents)
        self.worker.drain()  # done before anything can write the weights in place (PageWorker.drain)


MAX_KINDS = 16  # kinds of input RowChunks checks; later ones compute whole (each check reads the head twice)
# The rows of a chunk, where half the step holds it beside the folio it shares: two 2 MiB folios, whatever the
# step. Chunks that grew with the step were cut afresh, and checked afresh (the head read twice, computed
# twice), each time the plan went from whole layers to parts and back over a run's first forwards.
CHUNK_BYTES = 2 * FOLIO_BYTES


class RowChunks:
    """A linear module's weight larger than the room, computed over chunks of its rows where that is exact.

    A head larger than the room is read by its own faults as its one matmul runs, and the matmul walks
    the weight more than once: several times its bytes a forward (issue 43, ``docs/benchmarks.md``).
    Over chunks of its rows (each ``F.linear`` of the input and the chunk's rows, into the output's
    columns), each chunk is read in whole on the page worker while the one before it computes, and let
    go after: the weight is read once, as many chunks at a time as the room holds, two at least (a chunk
    is at most half of the one layer or part the window holds ``1 + depth`` of).

    Whether the chunks compute the same bits as the whole matmul is the BLAS's matter: it picks its
    blocking and kernels by the shapes, strides, alignment and threads, never by the values, and the
    outputs are equal on some machines and not on others (issue 41: not on an Intel Xeon; on an AMD EPYC
    they were). So it is checked, once per kind of input (:meth:`signature`): the first call of a kind
    computes the whole matmul (read by its faults, as without chunks) and the chunks, returns the whole
    one, and keeps the chunks for later calls of that kind only where every output bit was equal. Where
    not, that kind is computed whole from then on (logged once). The check holds one chunk's output beside
    the whole one at a time. Past :data:`MAX_KINDS` kinds (a last-token slice's strides carry the prompt's
    length), new kinds compute whole unchecked. What the chunks do not fit computes as the module does
    (:meth:`_plain`): autograd recorded, autocast, sparse, nested or functorch-wrapped inputs, a weight
    whose data was replaced since the chunks were cut.
    """

    def __init__(self, module, name: str, weight, worker: PageWorker, chunks: list, whole: tuple,
                 exact: dict[tuple, bool] | None = None) -> None:
        self.module, self.name, self.weight, self.worker = module, name, weight, worker
        self.stopped = False  # the hooks that read the chunks were removed (stop())
        self.chunks = chunks  # (first row, end row, (spans, extents, edges) read, (spans, extents) let go) of each
        self.whole = whole  # (spans, extents) of the whole weight: the pages two chunks share let go too
        self.exact = {} if exact is None else exact  # signature -> the chunks computed the whole matmul's bits
        self.cut = (weight.data_ptr(), weight.shape, weight.stride())  # the weight the chunks' spans were cut from
        self.chunked_calls = 0
        self.on_last: Callable[[int], None] | None = None  # called with the bytes held as the last chunk computes
        self.shared = 0  # bytes two chunks share (a folio, where they are cut at folio boundaries)
        self.step = 0  # the bytes the chunks may hold in the page cache at once (more than two read ahead)

    @staticmethod
    def plain_weight(module, wrapped: bool = False):
        """``module``'s weight where it is a plain ``nn.Linear`` (its class's forward, and no forward of its
        own unless ``wrapped``: the caller's, which calls :meth:`forward`) over a contiguous 2-D CPU
        weight; else None."""
        import torch

        linear = isinstance(module, torch.nn.Linear) and _linear_forward(type(module))
        weight = module._parameters.get("weight") if linear and (wrapped or "forward" not in vars(module)) else None
        if weight is None or weight.dim() != 2 or not weight.is_contiguous() or weight.device.type != "cpu":
            return None
        return weight

    @classmethod
    def of(cls, module, name: str, tensors, worker: PageWorker, files: MappedFiles, maps, step: int,
           verdicts: dict | None = None, *, wrapped: bool = False):
        """The row chunks of ``module``'s weight, or None where it is not a plain linear over a 2-D weight
        (:meth:`plain_weight`) among ``tensors`` (the mapped weights streamed) that splits into at least two
        chunks, each a power of two rows of at most :data:`CHUNK_BYTES` where half of ``step`` (the one
        computing and the one read ahead) holds that beside a folio, else of at most half of ``step``:
        chunks that do not change with the plan unless its step is that small. ``verdicts``: where the
        checks are kept, by the weight's geometry and the rows a chunk (a module of the same geometry, or
        the streaming started afresh, takes what was found)."""
        from ..memory.regions import tensor_extent
        from ..pagecache.pages import folio_edges

        weight = cls.plain_weight(module, wrapped)
        if weight is None or not any(t.data_ptr() == weight.data_ptr() for t in tensors):
            return None
        row = weight.shape[1] * weight.element_size()
        half = step // 2
        folios = half - FOLIO_BYTES >= CHUNK_BYTES  # chunks of two folios: cut at folio boundaries
        per = (CHUNK_BYTES if folios else half) // row if row else 0
        per = 1 << (per.bit_length() - 1) if per else 0  # a power of two of rows
        if per < 1 or per >= weight.shape[0]:
            return None
        start, place = weight.data_ptr(), maps.place(weight.data_ptr())
        rows = [*range(0, weight.shape[0], per), weight.shape[0]]
        if folios and place is not None:
            # Read and let go by whole 2 MiB windows of the file: a chunk's read takes the folio its last row
            # ends in (the next chunk's first rows), its let-go stops before it. Cut at its rows instead,
            # each chunk's two ends would be read as 4 KiB pages (up to 4 MiB of them a chunk), not folios.
            def cut(r: int, up: bool) -> int:
                if r in (0, weight.shape[0]):
                    return start + r * row
                off = place.offset + r * row
                at = start + r * row - off % FOLIO_BYTES + (FOLIO_BYTES if up and off % FOLIO_BYTES else 0)
                return min(max(at, start), start + weight.shape[0] * row)  # never past the weight's ends
        else:
            def cut(r: int, up: bool) -> int:
                return start + r * row
        chunks = []
        for lo, hi in zip(rows, rows[1:]):
            spans = layer_spans([(cut(lo, True), cut(hi, True) - cut(lo, True))])
            gone = layer_spans([(cut(lo, False), cut(hi, False) - cut(lo, False))])
            chunks.append((lo, hi, (spans, file_extents(spans, files, maps), folio_edges(spans, maps)),
                           (gone, file_extents(gone, files, maps))))
        whole = layer_spans([tensor_extent(weight)])
        geometry = (tuple(weight.shape), tuple(weight.stride()), weight.dtype, weight.data_ptr() % 64, per)
        exact = None if verdicts is None else verdicts.setdefault(geometry, {})
        rows = cls(module, name, weight, worker, chunks, (whole, file_extents(whole, files, maps)), exact)
        rows.shared = FOLIO_BYTES if folios and place is not None else 0
        rows.step = step
        return rows

    def signature(self, x, weight, bias) -> tuple:
        """What the BLAS chooses its blocking by: shapes, strides, dtypes, alignment, threads, and the
        settings that pick another kernel (oneDNN on or off, the fp32 matmul precision)."""
        import torch

        return (tuple(x.shape), tuple(x.stride()), x.dtype, x.data_ptr() % 64, weight.dtype, bias is None,
                bias.dtype if bias is not None else None, torch.get_num_threads(),
                torch.backends.mkldnn.enabled, _matmul_precision())

    def _plain(self, x, weight, bias) -> bool:
        """Whether this call may take the chunks (else the module's own forward): a plain strided CPU tensor
        (not a subclass, sparse, nested or a functorch transform's), the weight the chunks were cut from (the same
        storage, shape and strides), no autograd recorded, no autocast, ``nn.Linear``'s own forward."""
        import torch

        if type(x) is not torch.Tensor or x.layout is not torch.strided or x.is_nested or x.device.type != "cpu":
            return False  # a subclass's own ops (and the type of what they return) are its forward's matter
        wrapped = getattr(getattr(torch._C, "_functorch", None), "is_functorch_wrapped_tensor", None)
        if wrapped is not None and wrapped(x):
            return False
        if weight is not self.weight or (weight.data_ptr(), weight.shape, weight.stride()) != self.cut:
            return False
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)):
            return False
        if torch.is_autocast_enabled("cpu"):
            return False
        return _linear_forward(type(self.module))

    def stop(self) -> None:
        """The manager's hooks were removed (or it closed), maybe inside a chunk: the chunks left of a call
        compute on from the mapping (their faults read them), and nothing more is asked of the page worker."""
        self.stopped = True

    def will_chunk(self, args: tuple) -> bool:
        """Whether a call with positional ``args`` computes over the chunks (a kind found exact), each
        read by :meth:`parts`: a caller that reads the whole weight first need not."""
        x = args[0] if len(args) == 1 else None
        weight, bias = self.module._parameters.get("weight"), self.module._parameters.get("bias")
        return self._plain(x, weight, bias) and self.exact.get(self.signature(x, weight, bias)) is True

    def forward(self, *args, **kwargs):
        """The module's forward (``nn.Linear.forward``'s one input, by position or as ``input=``): whole,
        or over the chunks where a call of this kind was found exact."""
        import torch
        import torch.nn.functional as F

        module = self.module
        x = args[0] if len(args) == 1 and not kwargs else kwargs.get("input") if not args and len(kwargs) == 1 else None
        weight, bias = module._parameters.get("weight"), module._parameters.get("bias")
        if not self._plain(x, weight, bias):
            return _class_forward(module)(*args, **kwargs)
        key = self.signature(x, weight, bias)
        exact = self.exact.get(key)
        if exact is None and len(self.exact) >= MAX_KINDS:
            exact = False  # not checked: computed whole, as without chunks
        if exact is False:
            return F.linear(x, weight, bias)
        if exact is None:
            whole = F.linear(x, weight, bias)  # as without chunks: read by its faults
            with contextlib.closing(self.parts(x, weight, bias)) as parts:  # closed whatever leaves the check
                exact = all(_same_bits(part, whole[..., lo:hi]) for lo, hi, part in parts)
            self.exact[key] = exact  # one chunk's output beside the whole one at a time
            logger.info("%s: its matmul over %d chunks of rows %s the whole one for inputs of shape %s on %d "
                        "threads: %s", self.name, len(self.chunks), "computes every bit of" if exact else
                        "does not compute the bits of", tuple(x.shape), torch.get_num_threads(),
                        "chunks read ahead from now on" if exact else "computed whole (read by its faults)")
            return whole
        self.chunked_calls += 1
        out = None
        with contextlib.closing(self.parts(x, weight, bias, last=self.on_last)) as parts:
            for lo, hi, part in parts:
                if out is None:
                    out = torch.empty(*part.shape[:-1], weight.shape[0], dtype=part.dtype, device=part.device)
                out[..., lo:hi] = part
        return out

    def parts(self, x, weight, bias, last: Callable[[int], None] | None = None):
        """``(first row, end row, F.linear over those rows)`` of each chunk in turn, each chunk read in on
        the page worker while the ones before it compute (as many ahead as fit the step, one at least),
        and let go after; ``last(bytes held)`` called as the last chunk is about to compute (what reads
        behind it). Left early (an error, a KeyboardInterrupt, a check that found a chunk unequal), what
        was read ahead is let go."""
        import torch.nn.functional as F

        n = len(self.chunks)
        reads: list = [None] * n
        asked = 0  # the chunks whose reads were asked
        done = False
        try:
            for j, (lo, hi, _, gone) in enumerate(self.chunks):
                # The next chunks, as many as fit the step beside this one (the next always does), each queued
                # after the let-go of the chunk before: a read waits for the let-gos asked before it.
                while asked < n and (asked <= j + 1 or self._fit(j, asked)):
                    reads[asked] = self._read(asked)
                    asked += 1
                if reads[j] is not None:
                    reads[j].result()
                if j + 1 == n and last is not None and not self.stopped:
                    last(self.chunks[j][2][0].total_bytes + self.shared)  # its rows and what it shares
                yield lo, hi, F.linear(x, weight[lo:hi], None if bias is None else bias[lo:hi])
                if not self.stopped:
                    self.worker.let_go(*gone)
            done = True
        finally:
            if not done and not self.stopped:
                self.worker.let_go(*self.whole)  # queued after the reads in flight
                self.worker.drain()

    def _fit(self, j: int, last: int) -> bool:
        """Whether chunks ``j`` to ``last`` fit the step together, with the folio chunk ``j`` shares with the
        one before (in the page cache until ``j`` is let go)."""
        return self.shared + sum(c[2][0].total_bytes for c in self.chunks[j:last + 1]) <= self.step

    def _read(self, j: int):
        lo, hi, (spans, extents, edges), _ = self.chunks[j]
        if not spans.total_bytes or self.stopped:
            return None  # its rows' folios came with the chunk before
        return self.worker.read_in(spans, f"{self.name} (rows {lo}-{hi})", edges, extents)


def _linear_forward(cls) -> bool:
    """Whether ``cls.forward`` is ``nn.Linear``'s own as torch defines it: not a forward patched onto
    ``nn.Linear`` (before mapoffload was imported or after), which the chunks would not compute."""
    import torch

    forward = getattr(cls, "forward", None)
    code = getattr(forward, "__code__", None)
    return (forward is torch.nn.Linear.forward and code is not None and code.co_name == "forward"
            and getattr(forward, "__qualname__", None) == "Linear.forward"
            and code.co_filename.replace("\\", "/").endswith("torch/nn/modules/linear.py"))


def _matmul_precision() -> tuple:
    """The fp32 matmul precision settings (a kind of input's part: one may pick a bf16 kernel). Read one
    by one: ``torch.get_float32_matmul_precision()`` raises where one backend's ``fp32_precision`` was set
    through the newer API."""
    import torch

    def read(get):
        try:
            return str(get())
        except Exception:  # absent in this torch, or refused (the legacy and the new API mixed)
            return None

    backends = torch.backends
    return (read(torch.get_float32_matmul_precision), read(lambda: backends.fp32_precision),
            read(lambda: backends.mkldnn.fp32_precision), read(lambda: backends.mkldnn.matmul.fp32_precision))
