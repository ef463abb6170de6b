"""The first step of :func:`~mapoffload.load_checkpoint`: what a load would put where, checked.

:func:`plan_load` reads every tensor of the file set as a mapped view, pairs fp8 weights with their
block scales, cuts a rank's slices and checks everything against the module (keys, shapes, fp8
pairs, parameters left on meta) before anything is assigned. Its :class:`LoadPlan` is what the
decision (mapping or copies) and the assignment work from.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..memory.regions import same_bits, tensor_bytes
from .files import CheckpointError
from .read import read_files
from .shard import ShardPlan, group_dim, narrow_shard
from .sites import Site, module_sites

if TYPE_CHECKING:
    import torch

__all__ = ["Fp8Placement", "LoadPlan", "Placement", "plan_load"]


@dataclass
class Placement:
    """One tensor of the checkpoint and the names (a tie group) it goes to."""

    names: list[str]
    source: torch.Tensor  # a view of the mapping (a rank's slice of one, with a shard plan)
    sliced: bool = False  # a rank's slice
    strided: bool = False  # a slice strided in the file (a column split): no view of the mapping can be it


@dataclass
class Fp8Placement:
    """An fp8 weight kept as its one-byte codes and block scales (:mod:`mapoffload.loading.fp8`)."""

    key: str
    codes: torch.Tensor
    scale: torch.Tensor


@dataclass
class LoadPlan:
    """What a load would do, every check passed: nothing assigned yet."""

    path: str
    files: list[str]
    component: str  # the module's class, for messages and the log line
    sites: dict[str, Site]
    shard: tuple[int, int] | None = None  # (rank, world_size) with a shard plan
    placements: list[Placement] = field(default_factory=list)
    fp8: list[Fp8Placement] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)

    @property
    def slice_bytes(self) -> int:
        """Bytes of the tensors placed (a rank's slices, with a shard plan)."""
        return sum(tensor_bytes(p.source) for p in self.placements)


def _fp8_pairs(loaded: dict[str, torch.Tensor], sites: dict[str, Site], path: Any) -> dict[str, str]:
    """``{weight key: scale key}`` for fp8 checkpoint weights stored with a
    ``<key>_scale_inv`` whose module parameter is not fp8 (it computes in a
    wider dtype): those load as codes + scales, dequantized as used. Shapes are
    checked here, before anything is assigned."""
    from .fp8 import check_fp8_pair, is_fp8

    out = {}
    for key, t in loaded.items():
        scale = f"{key}_scale_inv"
        site = sites.get(key)
        if scale not in loaded or site is None or not site.is_param or not is_fp8(t) or is_fp8(site.current):
            continue
        if tuple(t.shape) != tuple(site.current.shape):
            raise ValueError(f"{key}: checkpoint shape {tuple(t.shape)} does not match the module's "
                             f"{tuple(site.current.shape)}")
        try:
            check_fp8_pair(t, loaded[scale])
        except (TypeError, ValueError) as exc:
            raise CheckpointError(path, f"{scale}: {exc}") from None
        out[key] = scale
    return out


def _check_stray(shard_plan: ShardPlan | None, loaded: Mapping, plan: LoadPlan) -> None:
    """A shard plan naming keys neither the checkpoint nor the module has is refused by name."""
    if shard_plan is None or not isinstance(shard_plan, Mapping):
        return
    # A tied alias the module has (the checkpoint holds the tensor once) is no stray.
    stray = sorted(k for k in shard_plan if k not in loaded and k not in plan.sites)
    if stray:
        raise ValueError(f"shard plan names keys neither {plan.path} nor {plan.component} has: {', '.join(stray)}")


def _split_fp8(loaded: dict[str, torch.Tensor], plan: LoadPlan, shard_plan: ShardPlan | None) -> None:
    """fp8 weights with their block scales taken out of ``loaded``: kept as codes + scales, never cast
    without them."""
    pairs = _fp8_pairs(loaded, plan.sites, plan.path)
    if pairs and shard_plan is not None:
        raise ValueError(f"{plan.path}: fp8 weights with scales ({next(iter(pairs))}) cannot be sharded yet")
    plan.fp8 = [Fp8Placement(k, loaded.pop(k), loaded.pop(scale)) for k, scale in pairs.items()]


def _placement(names: list[str], key: str, src: torch.Tensor, plan: LoadPlan,
               shard_plan: ShardPlan | None) -> Placement:
    """The group's tensor (this rank's slice of it, with a shard plan), its shape checked."""
    out = Placement(names, src)
    what = f"checkpoint shape {tuple(src.shape)}"
    dim = group_dim(shard_plan, names) if plan.shard is not None else None
    if dim is not None:
        rank, world = plan.shard
        out.source = narrow_shard(src, rank, world, dim, what=key)
        out.sliced = True
        out.strided = src.is_contiguous() and not out.source.is_contiguous()
        what = f"rank {rank}'s slice {tuple(out.source.shape)} of checkpoint shape {tuple(src.shape)} (dim {dim})"
    target = plan.sites[key].current
    if tuple(out.source.shape) != tuple(target.shape):
        raise ValueError(f"{key}: {what} does not match the module's {tuple(target.shape)}")
    return out


def _check_alias(names: list[str], key: str, alias: str, loaded: dict[str, torch.Tensor], plan: LoadPlan,
                 shard_plan: ShardPlan | None) -> None:
    """A second name of a tie group in the checkpoint (the group takes ``key``'s tensor): its shape
    checked as ``key``'s, and its values the same as ``key``'s, else refused (one parameter cannot hold
    both; ``load_state_dict`` would keep whichever it copied last)."""
    _placement(names, alias, loaded[alias], plan, shard_plan)
    a, b = loaded[key], loaded[alias]
    if not same_bits(a, b):
        raise ValueError(f"{plan.path}: {key} and {alias} are tied in {plan.component} (one parameter), and the "
                         f"checkpoint holds different tensors for them ({a.dtype} {tuple(a.shape)} and {b.dtype} "
                         f"{tuple(b.shape)}{', other values' if a.dtype == b.dtype and a.shape == b.shape else ''}): "
                         "untie them before loading, or drop one of the two from the checkpoint")


def _check_keys(plan: LoadPlan, strict: bool) -> None:
    """Missing or unexpected keys (``strict``), and parameters that would stay on meta, refused."""
    if strict and (plan.missing or plan.unexpected):
        parts = []
        if plan.missing:
            parts.append(f"missing keys: {', '.join(plan.missing)}")
        if plan.unexpected:
            parts.append(f"unexpected keys: {', '.join(plan.unexpected)}")
        raise ValueError(f"{plan.path} does not match {plan.component}: " + "; ".join(parts))
    sites = plan.sites
    left_on_meta = [n for n in plan.missing if sites[n].is_param and sites[n].current.device.type == "meta"]
    if left_on_meta:
        raise ValueError(f"parameters would stay on the meta device (not in the checkpoint): {', '.join(left_on_meta)}")


def plan_load(module: torch.nn.Module, path: str | os.PathLike, files: list[str], *, strict: bool,
              shard_plan: ShardPlan | None, shard: tuple[int, int] | None,
              progress: bool | None) -> LoadPlan:
    """Read ``files`` as mapped views and check them against ``module``: the :class:`LoadPlan`.

    Raises
    ------
    ValueError, CheckpointError
        Anything that does not fit the module; nothing is assigned yet.
    """
    loaded = read_files(files, progress)
    sites, groups = module_sites(module)
    plan = LoadPlan(os.fspath(path), files, type(module).__name__, sites, shard=shard)
    _check_stray(shard_plan, loaded, plan)
    _split_fp8(loaded, plan, shard_plan)
    fp8_keys = {f.key for f in plan.fp8}
    plan.unexpected = sorted(k for k in loaded if k not in sites)
    for names in groups:
        key = next((n for n in names if n in loaded), None)
        fp8 = [n for n in names if n in fp8_keys]
        if fp8 and len(names) > 1:
            # An fp8 weight is kept as its codes and scales behind one module's parametrization: the other
            # places that share the parameter would keep what they held (their initial values, or meta).
            raise ValueError(f"{plan.path}: {fp8[0]} is stored as fp8 codes and scales, and {plan.component} ties "
                             f"it to {', '.join(n for n in names if n != fp8[0])}: tied fp8 weights cannot be kept "
                             "as fp8; untie them before loading, or load a checkpoint that stores them dequantized")
        if key is not None:
            plan.placements.append(_placement(names, key, loaded[key], plan, shard_plan))
            for alias in (n for n in names[names.index(key) + 1:] if n in loaded):
                _check_alias(names, key, alias, loaded, plan, shard_plan)
        elif not fp8:
            plan.missing.extend(names)
    plan.missing.sort()
    _check_keys(plan, strict)
    return plan
