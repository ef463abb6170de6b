"""Merging byte runs: the one definition of "these bytes are one run".

Two kinds of run are merged across the package, each in one function here:

- :func:`merge_runs` - ``[first, end)`` ranges of one address space (a
  layer's spans in memory, a file's byte ranges): sorted, and those that
  overlap or touch made one; with ``align``, also those that share an
  aligned block (a page: one read, one drop);
- :func:`merge_copies` - copies ``(dst, src, nbytes, kind)`` in the order
  given: one that continues the previous on both sides (and is of the same
  kind: pinned or not, one dtype) is made one copy.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["merge_copies", "merge_runs"]


def merge_runs(runs: Iterable[tuple[int, int]], *, align: int = 1) -> list[list[int]]:
    """``[first, end)`` runs sorted, empty ones dropped, those that overlap or touch merged.

    With ``align`` > 1, a run that starts in the aligned block where the
    previous one ends (or right at the next block) joins it too: byte runs
    of one file that share a page are one run of pages.
    """
    out: list[list[int]] = []
    for first, end in sorted(runs):
        if end <= first:
            continue
        if out and first <= -(-out[-1][1] // align) * align:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([first, end])
    return out


def merge_copies(copies: Iterable[tuple[int, int, int, Any]]) -> list[list[Any]]:
    """``[dst, src, nbytes, kind]`` of each copy, in the order given, those that continue the previous
    one on both sides (``dst`` and ``src`` right after its ends) and are of its ``kind`` merged."""
    out: list[list[Any]] = []
    for dst, src, n, kind in copies:
        last = out[-1] if out else None
        if last is not None and last[3] == kind and last[0] + last[2] == dst and last[1] + last[2] == src:
            last[2] += n
        else:
            out.append([dst, src, n, kind])
    return out
