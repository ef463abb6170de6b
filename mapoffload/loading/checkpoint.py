"""``load_checkpoint``: a checkpoint into a module, its weights left on the file
mapping when asked to or when the gate finds host copies would not fit.

The loader of the contract (``shared/DESIGN.md``; its names are importable from ``mapoffload``): the
gates (:mod:`.gate`), ``empty_weights``, ``LoadReport`` and the file set are
re-exported here, and ``load_checkpoint`` calls the gate through this module.
The steps: plan (:mod:`.load_plan`: the file set, every tensor read as a mapped
view, the module's names and ties, fp8 weights paired with their scales, a
rank's slices, all checked against the module), decide (:mod:`.decide`: the
caller's ``keep_mapping`` or the gate, asked once) and assign (:mod:`.assign`:
the tensors put in place, each copy filed under its :class:`CopyReason`, the
bytes accounted).

State of a module after an error: every check (files, keys, shapes, dtypes,
parameters left on meta) runs before the first parameter is assigned, so an
error leaves the module exactly as it was. Only a failure while converting or
copying a tensor's bytes (a file truncated during the load, say) can stop the
assignment half way; the module is then partly loaded and must be rebuilt.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

from .._checks import check_bool, check_count, check_device, user_path
from .._log import logger
from .assign import assign
from .decide import decide, load_bytes
from .empty import empty_weights
from .files import CheckpointError, NotLocalError, checkpoint_bytes, checkpoint_files
from .gate import keep_checkpoint_mapped, match_checkpoint_dtypes
from .load_plan import plan_load
from .reasons import CopyReason
from .report import LoadReport
from .shard import ShardPlan, check_plan, resolve_rank

if TYPE_CHECKING:
    import torch

__all__ = [
    "CheckpointError",
    "NotLocalError",
    "CopyReason",
    "LoadReport",
    "checkpoint_bytes",
    "checkpoint_files",
    "empty_weights",
    "keep_checkpoint_mapped",
    "load_checkpoint",
    "match_checkpoint_dtypes",
]


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
        initialised ``torch.distributed`` group's. Without a ``shard_plan``
        every tensor loads whole (a replica), and they are checked all the same.
    local_ranks
        Ranks sharing this host, for the gate; None detects
        (:mod:`mapoffload.memory.ranks`).
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
    t0 = time.perf_counter()
    # A non-empty string is truthy: keep_mapping="false" would keep the mapping and report True.
    check_bool("keep_mapping", keep_mapping, none=True)
    check_bool("strict", strict)
    check_bool("progress", progress, none=True)
    check_count("local_ranks", local_ranks, minimum=1, none=True)
    target_device = check_device(device, "device")
    path = user_path(path)
    files = checkpoint_files(path)
    if shard_plan is not None:
        check_plan(shard_plan)
    elif rank is not None or world_size is not None:
        resolve_rank(rank, world_size)  # checked all the same (a rank of -1 or True is a mistake); all loads whole
    shard = resolve_rank(rank, world_size) if shard_plan is not None else None
    plan = plan_load(module, path, files, strict=strict, shard_plan=shard_plan, shard=shard, progress=progress)
    # The gate by this module's name: a keep_checkpoint_mapped set here (a test's monkeypatch) is the one asked.
    weight_bytes, component = load_bytes(plan)
    decision = decide(keep_mapping, weight_bytes=weight_bytes, component=component, local_ranks=local_ranks,
                      gate=keep_checkpoint_mapped)
    report = assign(plan, decision, device=target_device, progress=progress)
    report.seconds = time.perf_counter() - t0
    logger.info("%s: %s", plan.component, report)
    return report
