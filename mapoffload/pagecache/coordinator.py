"""The process's page-cache coordinator: one budget for every offload manager.

The page cache a process may fill belongs to the host (its cgroup), not to
one stack. Every :class:`~mapoffload.LayerwiseOffloadManager` registers its stack
here (a :class:`~mapoffload.pagecache.member.StackMember`) when it is made and
leaves when it closes; the coordinator talks to members only; each registration, each departure
and each change of the cgroup's cap (checked at most once per forward) makes
one plan for all of them (:func:`~mapoffload.pagecache.residency.plan_shared`):

- the budget is measured with every registered layer's resident bytes and the always-read
  weights outside the stacks (a head; once, whichever stacks share a model) as the weights' own,
  and again when what the process holds or a forward adds moved (``room.py``, issue 35);
- stacks run one after another: one streaming window (the largest a stack needs) is kept;
- a manager given ``page_cache_bytes`` keeps that share and the others plan
  around it;
- under a cgroup's cap, the cached set may fill most of the budget's margin
  (``PageCacheBudget.cache_extra``: the kernel can reclaim cached pages, so
  a margin too thin there costs re-reads, never the OOM killer); a cached
  layer used before under its plan is checked (``mincore``) to be still
  resident when it is used again, and once the kernel took some, the plans
  keep the whole margin (from the next forward) until the cap changes;
- other processes under the same cap (local ranks, replicas) are read from
  their records (``peers.py``): ranks mapping other bytes split the budget by
  their mapped bytes, and what they hold now is added back to the measure;
  replicas mapping the same bytes share the cached set once and keep a
  window each.

The plan is logged (one line per stack and one for the whole) and visible:
:meth:`PageCacheCoordinator.describe`, :meth:`layer_residency`, and the
``page cache`` line of ``summary()``.
"""

from __future__ import annotations

import atexit
import os
import threading
import weakref
from dataclasses import replace
from typing import TYPE_CHECKING

from .._log import format_bytes, logger
from .member import always_read_of, cached_lost, file_ranges_of, planned_buffers
from .peers import PeerLink, PeerRegistry
from .residency import plan_residency, plan_shared, smallest_window
from .room import ForwardMemory, LastMeasure, anon_now, cap_text as _cap_text, read_cap, refuse_without_room
from .uncached_fit import uncached_fits

if TYPE_CHECKING:
    from ..memory.budget import PageCacheBudget
    from .member import StackMember

__all__ = ["CGROUP_ROOT", "PageCacheCoordinator", "coordinator"]

CGROUP_ROOT = "/"  # prefix of the /proc and /sys paths the plan reads (tests point it at fake trees)


class PageCacheCoordinator:
    """One page-cache budget for every offload manager of this process.

    Attributes
    ----------
    budget
        The last measured :class:`~mapoffload.memory.budget.PageCacheBudget` (None
        before a measured plan).
    room
        Bytes the registered stacks' layers may fill, after the always-read
        weights, given shares and other processes' shares.
    replicas, ranks
        Other processes found at the last plan mapping the same bytes
        (sharing the cached set) or other bytes (splitting the budget).
    """

    def __init__(self, registry: PeerRegistry | None = None) -> None:
        self._lock = threading.RLock()
        self._members: list[weakref.ref] = []
        self.peers = PeerLink(registry, lambda: CGROUP_ROOT)  # read at the registry's making: tests move it
        self._cap: int | None = None
        self.budget: PageCacheBudget | None = None
        self.room = 0
        self.window_buffers = 0
        self.working_buffers = 0  # staging rings and CPU-twin buffers the plan charges (StackMember.host_bytes)
        self.buffers = 0  # uncached buffers the plan charges (UncachedSource.planned_bytes, every member)
        self.always_bytes = 0
        self.replicas: list[int] = []
        self.ranks: list[int] = []
        # The cached set's thin margin (budget.cache_extra): in use while the
        # cached layers stay resident from one forward to the next.
        self.cache_extra = 0
        self.thin_margin_failed = False
        self._others = 0  # bytes the ranks under this cap map (the split's other side)
        # The weights every forward reads outside the stacks do not fit beside the streaming window:
        # read as they run and let go after (the plans say so: ResidencyPlan.always_streamed).
        self.always_streamed = False
        self.memory = ForwardMemory()  # what forwards add at their peak, what the process held at the measure
        self._last = LastMeasure()  # the last measured plan's inputs (see _place_last)
        # Forwards each registered manager began (note_forward), for streamed_since.
        self._forward_counts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # Plan again at the next forward whatever the cap and the peers say:
        # a member was collected without close(), the last plan was cut short,
        # or this is a forked child (whose record is still to be published).
        self._stale = False

    # -- membership --------------------------------------------------------------------------
    def members(self) -> list[StackMember]:
        """The registered members still alive, in registration order."""
        return [m for m in (r() for r in self._members) if m is not None]

    def managers(self) -> list[object]:
        """The managers (owners) of the registered members still alive, in registration order."""
        return [o for o in (m.owner for m in self.members()) if o is not None]

    def join(self, member: StackMember) -> None:
        """Register a stack and plan again for all (a member whose plan failed is not registered)."""
        with self._lock:
            self._members = [r for r in self._members if r() is not None and r() is not member]
            self._members.append(weakref.ref(member, self._collected))
            try:
                self._plan()
                refuse_without_room(member, CGROUP_ROOT)
            except BaseException:
                self._members = [r for r in self._members if r() is not None and r() is not member]
                raise

    def _collected(self, ref: weakref.ref) -> None:
        """A member was garbage-collected without close(): the others plan without it at their next forward."""
        self._stale = True
        with self._lock:
            self._members = [r for r in self._members if r is not ref and r() is not None]
            if not any(m.given is None for m in self.members()):
                self.peers.withdraw()  # no measured manager maps those bytes now

    def leave(self, member: StackMember) -> None:
        """Unregister a stack; the others share what it leaves."""
        with self._lock:
            before = len(self._members)
            self._members = [r for r in self._members if r() is not None and r() is not member]
            if len(self._members) == before:
                return
            if self._members:
                self._plan()
            else:
                self.peers.withdraw()
                self.thin_margin_failed = False  # the next model's forwards are its own: it tries the thin share
                self.cache_extra = 0

    def after_fork_in_child(self) -> None:
        self._lock = threading.RLock()
        self.peers.published = None  # the record is the parent's; publish our own at our next plan
        self._stale = True  # which is the next forward's (the cap and the folder did not change)

    # -- forwards ----------------------------------------------------------------------------
    def note_forward(self, member: StackMember) -> None:
        """A forward of ``member``'s model began (counted for :meth:`streamed_since`)."""
        with self._lock:
            self._forward_counts[member] = self._forward_counts.get(member, 0) + 1

    def streamed_since(self, marks: dict[int, int] | None) -> tuple[int, dict[int, int]]:
        """``(bytes, marks now)``: what the plans stream in the forwards every registered manager
        began since ``marks`` (the marks an earlier call returned; None: nothing yet, 0 bytes),
        plus the weights every forward reads outside the stacks once per forward of the manager
        that ran most. A process's read counter over the same interval is judged against it."""
        with self._lock:
            counts = {id(m): (m, c) for m, c in self._forward_counts.items()}
        now = {k: c for k, (_, c) in counts.items()}
        if marks is None:
            return 0, now
        expected = most = 0
        for k, (m, c) in counts.items():
            ran = c - marks.get(k, 0)
            if ran > 0 and m.residency is not None:
                expected += ran * m.residency.streamed_bytes
            most = max(most, ran)
        return expected + most * self.always_bytes, now

    # -- what a forward holds -------------------------------------------------------------------
    @property
    def forward_bytes(self) -> int | None:
        """The anonymous memory a forward adds at its peak, as measured (:class:`.room.ForwardMemory`)."""
        return self.memory.forward_bytes

    @property
    def samples_anon(self) -> bool:
        """Whether the stacks sample their forwards' anonymous memory: under a cgroup's cap, where the
        plan's margin is measured (``page_cache_budget(forward_bytes=...)``)."""
        return self._cap is not None

    def note_forward_growth(self, grown: int) -> None:
        """A forward ended having added ``grown`` bytes of anonymous memory at its peak (sampled at each
        layer and at its end); the next forward measures the budget again when that moved the margin."""
        with self._lock:
            self.memory.note(grown, self._cap)

    # -- planning ----------------------------------------------------------------------------
    def replan(self) -> None:
        """Measure and plan again for every registered manager."""
        with self._lock:
            self._plan()

    def follow_cap(self) -> None:
        """Plan again when the cgroup's cap or a peer's record changed since the last plan.

        Cheap enough for every forward: a few small cgroup files and a
        listing of the peers' folder (a ``stat`` per record); the plan (a
        ``mincore`` over the layers) runs only on a change.
        """
        if not any(m.given is None for m in self.members()):
            return
        cap, stamp = read_cap(CGROUP_ROOT), self.peers.stamp_now()
        lost = cached_lost(self.members()) if self.cache_extra else 0
        thin_failed = lost > 0
        moved = self.memory.grown or self.memory.moved(self._cap, CGROUP_ROOT)
        if not self._stale and cap == self._cap and stamp == self.peers.stamp and not thin_failed and not moved:
            return
        held_moved = False
        with self._lock:
            if thin_failed and cap == self._cap:
                self.thin_margin_failed = True
                logger.info("the kernel took %s of the cached layers under the cap: the cached set keeps the "
                            "whole margin from now on (%s of weights less cached)", format_bytes(lost),
                            format_bytes(self.cache_extra))
                if not self._stale and stamp == self.peers.stamp:
                    # Nothing else changed: the last measure, without the thin share. (Measured
                    # again now, "other memory" would hold what the forward's activations left
                    # in the allocator, which the margin is already there for.)
                    self._place_last(cache_extra=0)  # without the thin share
                    return
            if self._stale:
                logger.debug("planning the page cache again (a member gone, a plan cut short, or a fork)")
            elif cap != self._cap:
                logger.info("memory cap changed (%s -> %s): planning the page cache again",
                            _cap_text(self._cap), _cap_text(cap))
            elif moved and stamp == self.peers.stamp:
                held_moved = True  # only what the process holds moved: the last full measure, adjusted
                logger.info("the process holds %s of anonymous memory (%s at the last plan; a forward adds %s at "
                            "its peak): planning the page cache again", format_bytes(anon_now(CGROUP_ROOT)),
                            format_bytes(self.memory.at_measure), format_bytes(self.forward_bytes or 0))
            else:
                logger.info("another process under this cap changed its page-cache record: planning again")
            self._plan(held_moved=held_moved)

    def _plan(self, *, held_moved: bool = False) -> None:
        self._stale = False
        try:
            self._plan_all(held_moved)
        except BaseException:
            self._stale = True  # cut short (Ctrl-C, a failure): the next forward plans again
            raise

    def _plan_all(self, held_moved: bool = False) -> None:
        from ..memory.budget import page_cache_budget
        from ..memory.regions import resident_bytes

        members = self.members()
        measured = [m for m in members if m.given is None]
        given = [m for m in members if m.given is not None]
        for m in given:
            m.watch(False)  # a share of its own: no thin margin to check
            plan = plan_residency(m.sizes(), m.given, prefetch_layers=m.prefetch_layers)
            m.apply(plan, f"page cache for these layers: {format_bytes(m.given)} (given)")
        if not measured:
            if self.peers.published is not None:
                self.peers.withdraw()  # the record named measured managers' bytes: none is left to share them
            # Nothing of the last measured plan stays shown or expected (the budget, the head's bytes, the
            # buffers charged, the peers): the room is the given shares.
            self.budget, self.room, self._last = None, sum(m.given for m in given), LastMeasure()
            self.window_buffers = self.working_buffers = self.buffers = self.always_bytes = self.cache_extra = 0
            self.always_streamed = False
            self.replicas, self.ranks, self._others = [], [], 0
            return
        always = always_read_of(measured)
        self.always_bytes = sum(n for _, n in always)
        cached = sum(sum(m.resident_bytes()) for m in measured)
        cached += sum(resident_bytes([t for t, _ in always])) if always else 0
        cap = read_cap(CGROUP_ROOT)
        if cap != self._cap:
            self.thin_margin_failed = False  # a new cap: the thin margin is tried again
        self._cap = cap
        budget = page_cache_budget(cached, root=CGROUP_ROOT, forward_bytes=self.forward_bytes)
        budget = self.memory.measure(budget, CGROUP_ROOT, adjust=held_moved)
        self.budget = budget
        # Unclamped (the budget's usable is never below 0): what is over the limit is not room for anyone.
        room = budget.limit - budget.other_bytes - budget.margin - sum(m.given for m in given) - self.always_bytes
        # Uncached buffers hold the streaming window in anonymous memory, which
        # the measure counted as "other"; the plan reserves that window itself -
        # every buffer a reader may make, made yet or not (_planned_buffers).
        self.window_buffers = sum(m.window_bytes for m in measured)
        room += self.window_buffers
        # The copier's staging ring and the CPU twin's buffers are host memory beside the window
        # (the layers are read through the page cache and copied on): the measure counted what
        # is held; the plan charges the most they take, made yet or not.
        working = [m.host_bytes for m in measured]  # (held now, charged) each
        self.working_buffers = sum(charged for _, charged in working)
        room += sum(held for held, _ in working) - self.working_buffers
        sizes = [m.sizes() for m in measured]
        mine = sum(map(sum, sizes))
        share = self.peers.share(lambda: file_ranges_of(measured), room, mine, budget.source)
        self.replicas, self.ranks, self._others = share.replicas, share.ranks, share.others
        room, windows = share.room, 1 + len(share.replicas)  # a streaming window for each replica
        extra = 0 if self.thin_margin_failed else budget.cache_extra
        if extra and self.ranks:
            extra = extra * mine // (mine + self._others)  # split as the room is
        # The weights every forward reads outside the stacks (a head) stay cached only where they fit
        # beside the smallest streaming window; else they are read as they run and let go after
        # (OutsideWeights), and take no room from the layers.
        need = smallest_window(sizes, [m.part_bytes for m in measured]) * windows
        self.always_streamed = bool(self.always_bytes) and mine > room + extra and room < need
        if self.always_streamed:
            room += self.always_bytes
        if room < 0:  # the thin share is of the room there is: over the full margin's deficit, not on top of 0
            extra = max(0, extra + room)
        self.room = max(0, room)
        self._last = LastMeasure(tuple(weakref.ref(m) for m in measured), sizes, windows, cached, str(budget),
                                 [m.part_bytes for m in measured])
        self._place(measured, sizes, windows, cached, extra, str(budget))

    def place_buffers(self) -> None:
        """The last measure placed again with the uncached buffers as they are now (a stack began or
        stopped reading uncached; a full plan if the members changed). Not measured again: mid-run the
        allocator holds what the last forward's activations left, which the margin is there for."""
        with self._lock:
            self._place_last(afresh=self.budget is None)

    def _place_last(self, *, cache_extra: int | None = None, afresh: bool = False) -> None:
        """The last plan's measure placed again, with ``cache_extra`` for the cached set (None: the one
        it has), or a full plan when ``afresh`` or when the members changed since."""
        last = self._last
        measured = last.measured()
        now = [m for m in self.members() if m.given is None]
        if afresh or len(measured) != len(now) or any(a is not b for a, b in zip(measured, now)):
            self._plan()
            return
        extra = self.cache_extra if cache_extra is None else cache_extra
        try:
            self._place(measured, last.sizes, last.windows, last.cached, extra, last.why)
        except BaseException:
            self._stale = True  # cut short: the next forward plans again
            raise

    def _place(self, measured, sizes, windows: int, cached: int, extra: int, why: str) -> None:
        """Plan the measured managers' layers in ``self.room`` (+ ``extra`` for cached ones) and apply it."""
        self.cache_extra = extra
        self.buffers = planned_buffers(measured)
        plans = plan_shared(sizes, self.room, prefetch_layers=[m.prefetch_layers for m in measured], windows=windows,
                            cache_only=extra, buffers=self.buffers, parts=self._last.parts or None)
        # Each plan's always_bytes is the shared one (for the record; the room is already net of it).
        plans = [replace(p, always_bytes=self.always_bytes, always_streamed=self.always_streamed) for p in plans]
        for m, plan in zip(measured, plans):
            m.apply(plan, why)
            m.watch(bool(extra))
            m.take_missing()  # what went missing before this plan is not its loss
        window = max((p.window_bytes for p in plans if p.streamed), default=0)
        self.peers.publish(file_ranges_of(measured), sum(sum(p.layer_bytes) for p in plans), cached, window,
                           lambda: {ident: path for m in measured for ident, _, _, path in m.file_ranges()},
                           self.window_buffers)
        if len(self.members()) > 1 or self.replicas or self.ranks:
            logger.info("page cache: %s", self.describe())

    def uncached_fits(self, member: StackMember, need: int) -> tuple[bool, str]:
        """Whether ``member`` may read its streamed layers around the page cache into ``need`` bytes of
        buffers under the last measured plan, and why not (:func:`.uncached_fit.uncached_fits`)."""
        with self._lock:
            last = self._last
            if self.budget is None:
                return True, ""
            where = f"{'a ' + _cap_text(self._cap) + ' cap' if self._cap else 'this host'}"
            return uncached_fits(last.measured(), last.sizes, last.windows, room=self.room,
                                 cache_extra=self.cache_extra, member=member, need=need, where=where,
                                 parts=last.parts or None)

    # -- what it shows -----------------------------------------------------------------------
    def layer_residency(self) -> list[tuple[str, list[int]]]:
        """``(stack name, resident bytes of each layer)`` for every registered manager, measured now."""
        return [(m.name, m.resident_bytes()) for m in self.members()]

    def describe(self) -> str:
        """One line: the budget, what is cached and streamed across all stacks, the peers."""
        members = self.members()
        plans = [m.residency for m in members if m.residency is not None]
        cached = sum(p.cached_bytes for p in plans)
        streamed = sum(p.streamed_bytes for p in plans)
        extra = f" (+{format_bytes(self.cache_extra)} for cached layers while they stay resident)" \
            if self.cache_extra else ""
        text = (f"{len(members)} stack{'s' if len(members) != 1 else ''} share {format_bytes(self.room)}{extra} of "
                f"page cache: {format_bytes(cached)} cached"
                + (f", {format_bytes(streamed)} streamed per forward" if streamed else "")
                + f", {format_bytes(self.always_bytes)} read every forward outside the stacks"
                + (f"; {format_bytes(self.working_buffers)} of staging and CPU-twin buffers charged"
                   if self.working_buffers else ""))
        if self.ranks:
            where = "under this cap" if self._cap is not None else "on this host (no cgroup cap)"
            text += f"; split with {len(self.ranks)} other rank{'s' if len(self.ranks) != 1 else ''} {where}"
        if self.replicas:
            text += f"; cached set shared with {len(self.replicas)} replica{'s' if len(self.replicas) != 1 else ''}"
        return text


_COORDINATOR = PageCacheCoordinator()


def coordinator() -> PageCacheCoordinator:
    """The process's page-cache coordinator."""
    return _COORDINATOR


def _after_fork_in_child() -> None:
    _COORDINATOR.after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _withdraw_at_exit() -> None:
    """A process that exits with managers still open leaves no record for its peers to read
    (they would skip it as gone, but only once they find its pid dead or reused)."""
    try:
        _COORDINATOR.peers.withdraw()
    except Exception:  # noqa: BLE001 - exiting: nothing to report to
        pass


atexit.register(_withdraw_at_exit)
