"""Residency plan of the layerwise offload manager: which layers' mapped
pages stay in the page cache across forwards, and which are read from the
file each forward and let go right after use.

Why: a forward reads every layer in order. When the layers' mapped pages do
not all fit in the memory a process may fill, LRU evicts exactly the page
needed next (a cyclic scan larger than the cache is its worst case), and
every forward re-reads the whole checkpoint. Keeping a fixed set cached and
streaming only the rest reads ``checkpoint - budget`` bytes per forward, the
physical floor. Streamed layers are let go with ``MADV_PAGEOUT`` after use,
so they never push the cached set out.

The plan is a pure function of the layers' mapped bytes and a budget
(:func:`mapoffload.memory.budget.page_cache_budget`), so it is tested against fake
budgets.
"""

from __future__ import annotations

from dataclasses import dataclass

from .._log import format_bytes

__all__ = ["LAYER", "PART", "ResidencyPlan", "plan_residency", "plan_shared", "smallest_window", "window_bytes"]

LAYER, PART = "layer", "part"  # what a streamed layer is read in as: whole, or part by part (its submodules)


def window_bytes(depth: int, largest: int) -> int:
    """The streaming window: room for the streamed layer computing and the ``depth`` read ahead of it,
    each counted as the largest layer (``largest`` bytes).

    The one definition: a plan keeps it beside the cached set (:func:`plan_residency`,
    :func:`plan_shared`), a stack reads ahead no deeper (the sequencer's window), and uncached
    buffers hold it instead of the page cache (``1 + depth`` of them: :attr:`ResidencyPlan.window_layers`).
    """
    return (1 + depth) * largest


def smallest_window(members: list[list[int]], parts: list[int]) -> int:
    """The least room any of the stacks streams in: its largest part where it can be read part by part
    (``parts``: each stack's largest part, 0 where it cannot), else its largest layer; the most of those."""
    need = 0
    for sizes, part in zip(members, parts):
        largest = max(sizes, default=0)
        need = max(need, part if 0 < part < largest else largest)
    return need


@dataclass(frozen=True)
class ResidencyPlan:
    """Which layers stay cached, which stream, and whether the next one is read ahead.

    Attributes
    ----------
    cached
        Layers whose mapped pages stay in the page cache across forwards.
    streamed
        Layers read from the file each forward and let go after use.
    readahead
        Whether streamed layers are read ahead while the current one
        computes (``depth > 0``; part by part, also at depth 0 unless
        ``prefetch_layers`` is 0: parts smaller than the largest, read
        ahead within the window).
    depth
        How many streamed layers ahead of the one computing may be read
        (at most the manager's ``prefetch_layers``): the plan keeps room for
        ``1 + depth`` streamed layers beside the cached set, so that reading
        ahead never evicts the layer in use or a cached one.
    layer_bytes
        Mapped bytes of each layer (weights not on a file mapping are not
        page cache and need no plan).
    budget
        Page cache bytes the layers may fill (usable budget less
        ``always_bytes``).
    always_bytes
        Mapped bytes outside the layers that every forward reads (a head,
        norms): kept out of the layers' budget, unless ``always_streamed``.
    unit
        :data:`LAYER`: a streamed layer is read in whole before it runs and let
        go after. :data:`PART`: the room does not hold one layer (or two, where
        it holds two parts: see :func:`plan_shared`), so a
        streamed layer's parts (the submodules that hold its weights: each
        projection, each norm) are read in one after another as they run and
        each let go after it ran; the window is then ``1 + depth`` of the
        largest part, ``depth`` the parts read ahead of the one computing (in
        the order the parts ran the forward before), 0 where two do not fit.
    part_bytes
        Mapped bytes of the largest part of any layer (0: not known, the
        stack cannot be read part by part).
    always_streamed
        The weights every forward reads outside the layers (``always_bytes``)
        do not fit beside the streaming window: they are read as their
        modules run and let go after, like a streamed layer, instead of
        staying cached; the layers' budget keeps them out no longer.
    """

    cached: tuple[int, ...]
    streamed: tuple[int, ...]
    readahead: bool
    layer_bytes: tuple[int, ...]
    budget: int
    always_bytes: int = 0
    depth: int = 0
    unit: str = LAYER
    part_bytes: int = 0
    always_streamed: bool = False

    @property
    def parts(self) -> bool:
        """Streamed layers are read part by part (``unit`` is :data:`PART`)."""
        return self.unit == PART

    @property
    def cached_bytes(self) -> int:
        return sum(self.layer_bytes[i] for i in self.cached)

    @property
    def streamed_bytes(self) -> int:
        """What one forward reads from the file once the cached set is warm."""
        return sum(self.layer_bytes[i] for i in self.streamed)

    @property
    def window_layers(self) -> int:
        """Streamed layers in memory at once: the one computing and the ``depth`` read ahead of it; read
        part by part, one (the parts read ahead fill :attr:`window_bytes` beside the one computing)."""
        return 1 if self.parts else 1 + self.depth

    @property
    def window_bytes(self) -> int:
        """The streaming window's bytes (:func:`window_bytes`), each layer counted as the largest (each part,
        read part by part)."""
        return window_bytes(self.depth, self.part_bytes if self.parts else max(self.layer_bytes, default=0))

    def is_streamed(self, i: int) -> bool:
        return i in self._streamed_set

    @property
    def _streamed_set(self) -> frozenset[int]:
        s = self.__dict__.get("_s")
        if s is None:
            s = frozenset(self.streamed)
            object.__setattr__(self, "_s", s)
        return s

    def describe(self) -> str:
        n = len(self.layer_bytes)
        if not self.streamed:
            return f"all {n} layers stay cached ({format_bytes(self.cached_bytes)} mapped)"
        ahead = (f"{self.depth} read ahead" if self.depth
                 else "smaller parts read ahead" if self.readahead and self.parts else "no readahead")
        how = f"part by part, largest part {format_bytes(self.part_bytes)}, {ahead}" if self.parts else ahead
        always = (f"{format_bytes(self.always_bytes)} read every forward and let go after"
                  if self.always_streamed else f"{format_bytes(self.always_bytes)} read every forward")
        return (
            f"{len(self.cached)} of {n} layers stay cached ({format_bytes(self.cached_bytes)}), "
            f"{len(self.streamed)} streamed ({format_bytes(self.streamed_bytes)} read per forward, "
            f"{how}), page cache budget {format_bytes(self.budget)} beside {always}"
        )


def plan_residency(layer_bytes: list[int], budget: int, *, always_bytes: int = 0,
                   prefetch_layers: int = 1) -> ResidencyPlan:
    """The plan for layers of ``layer_bytes`` mapped bytes under ``budget`` bytes of page cache.

    Everything fits: every layer stays cached. Otherwise the streamed layers
    need room while they are read: the one computing and the ``depth`` read
    ahead of it, each counted as the largest layer. ``depth`` is
    ``prefetch_layers`` when the room allows, else as many as fit (0: no
    readahead). The cached set is the longest prefix of the layers that fits
    in what is left.
    """
    sizes = tuple(int(b) for b in layer_bytes)
    if any(b < 0 for b in sizes):
        raise ValueError("layer sizes must be >= 0")
    if prefetch_layers < 0:
        raise ValueError(f"prefetch_layers must be >= 0, not {prefetch_layers}")
    room = max(0, int(budget) - int(always_bytes))
    everything = tuple(range(len(sizes)))
    if sum(sizes) <= room:
        return ResidencyPlan(everything, (), True, sizes, room, always_bytes, prefetch_layers)
    largest = max(sizes)
    depth = min(prefetch_layers, max(0, room // largest - 1)) if largest else prefetch_layers
    left = room - window_bytes(depth, largest)
    cached: list[int] = []
    for i, b in enumerate(sizes):
        if b > left:
            break
        cached.append(i)
        left -= b
    streamed = tuple(i for i in everything if i not in set(cached))
    return ResidencyPlan(tuple(cached), streamed, depth > 0, sizes, room, always_bytes, depth)


def _unit_and_depth(largest: int, part: int, prefetch: int, room: int, windows: int,
                    spare: int = 0) -> tuple[int, int]:
    """What a stack streams in (its largest ``part``, or its ``largest`` layer) and how many of those it
    reads ahead, in ``room`` (``windows`` streaming at once): part by part where one layer does not fit,
    and where two do not but two parts do (a part read ahead while one computes beats a layer read
    whole while nothing does); ``prefetch`` layers' worth read ahead at most, as much as the room holds.

    Parts read ahead may also take ``spare`` (the cached set's thin share of the margin): they are page
    cache the kernel can reclaim, like the cached layers, and are watched the same way (a part read
    ahead that is missing at its use gives the thin share back). Whole layers may not: their window may
    be uncached buffers, anonymous memory."""
    if not largest:
        return largest, prefetch
    split = 0 < part < largest and (room < largest * windows or (
        prefetch > 0 and room < 2 * largest * windows and room >= 2 * part * windows))
    if not split:
        return largest, min(prefetch, max(0, room // (largest * windows) - 1))
    return part, min(prefetch * max(1, largest // part), max(0, (room + spare) // (part * windows) - 1))


def plan_shared(members: list[list[int]], budget: int, *, always_bytes: int = 0,
                prefetch_layers: list[int] | None = None, windows: int = 1,
                cache_only: int = 0, buffers: int = 0, parts: list[int] | None = None) -> list[ResidencyPlan]:
    """One plan for several stacks that share a page cache of ``budget`` bytes.

    ``members`` holds each stack's layer sizes, in the order their layers
    are kept cached when not all fit. The stacks run one after another (a
    forward goes through an encoder, then a decoder; a pipeline through its
    components), so one streaming window - the largest any streaming stack
    needs, ``(1 + depth) * largest layer`` - is kept beside the cached
    layers, ``windows`` times when that many processes stream from the same
    cached set at once (replicas). The cached layers are each stack's longest
    prefix that fits, stacks filled in order; a stack that ends up wholly
    cached needs no window, and the others get its room. With one member this
    is :func:`plan_residency`.

    ``cache_only`` bytes beyond ``budget`` may hold cached layers but never
    the streaming window: the window's depth is chosen within ``budget``
    (uncached buffers are anonymous memory, which the kernel cannot
    reclaim), the cached set fills what is left of both. Each plan's
    ``budget`` is the room with ``cache_only`` in it.

    ``buffers`` bytes of anonymous memory the stacks' machinery holds while
    layers stream (uncached buffers: the window read into them instead of
    the page cache, one set per stack that reads uncached) are charged like
    the window: what is kept beside the cached layers is the larger of the
    two, never the sum (the buffers *are* the window of a stack that reads
    uncached) and never less than the buffers.

    ``parts`` holds each stack's largest part (the submodule of a layer with
    the most mapped bytes; 0: the stack is read a layer at a time only). A
    streaming stack is read part by part (:data:`PART`) where its largest
    layer does not fit the room even without reading ahead, or where two of
    them do not fit but two of its largest parts do (a part read ahead while
    one computes, where whole layers would take turns with the compute): its
    window is its largest part and the parts read ahead of it, as many as the
    room holds and ``prefetch_layers`` layers' worth at most (none where two
    parts do not fit). So the room a stack needs is its largest part, not its
    largest layer.
    """
    n = len(members)
    prefetch = list(prefetch_layers) if prefetch_layers is not None else [1] * n
    if len(prefetch) != n:
        raise ValueError(f"{n} members but {len(prefetch)} prefetch depths")
    if any(p < 0 for p in prefetch):
        raise ValueError("prefetch_layers must be >= 0")
    if windows < 1:
        raise ValueError(f"windows must be >= 1, not {windows}")
    if cache_only < 0:
        raise ValueError(f"cache_only must be >= 0, not {cache_only}")
    if buffers < 0:
        raise ValueError(f"buffers must be >= 0, not {buffers}")
    part_sizes = [int(b) for b in parts] if parts is not None else [0] * n
    if len(part_sizes) != n or any(b < 0 for b in part_sizes):
        raise ValueError(f"{n} members need {n} part sizes >= 0, not {parts}")
    sizes = [tuple(int(b) for b in m) for m in members]
    if any(b < 0 for m in sizes for b in m):
        raise ValueError("layer sizes must be >= 0")
    room = max(0, int(budget) - int(always_bytes))
    total = room + int(cache_only)
    if sum(map(sum, sizes)) <= total - int(buffers):
        return [ResidencyPlan(tuple(range(len(s))), (), True, s, total, always_bytes, p, LAYER, part)
                for s, p, part in zip(sizes, prefetch, part_sizes)]
    units, depths = map(list, zip(*(_unit_and_depth(max(s, default=0), part, p, room, windows, int(cache_only))
                                    for s, p, part in zip(sizes, prefetch, part_sizes))))
    streaming = {k for k in range(n) if sizes[k] and max(sizes[k])}
    while True:
        window = max((window_bytes(depths[k], units[k]) for k in streaming), default=0) * windows
        window = max(window, int(buffers))
        left = total - window
        cached: list[list[int]] = []
        for s in sizes:
            mine: list[int] = []
            for i, b in enumerate(s):
                if b > left:
                    break
                mine.append(i)
                left -= b
            cached.append(mine)
        still = {k for k in streaming if len(cached[k]) < len(sizes[k])}
        if still == streaming:
            break
        streaming = still
    plans = []
    for k, s in enumerate(sizes):
        kept = set(cached[k])
        streamed = tuple(i for i in range(len(s)) if i not in kept)
        depth = depths[k] if streamed else prefetch[k]
        unit = PART if streamed and units[k] < max(s, default=0) else LAYER
        # Part by part, parts smaller than the largest are read ahead within the window even at depth 0.
        ahead = depth > 0 or (unit == PART and prefetch[k] > 0)
        plans.append(ResidencyPlan(tuple(cached[k]), streamed, ahead, s, total, always_bytes, depth, unit,
                                   part_sizes[k]))
    return plans
