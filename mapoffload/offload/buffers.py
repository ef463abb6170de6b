"""The host memory a manager's machinery holds besides the weights' stores.

summary() counts it (issue 27: under a cap, the read-around buffers were
+107 MiB of anonymous memory that the table called "nothing is copied"):

- read-around buffers: the ``O_DIRECT`` reader's ``1 + depth`` reused,
  page-aligned buffers (anonymous memory; on CUDA page-locked);
- staging slots: the copier's ring (pinned on CUDA; page-aligned anonymous
  memory for the CPU twin), allocated when the copier is made;
- device buffers on the CPU: the CPU twin's "device" buffers are host memory.

Each entry carries the identity of what holds it, so that a copier shared by
several managers is counted once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from ..copier import Copier
    from .loads import Target

__all__ = ["HeldBuffers", "held_buffers"]


@dataclass(frozen=True)
class HeldBuffers:
    """Bytes of one kind of working buffer: ``anonymous`` and ``pinned`` host
    bytes; ``owner`` the id of the object that holds them (count each once)."""

    what: str
    anonymous: int
    pinned: int
    owner: int

    @property
    def nbytes(self) -> int:
        return self.anonymous + self.pinned


def held_buffers(loads: Target, copier: Copier | None, device: torch.device) -> list[HeldBuffers]:
    """What a manager holds now besides its weights (entries with bytes only): its load target ``loads``
    (``manager.loads``), its ``copier`` (None in place), on ``device``."""
    out: list[HeldBuffers] = []
    source = loads.source
    held, pinned = source.held_bytes, source.pinned_bytes
    out.append(HeldBuffers("read-around buffers", held - pinned, pinned, id(source)))
    ring = copier.ring_bytes if copier is not None else 0
    if ring:
        cuda = copier.device.type == "cuda"
        out.append(HeldBuffers("staging slots", 0 if cuda else ring, ring if cuda else 0, id(copier)))
    if copier is not None and device.type == "cpu":
        out.append(HeldBuffers("device buffers on the CPU", loads.bytes, 0, id(loads)))
    return [b for b in out if b.nbytes]
