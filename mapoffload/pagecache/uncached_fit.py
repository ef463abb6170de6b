"""Whether a stack may read its streamed layers around the page cache, under the plan it is in.

Uncached buffers (``O_DIRECT``) are anonymous memory: with the other stacks' they must fit in the
room the page-cache plan has for the layers (never in the cached set's thin share of the margin,
which the kernel may need back), and the plan that charges them must stream no more than the one
through the mapping (buffers that push cached layers out read more). The coordinator asks this for
``reads="auto"`` (:meth:`~mapoffload.pagecache.coordinator.PageCacheCoordinator.uncached_fits`);
a manager with a share of its own (``page_cache_bytes``) is not weighed here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .._log import format_bytes
from .member import planned_buffers
from .residency import plan_shared

if TYPE_CHECKING:
    from .member import StackMember

__all__ = ["uncached_fits"]


def uncached_fits(measured: Sequence[StackMember | None], sizes: list, windows: int, *, room: int,
                  cache_extra: int, member: StackMember, need: int, where: str,
                  parts: list[int] | None = None) -> tuple[bool, str]:
    """``(fits, why not)`` for ``member`` reading uncached into ``need`` bytes of buffers.

    ``measured``, ``sizes`` and ``windows`` are the last measured plan's stacks (None: collected
    since), their layers' mapped sizes and the streaming windows it keeps; ``room`` what it had for
    the layers, ``cache_extra`` the cached set's share of the margin; ``where`` names the cap;
    ``parts`` each stack's largest part (read part by part where a layer does not fit).
    A stack outside that plan (or a plan with a stack gone) is not refused here.
    """
    if not any(m is member for m in measured) or any(m is None for m in measured):
        return True, ""
    others = planned_buffers([m for m in measured if m is not member])
    if others + need > room:
        besides = f" beside {format_bytes(others)} of other stacks'" if others else ""
        return False, (f"its uncached buffers ({format_bytes(need)}{besides}) do not fit the "
                       f"{format_bytes(room)} the page-cache plan has for the layers under {where}: "
                       "streamed layers are read through the mapping")
    kw = dict(prefetch_layers=[m.prefetch_layers for m in measured], windows=windows, cache_only=cache_extra,
              parts=parts)
    mine = planned_buffers([member])
    mapping = plan_shared(sizes, room, buffers=others, **kw)
    uncached = plan_shared(sizes, room, buffers=others + max(need, mine), **kw)
    more = sum(p.streamed_bytes for p in uncached) - sum(p.streamed_bytes for p in mapping)
    if more > 0:
        return False, (f"its uncached buffers ({format_bytes(need)}) would take the room of cached "
                       f"layers ({format_bytes(more)} more read per forward): streamed layers are read "
                       "through the mapping")
    return True, ""
