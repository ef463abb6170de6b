"""Device buffers of the layerwise offload manager: a pool per size, and the
byte accounting.

A buffer given back is reused by the next layer of the same size. Reuse is
ordered by the copier, not here: every prefetch's copies wait for the work
already queued on the compute stream (``wait_for``), which includes every
read of a buffer given back before it, and the copier holds the buffers of a
copy in flight until it is done.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class DevicePool:
    """Flat ``uint8`` buffers on one device, pooled by size."""

    def __init__(self, device: torch.device, copy_stream: object | None) -> None:
        self.device = device
        self._copy_stream = copy_stream
        self._free: dict[int, list[torch.Tensor]] = {}
        self.bytes = 0  # held now: in use or pooled
        self.peak_bytes = 0

    def take(self, nbytes: int) -> torch.Tensor:
        import torch

        free = self._free.get(nbytes)
        if free:
            return free.pop()
        # A normal tensor even when the first forward runs under inference_mode:
        # an inference tensor could not be written (update_cpu_weights) outside it.
        with torch.inference_mode(False):
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        if self._copy_stream is not None:
            # Written on the copy stream: the caching allocator must not hand
            # this memory to another stream before that work is done.
            buf.record_stream(self._copy_stream)
        self.bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.bytes)
        return buf

    def pooled(self) -> list[torch.Tensor]:
        """The buffers given back and not taken again."""
        return [b for bufs in self._free.values() for b in bufs]

    def give(self, buf: torch.Tensor) -> None:
        self._free.setdefault(buf.numel(), []).append(buf)

    def clear(self) -> None:
        """Drop the pooled buffers (buffers in use stay with their holders)."""
        for bufs in self._free.values():
            self.bytes -= sum(b.numel() for b in bufs)
        self._free.clear()
