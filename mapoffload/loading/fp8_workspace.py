"""The working buffers FP8 weights are dequantized into on the CPU.

A forward dequantizes every fp8 weight it reads, each into memory that lives
only while its module computes. Allocated afresh each time, that memory is a
new mapping the kernel zeroes and faults in (a 3584 x 1024 weight in bf16 is
7 MiB), or heap the allocator keeps after it is freed - anonymous memory that
grows with the shapes seen, not with what is in use. Here a few flat buffers
per (size, dtype) are kept and reused: a dequantization takes one that
nothing else holds, and hands out a view of it.

"Nothing else holds it": the buffer's storage has no user but the buffer
itself (``torch._C._storage_Use_Count``). A view handed out - the weight
while its module computes, a tensor autograd saved for a backward, a weight
a caller kept (``w = linear.weight``, ``w.t()``) - holds the storage, so the
buffer is not reused until it is gone; such a caller keeps what it got.

Bounded: at most ``PER_KEY`` buffers of one (size, dtype), none larger than
``MAX_BUFFER_BYTES`` (a whole MoE expert stack is dequantized into memory of
its own, as before), ``MAX_TOTAL_BYTES`` in all; beyond that, fresh memory.
The buffers go when the last fp8 parametrization of the process does.
"""

from __future__ import annotations

import os
import threading
import weakref

import torch

__all__ = ["MAX_BUFFER_BYTES", "MAX_TOTAL_BYTES", "PER_KEY", "Workspace", "workspace"]

PER_KEY = 2  # the weight in use and the one a memo or a read-ahead layer still holds
MAX_BUFFER_BYTES = 64 << 20
MAX_TOTAL_BYTES = 256 << 20

_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _unused(buf: torch.Tensor) -> bool:
    """Whether ``buf``'s storage has no user but ``buf`` (and the wrapper made to ask)."""
    return _use_count is not None and _use_count(buf.untyped_storage()._cdata) <= 2


class Workspace:
    """Reused CPU buffers for dequantized fp8 weights (see the module)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buffers: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self._owners = 0
        self.hits = 0  # takes served by a reused buffer (tests, summary)

    @property
    def bytes(self) -> int:
        """Bytes of the buffers kept now."""
        with self._lock:
            return sum(b.nbytes for bufs in self._buffers.values() for b in bufs)

    def take(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised CPU tensor of ``shape`` and ``dtype``: a view of a kept buffer
        nothing else holds, else new memory (kept when the bounds allow)."""
        numel = 1
        for n in shape:
            numel *= int(n)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if _use_count is None or numel == 0 or nbytes > MAX_BUFFER_BYTES:
            return torch.empty(shape, dtype=dtype)
        key = (numel, dtype)
        with self._lock:
            bufs = self._buffers.setdefault(key, [])
            for buf in bufs:
                if _unused(buf):
                    self.hits += 1
                    return buf.view(shape)
            total = sum(b.nbytes for kept in self._buffers.values() for b in kept)
            if len(bufs) >= PER_KEY or total + nbytes > MAX_TOTAL_BYTES or not self._owners:
                return torch.empty(shape, dtype=dtype)
            buf = torch.empty(numel, dtype=dtype)
            bufs.append(buf)
            return buf.view(shape)

    def own(self, owner: object) -> None:
        """Keep the buffers while ``owner`` (an fp8 parametrization) lives."""
        with self._lock:
            self._owners += 1
        weakref.finalize(owner, self._disown)

    def _disown(self) -> None:
        with self._lock:
            self._owners -= 1
            if self._owners <= 0:
                self._owners = 0
                self._buffers.clear()  # views still held elsewhere keep their storage alive

    def clear(self) -> None:
        """Drop the kept buffers (views handed out keep theirs)."""
        with self._lock:
            self._buffers.clear()


_WORKSPACE = Workspace()


def _after_fork_in_child() -> None:
    _WORKSPACE._lock = threading.Lock()  # a fork while another thread held it


os.register_at_fork(after_in_child=_after_fork_in_child)


def workspace() -> Workspace:
    """The process's fp8 workspace."""
    return _WORKSPACE
