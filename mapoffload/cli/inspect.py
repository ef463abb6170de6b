"""What `mapoffload inspect` reports, without loading any weight.

Safetensors headers give tensor counts and dtypes; ``mincore`` over a fresh
read-only mapping gives page-cache residency (the vmtouch view); the budget and
the gate say whether a load would keep the checkpoint mapped.
"""

from __future__ import annotations

import os
import json
from dataclasses import asdict, dataclass, field

from ..loading.files import checkpoint_components, checkpoint_files
from ..loading.header import read_safetensors_header
from .._native import _core
from ..memory.budget import HOST_COPY_RESERVE_BYTES, host_copies_would_not_fit, host_memory

__all__ = ["CheckpointInfo", "FileInfo", "inspect_checkpoint", "read_safetensors_header"]


# The folder beside a checkpoint that conversions go to (mapoffload.conversion.default_root).
CONVERTED_DIR = ".mapoffload-converted"


def _conversion_root(folder: str) -> str:
    """Where a load of ``folder`` that converts writes (without ``cache_dir=``)."""
    from ..conversion import default_root

    return default_root(folder)


@dataclass
class FileInfo:
    path: str
    bytes: int
    tensors: int
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
        return sum(f.tensors for f in self.files)


# safetensors' names for torch dtypes, so that both kinds of file read alike.
_SAFETENSORS_NAMES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
    "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8", "bool": "BOOL",
    "complex64": "C64",
}


def _dtype_name(dtype: object) -> str:
    name = str(dtype).removeprefix("torch.")
    return _SAFETENSORS_NAMES.get(name, name)


def _file_info(path: str) -> FileInfo:
    """One file's row. The header is read and validated before anything else
    touches the file (``checkpoint_files`` already refused non-regular ones).

    A PyTorch zip checkpoint (``.pt``/``.pth``/``.bin``) is opened as the
    loader opens it (``torch.load(mmap=True, weights_only=True)``): its
    pickle is read, its tensors' bytes stay on the mapping, unread.
    """
    dtypes: dict[str, int] = {}
    if path.endswith(".safetensors"):
        header = read_safetensors_header(path)
        names = [entry["dtype"] for key, entry in header.items() if key != "__metadata__"]
    else:
        from ..loading.read import read_file  # the loader's own reader: what it refuses, this refuses

        names = [_dtype_name(t.dtype) for t in read_file(path).values()]
    for name in names:
        dtypes[name] = dtypes.get(name, 0) + 1
    resident, size = _core.file_resident_bytes(path)
    return FileInfo(path, size, len(names), dtypes, resident)


def _transformers_refusal(folder: str) -> str | None:
    """Why ``from_pretrained`` would refuse this folder before loading, from its
    ``config.json`` alone (the quantization method); None when it would load."""
    from ..hf.transformers import quantization_refusal

    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except RecursionError:
        return "config.json is not valid JSON (nested too deeply)"
    except ValueError as exc:
        return f"config.json is not valid JSON ({exc})"
    except OSError as exc:
        return f"config.json cannot be read ({exc.strerror or exc})"
    if not isinstance(config, dict):
        return "config.json is not a JSON object"
    return quantization_refusal(config.get("quantization_config"))


def entry_points(path: str, gate_keeps: bool) -> dict[str, str]:
    """What each loading entry point does with this checkpoint on this host:
    the one rule (docs: README "Mapped or copied")."""
    folder = path if os.path.isdir(path) else None
    library = None
    if folder and os.path.isfile(os.path.join(folder, "model_index.json")):
        library = ("pipeline_from_pretrained", "diffusers' own")
    elif folder and os.path.isfile(os.path.join(folder, "config.json")):
        library = ("from_pretrained", "transformers' own")
    out = {}
    refusal = _transformers_refusal(folder) if library and library[0] == "from_pretrained" else None
    if refusal:
        out[library[0]] = f"refused: {refusal}"
    elif library:
        out[library[0]] = (f"kept on the file mapping, where {library[1]} load leaves it; what that load converts "
                           "or casts is written once to a mapped conversion folder (keep_mapping=False copies, "
                           "keep_mapping=None asks the gate as load_checkpoint does)")
    out["load_checkpoint"] = ("kept on the file mapping: host copies would not fit" if gate_keeps
                              else "copied into host memory: copies fit (keep_mapping=True keeps the mapping)")
    return out


def _dir_bytes(path: str) -> int:
    """Bytes the folder's files take on disk (a vLLM conversion's part is sparse: what vLLM kept
    unchanged is a view of the checkpoint, a hole in the part)."""
    total = 0
    for entry in os.scandir(path):
        if entry.is_file(follow_symlinks=False):
            st = entry.stat(follow_symlinks=False)
            total += min(st.st_size, st.st_blocks * 512)
    return total


def conversions(folder: str) -> list[dict]:
    """The conversion folders ``from_pretrained`` (or a pipeline's component, or vLLM's
    ``mapoffload`` load format: ``"for"`` says which) made from the checkpoint in ``folder``: every one
    beside it (``<folder>/.mapoffload-converted/<fingerprint>/``), and the finished ones a load of it
    would write elsewhere (``$MAPOFFLOAD_CONVERT_DIR``, the user's cache: a hub snapshot's, or a folder
    this user cannot write) whose manifest names this folder as their origin; finished when its
    manifest is there (:mod:`mapoffload.conversion`).

    Which one a later load reuses depends on what it asks for (class, dtype,
    config, versions), which a folder alone does not say: each is listed.
    """
    local = os.path.join(folder, CONVERTED_DIR)
    out = _conversions_in(local, None)
    try:
        elsewhere = _conversion_root(folder)
    except Exception:  # an environment setting refused: the loader says why
        return out
    if os.path.realpath(elsewhere) != os.path.realpath(local):
        out += _conversions_in(elsewhere, os.path.realpath(folder))
    return out


def _conversions_in(root: str, origin: str | None) -> list[dict]:
    """The conversion folders under ``root``; with ``origin``, only the finished ones made from it."""
    from ..conversion.cache import read_manifest

    out: list[dict] = []
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return out
    for name in names:
        path = os.path.join(root, name)
        if not os.path.isdir(path) or os.path.islink(path):
            continue
        tensors, finished, made_for, made_from = 0, False, None, None
        if not name.startswith("."):  # ".<key>.<random>": a conversion being written, or one that died
            try:  # the loader's own read: a FIFO under the manifest's name is not waited on
                manifest = read_manifest(path)
                tensors = len(manifest["tensors"])
                meta = manifest.get("meta") or {}
                made_for = "vllm" if isinstance(meta, dict) and "vllm" in meta else "transformers"
                made_from = manifest.get("origin")
                finished = True
            except (OSError, ValueError, RecursionError, KeyError, TypeError, AttributeError):
                pass
        if origin is not None and made_from != origin:
            continue  # another checkpoint's (a shared root), or not known to be this one's
        try:
            nbytes = _dir_bytes(path)
        except OSError:
            nbytes = 0
        out.append({"path": path, "key": name, "finished": finished, "tensors": tensors, "bytes": nbytes,
                    "for": made_for})
    return out


def _gate(total: int, available: int, keep: bool) -> dict:
    """The copy gate's numbers and its reason, with the ranks sharing this host as the gate counts them
    (each its own copy and its own reserve: :func:`~mapoffload.memory.budget.host_copies_would_not_fit`)."""
    from ..memory.budget import host_copy_room
    from ..memory.ranks import local_world

    n = local_world(None).size
    each = "" if n == 1 else f"{n} ranks x "
    compare = ">=" if keep else "<"
    return {
        "keep_mapped": keep,
        "local_ranks": n,
        "reserve_bytes": HOST_COPY_RESERVE_BYTES,
        "copy_budget_bytes": host_copy_room(available, n),
        "reason": f"{each}{total} bytes {compare} {available} available - {each}{HOST_COPY_RESERVE_BYTES} reserve: "
                  + ("keep mapped" if keep else "copies fit"),
    }


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
    folders = [p] if os.path.isdir(p) else []
    folders += [c.path for c in components if os.path.isdir(c.path) and c.path not in folders]
    found = [entry for f in folders for entry in conversions(f)]
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
        "entry_points": entry_points(p, keep),
        "conversions": found,
        "conversion_root": _conversion_root(p) if os.path.isdir(p) else None,
        "gate": _gate(total, host.available, keep),
    }
