"""The room a process really has under its cap: what its forwards add, what it holds, and the refusal.

The page-cache plan is made from a measure of the cap less what the process holds. Before any forward
ran, what a forward adds on top (its activations, the first uses of torch, the allocator's growth) is
a guess: the default margin (64 MiB + 1/32 of the cap). Issue 35 measured it at about 80 MiB for the
first forward of a 1.6 GiB Llama against 162 MiB held after the imports - under a cap with half a
layer of room, the plan saw twice the room there was. So the stacks sample the process's anonymous
memory at each layer (and part) and at a forward's end (:class:`ForwardMemory`), and the coordinator
measures again, with that growth as the margin, when it moved, or when what the process holds
moved since the last measure (``PageCacheCoordinator.follow_cap``).

:func:`refuse_without_room`: where the cap leaves less beside what the process holds than the least a
stack streams in (its largest part, or layer), no plan can help, and a forward would re-read without
end or meet the OOM killer: the stack is refused before it runs, naming the numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .._log import format_bytes
from .residency import smallest_window

if TYPE_CHECKING:
    from ..memory.budget import PageCacheBudget
    from .member import StackMember

__all__ = ["ForwardMemory", "LastMeasure", "cap_text", "margin_is_measured", "moved_enough", "read_cap",
           "refuse_without_room"]


def read_cap(root: str) -> int | None:
    """The tightest cgroup memory cap on this process now (None: uncapped); ``root`` prefixes the paths."""
    from ..memory.budget import cgroup_memory_limit_bytes

    found = cgroup_memory_limit_bytes(root=root)
    return None if found is None else found[0]


def cap_text(cap: int | None) -> str:
    return "uncapped" if cap is None else format_bytes(cap)


@dataclass(frozen=True)
class LastMeasure:
    """The last measured plan's inputs, placed again without measuring (``_place_last``)."""

    members: tuple = ()  # weak references to the measured members, in plan order
    sizes: list = field(default_factory=list)  # each member's layer sizes
    windows: int = 1  # streaming windows kept (1 + replicas)
    cached: int = 0  # bytes of cached layers resident at the measure
    why: str = ""  # the budget, in words
    parts: list = field(default_factory=list)  # each member's largest part (0: a layer at a time)

    def measured(self) -> list:
        return [r() for r in self.members]


def moved_enough(cap: int | None) -> int:
    """How far what the process holds (or a forward's growth) moves before the budget is measured
    again: 4 MiB or 1/128 of the cap, the more."""
    return max(4 << 20, (cap or 0) // 128)


def margin_is_measured() -> bool:
    """Whether the plan's margin is measured from the forwards (not the user's
    ``MAPOFFLOAD_PAGE_CACHE_MARGIN_MIB``)."""
    from ..memory.budget import _margin_override

    return _margin_override() is None


def anon_now(root: str) -> int:
    """The process's anonymous resident bytes, read under ``root`` (0: unreadable)."""
    from ..memory.budget import rss_anon_bytes

    return rss_anon_bytes(root=root)


class ForwardMemory:
    """What the forwards add to the process's anonymous memory at their peak, and what it held at the
    last measure: when either moved enough, the budget is measured again."""

    def __init__(self) -> None:
        self._growths: list[int] = []
        self.at_measure = 0  # RssAnon when the budget was last measured
        self.grown = False  # a forward's growth moved since the last measure: measure again
        self._full: tuple[int, int] | None = None  # (other bytes, RssAnon) of the last full measure

    @property
    def forward_bytes(self) -> int | None:
        """The anonymous memory a forward adds at its peak, as measured (None before a forward ended):
        the first forward's until a later one ended, then the most any later one added (the first
        forward's first uses of torch are held by the process afterwards, and measured as such)."""
        if not self._growths:
            return None
        return max(self._growths[1:]) if len(self._growths) > 1 else self._growths[0]

    def note(self, grown: int, cap: int | None) -> None:
        """A forward ended having added ``grown`` bytes at its peak; under ``cap`` (and a measured
        margin), a growth that moves the margin enough asks for a new measure."""
        before = self.forward_bytes
        self._growths = (self._growths + [max(0, int(grown))])[-64:]
        after = self.forward_bytes
        if cap is not None and margin_is_measured() and (before is None or abs(after - before) > moved_enough(cap)):
            self.grown = True

    def moved(self, cap: int | None, root: str) -> bool:
        """What the process holds moved enough since the last measure (under a cap, a measured margin)."""
        if cap is None or not margin_is_measured():
            return False
        return abs(anon_now(root) - self.at_measure) > moved_enough(cap)

    def measure(self, budget: PageCacheBudget, root: str, *, adjust: bool) -> PageCacheBudget:
        """The budget to plan with, measured now: as measured, or - where only what the process holds
        moved (``adjust``) - the last full measure's other memory moved by as much as the process's
        anonymous memory did. (The cgroup's other file cache, the libraries' pages, comes and goes
        with the cap's pressure between two reads: at a forward's start it held 115 MiB more in a
        test than when the plan was first made, which is not room the process lost.)"""
        from dataclasses import replace

        now = anon_now(root)
        self.at_measure, self.grown = now, False
        if not adjust or self._full is None:
            self._full = (budget.other_bytes, now)
            return budget
        other = max(0, self._full[0] + now - self._full[1])
        return replace(budget, other_bytes=other, usable=max(0, budget.limit - other - budget.margin))


def refuse_without_room(member: StackMember, root: str) -> None:
    """Refuse a measured in-place stack whose least streaming need (its largest part, or layer) does not
    fit under the cap beside what the process holds: whatever the plan, its forward thrashes or dies.

    Raises
    ------
    NoRoomError
        Naming the cap, what the process holds, the room left and what the stack needs.
    """
    from ..memory.budget import NoRoomError, cap_room

    # Whatever the plan says (a plan made with a margin too wide for the cap may even cache it all):
    # the room under the thin margin is what the cap physically leaves.
    if member.given is not None or member.residency is None or not member.part_bytes:
        return  # a share of its own, or the device path (its copier reads in pieces)
    found = cap_room(root=root)
    if found is None:
        return
    need = smallest_window([member.sizes()], [member.part_bytes])
    if found.room >= need:
        return
    raise NoRoomError(
        f"{member.name}: under the {format_bytes(found.cap)} memory cap this process holds "
        f"{format_bytes(found.held)} of anonymous and kernel memory, which leaves "
        f"{format_bytes(max(0, found.room))} (after a {format_bytes(found.margin)} margin); streaming these "
        f"layers needs at least {format_bytes(need)} (the largest part of a layer, read part by part): "
        "raise the cap or free memory before offloading",
        cap=found.cap, held=found.held, room=found.room, need=need)
