"""Reading a checkpoint's files: every tensor as a mapped CPU view, a key in two files refused.

A safetensors file is checked by :func:`~mapoffload.loading.header.read_safetensors_header` (a
repeated key or any other defect is a :class:`CheckpointError` naming it) before safetensors maps
it; a PyTorch zip checkpoint (``.pt``/``.pth``/``.bin``) is read with
``torch.load(mmap=True, weights_only=True)``. The files are those
:func:`~mapoffload.loading.files.checkpoint_files` listed (regular files, checked); a tqdm bar
counts them when the load is long or has many shards.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .files import TORCH_SUFFIXES, CheckpointError
from .header import read_safetensors_header

if TYPE_CHECKING:
    import torch

__all__ = ["MANY_SHARDS", "read_file", "read_files"]


def read_file(path: str) -> dict[str, torch.Tensor]:
    """Mapped CPU views of every tensor in one file (a regular file, as
    :func:`checkpoint_files` checked)."""
    import torch

    if path.endswith(TORCH_SUFFIXES):
        try:
            obj = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
        except Exception as exc:
            raise CheckpointError(path, f"not a readable PyTorch checkpoint ({exc})") from None
        if isinstance(obj, Mapping) and "state_dict" in obj and isinstance(obj["state_dict"], Mapping):
            obj = obj["state_dict"]
        if not isinstance(obj, Mapping) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
            raise CheckpointError(path, "does not hold a flat dict of tensors")
        return dict(obj)
    from safetensors import SafetensorError, safe_open

    # safetensors' own parser takes a repeated key last-wins; ours refuses it,
    # and names the key at fault for every other defect too.
    read_safetensors_header(path)
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            return {k: f.get_tensor(k) for k in f.keys()}
    except SafetensorError as exc:
        raise CheckpointError(path, f"not a valid safetensors file ({exc})") from None
    except OSError as exc:
        raise CheckpointError(path, f"cannot be read ({exc})") from None


MANY_SHARDS = 8  # a load of this many files shows its bar at once


def _progress_bar(files: list[str], enabled: bool | None) -> Any:
    """A tqdm bar over ``files`` (None: no bar) when tqdm is installed and
    ``enabled`` is not False: shown at once for many shards (or when asked
    for with True), otherwise only once the load has taken a second."""
    if enabled is False or not files:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=len(files), unit="file", desc="Loading checkpoint", delay=0 if enabled or len(files) >= MANY_SHARDS else 1.0,
                leave=False)


def read_files(files: list[str], progress: bool | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of every file; a key in two files is an error, not last-wins."""
    loaded: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    bar = _progress_bar(files, progress)
    try:
        for f in files:
            _read_one(f, loaded, origin)
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return loaded


def _read_one(f: str, loaded: dict[str, torch.Tensor], origin: dict[str, str]) -> None:
    for key, tensor in read_file(f).items():
        if key in origin:
            raise CheckpointError(f, f"key {key!r} is in both {origin[key]} and {f}")
        origin[key] = f
        loaded[key] = tensor
