"""What a load by transformers' or diffusers' own loader left where: the
:class:`~mapoffload.LoadReport` measured from the model, and the copy that
``keep_mapping`` asks for (False), or that the gate decides (None, as for
:func:`~mapoffload.load_checkpoint`)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._log import format_bytes, logger
from ..loading.reasons import CopyReason
from ..loading.report import LoadReport
from ..memory.regions import tensor_bytes
from ..conversion import ConversionCache

if TYPE_CHECKING:
    import torch


def state_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """What a checkpoint of ``model`` holds, as stored: its parameters (an fp8
    weight as its codes and scales, not the dequantized value ``state_dict()``
    gives) and persistent buffers."""
    out = list(model.named_parameters(remove_duplicate=False))
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for attr, b in module._buffers.items():
            if b is not None and attr not in module._non_persistent_buffers_set:
                out.append((f"{mod_name}.{attr}" if mod_name else attr, b))
    return out


def _storages(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The state dict's tensors (parameters and persistent buffers: what a
    checkpoint holds), each storage once (first name wins)."""
    seen: set[tuple[int, int]] = set()
    out = []
    for name, t in state_tensors(model):
        if t is None or t.device.type != "cpu" or not t.numel():
            continue
        key = (t.untyped_storage().data_ptr(), t.data_ptr())
        if key not in seen:
            seen.add(key)
            out.append((name, t.detach()))
    return out


def copy_mapped(model: torch.nn.Module, regions: Any) -> int:
    """keep_mapping=False: every mapped parameter and buffer copied into host memory."""
    copied = 0
    done: dict[int, Any] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for attr, t in table.items():
                if t is None or t.device.type != "cpu" or not regions.holds(t):
                    continue
                if id(t) not in done:
                    done[id(t)] = t.detach().clone()
                    copied += tensor_bytes(t)
                if table is module._parameters:
                    t.data = done[id(t)]
                else:
                    table[attr] = done[id(t)]
    return copied


@dataclass
class Unsettled:
    """A model its library loaded, its mapped weights not yet kept or copied (see :func:`settle`)."""

    model: torch.nn.Module
    files: list[str]
    info: dict
    cache: ConversionCache
    seconds: float  # the load's own
    maker: str  # "transformers" or "diffusers", for the report's reasons
    folder: str


def mapped_bytes(models: list[torch.nn.Module], regions: Any) -> int:
    """What the models' state holds on a file mapping: what copies of it would take (each storage
    once, across the models too)."""
    seen: set[tuple[int, int]] = set()
    tensors = []
    for model in models:
        for _, t in _storages(model):
            key = (t.untyped_storage().data_ptr(), t.data_ptr())
            if key not in seen:
                seen.add(key)
                tensors.append(t)
    return sum(tensor_bytes(t) for t, held in zip(tensors, regions.classify(tensors)) if held)


def settle(loaded: list[Unsettled], keep_mapping: bool | None, *, component: str) -> list[LoadReport]:
    """Keep the models' mapped weights on the mapping or copy them, as ``keep_mapping`` says, one
    decision for all of them; their reports.

    True keeps, False copies; None asks the gate (:func:`~mapoffload.keep_checkpoint_mapped`) once
    whether copies would fit, as ``keep_mapping=None`` does in :func:`~mapoffload.load_checkpoint` and
    the vLLM load format. Unlike ``load_checkpoint`` (which weighs the files before reading), it weighs
    what the models hold on a mapping after their library's load (what copies would take, conversions
    included): a pipeline's components together, since their copies would all be in memory at once.
    Each report records who decided (``"gate"`` or ``"caller"``).

    Parameters
    ----------
    loaded
        One model, or a pipeline's model components.
    component
        What the gate's one log line names (the model's class, or the pipeline and its components).
    """
    from ..loading.checkpoint import keep_checkpoint_mapped
    from ..loading.decide import decide
    from ..memory.regions import MappedRegions

    if not loaded:
        return []
    regions = MappedRegions(files=[f for u in loaded for f in (*u.files, *u.cache.part_files())])
    decision = decide(keep_mapping, weight_bytes=lambda: mapped_bytes([u.model for u in loaded], regions),
                      component=component, gate=keep_checkpoint_mapped)
    keep_mapping, decided_by = decision.keep_mapping, decision.decided_by
    reports = []
    for u in loaded:
        start = time.perf_counter()
        copied = 0 if keep_mapping else copy_mapped(u.model, regions)
        report = load_report(u.model, u.files, u.info, u.cache, keep_mapping, copied,
                             u.seconds + time.perf_counter() - start, maker=u.maker, decided_by=decided_by)
        if report.converted_tensors:
            (logger.info if report.conversion_reused else logger.warning)(
                "%s: %d tensors converted by %s' loading (%s) %s %s", u.folder, report.converted_tensors, u.maker,
                format_bytes(report.bytes_converted), "reused from" if report.conversion_reused else "written to",
                report.conversion_dir)
        reports.append(report)
    return reports


def load_report(model: torch.nn.Module, files: list[str], info: dict, cache: ConversionCache, keep_mapping: bool,
                copied_by_request: int, seconds: float, *, maker: str, decided_by: str = "caller") -> LoadReport:
    """The :class:`LoadReport` of a load by transformers or diffusers, from the
    model as it is (classified with one ``MappedRegions`` snapshot): every
    anonymous state-dict byte under a reason."""
    from ..memory.regions import MappedRegions

    tensors = _storages(model)
    held = MappedRegions(files=[*files, *cache.part_files()]).classify([t for _, t in tensors])
    missing = set(info.get("missing_keys") or ())
    report = LoadReport(files=list(files), keep_mapping=keep_mapping, tensors=len(tensors),
                        missing_keys=sorted(missing), unexpected_keys=sorted(info.get("unexpected_keys") or ()))
    for (name, t), mapped in zip(tensors, held):
        n = tensor_bytes(t)
        if mapped:
            report.bytes_mapped += n
            continue
        report.bytes_copied += n
        reason = CopyReason.initialised_by(maker) if name in missing else CopyReason.made_by(maker)
        report.copied[reason] = report.copied.get(reason, 0) + n
    report.decided_by = decided_by
    if copied_by_request:
        # The decision's copies under its one reason, as load_checkpoint files them; what the loader made
        # itself (a buffer it computes, a weight it built) stays under its own.
        made = CopyReason.made_by(maker)
        report.copied[CopyReason.of_decision(decided_by)] = copied_by_request
        left = report.copied.pop(made, 0) - copied_by_request
        if left > 0:
            report.copied[made] = left
    report.converted_tensors = len(cache.tensors)
    report.bytes_converted = cache.bytes
    report.conversion_dir = cache.path if cache.tensors else None
    report.conversion_reused = cache.reused
    from ..loading.fp8 import fp8_weights

    for _, codes, dequant in fp8_weights(model):
        report.fp8_weights += 1
        report.bytes_fp8 += codes.nbytes
        report.bytes_fp8_scales += dequant.scale.nbytes
    report.seconds = seconds
    return report
