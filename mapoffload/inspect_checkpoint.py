"""What `mapoffload inspect` reports, without loading any weight.

Safetensors headers give tensor counts and dtypes; ``mincore`` over a fresh
read-only mapping gives page-cache residency (the vmtouch view); the budget and
the gate say whether a load would keep the checkpoint mapped.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import asdict, dataclass, field

from ._native import _core
from .budget import HOST_COPY_RESERVE_BYTES, host_copies_would_not_fit, host_memory
from .checkpoint import CheckpointError, checkpoint_files

__all__ = ["CheckpointInfo", "FileInfo", "inspect_checkpoint", "read_safetensors_header"]

_MAX_HEADER = 100 << 20  # safetensors caps headers at 100 MB


def read_safetensors_header(path: str) -> dict:
    """The JSON header of a safetensors file (reads only the header bytes).

    Raises
    ------
    CheckpointError
        When the file is not a safetensors file.
    """
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(path, "too short to be a safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n > min(_MAX_HEADER, size - 8):
            raise CheckpointError(path, f"header length {n} does not fit the file ({size} bytes)")
        try:
            header = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError) as exc:
            raise CheckpointError(path, f"header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(path, "header is not a JSON object")
    return header


@dataclass
class FileInfo:
    path: str
    bytes: int
    tensors: int | None  # None for PyTorch zip files (counting needs unpickling)
    dtypes: dict[str, int]  # dtype -> tensor count
    resident_bytes: int


@dataclass
class CheckpointInfo:
    path: str
    component: str
    files: list[FileInfo] = field(default_factory=list)

    @property
    def bytes(self) -> int:
        return sum(f.bytes for f in self.files)

    @property
    def resident_bytes(self) -> int:
        return sum(f.resident_bytes for f in self.files)

    @property
    def tensors(self) -> int:
        return sum(f.tensors or 0 for f in self.files)


def _file_info(path: str) -> FileInfo:
    resident, size = _core.file_resident_bytes(path)
    if path.endswith(".safetensors"):
        header = read_safetensors_header(path)
        dtypes: dict[str, int] = {}
        count = 0
        for key, entry in header.items():
            if key == "__metadata__":
                continue
            count += 1
            dt = entry.get("dtype", "?") if isinstance(entry, dict) else "?"
            dtypes[dt] = dtypes.get(dt, 0) + 1
        return FileInfo(path, size, count, dtypes, resident)
    return FileInfo(path, size, None, {}, resident)


def _components(path: str) -> list[tuple[str, str]]:
    """(component name, checkpoint path) rows: diffusers-style sub-folders each
    get a row; a plain checkpoint gets one."""
    if not os.path.isdir(path):
        return [(os.path.basename(path), path)]
    rows = []
    has_own = any(e.endswith((".safetensors", ".pt", ".bin", ".safetensors.index.json")) for e in os.listdir(path))
    if has_own:
        rows.append((os.path.basename(os.path.normpath(path)), path))
    for entry in sorted(os.listdir(path)):
        sub = os.path.join(path, entry)
        if os.path.isdir(sub) and any(
            f.endswith((".safetensors", ".pt", ".bin", ".safetensors.index.json")) for f in os.listdir(sub)
        ):
            rows.append((entry, sub))
    if not rows:
        raise ValueError(f"{path}: no .safetensors, .pt or .bin checkpoint in this folder or its sub-folders")
    return rows


def inspect_checkpoint(path: str | os.PathLike) -> dict:
    """Everything `mapoffload inspect` prints, as plain data (JSON-ready)."""
    p = os.fspath(path)
    components = []
    for name, sub in _components(p):
        info = CheckpointInfo(sub, name, [_file_info(f) for f in checkpoint_files(sub)])
        components.append(info)
    host = host_memory()
    total = sum(c.bytes for c in components)
    keep = host_copies_would_not_fit(total, available_bytes=host.available)
    return {
        "path": p,
        "total_bytes": total,
        "components": [
            {
                "component": c.component, "path": c.path, "bytes": c.bytes, "tensors": c.tensors,
                "resident_bytes": c.resident_bytes,
                "keep_mapped": host_copies_would_not_fit(c.bytes, available_bytes=host.available),
                "files": [asdict(f) for f in c.files],
            }
            for c in components
        ],
        "host": asdict(host) | {"summary": str(host)},
        "gate": {
            "keep_mapped": keep,
            "reserve_bytes": HOST_COPY_RESERVE_BYTES,
            "copy_budget_bytes": host.available - HOST_COPY_RESERVE_BYTES,
            "reason": (
                f"{total} bytes >= {host.available} available - {HOST_COPY_RESERVE_BYTES} reserve: keep mapped"
                if keep
                else f"{total} bytes < {host.available} available - {HOST_COPY_RESERVE_BYTES} reserve: copies fit"
            ),
        },
    }
