"""The second step of :func:`~mapoffload.load_checkpoint`: the mapping or copies, decided once.

:func:`decide` takes the caller's ``keep_mapping`` as it is, or asks the gate once (None) with the
bytes this load would copy: the checkpoint's files, or with a shard plan this rank's slices. Its
:class:`Decision` says what is kept, who chose, and the one :class:`CopyReason` every copy the
decision makes is filed under (fp8 codes and scales as well as ordinary tensors).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .files import checkpoint_bytes
from .load_plan import LoadPlan
from .reasons import CopyReason

__all__ = ["Decision", "decide"]


@dataclass(frozen=True)
class Decision:
    """Whether the load keeps the mapping, who decided, and why its copies are made."""

    keep_mapping: bool
    decided_by: str  # "gate" (keep_mapping=None) or "caller"

    @property
    def copy_reason(self) -> CopyReason:
        """What the copies this decision makes are filed under (``LoadReport.copied``)."""
        return CopyReason.of_decision(self.decided_by)


def decide(plan: LoadPlan, keep_mapping: bool | None, *, gate: Callable[..., bool],
           local_ranks: int | None) -> Decision:
    """The caller's choice, or the gate's (``gate``: :func:`~mapoffload.keep_checkpoint_mapped`),
    asked once: with the checkpoint's bytes (exactly the files the plan read), or with a shard plan
    this rank's slices (what it would copy)."""
    if keep_mapping is not None:
        return Decision(bool(keep_mapping), "caller")
    if plan.shard is None:
        weight_bytes, component = checkpoint_bytes(plan.path), plan.component
    else:
        rank, world = plan.shard
        weight_bytes, component = plan.slice_bytes, f"{plan.component} (rank {rank} of {world})"
    keep = gate(weight_bytes=weight_bytes, component=component, local_ranks=local_ranks)
    return Decision(bool(keep), "gate")
