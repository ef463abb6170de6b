"""Safetensors files written for conversions: the header laid out once (data page-aligned, widest
dtype first), then the bytes straight from each tensor's storage -- or, for a part computed into,
no bytes at all: a sparse file mapped shared and writable."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

_ALIGN = 4096  # data start: page-aligned, so every tensor maps page-aligned within its dtype order
_ST_CODES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
}


def _layout(specs: dict[str, tuple[tuple[int, ...], Any]]) -> tuple[bytes, list[tuple[str, int, int]]]:
    """A safetensors header for tensors of ``specs`` (name -> (shape, dtype)), padded so the data
    starts page-aligned, and ``(name, offset, nbytes)`` in data order: widest dtype first, so every
    tensor stays aligned to its element size."""
    import torch

    def width(k: str) -> int:
        return torch.empty((), dtype=specs[k][1]).element_size()

    order = sorted(specs, key=lambda k: (-width(k), k))
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "writer": "mapoffload"}}
    placed = []
    offset = 0
    for k in order:
        shape, dtype = specs[k]
        code = _ST_CODES.get(str(dtype).removeprefix("torch."))
        if code is None:
            raise TypeError(f"{k!r}: dtype {dtype} cannot be stored in a safetensors file")
        n = width(k)
        for d in shape:
            n *= int(d)
        header[k] = {"dtype": code, "shape": [int(d) for d in shape], "data_offsets": [offset, offset + n]}
        placed.append((k, offset, n))
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((-(8 + len(text))) % _ALIGN)
    return len(text).to_bytes(8, "little") + text, placed


def write_safetensors(path: str, tensors: dict[str, torch.Tensor]) -> None:
    """Write ``tensors`` (CPU) as one safetensors file without an in-memory copy
    of the whole: the header (see :func:`_layout`), then each tensor's bytes
    straight from its storage."""
    import torch

    head, placed = _layout({k: (tuple(t.shape), t.dtype) for k, t in tensors.items()})
    with open(path, "wb") as f:
        f.write(head)
        for k, _, _ in placed:
            t = tensors[k].detach()
            if t.device.type != "cpu":
                t = t.cpu()
            t = t.contiguous()
            if t.numel():
                f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))  # 1-D first: a 0-d tensor cannot change its element size
        f.flush()
        os.fsync(f.fileno())


def reserve_safetensors(path: str, specs: dict[str, tuple[tuple[int, ...], Any]]) -> dict[str, torch.Tensor]:
    """Create ``path`` as a safetensors file for ``specs`` whose data is not written yet (a sparse
    file: no disk blocks until written) and return each tensor as a writable view of a *shared*
    mapping of it: what is written into a view lands in the file through the page cache, never
    in anonymous memory. Bytes never written read as zeros and take no space."""
    import torch

    head, placed = _layout(specs)
    size = len(head) + sum(n for _, _, n in placed)
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(size)
    whole = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
    base = len(head)
    return {k: whole[base + o: base + o + n].view(specs[k][1]).view(specs[k][0]) for k, o, n in placed}
