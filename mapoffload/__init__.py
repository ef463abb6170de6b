"""mapoffload: run PyTorch models whose weights are bigger than host RAM.

Weights stay on the checkpoint's file mapping (page cache the kernel can drop
and re-read) instead of being copied into anonymous or pinned memory. See
``docs/design.md`` for the architecture.
"""

from __future__ import annotations

from ._native import _core
from .regions import (
    CowMapping,
    CowReport,
    MappedRegions,
    component_residency_bytes,
    cow_report,
    resident_bytes,
    tensor_spans,
)

__version__ = "0.1.0"

__all__ = [
    "CowMapping",
    "CowReport",
    "MappedRegions",
    "component_residency_bytes",
    "cow_report",
    "resident_bytes",
    "tensor_spans",
]
