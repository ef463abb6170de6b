"""Reading and validating a safetensors header without trusting it.

A safetensors file is an 8-byte little-endian header length, a JSON header
(``{"__metadata__": {str: str}, name: {"dtype", "shape", "data_offsets"}}``)
and the data. Every field is checked against the format and the file's size,
so a bad file gives one :class:`CheckpointError` naming the file and the key at
fault — never a traceback from deep recursion or an odd-typed value.
"""

from __future__ import annotations

import json
import math
import os
import struct
from typing import Any

from .files import CheckpointError, open_regular

__all__ = ["DTYPE_BITS", "read_safetensors_header"]

MAX_HEADER_BYTES = 100 << 20  # the format's own cap (100 MB)

# Bits per element of every dtype the safetensors format defines.
DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8,
    "F8_E5M2": 8, "F8_E4M3": 8, "F8_E5M2FNUZ": 8, "F8_E4M3FNUZ": 8, "F8_E8M0": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32,
    "I64": 64, "U64": 64, "F64": 64, "C64": 64,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}


class _DuplicateKey(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _short(x: Any, limit: int = 80) -> str:
    text = repr(x)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_entry(entry: Any, data_bytes: int) -> str | None:
    """Why ``entry`` is not a valid tensor entry, or None."""
    if not isinstance(entry, dict):
        return f"a JSON {type(entry).__name__}, not a tensor entry"
    for field in ("dtype", "shape", "data_offsets"):
        if field not in entry:
            return f"no {field!r}"
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        return f"dtype {_short(dtype)} is not a safetensors dtype"
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        return f"shape {_short(shape)} is not a list of non-negative integers"
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
        return f"data_offsets {_short(offsets)} are not two integers [begin, end]"
    begin, end = offsets
    if not 0 <= begin <= end:
        return f"data_offsets {offsets!r} do not satisfy 0 <= begin <= end"
    if end > data_bytes:
        return f"data_offsets {offsets!r} run past the data ({data_bytes} bytes after the header)"
    bits = math.prod(shape) * DTYPE_BITS[dtype]
    if bits % 8 or bits // 8 != end - begin:
        size = f"{bits} bits" if bits % 8 else f"{bits // 8} bytes"
        return f"{dtype} {_short(shape)} is {size} but data_offsets {offsets!r} span {end - begin} bytes"
    return None


def read_safetensors_header(path: str | os.PathLike) -> dict:
    """The JSON header of a safetensors file, validated (reads only the header).

    Checks: the header length fits the file (and the format's 100 MB cap); the
    header is a JSON object without repeated keys; ``__metadata__`` is an
    object of strings; every other entry has a known dtype, a shape of
    non-negative integers, and ``data_offsets`` ``[begin, end]`` with
    ``0 <= begin <= end <= file size - 8 - header length`` spanning exactly the
    shape's bytes; and the tensors' ranges, sorted, cover the data exactly as
    safetensors' own loader requires (no two overlap, no bytes between or
    after them: :func:`_check_layout`). Every loader and ``mapoffload
    inspect`` read headers through this one function, so what one refuses
    the others refuse.

    Raises
    ------
    CheckpointError
        Naming the file and, where one is at fault, the key.
    FileNotFoundError
        For a missing file.
    """
    p = os.fspath(path)
    with open_regular(p) as (f, st):
        size = st.st_size
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(p, f"too short to be a safetensors file ({size} bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > min(MAX_HEADER_BYTES, size - 8):
            raise CheckpointError(p, f"header length {n} does not fit the file ({size} bytes)")
        raw = f.read(n)
    if len(raw) != n:
        raise CheckpointError(p, f"header length {n} but only {len(raw)} bytes could be read")
    try:
        header = json.loads(raw, object_pairs_hook=_no_duplicates)
    except _DuplicateKey as exc:
        raise CheckpointError(p, f"key {_short(exc.args[0], 200)} appears twice in the header") from None
    except RecursionError:
        raise CheckpointError(p, "header is not JSON (nested too deeply)") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(p, f"header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(p, f"header is a JSON {type(header).__name__}, not a JSON object")
    data_bytes = size - 8 - n
    for key, entry in header.items():
        if key == "__metadata__":
            if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
                raise CheckpointError(p, f"__metadata__ is {json.dumps(entry)[:80]}, not an object of strings")
            continue
        why = _check_entry(entry, data_bytes)
        if why:
            raise CheckpointError(p, f"tensor {_short(key, 200)}: {why}")
    why = _check_layout(header, data_bytes)
    if why:
        raise CheckpointError(p, why)
    return header


def _check_layout(header: dict, data_bytes: int) -> str | None:
    """Why the tensors' byte ranges are not laid out as safetensors' own loader
    requires, or None: sorted by ``data_offsets``, each begins where the one
    before ends (no two overlap, no bytes between), the last ends where the
    data does. Overlapping ranges are named as a pair. Every entry has passed
    :func:`_check_entry`."""
    ranges = sorted((entry["data_offsets"][0], entry["data_offsets"][1], key)
                    for key, entry in header.items() if key != "__metadata__")
    end, last = 0, None
    for begin, stop, key in ranges:
        if begin < end and last is not None:  # end > 0: there is a tensor before
            return (f"tensors {_short(last[2], 200)} (data_offsets {[last[0], last[1]]}) and {_short(key, 200)} "
                    f"(data_offsets {[begin, stop]}) overlap: each tensor must have bytes of its own")
        if begin > end:
            after = f"after tensor {_short(last[2], 200)}" if last else "at the start of the data"
            return (f"bytes {end}..{begin} of the data, {after}, belong to no tensor (tensor {_short(key, 200)} "
                    f"begins at {begin}): the tensors must cover the data without gaps")
        end, last = stop, (begin, stop, key)
    if end != data_bytes:
        return (f"the data is {data_bytes} bytes but its tensors end at {end}: the last "
                f"{data_bytes - end} bytes belong to no tensor")
    return None
