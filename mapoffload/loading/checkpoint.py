"""Loader gates and ``load_checkpoint``: keep weights on the checkpoint's file
mapping when host copies would not fit.

State of a module after an error: every check (files, keys, shapes, dtypes,
parameters left on meta) runs before the first parameter is assigned, so an
error leaves the module exactly as it was. Only a failure while converting or
copying a tensor's bytes (a file truncated during the load, say) can stop the
assignment half way; the module is then partly loaded and must be rebuilt.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .files import TORCH_SUFFIXES, CheckpointError, checkpoint_bytes, checkpoint_files
from .header import read_safetensors_header
from .._log import format_bytes, logger
from .._progress import byte_bar
from .shard import ShardPlan, check_plan, group_dim, narrow_shard, resolve_rank
from ..memory.budget import HOST_COPY_RESERVE_BYTES, host_copies_would_not_fit, host_memory_available_bytes
from ..memory.ranks import local_world
from ..memory.regions import tensor_bytes

if TYPE_CHECKING:
    import torch

__all__ = [
    "CheckpointError",
    "LoadReport",
    "checkpoint_bytes",
    "checkpoint_files",
    "empty_weights",
    "keep_checkpoint_mapped",
    "load_checkpoint",
    "match_checkpoint_dtypes",
]

# --- the gate ---------------------------------------------------------------------


def keep_checkpoint_mapped(*, weight_bytes: int, component: str, local_ranks: int | None = None) -> bool:
    """True exactly when host copies of ``weight_bytes`` would not fit.

    With several ranks on the host (``local_ranks``; None detects, see
    :mod:`mapoffload.ranks`) copies cost ``local ranks x weight_bytes`` of
    anonymous memory, a mapping the shared page cache once. Logs one line
    saying why, with both numbers against the host's available memory.
    """
    world = local_world(local_ranks)
    available = host_memory_available_bytes()
    keep = host_copies_would_not_fit(weight_bytes, available_bytes=available, local_ranks=world.size)
    gib = 1 << 30
    logger.info(
        "%s: %.2f GiB of weights, %s: copies would take %.2f GiB of anonymous memory, a mapping %.2f GiB "
        "of shared page cache; host has %.2f GiB available (%.0f GiB reserve per rank): %s",
        component,
        weight_bytes / gib,
        world,
        world.size * weight_bytes / gib,
        weight_bytes / gib,
        available / gib,
        HOST_COPY_RESERVE_BYTES / gib,
        "copies would not fit, keeping the checkpoint mapped" if keep else "copies fit, copying into host memory",
    )
    return keep


def match_checkpoint_dtypes(
    loaded: dict[str, torch.Tensor], target_state: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Convert, in ``loaded``, only tensors whose dtype differs from the target's.

    That conversion is the only anonymous memory a mapped load makes; tensors
    whose dtype matches stay the very same objects (still views of the
    mapping), and keys the target lacks are untouched. Returns ``loaded``.
    """
    for key, tensor in loaded.items():
        target = target_state.get(key)
        if target is not None and tensor.dtype != target.dtype:
            loaded[key] = tensor.to(target.dtype)
    return loaded


# --- building without memory ----------------------------------------------------


@contextlib.contextmanager
def empty_weights() -> Iterator[None]:
    """Build modules with parameters on the meta device and buffers real.

    Building a 60 GiB model costs nothing: each parameter moves to meta as it
    is registered, before the module's own initialisation runs on it. Buffers
    (position ids, rotary tables, non-persistent ones too) are created as
    usual, so they exist after :func:`load_checkpoint`.
    """
    import torch

    original = torch.nn.Module.register_parameter

    def register_parameter(self: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        original(self, name, param)
        if param is not None and param.device.type != "meta":
            cls = type(param)
            meta = cls(param.to("meta"), requires_grad=param.requires_grad)
            self._parameters[name] = meta

    torch.nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original  # type: ignore[method-assign]


# --- reading files -------------------------------------------------------------


def _read_file(path: str) -> dict[str, torch.Tensor]:
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


def _read_files(files: list[str], progress: bool | None = None) -> dict[str, torch.Tensor]:
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
    for key, tensor in _read_file(f).items():
        if key in origin:
            raise CheckpointError(f, f"key {key!r} is in both {origin[key]} and {f}")
        origin[key] = f
        loaded[key] = tensor


# --- the report ------------------------------------------------------------------


@dataclass
class LoadReport:
    """What :func:`load_checkpoint` did.

    ``copied`` maps a reason (``dtype``, ``keep_mapping=False``, ``copies fit
    (gate)``, ``device``, ``column slice``, ``not mapped``) to the bytes
    copied for it.

    ``decided_by`` says who chose between the mapping and copies: ``"gate"``
    (the caller passed ``keep_mapping=None``; :func:`keep_checkpoint_mapped`
    weighed the bytes against the host; the same in ``from_pretrained`` and
    the vLLM load format) or ``"caller"`` (True or False).

    With a shard plan, ``shard`` is ``(rank, world_size)``;
    ``bytes_sliced_mapped`` counts this rank's slices left as views of the
    mapping (slices contiguous in the file: row splits) and
    ``bytes_sliced_copied`` the slices that had to be copied because they are
    strided in the file (column splits), whatever else was done to them.

    ``fp8_weights`` / ``bytes_fp8`` / ``bytes_fp8_scales``: fp8 weights kept
    as one-byte codes with their block scales (:mod:`mapoffload.fp8`: the
    module's weight is their dequantization, computed as it is used).

    ``converted_tensors`` / ``bytes_converted``: tensors a loader made (fused
    experts, casts, dequantized weights; :func:`mapoffload.from_pretrained`),
    written once into mapped files in ``conversion_dir`` (counted in
    ``bytes_mapped``); ``conversion_reused`` when an earlier load wrote them.
    """

    files: list[str] = field(default_factory=list)
    keep_mapping: bool = False
    tensors: int = 0
    bytes_mapped: int = 0
    bytes_copied: int = 0
    copied: dict[str, int] = field(default_factory=dict)
    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)
    seconds: float = 0.0
    shard: tuple[int, int] | None = None
    bytes_sliced_mapped: int = 0
    bytes_sliced_copied: int = 0
    converted_tensors: int = 0
    bytes_converted: int = 0
    conversion_dir: str | None = None
    conversion_reused: bool = False
    decided_by: str = "caller"
    fp8_weights: int = 0
    bytes_fp8: int = 0
    bytes_fp8_scales: int = 0

    def _decision(self) -> str:
        if self.decided_by == "gate":
            return ("kept on the mapping: the gate found host copies would not fit" if self.keep_mapping
                    else "copied into host memory: the gate found copies fit (keep_mapping=True keeps the mapping)")
        return f"{'kept on the mapping' if self.keep_mapping else 'copied into host memory'}: " \
               f"keep_mapping={self.keep_mapping}"

    def __str__(self) -> str:
        why = ", ".join(f"{format_bytes(n)} for {r}" for r, n in sorted(self.copied.items())) or "nothing"
        keys = ""
        if self.missing_keys:
            keys += f" Missing keys: {', '.join(self.missing_keys)}."
        if self.unexpected_keys:
            keys += f" Unexpected keys: {', '.join(self.unexpected_keys)}."
        shard = ""
        if self.shard is not None:
            shard = (
                f" Rank {self.shard[0]} of {self.shard[1]}: slices {format_bytes(self.bytes_sliced_mapped)} "
                f"as views of the mapping, {format_bytes(self.bytes_sliced_copied)} copied (strided in the file)."
            )
        if self.fp8_weights:
            shard += (
                f" {self.fp8_weights} fp8 weights kept as codes ({format_bytes(self.bytes_fp8)}) and block "
                f"scales ({format_bytes(self.bytes_fp8_scales)}), dequantized as used."
            )
        if self.converted_tensors:
            shard += (
                f" {self.converted_tensors} converted tensors ({format_bytes(self.bytes_converted)}) "
                f"{'reused from' if self.conversion_reused else 'written to'} {self.conversion_dir}, mapped."
            )
        return (
            f"Loaded {self.tensors} tensors from {len(self.files)} file(s) in {self.seconds:.2f} s "
            f"({self._decision()}): "
            f"{format_bytes(self.bytes_mapped)} left on the file mapping, "
            f"{format_bytes(self.bytes_copied)} copied ({why}).{shard}{keys}"
        )


# --- load_checkpoint -----------------------------------------------------------------


def _fp8_pairs(loaded: dict[str, torch.Tensor], slots: dict[str, _Slot], path: Any) -> dict[str, str]:
    """``{weight key: scale key}`` for fp8 checkpoint weights stored with a
    ``<key>_scale_inv`` whose module parameter is not fp8 (it computes in a
    wider dtype): those load as codes + scales, dequantized as used. Shapes are
    checked here, before anything is assigned."""
    from .fp8 import check_fp8_pair, is_fp8

    out = {}
    for key, t in loaded.items():
        scale = f"{key}_scale_inv"
        slot = slots.get(key)
        if scale not in loaded or slot is None or not slot.is_param or not is_fp8(t) or is_fp8(slot.current):
            continue
        if tuple(t.shape) != tuple(slot.current.shape):
            raise ValueError(f"{key}: checkpoint shape {tuple(t.shape)} does not match the module's "
                             f"{tuple(slot.current.shape)}")
        try:
            check_fp8_pair(t, loaded[scale])
        except (TypeError, ValueError) as exc:
            raise CheckpointError(path, f"{scale}: {exc}") from None
        out[key] = scale
    return out


@dataclass
class _Slot:
    """Where one state-dict name lives in the module."""

    owner: Any
    attr: str
    is_param: bool
    current: Any


def _slots(module: torch.nn.Module) -> tuple[dict[str, _Slot], list[list[str]]]:
    """Every parameter and persistent buffer by name, and tie groups (names
    sharing one tensor object)."""
    slots: dict[str, _Slot] = {}
    groups: dict[int, list[str]] = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for name, p in sub._parameters.items():
            if p is None:
                continue
            slots[dot + name] = _Slot(sub, name, True, p)
            groups.setdefault(id(p), []).append(dot + name)
        for name, b in sub._buffers.items():
            if b is None or name in sub._non_persistent_buffers_set:
                continue
            slots[dot + name] = _Slot(sub, name, False, b)
            groups.setdefault(id(b), []).append(dot + name)
    return slots, list(groups.values())


def load_checkpoint(
    module: torch.nn.Module,
    path: str | os.PathLike,
    *,
    keep_mapping: bool | None = None,
    strict: bool = True,
    device: str | torch.device = "cpu",
    shard_plan: ShardPlan | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    local_ranks: int | None = None,
    progress: bool | None = None,
) -> LoadReport:
    """Load a checkpoint into ``module``, leaving weights on the file mapping
    when asked to (or when the gate says copies would not fit).

    Parameters
    ----------
    module
        Built normally or under :func:`empty_weights`.
    path
        A ``.safetensors`` file, a ``*.safetensors.index.json``, a directory
        of safetensors files, or a PyTorch zip checkpoint (``.pt``/``.bin``,
        read with ``torch.load(mmap=True, weights_only=True)``).
    keep_mapping
        None asks :func:`keep_checkpoint_mapped` with the checkpoint's bytes
        (with a shard plan: the bytes of this rank's slices);
        True assigns the mapped views (after :func:`match_checkpoint_dtypes`,
        so only mismatched dtypes are copied); False copies into owned memory.
    strict
        Missing or unexpected keys raise. Parameters still on meta after
        loading raise whatever ``strict`` says.
    device
        Where the weights go; anything but ``cpu`` copies.
    shard_plan
        Tensor parallelism: ``{name: dim}`` (a name absent or mapped to None
        is replicated) or a callable ``name -> dim | None``. Each split tensor
        loads as ``rank``'s even slice along ``dim`` (:func:`shard_tensor`): a
        view of the mapping where the slice is contiguous in the file (row
        splits), a copy where it is not (column splits, reported as
        ``copied["column slice"]`` and ``bytes_sliced_copied``). The module's
        parameters have the slices' shapes.
    rank, world_size
        This rank's place in the tensor-parallel group; default: the
        initialised ``torch.distributed`` group's.
    local_ranks
        Ranks sharing this host, for the gate; None detects
        (:mod:`mapoffload.ranks`).
    progress
        A tqdm progress bar over the files (when tqdm is installed): None
        shows it at once for 8 files or more, otherwise once the load has
        taken a second; True: at once; False: never.

    Returns
    -------
    LoadReport

    Raises
    ------
    FileNotFoundError, ValueError, CheckpointError
        See the module docstring for the state the module is left in. A
        shard plan naming a key the checkpoint lacks, or a size that does not
        split evenly, is a ``ValueError`` naming the key.
    """
    import torch

    from ..memory.regions import MappedRegions

    t0 = time.perf_counter()
    files = checkpoint_files(path)
    component = type(module).__name__
    decided_by = "gate" if keep_mapping is None else "caller"
    if shard_plan is not None:
        check_plan(shard_plan)
    shard = resolve_rank(rank, world_size) if shard_plan is not None else None
    if keep_mapping is None and shard is None:
        # checkpoint_bytes counts exactly the files listed above.
        keep_mapping = keep_checkpoint_mapped(
            weight_bytes=checkpoint_bytes(path), component=component, local_ranks=local_ranks
        )
    target_device = torch.device(device)

    loaded = _read_files(files, progress)
    slots, groups = _slots(module)
    if shard_plan is not None and isinstance(shard_plan, Mapping):
        # A tied alias the module has (the checkpoint holds the tensor once) is no stray.
        stray = sorted(k for k in shard_plan if k not in loaded and k not in slots)
        if stray:
            raise ValueError(
                f"shard plan names keys neither {os.fspath(path)} nor {component} has: {', '.join(stray)}"
            )

    # fp8 weights with their block scales: kept as codes + scales (mapoffload.fp8), never cast without them.
    fp8 = _fp8_pairs(loaded, slots, path)
    if fp8 and shard_plan is not None:
        raise ValueError(f"{os.fspath(path)}: fp8 weights with scales ({next(iter(fp8))}) cannot be sharded yet")
    fp8_sources = {k: (loaded.pop(k), loaded.pop(scale)) for k, scale in fp8.items()}

    # Validate everything before assigning anything.
    unexpected = sorted(k for k in loaded if k not in slots)
    missing: list[str] = []
    plan: list[tuple[list[str], torch.Tensor, bool, bool]] = []  # names, source, sliced, strided slice
    for names in groups:
        source_key = next((n for n in names if n in loaded), None)
        if source_key is None:
            if not any(n in fp8_sources for n in names):
                missing.extend(names)
            continue
        src = loaded[source_key]
        sliced = strided = False
        what = f"checkpoint shape {tuple(src.shape)}"
        if shard is not None:
            dim = group_dim(shard_plan, names)
            if dim is not None:
                whole = src
                src = narrow_shard(whole, shard[0], shard[1], dim, what=source_key)
                sliced = True
                strided = whole.is_contiguous() and not src.is_contiguous()
                what = f"rank {shard[0]}'s slice {tuple(src.shape)} of checkpoint shape {tuple(whole.shape)} (dim {dim})"
        target = slots[source_key].current
        if tuple(src.shape) != tuple(target.shape):
            raise ValueError(f"{source_key}: {what} does not match the module's {tuple(target.shape)}")
        plan.append((names, src, sliced, strided))
    missing.sort()
    if strict and (missing or unexpected):
        parts = []
        if missing:
            parts.append(f"missing keys: {', '.join(missing)}")
        if unexpected:
            parts.append(f"unexpected keys: {', '.join(unexpected)}")
        raise ValueError(f"{os.fspath(path)} does not match {component}: " + "; ".join(parts))
    left_on_meta = [n for n in missing if slots[n].is_param and slots[n].current.device.type == "meta"]
    if left_on_meta:
        raise ValueError(f"parameters would stay on the meta device (not in the checkpoint): {', '.join(left_on_meta)}")
    if keep_mapping is None:
        # Sharded: what this rank would copy is its slices, not the checkpoint.
        keep_mapping = keep_checkpoint_mapped(
            weight_bytes=sum(tensor_bytes(src) for _, src, _, _ in plan),
            component=f"{component} (rank {shard[0]} of {shard[1]})" if shard else component,
            local_ranks=local_ranks,
        )

    from .fp8 import attach_fp8

    report = LoadReport(
        files=files, keep_mapping=bool(keep_mapping), missing_keys=missing, unexpected_keys=unexpected, shard=shard,
        decided_by=decided_by,
    )
    assigned: list[torch.Tensor] = []
    sliced_flags: list[bool] = []
    bar = byte_bar(sum(src.nbytes for _, src, _, _ in plan), "Assigning weights", enabled=progress)
    for names, src, sliced, strided in plan:
        bar.update(src.nbytes)  # shown only once the work (host copies, cold pages) has taken a second
        target = slots[names[0]].current
        tensor = src
        reason = None
        if tensor.dtype != target.dtype:
            tensor = tensor.to(target.dtype, memory_format=torch.contiguous_format)
            reason = "dtype"
        if target_device.type != "cpu":
            tensor = tensor.to(target_device, memory_format=torch.contiguous_format)
            reason = reason or "device"
        elif strided and reason is None:
            # Strided in the file: no view of the mapping can be this rank's
            # contiguous slice.
            tensor = tensor.clone(memory_format=torch.contiguous_format)
            reason = "column slice"
        elif not keep_mapping and reason is None:
            tensor = tensor.clone(memory_format=torch.contiguous_format)
            reason = "copies fit (gate)" if decided_by == "gate" else "keep_mapping=False"
        if reason:
            report.copied[reason] = report.copied.get(reason, 0) + tensor.nbytes
        if strided:
            report.bytes_sliced_copied += tensor.nbytes
        value: torch.Tensor
        if slots[names[0]].is_param:
            value = torch.nn.Parameter(tensor, requires_grad=target.requires_grad and tensor.is_floating_point())
        else:
            value = tensor
        for n in names:
            s = slots[n]
            (s.owner._parameters if s.is_param else s.owner._buffers)[s.attr] = value
        assigned.append(value)
        sliced_flags.append(sliced and not strided)
        report.tensors += 1

    bar.close()
    for key, (codes, scale) in fp8_sources.items():
        target = slots[key]
        if not keep_mapping:
            codes, scale = codes.clone(), scale.clone()
            report.copied["keep_mapping=False"] = (report.copied.get("keep_mapping=False", 0)
                                                   + codes.nbytes + scale.nbytes)
        attach_fp8(target.owner, target.attr, codes, scale, dtype=target.current.dtype, key=key)
        assigned += [codes, scale]
        sliced_flags += [False, False]
        report.tensors += 2
        report.fp8_weights += 1
        report.bytes_fp8 += codes.nbytes
        report.bytes_fp8_scales += scale.nbytes
    held = MappedRegions().classify(assigned)
    for t, h, row_slice in zip(assigned, held, sliced_flags):
        if h:
            report.bytes_mapped += t.nbytes
            if row_slice:
                report.bytes_sliced_mapped += t.nbytes
        else:
            report.bytes_copied += t.nbytes
    not_mapped = report.bytes_copied - sum(report.copied.values())
    if not_mapped > 0:
        report.copied["not mapped"] = not_mapped
    report.seconds = time.perf_counter() - t0
    logger.info("%s: %s", component, report)
    return report
