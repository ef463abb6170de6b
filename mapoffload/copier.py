"""Python face of the native copier: devices, streams, settings.

The engine (``csrc/copier.cpp``) moves bytes from host memory - above all
from a checkpoint's file mapping - into device buffers on a CUDA stream.
``staged`` (default): worker threads memcpy the source into a bounded ring of
pinned slots, then an async H2D copy goes from each slot; a CPU read never
breaks copy-on-write, and page faults happen off the caller's thread.
``direct``: one ``cudaMemcpyAsync`` per span from the source, as the seed
runtime did (kept for comparison). With ``device="cpu"`` the same pipeline runs
into CPU buffers (page-aligned slots, memcpy in place of the H2D copy).

Settings: arguments, else ``MAPOFFLOAD_COPY_THREADS``,
``MAPOFFLOAD_STAGING_MIB``, ``MAPOFFLOAD_STAGING_SLOTS``, else defaults.
"""

from __future__ import annotations

import atexit
import os
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ._env import env_number
from ._log import logger
from ._native import _core

if TYPE_CHECKING:
    import torch

__all__ = ["CopyHandle", "CopyStats", "Copier", "CudaError", "MappingFaultError", "cuda_available"]

CudaError = _core.CudaError
MappingFaultError = _core.MappingFaultError

ENV_THREADS = "MAPOFFLOAD_COPY_THREADS"
ENV_STAGING_MIB = "MAPOFFLOAD_STAGING_MIB"
ENV_SLOTS = "MAPOFFLOAD_STAGING_SLOTS"
DEFAULT_SLOT_MIB = 8
MAX_THREADS = _core.COPIER_MAX_THREADS
MAX_SLOTS = _core.COPIER_MAX_SLOTS
MAX_SLOT_BYTES = _core.COPIER_MAX_SLOT_BYTES
MIN_SLOT_BYTES = _core.COPIER_MIN_SLOT_BYTES  # the native engine's smallest slot (one page): the only one


def cuda_available() -> bool:
    """True when the CUDA runtime loads (no toolkit needed) and has a device."""
    # torch first: its import loads the libcudart it uses, which the native
    # loader then finds (RTLD_NOLOAD) instead of opening another one from the
    # system paths for the rest of the process.
    import torch  # noqa: F401

    return _core.cuda_available()



def _argument(value: object, name: str, low: int, high: int, unit: str = "") -> int:
    """A setting passed as an argument: an int (not a bool) in ``low..high``."""
    import operator

    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{name} must be an int, not {type(value).__name__} ({value!r})")
    n = operator.index(value)  # type: ignore[arg-type]
    if not low <= n <= high:
        raise ValueError(f"{name} must be in {low}..{high}{unit}, got {n}")
    return n


def _setting(value: int | None, env: str, default: int, *, name: str, low: int, high: int,
             env_unit: str = "", env_scale: int = 1, unit: str = "") -> int:
    """The argument, else the environment variable (in ``env_unit``, times ``env_scale``), else the default.

    Raises
    ------
    TypeError
        The argument is not an int.
    ValueError
        The argument is out of range, or the variable is not a number in
        range (a whole number unless ``env_scale`` > 1): the argument or the
        variable is named, with the range in its own unit.
    """
    if value is not None:
        return _argument(value, name, low, high, unit)
    if env_scale == 1:
        from_env = env_number(env, low=low, high=high, unit=env_unit, integer=True)
    else:
        from_env = env_number(env, low=low / env_scale, high=high / env_scale, unit=env_unit)
    if from_env is None:
        return default
    return int(round(from_env * env_scale))


def resolve_settings(
    threads: int | None = None, staging_bytes: int | None = None, slots: int | None = None
) -> tuple[int, int, int]:
    """``(threads, slot bytes, slots)`` a copier made with these arguments gets.

    Each: the argument, else its environment variable
    (``MAPOFFLOAD_COPY_THREADS``: whole threads; ``MAPOFFLOAD_STAGING_MIB``:
    MiB per slot, 4 KiB to 4 GiB; ``MAPOFFLOAD_STAGING_SLOTS``: whole slots),
    else the default.

    Raises
    ------
    TypeError, ValueError
        See :func:`_setting`; the argument or variable at fault is named.
    """
    n_threads = _setting(threads, ENV_THREADS, min(4, os.cpu_count() or 1), name="threads", low=1,
                         high=MAX_THREADS)
    slot_bytes = _setting(
        staging_bytes, ENV_STAGING_MIB, DEFAULT_SLOT_MIB << 20, name="staging_bytes", low=MIN_SLOT_BYTES,
        high=MAX_SLOT_BYTES, env_unit="MiB", env_scale=1 << 20, unit=" bytes",
    )
    n_slots = _setting(slots, ENV_SLOTS, max(4, 2 * n_threads), name="slots", low=1, high=MAX_SLOTS)
    return n_threads, slot_bytes, n_slots


# Every live copier, closed at interpreter exit: workers never outlive the
# objects they copy, and no exit waits on a copy that can no longer finish.
_LIVE: weakref.WeakSet[Copier] = weakref.WeakSet()


@atexit.register
def _close_all_at_exit() -> None:
    for copier in list(_LIVE):
        try:
            copier.close(cancel=True)
        except Exception:  # pragma: no cover - exit must go on
            logger.debug("closing %r at exit failed", copier, exc_info=True)


@dataclass(frozen=True)
class CopyStats:
    """Cumulative counters of one copier."""

    jobs: int
    units: int
    bytes: int
    faults: int
    read_seconds: float
    submit_seconds: float
    slot_wait_seconds: float
    unstaged_bytes: int  # copied without a staging slot (pinned sources, DMA straight from them)


class CopyHandle:
    """One :meth:`Copier.copy`: wait for it, or ask whether it is done.

    Completion has one meaning: a copy is *done* when every byte is at its
    destination - on CUDA, when the device copies have completed, not merely
    been queued. :meth:`wait_stream` is the stream-ordered alternative: the
    host waits only until the copies are queued, and a CUDA stream waits for
    them on the device.

    The copier, not this handle, keeps the source and destination tensors
    (and their storages) alive until the copy is done: dropping the handle,
    every other reference to the tensors, or re-pointing them
    (``param.data = other``, ``t.set_()``) early is safe. Resizing a tensor
    in place (``resize_``) while its copy runs is not: that frees its memory
    under the copy, as it would under any other reader.

    The handle keeps its copier alive: ``Copier(...).copy(...).wait()`` with
    a temporary copier completes instead of being cancelled by the copier's
    destruction.
    """

    __slots__ = ("_job", "_copier")

    def __init__(self, job: _core.CopyJob, copier: Copier | None = None) -> None:
        self._job = job
        self._copier = copier

    def wait(self) -> None:
        """Block until every byte is at its destination (CUDA: copies completed).

        Raises
        ------
        MappingFaultError
            A source mapping's file was truncated (the file and byte range are named).
        CudaError
            A CUDA call failed (the call is named). After a sticky error the
            copier is broken: every later copy fails at once.
        RuntimeError
            The copier was closed before the copy ran, or the process forked
            while it was in flight.
        """
        self._job.wait()

    def done(self) -> bool:
        """True once every byte is at its destination (or the copy failed). Never raises."""
        return self._job.done()

    def enqueued(self) -> bool:
        """True once every copy has been queued on the stream (CPU: copied)."""
        return self._job.enqueued()

    def wait_stream(self, stream: object | None = None) -> None:
        """Make ``stream`` (default: torch's current stream on the copies' device) wait for these copies.

        Blocks the host only until the copies are queued; re-raises a
        failure. On the CPU it is :meth:`wait`. Handle 0 is a CUDA stream
        like any other (the legacy default stream: torch's default one),
        never a reason to wait on the host.
        """
        device = self._job.device
        if device < 0:  # CPU destinations: nothing orders them but the host
            self._job.wait()
            return
        if stream is None:
            import torch

            stream = torch.cuda.current_stream(device)
        self._job.wait_stream(int(getattr(stream, "cuda_stream", stream)))


class Copier:
    """Copy engine for host -> device (or host -> CPU buffer) transfers.

    Parameters
    ----------
    device
        ``"cuda"``, ``"cuda:N"`` or ``"cpu"``.
    mode
        ``"staged"`` (default: worker threads copy into a ring of pinned
        slots, each sent on by an asynchronous H2D copy) or ``"direct"`` (one
        ``cudaMemcpyAsync`` per span from the source, as the seed runtime
        does; a manager given such a copier enqueues on the compute stream,
        as the seed does: kept for comparison, ``benchmarks/offload_step.py``).
    threads, staging_bytes, slots
        Worker threads, bytes per staging slot, slots in the ring.
    """

    def __init__(
        self,
        device: str | torch.device = "cuda",
        mode: str = "staged",
        *,
        threads: int | None = None,
        staging_bytes: int | None = None,
        slots: int | None = None,
    ) -> None:
        import torch

        dev = torch.device(device)
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError(f"device {dev} requested but torch sees no CUDA device")
            torch.cuda.init()  # the runtime torch loads is the one the copier opens
            index = dev.index if dev.index is not None else torch.cuda.current_device()
            self.device = torch.device("cuda", index)
        elif dev.type == "cpu":
            index = -1
            self.device = dev
        else:
            raise ValueError(f"device must be cuda or cpu, not {dev}")
        n_threads, slot_bytes, n_slots = resolve_settings(threads, staging_bytes, slots)
        self._native = _core.Copier(index, mode, n_threads, slot_bytes, n_slots)
        _LIVE.add(self)
        logger.debug(
            "copier on %s: mode %s, %d threads, %d slots of %d bytes",
            self.device, mode, self._native.threads, n_slots, self._native.slot_bytes,
        )

    # -- settings ----------------------------------------------------------------
    @property
    def mode(self) -> str:
        return self._native.mode

    @property
    def threads(self) -> int:
        return self._native.threads

    @property
    def staging_bytes(self) -> int:
        return self._native.slot_bytes

    @property
    def slots(self) -> int:
        return self._native.slots

    @property
    def ring_bytes(self) -> int:
        """Host memory of the staging ring now: ``slots`` x ``staging_bytes`` (pinned on CUDA, page-aligned
        for CPU destinations), made with the copier in ``staged`` mode; 0 in ``direct`` mode or closed."""
        return self.slots * self.staging_bytes if self.mode == "staged" and not self.closed else 0

    # -- copying -----------------------------------------------------------------
    def _stream_handle(self, stream: object | None) -> int:
        if self.device.type != "cuda":
            return 0
        import torch

        if stream is None:
            stream = torch.cuda.current_stream(self.device)
        return int(getattr(stream, "cuda_stream", stream))

    def copy_spans(
        self,
        dst: Sequence[int],
        src: Sequence[int],
        sizes: Sequence[int],
        stream: object | None = None,
        keepalive: object = None,
        *,
        unstaged: Sequence[bool] | None = None,
        wait_for: object | None = None,
    ) -> CopyHandle:
        """Copy raw ``(dst, src, nbytes)`` spans.

        ``keepalive`` (whatever owns the memory) is held by the copier until
        the copy is done. ``unstaged`` flags spans whose source is pinned: DMA
        straight from it, no staging.
        ``wait_for``: a CUDA stream whose work
        already queued must finish before these copies start (a destination
        recycled from it); torch's default stream (handle 0) included.

        The addresses are trusted, as by ``ctypes.memmove``: only null and
        wrapping ranges are refused. A range that is not mapped (or a
        destination that is read-only) is a SIGSEGV on a worker thread, which
        the SIGBUS guard does not catch by design; :meth:`copy` derives the
        spans from tensors and cannot produce one.

        Raises
        ------
        ValueError
            A null address, or a destination overlapping another destination
            or a source (the pair is named).
        """
        job = self._native.submit(
            dst, src, sizes, self._stream_handle(stream), keepalive=keepalive, unstaged=unstaged,
            # None: no wait. A handle of 0 is torch's default stream (the
            # legacy default stream), which a side stream does not wait for
            # by itself: torch makes its streams non-blocking.
            wait_for=self._stream_handle(wait_for) if wait_for is not None and self.device.type == "cuda" else None,
        )
        return CopyHandle(job, self)

    def copy(
        self, dst_tensors: Sequence[torch.Tensor], src_tensors: Sequence[torch.Tensor], stream: object | None = None
    ) -> CopyHandle:
        """Copy each source tensor's bytes into the destination tensor of the same index.

        Non-blocking: returns a :class:`CopyHandle`. ``stream=None`` means
        torch's current stream on the destination device.

        Raises
        ------
        ValueError
            Lengths, bytes, devices or contiguity do not match (the index is named).
        """
        dst_list, src_list = list(dst_tensors), list(src_tensors)
        if len(dst_list) != len(src_list):
            raise ValueError(f"{len(dst_list)} destinations for {len(src_list)} sources")
        want = self.device
        for i, (d, s) in enumerate(zip(dst_list, src_list)):
            if d.nbytes != s.nbytes:
                raise ValueError(f"pair {i}: destination has {d.nbytes} bytes, source {s.nbytes}")
            if d.device != want and not (want.type == "cpu" and d.device.type == "cpu"):
                raise ValueError(f"pair {i}: destination is on {d.device}, the copier on {want}")
            if s.device.type != "cpu":
                raise ValueError(f"pair {i}: source is on {s.device}, not on the host")
            if not (d.is_contiguous() and s.is_contiguous()):
                raise ValueError(f"pair {i}: tensors must be contiguous")
        import torch

        dspans = _core.extract_spans(dst_list, torch.Tensor, False)
        sspans = _core.extract_spans(src_list, torch.Tensor, False)
        unstaged = None
        if self.device.type == "cuda":
            # Pinned sources need no staging: the DMA engine reads them directly.
            unstaged = [bool(s.is_pinned()) for s in src_list]
        # The storages too: a tensor re-pointed while the copy runs
        # (``param.data = other``) must not free the memory being copied.
        storages = [t.untyped_storage() for t in dst_list + src_list]
        return self.copy_spans(
            dspans.addrs, sspans.addrs, sspans.sizes, stream, (dst_list, src_list, storages), unstaged=unstaged
        )

    def advise(self, tensors: Sequence[torch.Tensor]) -> None:
        """Readahead hint (``MADV_WILLNEED``) for tensors to be copied next."""
        import torch

        spans = _core.extract_spans(list(tensors), torch.Tensor, True)
        self._native.advise(spans.addrs, spans.sizes)

    def stats(self) -> CopyStats:
        s = self._native.stats()
        return CopyStats(
            s.jobs, s.units, s.bytes, s.faults, s.read_ns / 1e9, s.submit_ns / 1e9, s.slot_wait_ns / 1e9,
            s.unstaged_bytes,
        )

    @property
    def broken(self) -> str | None:
        """The sticky CUDA error that broke this copier (every copy now fails with it), else None."""
        return self._native.broken

    def collect(self) -> int:
        """Let go of the tensors of finished copies now; returns how many copies still hold some."""
        return self._native.collect()

    def close(self, *, cancel: bool = False) -> None:
        """Stop the workers: run queued copies first, or fail them with ``cancel``.

        Always returns; waits for device copies in flight, then lets go of
        every tensor the copier held. Idempotent.
        """
        self._native.close(cancel)

    @property
    def closed(self) -> bool:
        return self._native.closed

    def __enter__(self) -> Copier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Copier(device={str(self.device)!r}, mode={self.mode!r}, threads={self.threads}, "
            f"staging_bytes={self.staging_bytes}, slots={self.slots})"
        )
