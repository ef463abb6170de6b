"""A checkpoint's keys read from its headers (names, shapes, dtypes: the
stored dtype a diffusers component is built in) and short diagnostics for
keys that do not match (``"3 missing keys (common prefix 'cls.'): …"``).
transformers' own key rules are applied by transformers (see ``_drive``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..loading.files import TORCH_SUFFIXES
from ..loading.header import read_safetensors_header

MAX_LISTED = 10

# safetensors dtype names -> torch dtype attribute names.
_ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}


@dataclass
class CheckpointKeys:
    """Names, shapes and dtypes of a checkpoint's tensors, read without loading them."""

    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    dtypes: dict[str, str] = field(default_factory=dict)  # torch dtype attribute names
    nbytes: dict[str, int] = field(default_factory=dict)


def read_keys(files: list[str]) -> CheckpointKeys:
    """Keys of every file (safetensors: the header only; PyTorch files: a mapped load)."""
    import torch

    out = CheckpointKeys()
    for f in files:
        if f.endswith(TORCH_SUFFIXES):
            state = torch.load(f, mmap=True, weights_only=True, map_location="cpu")
            if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
                state = state["state_dict"]
            for k, t in state.items():
                out.shapes[k] = tuple(t.shape)
                out.dtypes[k] = str(t.dtype).removeprefix("torch.")
                out.nbytes[k] = t.nbytes
            continue
        for k, entry in read_safetensors_header(f).items():
            if k == "__metadata__":
                continue
            out.shapes[k] = tuple(entry["shape"])
            out.dtypes[k] = _ST_DTYPES.get(entry["dtype"], entry["dtype"].lower())
            begin, end = entry["data_offsets"]
            out.nbytes[k] = end - begin
    return out


def checkpoint_float_dtype(keys: CheckpointKeys) -> str | None:
    """The floating dtype holding most of the checkpoint's bytes (None: no float tensor)."""
    by_dtype: dict[str, int] = {}
    for k, d in keys.dtypes.items():
        if d in _ST_DTYPES.values():
            by_dtype[d] = by_dtype.get(d, 0) + keys.nbytes[k]
    return max(by_dtype, key=by_dtype.__getitem__) if by_dtype else None


def common_prefix(keys: list[str]) -> str:
    """The longest dotted prefix all ``keys`` share ('' when none)."""
    if not keys:
        return ""
    parts = [k.split(".") for k in keys]
    out = []
    for group in zip(*parts):
        if len(set(group)) != 1:
            break
        out.append(group[0])
    if out and len(out) == min(len(p) for p in parts):
        out.pop()  # a full key is not a prefix
    return ".".join(out)


def describe_keys(kind: str, keys: list[str]) -> str:
    """``"3 missing keys (common prefix 'cls.'): a, b, c"``, at most ten listed."""
    keys = sorted(keys)
    pre = common_prefix(keys)
    shown = ", ".join(keys[:MAX_LISTED]) + (f", … ({len(keys) - MAX_LISTED} more)" if len(keys) > MAX_LISTED else "")
    where = f" (common prefix {pre + '.'!r})" if pre else ""
    return f"{len(keys)} {kind} key{'s' if len(keys) != 1 else ''}{where}: {shown}"
