"""The last step of :func:`~mapoffload.load_checkpoint`: the planned tensors put in place, accounted.

:func:`assign` gives every tie group of the :class:`LoadPlan` its tensor (a view of the mapping, or a
copy filed under its :class:`CopyReason`), attaches fp8 codes and scales, and measures what is on
the mapping with one ``MappedRegions`` snapshot: the :class:`LoadReport`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .._progress import byte_bar
from .decide import Decision
from .load_plan import LoadPlan, Placement
from .reasons import CopyReason
from .report import LoadReport

if TYPE_CHECKING:
    import torch

__all__ = ["assign"]


@dataclass
class _Prepared:
    """A placement's tensor as it will be assigned, and why it is a copy (None: the source itself)."""

    tensor: torch.Tensor
    reason: CopyReason | None = None


@dataclass
class _Assigned:
    """What was assigned, for the accounting: each tensor, and whether it is a row slice left as a view."""

    tensors: list = field(default_factory=list)
    row_slices: list = field(default_factory=list)

    def add(self, tensor: torch.Tensor, row_slice: bool = False) -> None:
        self.tensors.append(tensor)
        self.row_slices.append(row_slice)


def _prepare(p: Placement, target: torch.Tensor, decision: Decision, device: torch.device) -> _Prepared:
    """The placement's tensor converted, moved or copied as the target, the device and the decision ask."""
    import torch

    contiguous = torch.contiguous_format
    out = _Prepared(p.source)
    if out.tensor.dtype != target.dtype:
        out.tensor, out.reason = out.tensor.to(target.dtype, memory_format=contiguous), CopyReason.DTYPE
    if device.type != "cpu":
        out.tensor = out.tensor.to(device, memory_format=contiguous)
        out.reason = out.reason or CopyReason.DEVICE
    elif out.reason is None and p.strided:
        # Strided in the file: no view of the mapping can be this rank's contiguous slice.
        out.tensor, out.reason = out.tensor.clone(memory_format=contiguous), CopyReason.COLUMN_SLICE
    elif out.reason is None and not decision.keep_mapping:
        out.tensor, out.reason = out.tensor.clone(memory_format=contiguous), decision.copy_reason
    return out


def _file(report: LoadReport, reason: CopyReason | None, nbytes: int) -> None:
    if reason is not None:
        report.copied[reason] = report.copied.get(reason, 0) + nbytes


def _place(plan: LoadPlan, p: Placement, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (a Parameter for a parameter's site) given to every name of the group."""
    import torch

    first = plan.sites[p.names[0]]
    value = tensor
    if first.is_param:
        value = torch.nn.Parameter(tensor, requires_grad=first.current.requires_grad and tensor.is_floating_point())
    for n in p.names:
        s = plan.sites[n]
        (s.owner._parameters if s.is_param else s.owner._buffers)[s.attr] = value
    return value


def _assign_placements(plan: LoadPlan, decision: Decision, device: torch.device, report: LoadReport,
                       done: _Assigned, progress: bool | None) -> None:
    bar = byte_bar(sum(p.source.nbytes for p in plan.placements), "Assigning weights", enabled=progress)
    for p in plan.placements:
        bar.update(p.source.nbytes)  # shown only once the work (host copies, cold pages) has taken a second
        prepared = _prepare(p, plan.sites[p.names[0]].current, decision, device)
        _file(report, prepared.reason, prepared.tensor.nbytes)
        if p.strided:
            report.bytes_sliced_copied += prepared.tensor.nbytes
        done.add(_place(plan, p, prepared.tensor), p.sliced and not p.strided)
        report.tensors += 1
    bar.close()


def _assign_fp8(plan: LoadPlan, decision: Decision, report: LoadReport, done: _Assigned) -> None:
    """fp8 codes and scales attached (copied, under the decision's reason, when it copies)."""
    from .fp8 import attach_fp8

    for f in plan.fp8:
        codes, scale = f.codes, f.scale
        if not decision.keep_mapping:
            codes, scale = codes.clone(), scale.clone()
            _file(report, decision.copy_reason, codes.nbytes + scale.nbytes)
        target = plan.sites[f.key]
        attach_fp8(target.owner, target.attr, codes, scale, dtype=target.current.dtype, key=f.key)
        done.add(codes)
        done.add(scale)
        report.tensors += 2
        report.fp8_weights += 1
        report.bytes_fp8 += codes.nbytes
        report.bytes_fp8_scales += scale.nbytes


def _account(report: LoadReport, done: _Assigned) -> None:
    """Bytes on the mapping and copied, measured; copied bytes no reason covers are ``not mapped``."""
    from ..memory.regions import MappedRegions

    held = MappedRegions().classify(done.tensors)
    for t, h, row_slice in zip(done.tensors, held, done.row_slices):
        if h:
            report.bytes_mapped += t.nbytes
            if row_slice:
                report.bytes_sliced_mapped += t.nbytes
        else:
            report.bytes_copied += t.nbytes
    not_mapped = report.bytes_copied - sum(report.copied.values())
    if not_mapped > 0:
        report.copied[CopyReason.NOT_MAPPED] = not_mapped


def assign(plan: LoadPlan, decision: Decision, *, device: torch.device, progress: bool | None) -> LoadReport:
    """Put the plan's tensors in place as ``decision`` says; the report (``seconds`` left to the caller)."""
    report = LoadReport(
        files=plan.files, keep_mapping=decision.keep_mapping, missing_keys=plan.missing,
        unexpected_keys=plan.unexpected, shard=plan.shard, decided_by=decision.decided_by,
    )
    done = _Assigned()
    _assign_placements(plan, decision, device, report, done, progress)
    _assign_fp8(plan, decision, report, done)
    _account(report, done)
    return report
