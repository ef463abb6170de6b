"""``load_checkpoint``: a checkpoint into a module, its weights left on the file
mapping when asked to or when the gate finds host copies would not fit.

This is :mod:`mapoffload.checkpoint` (a contract name, ``shared/DESIGN.md``): the
gates (:mod:`.gate`), ``empty_weights``, ``LoadReport`` and the file set are
re-exported here, and ``load_checkpoint`` calls the gate through this module.
The steps: the file set (:mod:`.files`), every tensor read as a mapped view
(:mod:`.read`), the module's names and ties (:mod:`.slots`), fp8 weights paired
with their scales (:mod:`.fp8`), a rank's slices (:mod:`.shard`).

State of a module after an error: every check (files, keys, shapes, dtypes,
parameters left on meta) runs before the first parameter is assigned, so an
error leaves the module exactly as it was. Only a failure while converting or
copying a tensor's bytes (a file truncated during the load, say) can stop the
assignment half way; the module is then partly loaded and must be rebuilt.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .._checks import check_bool, check_count, check_device, user_path
from .._log import logger
from .._progress import byte_bar
from ..memory.regions import tensor_bytes
from .empty import empty_weights
from .files import CheckpointError, checkpoint_bytes, checkpoint_files
from .gate import keep_checkpoint_mapped, match_checkpoint_dtypes
from .read import read_files
from .report import LoadReport
from .shard import ShardPlan, check_plan, group_dim, narrow_shard, resolve_rank
from .slots import Slot, module_slots

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


def _fp8_pairs(loaded: dict[str, torch.Tensor], slots: dict[str, Slot], path: Any) -> dict[str, str]:
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
        read with ``torch.load(mmap=True, weights_only=True)``); ``~`` is the
        home folder.
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
    TypeError
        An option of the wrong type, before anything is read: ``keep_mapping``
        not True/False/None (``"false"`` is no bool), ``strict`` not a bool,
        ``progress`` not True/False/None, ``local_ranks`` not a whole number,
        ``device`` neither a str, an int nor a ``torch.device``. A
        ``local_ranks`` < 1 or a ``device`` string torch does not read is a
        ``ValueError`` naming it.
    FileNotFoundError, ValueError, CheckpointError
        See the module docstring for the state the module is left in. A
        shard plan naming a key the checkpoint lacks, or a size that does not
        split evenly, is a ``ValueError`` naming the key.
    """
    import torch

    from ..memory.regions import MappedRegions

    t0 = time.perf_counter()
    # A non-empty string is truthy: keep_mapping="false" would keep the mapping and report True.
    check_bool("keep_mapping", keep_mapping, none=True)
    check_bool("strict", strict)
    check_bool("progress", progress, none=True)
    check_count("local_ranks", local_ranks, minimum=1, none=True)
    target_device = check_device(device, "device")
    path = user_path(path)
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

    loaded = read_files(files, progress)
    slots, groups = module_slots(module)
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
