"""mapoffload: run PyTorch models whose weights are bigger than host RAM.

Weights stay on the checkpoint's file mapping (page cache the kernel can drop
and re-read) instead of being copied into anonymous or pinned memory. See
``docs/design.md`` for the architecture.
"""

from __future__ import annotations

from ._native import _core
from .memory.budget import (
    GIB_BYTES,
    HOST_COPY_RESERVE_BYTES,
    HostMemory,
    NoRoomError,
    cgroup_memory_limit_bytes,
    describe_host,
    host_copies_would_not_fit,
    host_memory,
    host_memory_available_bytes,
    rss_anon_bytes,
)
from .loading.checkpoint import (
    CheckpointError,
    CopyReason,
    NotLocalError,
    LoadReport,
    checkpoint_bytes,
    checkpoint_files,
    empty_weights,
    keep_checkpoint_mapped,
    load_checkpoint,
    match_checkpoint_dtypes,
)
from .copier import Copier, CopyHandle, CopyStats, CudaError, MappingFaultError, cuda_available
from .loading.shard import shard_tensor
from .offload import LayerwiseOffloadManager
from .offload.runtime import OffloadedGradientError
from .offload.hooks import ReplacedWeightError, WeightNotLoadedError
from .options import OffloadOptions
from .pagecache.coordinator import PageCacheCoordinator, coordinator as page_cache_coordinator
from .memory.ranks import LocalWorld, local_world
from .memory.regions import (
    CowMapping,
    CowReport,
    MappedRegions,
    component_residency_bytes,
    cow_report,
    drop_page_cache,
    resident_bytes,
    tensor_extent,
    tensor_spans,
)

__version__ = "0.1.0"


# `mapoffload.offload` is the Hugging Face entry point (a function, lazily
# imported below), not the submodule of the same name that the import above
# bound here; the submodule stays importable as `mapoffload.offload`.
del offload  # type: ignore[name-defined]  # noqa: F821

_HF_NAMES = ("from_pretrained", "offload", "offload_pipeline", "pipeline_from_pretrained")


def __getattr__(name: str):
    # OffloadedWeight subclasses torch.nn.Parameter: importing it imports
    # torch, which `import mapoffload` itself never does.
    if name == "OffloadedWeight":
        from .offload.placeholder import OffloadedWeight

        return OffloadedWeight
    # The Hugging Face integration imports torch (and transformers/diffusers
    # when called): loaded on first use only.
    if name in _HF_NAMES:
        from . import hf

        return getattr(hf, name)
    raise AttributeError(f"module 'mapoffload' has no attribute {name!r}")

__all__ = [
    "CheckpointError",
    "Copier",
    "CopyHandle",
    "CopyReason",
    "CopyStats",
    "CowMapping",
    "CowReport",
    "CudaError",
    "GIB_BYTES",
    "HOST_COPY_RESERVE_BYTES",
    "HostMemory",
    "LayerwiseOffloadManager",
    "LoadReport",
    "LocalWorld",
    "MappedRegions",
    "MappingFaultError",
    "NoRoomError",
    "NotLocalError",
    "OffloadOptions",
    "OffloadedGradientError",
    "OffloadedWeight",
    "PageCacheCoordinator",
    "ReplacedWeightError",
    "WeightNotLoadedError",
    "cgroup_memory_limit_bytes",
    "checkpoint_bytes",
    "checkpoint_files",
    "component_residency_bytes",
    "cow_report",
    "cuda_available",
    "describe_host",
    "drop_page_cache",
    "empty_weights",
    "from_pretrained",
    "host_copies_would_not_fit",
    "host_memory",
    "host_memory_available_bytes",
    "keep_checkpoint_mapped",
    "load_checkpoint",
    "local_world",
    "match_checkpoint_dtypes",
    "offload",
    "offload_pipeline",
    "page_cache_coordinator",
    "pipeline_from_pretrained",
    "resident_bytes",
    "rss_anon_bytes",
    "shard_tensor",
    "tensor_extent",
    "tensor_spans",
]
