"""Where a streamed layer's bytes come from: the interface a load target holds, and the mapping.

A load target (``offload.loads.InPlace``, ``offload.device_copies.DeviceCopies``) holds one
:class:`Source` and asks it, at each load, whether it takes the layer (:meth:`Source.takes`).
:data:`MAPPING` takes none: every layer is read through its mapping. An uncached source
(``offload.loads.UncachedSource``) takes streamed layers and reads them around the page cache
(``O_DIRECT``); :mod:`.member` (the stack's reads policy) decides which one a stack's target holds.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from concurrent.futures import Future

__all__ = ["MAPPING", "MappingSource", "PauseReason", "Source"]


class PauseReason(enum.Enum):
    """Why an uncached source takes no layer for now (its layers are read through the mapping)."""

    REPLICAS = "replicas"  # other processes map the same bytes: one read through the page cache serves all
    NO_ROOM = "no room"  # the page-cache plan's room no longer holds the buffers (the cap or the plan changed)


class Source(Protocol):
    """What a load target and the read policy ask of a source.

    A source that :meth:`takes` a layer also answers :meth:`read` (a Future of the buffer),
    :meth:`done` (that read finished with), :meth:`places` and :meth:`view` (where each mapped
    weight lies in the buffer).
    """

    mode: str  # "uncached" while it takes layers, else "mapping"
    paused: PauseReason | None  # why it takes none for now (None: it is not paused)
    reads_uncached: bool  # it reads uncached when not paused (False: the mapping)
    buffers: int  # the uncached buffers it may hold at once (0: none)
    window_bytes: int  # the buffers it holds (the streaming window in anonymous memory)
    planned_bytes: int  # the buffers as the page-cache plan charges them
    held_bytes: int  # host bytes of its buffers now
    pinned_bytes: int  # of which page-locked

    def takes(self, i: int) -> bool: ...
    def read(self, i: int) -> Future: ...
    def done(self) -> None: ...
    def places(self, i: int) -> list: ...
    def view(self, w: Any, buf: Any) -> Any: ...
    def pause(self, reason: PauseReason) -> None: ...
    def resume(self) -> None: ...
    def forget(self, i: int) -> None: ...
    def close(self) -> None: ...


class MappingSource:
    """Every layer read through its mapping: takes none, holds nothing."""

    mode = "mapping"
    paused: PauseReason | None = None
    reads_uncached = False
    buffers = 0
    window_bytes = 0
    planned_bytes = 0
    held_bytes = 0
    pinned_bytes = 0

    def takes(self, i: int) -> bool:
        return False

    def read(self, i: int) -> Future:
        raise RuntimeError(f"layer {i} is read through its mapping: the mapping source takes no layer")

    def done(self) -> None:
        raise RuntimeError("the mapping source started no read")

    def places(self, i: int) -> list:
        return []

    def view(self, w: Any, buf: Any) -> None:
        return None

    def pause(self, reason: PauseReason) -> None:
        pass

    def resume(self) -> None:
        pass

    def forget(self, i: int) -> None:
        pass

    def close(self) -> None:
        pass


MAPPING = MappingSource()
