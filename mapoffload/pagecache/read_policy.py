"""How a stack's streamed layers are read: through the mapping, or uncached (``O_DIRECT``).

``reads=`` of :class:`~mapoffload.OffloadOptions`: ``"mapping"``, ``"uncached"`` (``O_DIRECT``), or
``"auto"`` - the policy here, decided at each forward's start (:meth:`ReadPolicy.choose`): on the
device path (a target that copies), uncached once the plan streams layers and their files take
``O_DIRECT`` and the plan's room holds the buffers (``PageCacheCoordinator.uncached_fits``);
through the shared page cache while replicas map the same bytes; else (in place, or files without
``O_DIRECT``) measured with ``/proc/self/io``, and uncached when two warm forwards in a row
read more than ``THRASH_RATIO`` x what the plans stream. In place the page-cache path reads at the
floor and is the faster one where both fit, with less anonymous memory (``docs/benchmarks.md``,
``capped_forward.py``). Switching gives the stack's load
target an uncached source (``uncached_source``, given by the stack: ``offload.loads.UncachedSource``);
pausing it reads through the mapping again.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from .._log import format_bytes, logger
from .coordinator import coordinator
from .read_source import PauseReason

if TYPE_CHECKING:
    from .layer_pages import LayerPages
    from .member import StackMember
    from .read_source import Source

__all__ = ["THRASH_RATIO", "ReadTarget", "ReadPolicy"]


class ReadTarget(Protocol):
    """What the policy reads and sets of a stack's load target (``offload.loads``)."""

    source: Source  # swapped here: the target itself is never replaced
    copies: bool  # it copies into device buffers (False: it computes in place)
    pin_device: int | None  # the CUDA device uncached buffers are page-locked for (when it copies)

# A warm forward reading more than this times what the plan streams (and the
# weights read every forward) is the kernel re-reading evicted pages.
THRASH_RATIO = 1.2


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


class ReadPolicy:
    """The ``reads`` setting of one manager, and the ``auto`` policy's state.

    ``why`` says why streamed layers are read as they are (``manager.parts.reads.why``).

    Parameters
    ----------
    setting
        ``"auto"``, ``"mapping"`` or ``"uncached"``.
    target
        The stack's load target: its source is the one switched.
    member
        The stack's page-cache member: its plan, and the load path the plan charges.
    pages
        The stack's pages (the files behind the streamed layers).
    cuda
        The device path is on CUDA (uncached buffers are then pinned).
    uncached_source
        ``uncached_source(buffers, pin_device)``: a new uncached source of that many buffers.
    buffer_bytes
        Bytes of one uncached buffer (the largest layer's mapped weights; 0: none mapped).
    """

    def __init__(self, setting: str, target: ReadTarget, member: StackMember, pages: LayerPages, *,
                 cuda: bool, uncached_source: Callable[[int, int | None], Source],
                 buffer_bytes: Callable[[], int]) -> None:
        self._loads, self._member, self._pages, self._cuda = target, member, pages, cuda
        self._new_source, self._buffer_bytes = uncached_source, buffer_bytes
        self.setting = setting
        self.why = ""
        self._reads_at_forward: int | None = None  # this process's read bytes at the last forward's start
        self._forward_marks: dict[int, int] | None = None  # every stack's forwards then (coordinator)
        self._forwards = 0
        self._excess = 0  # warm forwards in a row that read more than THRASH_RATIO x the plan
        self._uncached_capable: bool | None = None  # the streamed layers' files take O_DIRECT (auto; probed once)
        self._uncached_why = ""  # what the probe said when they do
        self._refused = ""  # why auto reads through the mapping where the files take O_DIRECT

    @property
    def mode(self) -> str:
        """How streamed layers are read now: ``"mapping"`` or ``"uncached"`` (see ``reads=``)."""
        return self._source.mode

    @property
    def _source(self) -> Source:
        return self._loads.source

    def _window_buffers(self) -> int:
        """Uncached buffers for the streaming window: the layer computing and the plan's depth ahead."""
        plan = self._member.residency
        return plan.window_layers if plan is not None else 1 + self._member.prefetch_layers

    def read_uncached(self, why: str) -> None:
        """From the next layer on, read streamed layers around the page cache (``O_DIRECT``).

        In place they compute from the buffers they are read into; on the
        device path (and its CPU twin) they are copied from them into the
        device buffers - on CUDA by DMA, the buffers being pinned.
        """
        name = self._member.name
        if self.mode == "uncached":
            return
        if self._source.reads_uncached:  # paused: read uncached again
            self._source.resume()
            self.why = why
            logger.info("%s: streamed layers are read uncached again: %s", name, why)
            return
        loads = self._loads
        if not loads.copies:
            pin = None
            where = "read uncached (O_DIRECT)"
        else:
            pin = loads.pin_device
            where = ("read uncached (O_DIRECT) into pinned buffers and copied from them"
                     if self._cuda else "read uncached (O_DIRECT) and copied from the buffers")
        # The plan charges its buffers (the member reads them off the same target).
        loads.source = self._new_source(self._window_buffers(), pin)
        self.why = why
        logger.info("%s: streamed layers are %s from now on: %s", name, where, why)

    def probe_uncached(self) -> tuple[bool, str]:
        """Whether every file behind the streamed layers takes ``O_DIRECT`` (and why not)."""
        from .._native import _core

        plan = self._member.residency
        files = {e.path: e.file for i in plan.streamed for e in self._pages.extents(i)}
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

    def choose(self) -> None:
        """``reads="auto"``, at a forward's start: on the device path, uncached once layers stream and
        their files take ``O_DIRECT``; else measure what the last forward read, and read uncached the
        cache when it thrashed (see the module)."""
        name, member = self._member.name, self._member
        if self.setting != "auto":
            return
        replicas = coordinator().replicas
        if replicas:
            # O_DIRECT reads are each process's own; through the page cache one replica's read
            # of a layer serves the other, and the last to let it go drops it.
            why = (f"replicas (pid {', '.join(map(str, replicas))}) map the same bytes: streamed layers "
                   "are read through the shared page cache")
            if self.mode == "uncached":
                self._source.pause(PauseReason.REPLICAS)
                logger.info("%s: %s", name, why)
            self.why = why
            return
        if self.mode == "uncached":
            fits, why = coordinator().uncached_fits(member, self._source.planned_bytes)
            if not fits:  # the cap or the plan changed under the buffers: through the mapping again
                self._source.pause(PauseReason.NO_ROOM)
                self.why = self._refused = why
                logger.info("%s: %s", name, why)
                coordinator().place_buffers()
            return
        if self._source.reads_uncached and self._source.paused:
            # Paused for replicas that are gone, or for room the plan now has.
            replicas_gone = self._source.paused is PauseReason.REPLICAS
            self._try("no replica maps these bytes now" if replicas_gone or not self._uncached_why
                      else self._uncached_why)
            return
        plan = member.residency
        if plan is None or not plan.streamed:
            self._reads_at_forward = None  # nothing to decide (and nothing read per forward to measure)
            return
        if self._uncached_capable is None:
            self._uncached_capable, self._uncached_why = self.probe_uncached()
            if not self._uncached_capable:
                self.why = self._uncached_why
                self._uncached_why = ""
        if self._uncached_capable and self._loads.copies and self._try(self._uncached_why):
            return  # copied from the buffers: in place the page cache path reads at the floor, measured below
        now = _process_read_bytes()
        last, self._reads_at_forward = self._reads_at_forward, now
        # The counter is the process's: since this stack's last forward, every model of the process
        # may have run (a pipeline's other components, a model served beside this one), each as
        # many forwards as it did. What they were all planned to read is the measure.
        expected, self._forward_marks = coordinator().streamed_since(self._forward_marks)
        if now is None or last is None:
            return
        self._forwards += 1
        if self._forwards < 2:
            return  # the first forward reads the cached set in too
        read = now - last
        self._excess = self._excess + 1 if read > THRASH_RATIO * expected else 0
        self.why = (f"{self._refused + '; ' if self._refused else ''}the last forward read "
                    f"{format_bytes(read)}, the plan streams {format_bytes(expected)} "
                    f"({read / max(expected, 1):.2f}x)")
        if self._excess >= 2:
            self._try(self.why + f", twice in a row over {THRASH_RATIO}x")

    def _try(self, why: str) -> bool:
        """``auto``: read uncached from the next layer on where the plan's room holds the
        buffers and reads no more with them (``coordinator.uncached_fits``); else say why not."""
        source = self._source
        count = source.buffers if source.reads_uncached else self._window_buffers()
        per_buffer = self._buffer_bytes()
        fits, refused = coordinator().uncached_fits(self._member, count * per_buffer)
        if not fits:
            if refused != self._refused:
                logger.info("%s: %s", self._member.name, refused)
            self.why = self._refused = refused
            return False
        self._refused = ""
        self.read_uncached(why)
        coordinator().place_buffers()  # the plan charges the buffers from now on
        return True
