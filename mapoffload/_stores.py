"""Host stores of the layerwise offload manager: per-layer layout and planning.

Each managed weight lives in one of three host stores:

``mapped``
    A view of the checkpoint's file mapping, kept as it is: never written,
    never copied on the host (page cache the kernel can drop and re-read).
``consolidated``
    One flat buffer per layer and dtype (pinned or pageable), weights at
    aligned offsets: one contiguous copy moves the whole group.
``strided``
    An owned tensor of its own with its exact layout: non-contiguous weights
    (sizes and strides kept; it moves as the byte extent its strides cover),
    and mapped weights replaced through ``update_cpu_weights``.

On the device, every layer has one flat buffer per dtype holding all its
weights at the same aligned offsets.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ._log import logger

if TYPE_CHECKING:
    import torch

ALIGN = 256  # bytes: device allocations and vector loads like this alignment

MAPPED, CONSOLIDATED, STRIDED = "mapped", "consolidated", "strided"


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def extent_elements(t: torch.Tensor) -> int:
    """Elements spanned from the tensor's first element to its last (strides >= 0)."""
    if t.numel() == 0:
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))


@dataclass
class Weight:
    """One managed parameter (tied names share one entry)."""

    names: list[str]
    param: torch.nn.Parameter
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    store: str = CONSOLIDATED
    host: torch.Tensor | None = None  # the host copy (mapped view, consolidated view, strided tensor)
    offset: int = 0  # byte offset in the layer's per-dtype device buffer (and consolidated buffer)
    nbytes: int = 0  # bytes moved: numel * itemsize, or the strided extent

    @property
    def contiguous(self) -> bool:
        return self.param.data.is_contiguous()


@dataclass
class LayerStore:
    """Host side of one layer: its weights and per-dtype buffers."""

    index: int
    weights: list[Weight] = field(default_factory=list)
    dtype_bytes: dict[torch.dtype, int] = field(default_factory=dict)  # device buffer size per dtype
    consolidated: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)  # uint8 host buffers
    pinned: bool = False
    # What a prefetch copies, built once (host addresses are stable until
    # update_cpu_weights replaces a tensor): (dtype, device offset, host tensor, bytes).
    _sources: list[tuple[torch.dtype, int, torch.Tensor, int]] | None = None

    def sources(self) -> list[tuple[torch.dtype, int, torch.Tensor, int]]:
        """Spans of one prefetch: each consolidated buffer whole, other weights one by one."""
        if self._sources is None:
            out = [(dtype, 0, buf, buf.numel()) for dtype, buf in self.consolidated.items()]
            out += [(w.dtype, w.offset, w.host, w.nbytes) for w in self.weights if w.store != CONSOLIDATED]
            self._sources = out
        return self._sources

    def invalidate_sources(self) -> None:
        self._sources = None

    def bytes_in(self, store: str) -> int:
        return sum(w.nbytes for w in self.weights if w.store == store)


def _pin_exact(nbytes: int) -> torch.Tensor:
    """A pageable buffer of exactly ``nbytes``, page-locked with cudaHostRegister.

    torch's pinned caching allocator rounds sizes up to a power of two; for
    multi-GiB layer stores that doubles the pinned memory.
    """
    import torch

    buf = torch.empty(nbytes, dtype=torch.uint8)
    if nbytes:
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(buf.data_ptr(), nbytes, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed: error {int(err)}")
        weakref.finalize(buf, cudart.cudaHostUnregister, buf.data_ptr())
    return buf


def build_consolidated(layer: LayerStore, pin: bool) -> None:
    """Copy the layer's consolidated weights into one buffer per dtype."""
    import torch

    for dtype in layer.dtype_bytes:
        members = [w for w in layer.weights if w.store == CONSOLIDATED and w.dtype == dtype]
        if not members:
            continue
        end = max(w.offset + w.nbytes for w in members)
        buf = _pin_exact(end) if pin else torch.empty(end, dtype=torch.uint8)
        for w in members:
            view = buf[w.offset : w.offset + w.nbytes].view(dtype).view(w.shape)
            view.copy_(w.param.data)
            w.host = view
        layer.consolidated[dtype] = buf
    layer.pinned = pin and bool(layer.consolidated)


def build_strided(w: Weight) -> None:
    """Keep a non-contiguous weight's exact layout in an owned host tensor."""
    import torch

    src = w.param.data
    host = torch.empty_strided(src.shape, src.stride(), dtype=src.dtype)
    host.copy_(src)
    w.host = host


def layout(layer: LayerStore) -> None:
    """Assign each weight its aligned offset in the per-dtype buffers."""
    cursor: dict = {}
    for w in layer.weights:
        w.offset = align_up(cursor.get(w.dtype, 0))
        cursor[w.dtype] = w.offset + w.nbytes
    layer.dtype_bytes = {d: align_up(n) for d, n in cursor.items()}


def log_plan(layers: list[LayerStore], device: object) -> None:
    from ._log import format_bytes

    totals = {MAPPED: 0, "pinned": 0, "pageable": 0, STRIDED: 0}
    for layer in layers:
        totals[MAPPED] += layer.bytes_in(MAPPED)
        totals["pinned" if layer.pinned else "pageable"] += layer.bytes_in(CONSOLIDATED)
        totals[STRIDED] += layer.bytes_in(STRIDED)
    logger.info(
        "layerwise offload to %s, %d layers: %s mapped, %s pinned, %s pageable, %s strided",
        device, len(layers), *(format_bytes(totals[k]) for k in (MAPPED, "pinned", "pageable", STRIDED)),
    )
