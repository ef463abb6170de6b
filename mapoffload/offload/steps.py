"""The per-forward policy around the sequencer: what the hooks (``turn.py``) run.

Once per forward of the model (before anything reads the mapping): follow the cap, count the forward
for the page-cache coordinator, let the ``reads`` policy choose, check the mapped weights
outside the layers. Per layer: autograd's rule (refused on reused device buffers; in place, a layer
read ahead into a reused read-around buffer is read again through its mapping), the streaming window
the plan allows, then the sequencer's step; after the layer, its release and the recorded-graph check.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..memory.budget import release_freed_memory, rss_anon_bytes
from ..pagecache import coordinator as _coordinator
from ..pagecache.coordinator import coordinator
from .grads import refuse_recorded_graph, refuse_weight_gradients

if TYPE_CHECKING:
    from ..pagecache.member import StackMember
    from .rest import RestGuard
    from .sequencer import Sequencer
    from ..pagecache.read_policy import ReadPolicy

__all__ = ["Steps"]


class Steps:
    """The hooks' work for one stack: :meth:`before_forward`, :meth:`start`, :meth:`finish`, :meth:`after`.

    Parameters
    ----------
    sequencer
        The stack's sequencer (its loads, stores and window).
    member
        The stack's page-cache member (its plan, its forwards counted).
    reads
        The stack's ``reads`` policy.
    rest
        The mapped weights outside the layers, checked once per forward.
    in_place
        The layers compute from their host stores (``device="cpu"``).
    """

    def __init__(self, sequencer: Sequencer, member: StackMember, reads: ReadPolicy, rest: RestGuard, *,
                 in_place: bool) -> None:
        self.sequencer = sequencer
        self.member = member
        self.reads = reads
        self.rest = rest
        self.in_place = in_place
        self._anon: int | None = None  # RssAnon at this forward's start (None: not measuring)
        self._peak = 0  # the most sampled since

    def before_forward(self, module: Any, args: Any) -> None:
        """Once per forward of the model: follow the cap (and what the process holds), check the mapped
        weights outside the layers, stream them where the plan has no room for them."""
        c = coordinator()
        c.follow_cap()
        c.note_forward(self.member)
        self.reads.choose()
        self.rest.check()
        plan = self.member.residency
        self.rest.stream(plan is not None and plan.rest_streamed, plan.window_bytes if plan is not None else 0)
        self._anon = self._peak = (_anon() or None) if c.samples_anon else None  # 0: unreadable, not measured

    def after_forward(self) -> None:
        """Once a forward of the model ended (or raised): what it added to the process's anonymous memory
        at its peak goes to the coordinator (the next plan's margin), and the memory its activations
        were freed from goes back to the kernel.

        glibc keeps freed blocks below its (growing) mmap threshold in its arenas, one per thread that
        allocated: measured on this project's Llama under a cap, a process held 381-421 MiB of anonymous
        memory between forwards with that retention and 332 MiB without it, a forward's peak 396-414 MiB
        against 377 MiB - tens of MiB the page cache, and so the layers, lose at every forward. Under a
        cap (while measuring) ``malloc_trim`` gives them back after each forward (a few milliseconds)."""
        if self._anon is not None:
            self._sample()
            coordinator().note_forward_growth(self._peak - self._anon)
            self._anon = None
            release_freed_memory()

    def _sample(self) -> None:
        """The process's anonymous memory now, into this forward's peak (sampled while measuring)."""
        if self._anon is not None:
            self._peak = max(self._peak, _anon())

    @property
    def wants_parts(self) -> bool:
        """Whether streamed layers are read part by part now (their parts' hooks are then on)."""
        return self.sequencer.pages.in_parts

    def start_part(self, i: int, k: int) -> None:
        """Part ``k`` of layer ``i`` is about to run: read it in, when its layer streams part by part."""
        pages = self.sequencer.pages
        if not pages.in_parts or not pages.streams(i):
            return
        load = self.sequencer.loaded.get(i)
        if load is None or load.around is not None:
            return  # not loaded by this stack's turn, or read around the page cache whole
        self._sample()
        read = pages.read_part(i, k)
        if read is not None:
            read.result()

    def finish_part(self, i: int, k: int) -> None:
        """Part ``k`` of layer ``i`` ran: let it go, when its layer streams part by part."""
        pages = self.sequencer.pages
        if pages.in_parts and pages.streams(i):
            pages.let_go_part(i, k)

    def start(self, i: int) -> None:
        """The pre-hook's work, holding the turn: load layer ``i``, start the read-ahead."""
        import torch

        seq = self.sequencer
        if seq.pages.in_parts and seq.pages.streams(i):
            # Under a room below one layer the allocator's freed blocks are the room: what the layers
            # before freed goes back before this one reads its parts in (measured on capped_forward.py's
            # Llama: a forward's peak 418-427 MiB without, 377-379 MiB with; a few ms a forward).
            release_freed_memory()
        self._sample()
        if torch.is_grad_enabled():
            if not self.in_place:
                refuse_weight_gradients(seq.stores[i])
            elif i in seq.loaded and seq.loads.reuses(seq.loaded[i]):
                seq.release(i)  # read ahead into a reused buffer: autograd reads it through its mapping
        seq.enter(i, seq.window(i, self.member.residency))

    def finish(self, i: int) -> None:
        """Layer ``i`` is done (its post-hook, or whatever left it): released unless it stays."""
        self.sequencer.exit(i)

    def after(self, i: int, output: Any) -> None:
        """After layer ``i`` computed: autograd must not have saved views of reused device buffers."""
        seq = self.sequencer
        if seq.loads.recycles(i):
            refuse_recorded_graph(seq.stores[i], output)


def _anon() -> int:
    """RssAnon, read where the coordinator reads the cgroups (tests point both at a fake tree)."""
    return rss_anon_bytes(root=_coordinator.CGROUP_ROOT)
