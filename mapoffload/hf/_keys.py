"""Checkpoint keys against a transformers model: the Hugging Face conventions
(``base_model_prefix`` added or stripped, ``_keys_to_ignore_on_load_*``) and
short diagnostics for what does not match."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .._files import TORCH_SUFFIXES
from .._header import read_safetensors_header
from .._log import format_bytes

if TYPE_CHECKING:
    import torch

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


def _as_regex(patterns: Any) -> re.Pattern | None:
    pats = [p for p in (patterns or ()) if p]
    return re.compile("|".join(f"({p})" for p in pats)) if pats else None


def ignore_patterns(model: torch.nn.Module) -> tuple[re.Pattern | None, re.Pattern | None]:
    """(missing, unexpected) regexes a transformers model says to ignore, with
    the library's own additions (old ``rotary_emb.inv_freq`` and
    ``position_ids`` entries of checkpoints saved when they were persistent)."""
    unexpected = set(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
    names = [n for n, _ in model.named_buffers()]
    if any(n.endswith("rotary_emb.inv_freq") for n in names):
        unexpected.add(r"rotary_emb\.inv_freq")
    if any(n.endswith("position_ids") for n in names):
        unexpected.add(r"(^|\.)position_ids$")
    return _as_regex(getattr(model, "_keys_to_ignore_on_load_missing", None)), _as_regex(unexpected)


def prefix_rule(model: torch.nn.Module, ckpt_keys: set[str], model_keys: set[str]) -> tuple[str, str]:
    """How checkpoint names meet the model's: ``("same"|"strip"|"add", prefix)``.

    ``strip``: the checkpoint is a model with a head (``bert.*``) loaded into
    the base model; ``add``: a base checkpoint loaded into a model with a head.
    """
    prefix = getattr(model, "base_model_prefix", "") or ""
    if not prefix:
        return "same", ""
    dot = prefix + "."
    import torch

    overlap = len(ckpt_keys & model_keys)
    stripped = {k[len(dot):] for k in ckpt_keys if k.startswith(dot)}
    added = {dot + k for k in ckpt_keys}
    if len(stripped & model_keys) > overlap:
        return "strip", prefix
    if isinstance(getattr(model, prefix, None), torch.nn.Module) and len(added & model_keys) > overlap:
        return "add", prefix
    return "same", prefix


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


def describe_conversion(nbytes: int, pairs: list[tuple[str, str]], kept_fp32: bool,
                        folder: str | os.PathLike) -> str:
    """The warning for a load that converted dtypes: bytes, directions, the fix."""
    how = ", ".join(f"from {a} to {b}" for a, b in pairs) or "to the model's dtypes"
    fix = "Load with dtype='auto' to build the model in the stored dtype and keep them mapped"
    if kept_fp32:
        fix += " (modules the model keeps in float32, _keep_in_fp32_modules, are always converted)"
    return (
        f"{os.fspath(folder)}: {format_bytes(nbytes)} of weights were converted {how} "
        f"(anonymous copies, not on the file mapping). {fix}."
    )
