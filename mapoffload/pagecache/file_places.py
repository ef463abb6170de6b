"""Where an address's bytes are in their file: the one address -> (file, offset) lookup.

A mapping's file offset of an address is ``offset + addr - start`` of the
``/proc/self/maps`` line that holds it. Every caller that needs it (a layer's
byte runs per file, its 2 MiB folio edges, where each weight sits in an
O_DIRECT buffer, the file a SIGBUS came from) asks :class:`MapsView`: one
snapshot of the maps, taken once for a whole batch of addresses, its columns
read out of the native table once (each property access copies a list).
"""

from __future__ import annotations

from typing import NamedTuple

from .._native import _core

__all__ = ["FilePlace", "MapsView"]


class FilePlace(NamedTuple):
    """The file bytes an address maps."""

    path: str  # as /proc/self/maps names it (a real file starts with "/")
    dev: tuple[int, int]  # (major, minor) of the mapped inode's device
    inode: int
    offset: int  # byte offset in the file of the address
    room: int  # bytes from the address to its mapping's end (a span past it continues in the next mapping)


class MapsView:
    """One snapshot of ``/proc/self/maps`` for a batch of lookups (mappings made later are not in it)."""

    __slots__ = ("_table", "_starts", "_ends", "_offsets", "_paths", "_devs", "_inodes")

    def __init__(self, table: _core.MapsTable | None = None) -> None:
        t = _core.snapshot() if table is None else table
        self._table = t
        self._starts, self._ends, self._offsets = t.starts, t.ends, t.offsets
        self._paths, self._devs, self._inodes = t.paths, t.devs, t.inodes

    def place(self, addr: int) -> FilePlace | None:
        """The file, offset and room left of ``addr``'s mapping; None where nothing maps it."""
        k = self._table.find(addr)
        if k < 0:
            return None
        return FilePlace(self._paths[k], self._devs[k], self._inodes[k], self._offsets[k] + addr - self._starts[k],
                         self._ends[k] - addr)
