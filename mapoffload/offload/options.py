"""A manager's options made whole: the environment's answers filled into the user's options.

The user's :class:`~mapoffload.OffloadOptions` are checked when they are made; :func:`resolve` fills
in what they leave to the environment (the host budget, the local ranks), checks the copier given
beside them, and hands the parts one frozen :class:`~mapoffload.OffloadOptions`. The copier a
manager makes for itself is made here too (:func:`make_copier`), its staging ring shrunk for the
local ranks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..options import HOST_STORES, OffloadOptions

if TYPE_CHECKING:
    from ..copier import Copier

__all__ = ["HOST_STORES", "make_copier", "resolve"]


def resolve(options: OffloadOptions, copier: Copier | None) -> OffloadOptions:
    """``options`` with the host budget and the local ranks measured where they were left to the
    environment (None), after checking that ``copier`` goes with them.

    Raises
    ------
    ValueError
        A copier for in-place layers (``device="cpu"`` copies nothing) or for another device.
    """
    from ..memory.budget import host_memory_available_bytes
    from ..memory.ranks import local_world

    if options.in_place and copier is not None:
        raise ValueError(
            "device='cpu' computes from the host stores and copies nothing: a copier is for the device "
            "pipeline (cpu_twin=True runs it on the CPU)"
        )
    if copier is not None and copier.device != options.device:
        raise ValueError(f"copier is on {copier.device}, the manager on {options.device}")
    available = options.available_bytes
    if available is None:
        available = host_memory_available_bytes()
    return options.filled(local_ranks=local_world(options.local_ranks).size, available_bytes=available)


def make_copier(options: OffloadOptions) -> Copier:
    """A copier with the default settings, its ring shrunk when the local ranks' rings would not fit."""
    from ..copier import Copier, resolve_settings

    if options.local_ranks is None or options.local_ranks <= 1:
        return Copier(options.device)
    from ..memory.ranks import staging_ring_settings

    threads, slot_bytes, slots = resolve_settings()
    threads, slot_bytes, slots = staging_ring_settings(
        threads=threads, slot_bytes=slot_bytes, slots=slots, local_ranks=options.local_ranks,
        available_bytes=options.available_bytes,
    )
    return Copier(options.device, threads=threads, staging_bytes=slot_bytes, slots=slots)
