"""One stack's forward: the hooks torch calls, and what each does, in the order a forward runs them.

Once per forward of the model (its pre-hook, before anything reads the mapping): follow the cap, count
the forward for the page-cache coordinator, let the ``reads`` policy choose, check the mapped weights
outside the layers and stream them where the plan has no room for them. Per layer (its pre-hook,
holding the layer turn): autograd's rule (refused on reused device buffers; in place, a layer read
ahead into a reused read-around buffer is read again through its mapping), then the sequencer's step:
the layer loaded (the load target's ``ready``: the copy, or the read in place), the window the plan
allows read ahead. After the layer (its always-call post-hook): its release and the recorded-graph
check. Where the plan reads streamed layers part by part, each part's hooks read it in (the next parts'
reads started behind it, to run while it computes, as deep as the plan's room) and let it go.
Once the forward ended: what it added to the process's anonymous memory goes to the coordinator.

One layer runs at a time (:class:`LayerTurn`): from its pre-hook to its post-hook the layer owns the
manager's loaded layers and device pool. Without that, one thread's hooks would release and recycle
buffers another thread's layer is computing with. Another thread's layer waits; the owning thread may
nest (a model run re-entrantly); a dead owner does not block anyone.

torch runs always-call post-hooks for an ``Exception`` only: a KeyboardInterrupt (the manager's own
interruptible wait included), SystemExit or GeneratorExit inside a layer skips them. The layer's
forward is wrapped (through ``patches``, the one registry of what mapoffload sets on a module), and the
pre-hook guards itself, so that whatever leaves the layer finishes its turn; a per-thread record of the
turns held (:meth:`LayerTurn.held`) makes finishing twice harmless.
"""

from __future__ import annotations

import functools
import threading
from typing import TYPE_CHECKING, Any

from ..memory.budget import release_freed_memory, rss_anon_bytes
from ..pagecache import coordinator as _coordinator
from ..pagecache.coordinator import coordinator
from .eager import Hook
from .grads import refuse_recorded_graph, refuse_weight_gradients
from .patches import wrap_forward

if TYPE_CHECKING:
    from ..pagecache.member import StackMember
    from ..pagecache.read_policy import ReadPolicy
    from .rest import RestGuard
    from .sequencer import Sequencer

__all__ = ["LayerTurn", "StackRuntime"]


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
        The stack's page-cache member (its plan, its forwards counted).
    reads
        The stack's ``reads`` policy.
    rest
        The mapped weights outside the layers, checked once per forward.
    in_place
        The layers compute from their host stores (``device="cpu"``).
    owner
        A weak reference to the manager (named when a copy of the model is refused).
    """

    def __init__(self, sequencer: Sequencer, member: StackMember, reads: ReadPolicy, rest: RestGuard, *,
                 in_place: bool, owner: Any = None) -> None:
        self.turn = LayerTurn()  # the stack's: the manager takes it too, to remove the hooks or close
        self.sequencer = sequencer
        self.member = member
        self.reads = reads
        self.rest = rest
        self.in_place = in_place
        self.owner = owner
        self.handles: list = []  # each with remove()
        self.part_handles: list = []  # the layers' parts' hooks, while streamed layers are read part by part
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
        self.sequencer.pages.let_go_ahead()  # removed inside a forward: what it read ahead
        self.rest.stream(False)

    # -- once per forward of the model -------------------------------------------------------
    def _before_forward(self, module: Any, args: Any) -> None:
        """Follow the cap (and what the process holds), check the mapped weights outside the layers,
        stream them where the plan has no room for them; hook the layers' parts while the plan reads
        streamed layers part by part."""
        c = coordinator()
        c.follow_cap()
        c.note_forward(self.member)
        self.reads.choose()
        self.rest.check()
        plan = self.member.residency
        self.rest.stream(plan is not None and plan.rest_streamed, plan.window_bytes if plan is not None else 0)
        self._anon = self._peak = (_anon() or None) if c.samples_anon else None  # 0: unreadable, not measured
        self._forward.on = True  # in a forward of the model: parts read ahead may cross from layer to layer
        self.sequencer.pages.let_go_ahead()  # what an interrupted forward read ahead; the order learnt afresh
        if self.sequencer.pages.in_parts:
            self._register_parts()
        else:
            self._remove_parts()

    def _after_forward(self, module: Any, args: Any, output: Any) -> None:
        """Once a forward of the model ended (or raised): what it added to the process's anonymous memory
        at its peak goes to the coordinator (the next plan's margin), and the memory its activations
        were freed from goes back to the kernel.

        glibc keeps freed blocks below its (growing) mmap threshold in its arenas, one per thread that
        allocated: measured on this project's Llama under a cap, a process held 381-421 MiB of anonymous
        memory between forwards with that retention and 332 MiB without it, a forward's peak 396-414 MiB
        against 377 MiB - tens of MiB the page cache, and so the layers, lose at every forward. Under a
        cap (while measuring) ``malloc_trim`` gives them back after each forward (a few milliseconds).

        The forward returns once its let-gos are done (:meth:`~mapoffload.pagecache.layer_pages.LayerPages.settle`):
        the user's code may write a weight in place next, which a let-go still in flight would drop.
        Parts read ahead that did not run (the forward went another way, or raised) are let go first."""
        self._forward.on = False
        self.sequencer.pages.let_go_ahead()
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
            """Layer ``i`` is about to run: take the turn, then autograd's rule, then the sequencer's
            step (the layer loaded - its copy, or its read in place - and the window read ahead)."""
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
                if seq.pages.in_parts and seq.pages.streams(i):
                    # Under a room below one layer the allocator's freed blocks are the room: what the
                    # layers before freed goes back before this one reads its parts in (measured on
                    # capped_forward.py's Llama: a forward's peak 418-427 MiB without, 377-379 MiB
                    # with; a few ms a forward).
                    release_freed_memory()
                self._sample()
                if torch.is_grad_enabled():
                    if not self.in_place:
                        refuse_weight_gradients(seq.stores[i])
                    elif i in seq.loaded and seq.loads.reuses(seq.loaded[i]):
                        seq.release(i)  # read ahead into a reused buffer: autograd reads it through its mapping
                seq.enter(i, seq.window(i, self.member.residency))
            except Exception:
                raise  # torch runs the always-call post-hook, which finishes the turn
            except BaseException:
                self.finish_layer(i)
                raise

        return pre_hook

    def _post_hook(self, i: int):
        def post_hook(module, args, output):
            self.finish_layer(i)
            seq = self.sequencer
            if seq.loads.recycles(i):  # autograd must not have saved views of reused device buffers
                refuse_recorded_graph(seq.stores[i], output)

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
                self.sequencer.pages.let_go_ahead()  # what was read ahead is let go, nothing left in flight
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
            self.sequencer.exit(i)
        finally:
            self.turn.leave()
        if not held and not getattr(self._forward, "on", False):
            # A layer called on its own (not in a forward of the model): what it read ahead of the next
            # layer is let go, and its let-gos done, before the user's code runs again.
            self.sequencer.pages.let_go_ahead()
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
        self.part_handles = hooks

    def _remove_parts(self) -> None:
        for h in self.part_handles:
            h.remove()
        self.part_handles = []

    def _part_pre_hook(self, i: int, k: int):
        def pre_hook(module, args):
            """Part ``k`` of layer ``i`` is about to run: read it in, when its layer streams part by part
            (inside layer ``i``'s turn: a part called on its own is no layer's)."""
            pages = self.sequencer.pages
            if i not in self.turn.held() or not pages.in_parts or not pages.streams(i):
                return
            load = self.sequencer.loaded.get(i)
            if load is None or load.around is not None:
                return  # not loaded by this stack's turn, or read around the page cache whole
            self._sample()
            read = pages.enter_part(i, k)  # and the next parts' reads started behind it, as the room allows
            if read is not None:
                read.result()

        return pre_hook

    def _part_post_hook(self, i: int, k: int):
        def post_hook(module, args, output):
            """Part ``k`` of layer ``i`` ran: let it go, when its layer streams part by part."""
            pages = self.sequencer.pages
            if i in self.turn.held() and pages.in_parts and pages.streams(i):
                pages.let_go_part(i, k)

        return post_hook


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
