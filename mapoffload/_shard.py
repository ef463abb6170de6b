"""A rank's slice of a tensor, as a view of the mapping wherever the file allows.

A row-major tensor split along dimension ``d`` gives each rank a block that is
contiguous in the file exactly when every dimension before ``d`` has size 1:
dimension 0 of a 2-D weight (the rows: a column-parallel linear's weight, its
bias) is a view of the checkpoint's mapping and costs no anonymous memory;
dimension 1 (the columns: a row-parallel linear's weight) is strided in the
file, and is copied into an owned contiguous tensor - the only bytes a
tensor-parallel load copies, counted by ``load_checkpoint``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Union

if TYPE_CHECKING:
    import torch

__all__ = ["ShardPlan", "narrow_shard", "plan_dim", "resolve_rank", "shard_bounds", "shard_tensor", "shard_view"]

# A per-key split plan: name -> dimension (None: replicated), or a callable
# name -> dimension | None. Keys are state-dict names.
ShardPlan = Union[Mapping[str, Union[int, None]], Callable[[str], Union[int, None]]]


def shard_bounds(size: int, rank: int, world_size: int, *, what: str = "tensor") -> tuple[int, int]:
    """``(start, length)`` of ``rank``'s even share of ``size`` elements.

    Raises
    ------
    ValueError
        ``world_size`` < 1, ``rank`` outside ``0..world_size-1``, or ``size``
        not divisible by ``world_size`` (``what`` names the tensor).
    """
    if world_size < 1:
        raise ValueError(f"{what}: world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"{what}: rank {rank} is outside 0..{world_size - 1}")
    if size % world_size:
        raise ValueError(f"{what}: size {size} does not split evenly across {world_size} ranks")
    length = size // world_size
    return rank * length, length


def narrow_shard(t: torch.Tensor, rank: int, world_size: int, dim: int, *, what: str = "tensor") -> torch.Tensor:
    """``rank``'s even slice of ``t`` along ``dim``: always a view (maybe strided)."""
    if t.dim() == 0:
        raise ValueError(f"{what}: a scalar cannot be split")
    if not -t.dim() <= dim < t.dim():
        raise ValueError(f"{what}: dimension {dim} is out of range for shape {tuple(t.shape)}")
    dim %= t.dim()
    start, length = shard_bounds(t.shape[dim], rank, world_size, what=f"{what} dimension {dim}")
    return t.narrow(dim, start, length)


def shard_view(t: torch.Tensor, rank: int, world_size: int, dim: int, *, what: str = "tensor") -> tuple[torch.Tensor, bool]:
    """``(slice, is_view)``: the view when it is contiguous, else a contiguous copy."""
    import torch

    view = narrow_shard(t, rank, world_size, dim, what=what)
    if view.is_contiguous() or not t.is_contiguous():
        # A non-contiguous source has no "contiguous in the file" to keep:
        # hand back the view and let the caller decide.
        return view, True
    return view.clone(memory_format=torch.contiguous_format), False


def shard_tensor(t: torch.Tensor, rank: int, world_size: int, dim: int | None) -> torch.Tensor:
    """``rank``'s even slice of ``t`` along ``dim``, without a copy where possible.

    For a contiguous ``t`` (a view of a checkpoint's mapping, say), the slice
    is a view - same storage, no new memory - when it is contiguous: ``dim``
    0, or any ``dim`` whose preceding dimensions all have size 1. Otherwise
    (the columns of a 2-D weight) it is a contiguous copy. ``dim=None`` means
    replicated: ``t`` itself.

    Parameters
    ----------
    t
        The whole tensor.
    rank, world_size
        This rank's index in the tensor-parallel group, and the group's size.
    dim
        The split dimension (negative counts from the end), or None.

    Raises
    ------
    ValueError
        The size along ``dim`` does not split evenly, ``rank`` is out of
        range, or ``dim`` is out of range.
    """
    if dim is None:
        return t
    return shard_view(t, rank, world_size, dim)[0]


def resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """``(rank, world_size)``: as given, else an initialised ``torch.distributed``'s.

    Raises
    ------
    ValueError
        Neither is given and no process group is initialised, or only one is given.
    """
    if rank is not None and world_size is not None:
        shard_bounds(world_size, rank, world_size, what="shard plan")  # range checks only
        return int(rank), int(world_size)
    if rank is not None or world_size is not None:
        raise ValueError("give both rank and world_size, or neither (then torch.distributed's are used)")
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank()), int(dist.get_world_size())
    raise ValueError("a shard plan needs rank and world_size, or an initialised torch.distributed process group")


def plan_dim(plan: ShardPlan, key: str) -> int | None:
    """The split dimension the plan gives ``key`` (None: replicated)."""
    if callable(plan) and not isinstance(plan, Mapping):
        return plan(key)
    return plan.get(key)
