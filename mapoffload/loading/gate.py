"""The loader's gate: keep the checkpoint mapped exactly when host copies would not fit.

:func:`keep_checkpoint_mapped` weighs a load's bytes (times the ranks sharing the host: copies are
per rank, the page cache is shared) against the host's available memory
(:mod:`mapoffload.memory.budget`) and logs why; :func:`match_checkpoint_dtypes` makes a mapped load's only
copies, the tensors whose dtype differs from the target's. Both are contract names of
:mod:`mapoffload.loading.checkpoint`; :func:`~mapoffload.load_checkpoint` asks the gate by that module's
name, so a ``keep_checkpoint_mapped`` set there (a test's monkeypatch) is the one it asks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from .._checks import check_count
from .._log import logger
from ..memory.budget import HOST_COPY_RESERVE_BYTES, host_copies_would_not_fit, host_memory_available_bytes
from ..memory.ranks import local_world

if TYPE_CHECKING:
    import torch

__all__ = ["keep_checkpoint_mapped", "match_checkpoint_dtypes"]


def keep_checkpoint_mapped(*, weight_bytes: int, component: str, local_ranks: int | None = None) -> bool:
    """True exactly when host copies of ``weight_bytes`` would not fit.

    With several ranks on the host (``local_ranks``; None detects, see
    :mod:`mapoffload.memory.ranks`) copies cost ``local ranks x weight_bytes`` of
    anonymous memory, a mapping the shared page cache once. Logs one line
    saying why, with both numbers against the host's available memory.

    Raises
    ------
    TypeError, ValueError
        ``weight_bytes`` not a whole number >= 0, ``local_ranks`` not one >= 1
        (or None).
    """
    check_count("weight_bytes", weight_bytes)
    check_count("local_ranks", local_ranks, minimum=1, none=True)
    world = local_world(local_ranks)
    available = host_memory_available_bytes()
    keep = host_copies_would_not_fit(weight_bytes, available_bytes=available, local_ranks=world.size)
    gib = 1 << 30
    logger.info(
        "%s: %.2f GiB of weights, %s: copies would take %.2f GiB of anonymous memory, a mapping %.2f GiB "
        "of shared page cache; host has %.2f GiB available (%.0f GiB reserve per rank): %s",
        component,
        weight_bytes / gib,
        world,
        world.size * weight_bytes / gib,
        weight_bytes / gib,
        available / gib,
        HOST_COPY_RESERVE_BYTES / gib,
        "copies would not fit, keeping the checkpoint mapped" if keep else "copies fit, copying into host memory",
    )
    return keep


def match_checkpoint_dtypes(
    loaded: dict[str, torch.Tensor], target_state: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Convert, in ``loaded``, only tensors whose dtype differs from the target's.

    That conversion is the only anonymous memory a mapped load makes; tensors
    whose dtype matches stay the very same objects (still views of the
    mapping), and keys the target lacks are untouched. Returns ``loaded``.
    """
    for key, tensor in loaded.items():
        target = target_state.get(key)
        if target is not None and tensor.dtype != target.dtype:
            loaded[key] = tensor.to(target.dtype)
    return loaded
