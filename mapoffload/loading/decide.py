"""The second step of :func:`~mapoffload.load_checkpoint`: the mapping or copies, decided once.

:func:`decide` takes the caller's ``keep_mapping`` as it is, or asks the gate once (None) with the
bytes this load would copy: the checkpoint's files, or with a shard plan this rank's slices
(:func:`load_bytes`). Every loader decides here: ``from_pretrained`` and the pipelines with the bytes
their models map, vLLM's load format with its checkpoint's. Its
:class:`Decision` says what is kept, who chose, and the one :class:`CopyReason` every copy the
decision makes is filed under (fp8 codes and scales as well as ordinary tensors).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .files import checkpoint_bytes
from .gate import keep_checkpoint_mapped
from .load_plan import LoadPlan
from .reasons import CopyReason

__all__ = ["Decision", "decide", "load_bytes"]


@dataclass(frozen=True)
class Decision:
    """Whether the load keeps the mapping, who decided, and why its copies are made."""

    keep_mapping: bool
    decided_by: str  # "gate" (keep_mapping=None) or "caller"

    @property
    def copy_reason(self) -> CopyReason:
        """What the copies this decision makes are filed under (``LoadReport.copied``)."""
        return CopyReason.of_decision(self.decided_by)


def decide(keep_mapping: bool | None, *, weight_bytes: int | Callable[[], int], component: str,
           local_ranks: int | None = None, gate: Callable[..., bool] = keep_checkpoint_mapped) -> Decision:
    """Keep the mapping or copy: the caller's choice, or the gate's (``gate``,
    :func:`~mapoffload.keep_checkpoint_mapped`), asked once with what the load would copy.

    The one place every loader decides (:func:`~mapoffload.load_checkpoint`, ``from_pretrained`` and
    the pipelines, vLLM's load format). ``weight_bytes`` is counted only when the gate is asked (a
    callable is called then); ``component`` names the load in the gate's log line."""
    if keep_mapping is not None:
        return Decision(bool(keep_mapping), "caller")
    counted = weight_bytes() if callable(weight_bytes) else weight_bytes
    keep = gate(weight_bytes=counted, component=component, local_ranks=local_ranks)
    return Decision(bool(keep), "gate")


def load_bytes(plan: LoadPlan) -> tuple[int, str]:
    """What a :class:`~mapoffload.loading.load_plan.LoadPlan` would copy, and the name the gate logs:
    the checkpoint's bytes (exactly the files the plan reads), or with a shard plan this rank's slices."""
    if plan.shard is None:
        return checkpoint_bytes(plan.path), plan.component
    rank, world = plan.shard
    return plan.slice_bytes, f"{plan.component} (rank {rank} of {world})"
