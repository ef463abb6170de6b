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

__all__ = ["ShardPlan", "check_plan", "group_dim", "narrow_shard", "plan_dim", "resolve_rank", "shard_bounds", "shard_tensor", "shard_view"]

# A per-key split plan: name -> dimension (None: replicated), or a callable
# name -> dimension | None. Keys are state-dict names.
ShardPlan = Union[Mapping[str, Union[int, None]], Callable[[str], Union[int, None]]]


def shard_bounds(size: int, rank: int, world_size: int, *, what: str = "tensor") -> tuple[int, int]:
    """``(start, length)`` of ``rank``'s even share of ``size`` elements.

    Raises
    ------
    TypeError
        ``rank`` or ``world_size`` is not an int (a bool, a float).
    ValueError
        ``world_size`` < 1, ``rank`` outside ``0..world_size-1``, or ``size``
        not divisible by ``world_size`` (``what`` names the tensor).
    """
    # A bool is an int to Python: rank=True took rank 1's slice, world_size=True the whole tensor.
    size, rank, world_size = _index(size, f"{what}: size"), _index(rank, f"{what}: rank"), \
        _index(world_size, f"{what}: world_size")
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
    dim = _index(dim, f"{what}: dim")
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
    TypeError
        ``rank``, ``world_size`` or ``dim`` is not an int (a bool, a float).
    ValueError
        The size along ``dim`` does not split evenly, ``rank`` is out of
        range, or ``dim`` is out of range.
    """
    if dim is None:
        return t
    return shard_view(t, rank, world_size, dim)[0]


def _index(value: object, what: str) -> int:
    """``value`` as an int: an ``int`` or anything with ``__index__`` (NumPy
    integers), never a bool, a float or a string (``what`` names it)."""
    import operator

    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{what} must be an int, not {type(value).__name__} ({value!r})")
    return operator.index(value)  # type: ignore[arg-type]


def resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """``(rank, world_size)``: as given, else an initialised ``torch.distributed``'s.

    Raises
    ------
    TypeError
        ``rank`` or ``world_size`` is not an int (``0.5``, ``"1"``).
    ValueError
        Neither is given and no process group is initialised, only one is
        given, ``world_size`` < 1, or ``rank`` is outside ``0..world_size-1``.
    """
    if rank is not None and world_size is not None:
        r, n = _index(rank, "rank"), _index(world_size, "world_size")
        if n < 1:
            raise ValueError(f"world_size must be >= 1, got {n}")
        if not 0 <= r < n:
            raise ValueError(f"rank must be in 0..{n - 1} (world_size {n}), got {r}")
        return r, n
    if rank is not None or world_size is not None:
        raise ValueError("give both rank and world_size, or neither (then torch.distributed's are used)")
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank()), int(dist.get_world_size())
    raise ValueError("a shard plan needs rank and world_size, or an initialised torch.distributed process group")


def check_plan(plan: object) -> None:
    """Refuse a shard plan that is neither a mapping nor a callable (before any file is read).

    Raises
    ------
    TypeError
        The plan is something else (a list, a string).
    """
    if not isinstance(plan, Mapping) and not callable(plan):
        raise TypeError(
            f"shard_plan must be a mapping {{name: dim or None}} or a callable name -> dim or None, "
            f"not {type(plan).__name__}"
        )


def plan_dim(plan: ShardPlan, key: str) -> int | None:
    """The split dimension the plan gives ``key`` (None: replicated).

    Raises
    ------
    TypeError
        The plan gives ``key`` something other than an int or None (``1.0``,
        ``"0"``, ``True``): the key is named.
    """
    if callable(plan) and not isinstance(plan, Mapping):
        dim = plan(key)
        what = f"shard_plan({key!r})"
    else:
        dim = plan.get(key)
        what = f"shard_plan[{key!r}]"
    if dim is None:
        return None
    if isinstance(dim, bool) or not hasattr(dim, "__index__"):
        raise TypeError(f"{what} = {dim!r}: a split dimension must be an int (or None: replicated), "
                        f"not {type(dim).__name__}")
    import operator

    return operator.index(dim)


def group_dim(plan: ShardPlan, names: list[str]) -> int | None:
    """The one split dimension a tie group (names sharing one tensor) gets.

    Raises
    ------
    TypeError
        A dimension is not an int (see :func:`plan_dim`).
    ValueError
        The plan gives tied names different dimensions (they are one tensor:
        it cannot be split two ways); the names and dimensions are listed.
    """
    dims = {n: plan_dim(plan, n) for n in names}
    given = {n: d for n, d in dims.items() if d is not None}
    if len(set(given.values())) > 1 or (given and len(given) < len(dims) and _strict_ties(plan, dims)):
        listed = ", ".join(f"{n}: {d}" for n, d in dims.items())
        raise ValueError(
            f"tied weights {', '.join(names)} are one tensor, but the shard plan splits them differently "
            f"({listed}); give them the same dimension"
        )
    return next(iter(given.values()), None)


def _strict_ties(plan: ShardPlan, dims: dict[str, int | None]) -> bool:
    """A mapping that names a tied key explicitly as None (replicated) while
    splitting another is a conflict; a key it leaves out is not."""
    return isinstance(plan, Mapping) and any(n in plan and d is None for n, d in dims.items())
