"""What a summary row measures: the bytes of a unit's tensors by where they live, each byte once.

The tensors' extents (:func:`~mapoffload.memory.regions.tensor_extent`, on every device) are merged
into their union (a byte two views reach counts once); host ranges are classified against one
snapshot of ``/proc/self/maps`` (a file mapping, anonymous memory, pinned), and the bytes of the
mapped ranges in pages copy-on-write made the process's own (a weight written in place) are read
from ``/proc/self/pagemap`` natively and counted as anonymous (:func:`measure`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import torch

__all__ = ["Measured", "measure"]

logger = logging.getLogger("mapoffload")


class Measured(NamedTuple):
    """What :func:`measure` found, in bytes; ``written`` is part of ``anonymous``."""

    mapped: int
    anonymous: int
    pinned: int
    device: int
    total: int
    written: int


def _union(extents: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """``(address, end, index)`` extents merged where they overlap, sorted:
    the union of the ranges, each byte once. ``index`` is the extent that
    starts the merged range (the longest of those starting there). Ranges
    that only touch stay apart, so each keeps its own class."""
    merged: list[list[int]] = []
    for addr, end, i in sorted(extents, key=lambda e: (e[0], -e[1])):
        if merged and addr < merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([addr, end, i])
    return [(a, e, i) for a, e, i in merged]


def _written_bytes(ranges: list[tuple[int, int]]) -> int:
    """Bytes of the mapped ``(address, end)`` ranges (sorted, disjoint) that
    lie in pages the process wrote in place (copy-on-write made them its
    own), from ``/proc/self/pagemap``; 0 where it cannot be read.

    A written page is copied whole, but only the bytes of the ranges in it are
    counted, so that a page two units share (a small tensor beside another)
    is not counted in both. One native call over all the ranges' pages
    answers the usual case (nothing written); when some are, one more over
    the partial pages at the ranges' ends says whether any of those is
    written, and only then are they halved until the written ones are found.
    """
    from .._native import _core

    ps = _core.page_size()
    bodies: list[tuple[int, int]] = []  # whole pages inside a range
    edges: dict[int, int] = {}  # a page only partly in the ranges -> the ranges' bytes in it
    for addr, end in ranges:
        pos = addr
        if pos % ps:
            page = pos - pos % ps
            stop = min(end, page + ps)
            edges[page] = edges.get(page, 0) + stop - pos
            pos = stop
        if pos < end - end % ps:
            bodies.append((pos, end - end % ps))
            pos = end - end % ps
        if pos < end:
            edges[pos] = edges.get(pos, 0) + end - pos

    def private(spans: list[tuple[int, int]]) -> int:
        return _core.private_page_bytes(_core.SpanArray([a for a, _ in spans], [n for _, n in spans]))

    pages = sorted(edges)
    got = private([(a, e - a) for a, e in bodies] + [(p, ps) for p in pages])
    if got <= 0:
        if got < 0:
            logger.debug("summary: /proc/self/pagemap unreadable (errno %d): pages written in place not counted",
                         -got)
        return 0
    in_edges = private([(p, ps) for p in pages]) if pages else 0
    written = got - max(in_edges, 0)
    todo = [(pages, in_edges)] if in_edges > 0 else []
    while todo:  # halve the partial pages until each written one is found
        group, n = todo.pop()
        if n >= ps * len(group) or len(group) == 1:  # all of them written
            written += sum(edges[p] for p in group)
            continue
        left = group[: len(group) // 2]
        k = private([(p, ps) for p in left])
        if k < 0:
            break
        todo += [(g, m) for g, m in ((left, k), (group[len(left):], n - k)) if m > 0]
    return written


def _extents(tensors: list[torch.Tensor]) -> list[tuple[int, int]]:
    """``(address, nbytes)`` of each tensor (:func:`~mapoffload.memory.regions.tensor_extent`), on
    the CPU and on a device alike (where ``tensor_spans`` answers ``(0, 0)``): two native calls.
    ``(0, 0)`` for a tensor without an address (no storage)."""
    import torch

    from .._native import _core
    from ..memory.regions import tensor_spans

    host = [i for i, t in enumerate(tensors) if t.device.type == "cpu"]
    off = [i for i, t in enumerate(tensors) if t.device.type != "cpu"]
    out: list[tuple[int, int]] = [(0, 0)] * len(tensors)
    spans = tensor_spans([tensors[i] for i in host])
    for i, a, n in zip(host, spans.addrs, spans.sizes):
        out[i] = (a, n)
    if off:
        try:  # the same extent, read without the CPU check (a device address: only compared, never read)
            spans = _core.extract_spans([tensors[i] for i in off], torch.Tensor, False)
            found = list(zip(spans.addrs, spans.sizes))
        except (RuntimeError, TypeError, OverflowError):  # a device tensor without a plain storage
            found = [(0, 0)] * len(off)
        for i, (a, n) in zip(off, found):
            out[i] = (a, n)
    return out


def measure(tensors: Iterable[torch.Tensor]) -> Measured:
    """Bytes of ``tensors``, each storage range once.

    The tensors' extents (:func:`~mapoffload.memory.regions.tensor_extent`,
    on every device) are merged per device into their union, so that views
    that overlap (``t`` and ``t[:10]``, a slice inside another) count each
    byte once. Host ranges are classified against one maps snapshot: on a
    file mapping they are mapped, except their bytes in pages written in
    place since they were mapped (pagemap, read natively for all the ranges
    at once: :func:`_written_bytes`), which are anonymous memory now; the
    rest is pinned or anonymous.
    """
    from .._native import _core
    from ..memory.regions import MappedRegions

    live = [t for t in tensors if t.device.type != "meta" and t.numel()]
    by_device: dict[str, list[tuple[int, int, int]]] = {}
    device = total = 0
    for i, (addr, n) in enumerate(_extents(live)):
        if n:
            by_device.setdefault(str(live[i].device), []).append((addr, addr + n, i))
        elif live[i].device.type != "cpu":  # on a device without an address to merge by: its values' bytes
            n = live[i].numel() * live[i].element_size()
            device, total = device + n, total + n
    host: list[tuple[int, int, int]] = []
    for extents in by_device.values():
        ranges = _union(extents)
        nbytes = sum(e - a for a, e, _ in ranges)
        total += nbytes
        if live[ranges[0][2]].device.type == "cpu":
            host = ranges
        else:
            device += nbytes
    mapped = anonymous = pinned = 0
    on_file: list[tuple[int, int]] = []
    table = MappedRegions().table
    if host:
        classes = (table.span_classes(_core.SpanArray([a for a, _, _ in host], [e - a for a, e, _ in host]))
                   if table is not None else ["unmapped"] * len(host))
        for (addr, end, i), cls in zip(host, classes):
            if cls == "file":
                mapped += end - addr
                on_file.append((addr, end))
            elif _pinned(live[i]):
                pinned += end - addr
            else:
                anonymous += end - addr  # anonymous, shared memory, mixed: none of it can be dropped and re-read
    written = min(_written_bytes(on_file), mapped)
    return Measured(mapped - written, anonymous + written, pinned, device, total, written)


def _pinned(t: torch.Tensor) -> bool:
    import torch

    if not torch.cuda.is_available():  # no pinned memory without CUDA (and no CUDA init to ask)
        return False
    return bool(t.is_pinned())
