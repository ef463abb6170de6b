"""One stack of layers as the page cache sees it: a member of the coordinator's plan, and how it reads.

The coordinator (``coordinator.py``) plans every stack of the process against one budget. What it
needs of a stack - its layers' mapped sizes and resident bytes, the file ranges they read, its
uncached buffers, the share it was given, where to carry a plan out - is this object, made and
registered by the stack's owner (a :class:`~mapoffload.LayerwiseOffloadManager`). The coordinator
talks to members only, never to the managers' insides; the page-cache layer imports nothing of the
offload parts: the stack's pages and load path are duck-typed here (:class:`StackPages`,
:class:`StackLoads`), and so is the coordinator (:class:`PlanHost`: this module is below it).

The member also holds how its streamed layers are read (``reads=`` of
:class:`~mapoffload.OffloadOptions`): ``"mapping"``, ``"uncached"`` (``O_DIRECT``), or ``"auto"`` -
decided at each forward's start (:meth:`StackMember.choose_reads`): on the device path (a target that
copies), uncached once the plan streams layers and their files take ``O_DIRECT`` and the plan's room
holds the buffers (``PageCacheCoordinator.uncached_fits``); through the shared page cache while
replicas map the same bytes; else (in place, or files without ``O_DIRECT``) measured with
``/proc/self/io``, and uncached when two warm forwards in a row read more than ``THRASH_RATIO`` x what
the plans stream. In place the page-cache path reads at the floor and is the faster one where both
fit, with less anonymous memory (``docs/benchmarks.md``, ``capped_forward.py``). Switching gives the
stack's load target an uncached source (``uncached_source``, given by the stack:
``offload.loads.UncachedSource``); pausing it reads through the mapping again.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from .._log import format_bytes, logger
from .._runs import merge_runs
from .read_source import PauseReason

if TYPE_CHECKING:
    from .read_source import Source
    from .residency import ResidencyPlan

__all__ = ["THRASH_RATIO", "PlanHost", "StackLoads", "StackMember", "StackPages", "always_read_of", "cached_lost",
           "file_ranges_of", "planned_buffers"]

# A warm forward reading more than this times what the plan streams (and the
# weights read every forward) is the kernel re-reading evicted pages.
THRASH_RATIO = 1.2


class StackPages(Protocol):
    """What a member reads of its stack's pages (``layer_pages.LayerPages``)."""

    watch: bool

    def mapped_sizes(self) -> list[int]: ...
    def resident_bytes(self) -> list[int]: ...
    def file_ranges(self) -> list[tuple[tuple[int, int], int, int, str]]: ...
    def take_missing(self) -> int: ...
    def apply(self, plan: ResidencyPlan) -> None: ...
    def extents(self, i: int) -> list: ...  # layer i's file extents (``.path``, ``.file``)


class StackLoads(Protocol):
    """What a member reads and sets of its stack's load target (``offload.loads``): the uncached window it
    holds (``window_bytes``) and, where it reads uncached, ``planned_bytes``; the host memory of its own
    machinery (``host_bytes`` now, ``planned_host_bytes`` at the most: an owned copier's ring, the CPU
    twin's buffers; 0 in place); its ``source``, swapped by the reads policy (the target itself is never
    replaced)."""

    window_bytes: int
    planned_bytes: int
    host_bytes: int
    planned_host_bytes: int
    source: Source
    copies: bool  # it copies into device buffers (False: it computes in place)
    pin_device: int | None  # the CUDA device uncached buffers are page-locked for (when it copies)


class PlanHost(Protocol):
    """What a member asks of the coordinator that plans it (``coordinator.PageCacheCoordinator``)."""

    replicas: list[int]

    def uncached_fits(self, member: StackMember, need: int) -> tuple[bool, str]: ...
    def streamed_since(self, marks: dict[int, int] | None) -> tuple[int, dict[int, int]]: ...
    def place_buffers(self) -> None: ...


def _process_read_bytes() -> int | None:
    """Bytes this process had read from storage (``/proc/self/io`` read_bytes); None where unreadable."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


class StackMember:
    """A stack under the page-cache plan, and how its streamed layers are read.

    ``reads`` is the ``reads=`` setting, ``reads_mode`` how streamed layers are read now and
    ``reads_why`` why (``manager.parts.member``).

    Parameters
    ----------
    name
        The stack's name, for logs and :meth:`PageCacheCoordinator.layer_residency`.
    model, layers
        The model and its managed layers (the weights outside every stack of a model that each
        forward reads are counted once: ``always_read(model, layers)``).
    pages
        The stack's pages (:class:`StackPages`).
    loads
        The stack's load target (:class:`StackLoads`): what the plan charges of it, and its source,
        the one the reads policy switches.
    prefetch_layers
        How deep the stack reads ahead (its streaming window).
    given
        Page-cache bytes of its own (``page_cache_bytes=``); None: measured with the others.
    always_read
        ``(model, layers) -> [(tensor, bytes)]``: the mapped weights outside ``layers`` that every
        forward reads.
    owner
        Who registered it (kept weakly; :meth:`PageCacheCoordinator.managers`).
    parts
        ``() -> bytes`` of the largest part of a layer, where the stack can read its streamed layers
        part by part (in place); None: a layer at a time only.
    reads
        ``"auto"``, ``"mapping"`` or ``"uncached"`` (see the module).
    cuda
        The device path is on CUDA (uncached buffers are then pinned).
    uncached_source
        ``uncached_source(buffers, pin_device)``: a new uncached source of that many buffers.
    layer_buffer_bytes
        ``() -> bytes`` of one uncached buffer (the largest layer's mapped weights; 0: none mapped).
    host
        The coordinator that plans it (:class:`PlanHost`; the process's).
    """

    def __init__(self, *, name: str, model: Any, layers: Sequence[Any], pages: StackPages, loads: StackLoads,
                 prefetch_layers: int, given: int | None,
                 always_read: Callable[[Any, list], list[tuple[Any, int]]], owner: object,
                 parts: Callable[[], int] | None = None, reads: str = "mapping", cuda: bool = False,
                 uncached_source: Callable[[int, int | None], Source], layer_buffer_bytes: Callable[[], int],
                 host: PlanHost) -> None:
        self.name = name
        self.model = model
        self.layers = layers
        self.pages = pages
        self.loads = loads
        self.prefetch_layers = prefetch_layers
        self.given = given
        self.always_read = always_read
        self._parts = parts
        self.residency: ResidencyPlan | None = None
        self._owner = weakref.ref(owner)
        self._host = host
        # How streamed layers are read (the reads policy's state).
        self.reads = reads
        self.reads_why = ""
        self._cuda, self._new_source, self._layer_buffer_bytes = cuda, uncached_source, layer_buffer_bytes
        self._reads_at_forward: int | None = None  # this process's read bytes at the last forward's start
        self._forward_marks: dict[int, int] | None = None  # every stack's forwards then (coordinator)
        self._forwards = 0
        self._excess = 0  # warm forwards in a row that read more than THRASH_RATIO x the plan
        self._uncached_capable: bool | None = None  # the streamed layers' files take O_DIRECT (auto; probed once)
        self._uncached_why = ""  # what the probe said when they do
        self._refused = ""  # why auto reads through the mapping where the files take O_DIRECT

    @property
    def owner(self) -> object | None:
        return self._owner()

    # -- what the plan is made from -----------------------------------------------------------
    def sizes(self) -> list[int]:
        """Mapped bytes of each layer."""
        return self.pages.mapped_sizes()

    @property
    def part_bytes(self) -> int:
        """Mapped bytes of the largest part of a layer (0: the stack is read a layer at a time only)."""
        return self._parts() if self._parts is not None else 0

    def resident_bytes(self) -> list[int]:
        """Bytes of each layer's mapped weights resident now (``mincore``)."""
        return self.pages.resident_bytes()

    def file_ranges(self) -> list[tuple[tuple[int, int], int, int, str]]:
        """``((dev, inode), first, end, path)`` of every file range the layers read."""
        return self.pages.file_ranges()

    @property
    def window_bytes(self) -> int:
        """Uncached buffers the stack holds (the streaming window in anonymous memory)."""
        return self.loads.window_bytes

    @property
    def buffer_bytes(self) -> int:
        """Uncached buffers the plan charges now (0 where the stack reads through the mapping)."""
        return self.loads.planned_bytes

    @property
    def host_bytes(self) -> tuple[int, int]:
        """``(held now, charged)``: host memory of the load path's own machinery beside the page-cache
        window - an owned copier's staging ring, the CPU twin's "device" buffers (0 in place)."""
        return self.loads.host_bytes, self.loads.planned_host_bytes

    def take_missing(self) -> int:
        """Bytes of cached layers found missing at their use since the last call."""
        return self.pages.take_missing()

    def watch(self, on: bool) -> None:
        """Check (or stop checking) that the cached layers stay resident between uses (the thin margin)."""
        self.pages.watch = on

    # -- the plan ----------------------------------------------------------------------------
    def apply(self, plan: ResidencyPlan, why: str) -> None:
        """Carry ``plan`` out from the next layer on."""
        if plan == self.residency:
            return
        self.residency = plan
        self.pages.apply(plan)
        logger.info("residency of %s: %s; %s", self.name, plan.describe(), why)

    # -- how streamed layers are read (``reads=``) --------------------------------------------------
    @property
    def reads_mode(self) -> str:
        """How streamed layers are read now: ``"mapping"`` or ``"uncached"`` (see ``reads=``)."""
        return self._source.mode

    @property
    def _source(self) -> Source:
        return self.loads.source

    def _window_buffers(self) -> int:
        """Uncached buffers for the streaming window: the layer computing and the plan's depth ahead."""
        plan = self.residency
        return plan.window_layers if plan is not None else 1 + self.prefetch_layers

    def read_uncached(self, why: str) -> None:
        """From the next layer on, read streamed layers around the page cache (``O_DIRECT``).

        In place they compute from the buffers they are read into; on the
        device path (and its CPU twin) they are copied from them into the
        device buffers - on CUDA by DMA, the buffers being pinned.
        """
        name = self.name
        if self.reads_mode == "uncached":
            return
        if self._source.reads_uncached:  # paused: read uncached again
            self._source.resume()
            self.reads_why = why
            logger.info("%s: streamed layers are read uncached again: %s", name, why)
            return
        loads = self.loads
        if not loads.copies:
            pin = None
            where = "read uncached (O_DIRECT)"
        else:
            pin = loads.pin_device
            where = ("read uncached (O_DIRECT) into pinned buffers and copied from them"
                     if self._cuda else "read uncached (O_DIRECT) and copied from the buffers")
        # The plan charges its buffers (the member reads them off the same target).
        loads.source = self._new_source(self._window_buffers(), pin)
        self.reads_why = why
        logger.info("%s: streamed layers are %s from now on: %s", name, where, why)

    def probe_uncached(self) -> tuple[bool, str]:
        """Whether every file behind the streamed layers takes ``O_DIRECT`` (and why not)."""
        from .._native import _core

        plan = self.residency
        files = {e.path: e.file for i in plan.streamed for e in self.pages.extents(i)}
        for path, f in files.items():
            if f is None or f.fd < 0:
                return False, f"{path} is not held open"
            try:
                fd, method, why = _core.open_for_reading(f.fd, True)
            except OSError as e:
                return False, f"{path}: {e}"
            os.close(fd)
            if method != "uncached":  # the native reader's word for O_DIRECT
                return False, f"{path} is read buffered ({why})"
        return True, (f"the plan streams {len(plan.streamed)} layers and their files take O_DIRECT "
                      "(reads at the bound, no page-cache work on the compute path)")

    def choose_reads(self) -> None:
        """``reads="auto"``, at a forward's start: on the device path, uncached once layers stream and
        their files take ``O_DIRECT``; else measure what the last forward read, and read uncached
        when it thrashed (see the module)."""
        name = self.name
        if self.reads != "auto":
            return
        replicas = self._host.replicas
        if replicas:
            # O_DIRECT reads are each process's own; through the page cache one replica's read
            # of a layer serves the other, and the last to let it go drops it.
            why = (f"replicas (pid {', '.join(map(str, replicas))}) map the same bytes: streamed layers "
                   "are read through the shared page cache")
            if self.reads_mode == "uncached":
                self._source.pause(PauseReason.REPLICAS)
                logger.info("%s: %s", name, why)
            self.reads_why = why
            return
        if self.reads_mode == "uncached":
            fits, why = self._host.uncached_fits(self, self._source.planned_bytes)
            if not fits:  # the cap or the plan changed under the buffers: through the mapping again
                self._source.pause(PauseReason.NO_ROOM)
                self.reads_why = self._refused = why
                logger.info("%s: %s", name, why)
                self._host.place_buffers()
            return
        if self._source.reads_uncached and self._source.paused:
            # Paused for replicas that are gone, or for room the plan now has.
            replicas_gone = self._source.paused is PauseReason.REPLICAS
            self._try_uncached("no replica maps these bytes now" if replicas_gone or not self._uncached_why
                               else self._uncached_why)
            return
        plan = self.residency
        if plan is None or not plan.streamed:
            self._reads_at_forward = None  # nothing to decide (and nothing read per forward to measure)
            return
        if self._uncached_capable is None:
            self._uncached_capable, self._uncached_why = self.probe_uncached()
            if not self._uncached_capable:
                self.reads_why = self._uncached_why
                self._uncached_why = ""
        if self._uncached_capable and self.loads.copies and self._try_uncached(self._uncached_why):
            return  # copied from the buffers: in place the page cache path reads at the floor, measured below
        now = _process_read_bytes()
        last, self._reads_at_forward = self._reads_at_forward, now
        # The counter is the process's: since this stack's last forward, every model of the process
        # may have run (a pipeline's other components, a model served beside this one), each as
        # many forwards as it did. What they were all planned to read is the measure.
        expected, self._forward_marks = self._host.streamed_since(self._forward_marks)
        if now is None or last is None:
            return
        self._forwards += 1
        if self._forwards < 2:
            return  # the first forward reads the cached set in too
        read = now - last
        self._excess = self._excess + 1 if read > THRASH_RATIO * expected else 0
        self.reads_why = (f"{self._refused + '; ' if self._refused else ''}the last forward read "
                    f"{format_bytes(read)}, the plan streams {format_bytes(expected)} "
                    f"({read / max(expected, 1):.2f}x)")
        if self._excess >= 2:
            self._try_uncached(self.reads_why + f", twice in a row over {THRASH_RATIO}x")

    def _try_uncached(self, why: str) -> bool:
        """``auto``: read uncached from the next layer on where the plan's room holds the
        buffers and reads no more with them (``coordinator.uncached_fits``); else say why not."""
        source = self._source
        count = source.buffers if source.reads_uncached else self._window_buffers()
        per_buffer = self._layer_buffer_bytes()
        fits, refused = self._host.uncached_fits(self, count * per_buffer)
        if not fits:
            if refused != self._refused:
                logger.info("%s: %s", self.name, refused)
            self.reads_why = self._refused = refused
            return False
        self._refused = ""
        self.read_uncached(why)
        self._host.place_buffers()  # the plan charges the buffers from now on
        return True


def cached_lost(members: Sequence[StackMember]) -> int:
    """Bytes of cached layers the kernel took since the last check, as their uses found them.

    A cached layer used before under its stack's plan must find its
    pages resident at its next use (``LayerPages.watch``, checked before
    the layer faults them back in), and so must a part read ahead (its
    window may take the thin share too). Missing pages beyond 1 MiB + 1 %
    of what a stack caches (the kernel's own slack: pages of a layer's ends
    shared with streamed neighbours) count.
    """
    lost = 0
    for m in members:
        missing = m.take_missing()
        plan = m.residency
        if m.given is not None or plan is None or not (plan.cached or (plan.parts and plan.depth)):
            continue
        if missing > (1 << 20) + plan.cached_bytes // 100:
            lost += missing
    return lost


def planned_buffers(members: Sequence[StackMember]) -> int:
    """Uncached buffers of ``members`` as the plan charges them (``StackMember.buffer_bytes``)."""
    return sum(m.buffer_bytes for m in members)


def file_ranges_of(measured: Sequence[StackMember]) -> tuple[tuple[int, int, int, int], ...]:
    """(dev, inode, first, end) of every file range the members' mapped layers read, merged per file."""
    per_file: dict[tuple[int, int], list[list[int]]] = {}
    for m in measured:
        for ident, first, end, _ in m.file_ranges():
            per_file.setdefault(ident, []).append([first, end])
    out = []
    for (dev, ino), spans in sorted(per_file.items()):
        out.extend((dev, ino, a, b) for a, b in merge_runs(spans))
    return tuple(out)


def always_read_of(measured: Sequence[StackMember]) -> list[tuple[object, int]]:
    """The mapped weights outside the members' stacks that each forward reads, once each."""
    by_model: dict[int, tuple[object, list, object]] = {}
    for m in measured:
        entry = by_model.setdefault(id(m.model), (m.model, [], m.always_read))
        entry[1].extend(m.layers)
    seen: set[int] = set()
    out = []
    for model, layers, always_read in by_model.values():
        for t, n in always_read(model, layers):
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                out.append((t, n))
    return out
