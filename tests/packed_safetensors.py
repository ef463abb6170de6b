"""A safetensors file written by hand, its tensors packed with no padding between them (safetensors' own
writer aligns them; the format does not ask it): weights at addresses that are not a multiple of their
element size, for the tests of what reads them."""

from __future__ import annotations

import json
import struct

import torch

_NAMES = {torch.float32: "F32", torch.int8: "I8", torch.float8_e4m3fn: "F8_E4M3"}


def write_packed(path, tensors: dict[str, torch.Tensor], odd: str | None = None) -> None:
    """``tensors`` in this order, back to back; with ``odd``, the header padded (as the format allows) so
    that tensor ``odd`` starts at a file offset of 1 modulo 4."""
    header, blobs, off = {}, [], 0
    for k, t in tensors.items():
        b = t.contiguous().view(torch.uint8).numpy().tobytes()
        header[k] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    if odd is not None:
        while (8 + len(h) + header[odd]["data_offsets"][0]) % 4 != 1:
            h += b" "
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))
