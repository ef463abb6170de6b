"""What `mapoffload inspect` reports, without loading any weight.

Safetensors headers give tensor counts and dtypes; ``mincore`` over a fresh
read-only mapping gives page-cache residency (the vmtouch view); the budget and
the gate say whether a load would keep the checkpoint mapped.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field

from ._files import checkpoint_components, checkpoint_files
from ._header import read_safetensors_header
from ._native import _core
from .budget import HOST_COPY_RESERVE_BYTES, host_copies_would_not_fit, host_memory

__all__ = ["CheckpointInfo", "FileInfo", "inspect_checkpoint", "read_safetensors_header"]


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
    """One file's row. The header is read and validated before anything else
    touches the file (``checkpoint_files`` already refused non-regular ones)."""
    if path.endswith(".safetensors"):
        header = read_safetensors_header(path)
        dtypes: dict[str, int] = {}
        count = 0
        for key, entry in header.items():
            if key == "__metadata__":
                continue
            count += 1
            dtypes[entry["dtype"]] = dtypes.get(entry["dtype"], 0) + 1
        resident, size = _core.file_resident_bytes(path)
        return FileInfo(path, size, count, dtypes, resident)
    resident, size = _core.file_resident_bytes(path)
    return FileInfo(path, size, None, {}, resident)


def inspect_checkpoint(path: str | os.PathLike) -> dict:
    """Everything `mapoffload inspect` prints, as plain data (JSON-ready)."""
    p = os.fspath(path)
    components = []
    # One file-set rule for the loader, the gate and this report.
    for name, sub in checkpoint_components(p):
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
