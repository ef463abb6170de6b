"""A manager's options: every knob of :class:`~mapoffload.LayerwiseOffloadManager` validated once.

:func:`resolve` checks the keyword arguments and fills in what they leave to the environment (the
device's index, the local ranks, the host budget) before anything is built; the manager and its parts
read the frozen :class:`Options` from then on. The copier a manager makes for itself is made here too
(:func:`make_copier`), its staging ring shrunk for the local ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .._checks import check_bool, check_count, check_device
from .stream_reads import STREAM_READS

if TYPE_CHECKING:
    import torch

    from ..copier import Copier

__all__ = ["HOST_STORES", "Options", "make_copier", "resolve"]

HOST_STORES = ("auto", "mapped", "pinned", "pageable")


@dataclass(frozen=True)
class Options:
    """The validated knobs (see :class:`~mapoffload.LayerwiseOffloadManager` for each)."""

    device: torch.device  # with its index on CUDA
    prefetch_layers: int
    resident_layers: int
    host_store: str
    in_place: bool  # device="cpu" without cpu_twin: layers compute from their host stores, nothing moves
    local_ranks: int
    available_bytes: int
    page_cache_bytes: int | None
    kernel_caps: str | None
    stream_reads: str

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


def check_page_cache_bytes(page_cache_bytes: int | None) -> None:
    """``page_cache_bytes``: a whole number >= 0, or None (measured); ``TypeError``/``ValueError`` naming it."""
    check_count("page_cache_bytes", page_cache_bytes, none=True)


def resolve(*, device: str | torch.device, prefetch_layers: int, resident_layers: int, host_store: str,
            copier: Copier | None, available_bytes: int | None,
            local_ranks: int | None, cpu_twin: bool, page_cache_bytes: int | None, kernel_caps: str | None,
            stream_reads: str) -> Options:
    """The :class:`Options` of a manager's keyword arguments.

    Every option is checked here, before anything is built: flags are bools, counts whole
    numbers (an ``int``, not a ``bool``), each refusal naming the option and the value.

    Raises
    ------
    TypeError
        An option of the wrong type (``prefetch_layers=1.5``, ``cpu_twin="false"``, ``device=1.5``).
    ValueError
        A value out of range or not one of the choices (``resident_layers=-1``, ``host_store="gpu"``),
        or options that do not go together.
    """
    import torch

    from ..memory.budget import host_memory_available_bytes
    from ..memory.ranks import local_world

    if host_store not in HOST_STORES:
        raise ValueError(f"host_store must be one of {HOST_STORES}, not {host_store!r}")
    check_count("prefetch_layers", prefetch_layers)
    check_count("resident_layers", resident_layers)
    check_bool("cpu_twin", cpu_twin)
    check_count("local_ranks", local_ranks, minimum=1, none=True)
    check_count("available_bytes", available_bytes, none=True)
    dev = check_device(device, "device")  # the one device rule (CUDA where torch sees it)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if cpu_twin and dev.type != "cpu":
        raise ValueError(f"cpu_twin is for device='cpu', not {dev}")
    # On the CPU a layer computes from its host store: no copy, no copier.
    in_place = dev.type == "cpu" and not cpu_twin
    if in_place and copier is not None:
        raise ValueError(
            "device='cpu' computes from the host stores and copies nothing: a copier is for the device "
            "pipeline (cpu_twin=True runs it on the CPU)"
        )
    if copier is not None and copier.device != dev:
        raise ValueError(f"copier is on {copier.device}, the manager on {dev}")
    check_page_cache_bytes(page_cache_bytes)
    if stream_reads not in STREAM_READS:
        raise ValueError(f"stream_reads must be one of {STREAM_READS}, not {stream_reads!r}")
    ranks = local_world(local_ranks).size
    if available_bytes is None:
        available_bytes = host_memory_available_bytes()
    return Options(device=dev, prefetch_layers=prefetch_layers, resident_layers=resident_layers,
                   host_store=host_store, in_place=in_place, local_ranks=ranks, available_bytes=available_bytes,
                   page_cache_bytes=page_cache_bytes, kernel_caps=kernel_caps, stream_reads=stream_reads)


def make_copier(options: Options) -> Copier:
    """A copier with the default settings, its ring shrunk when the local ranks' rings would not fit."""
    from ..copier import Copier, resolve_settings

    if options.local_ranks <= 1:
        return Copier(options.device)
    from ..memory.ranks import staging_ring_settings

    threads, slot_bytes, slots = resolve_settings()
    threads, slot_bytes, slots = staging_ring_settings(
        threads=threads, slot_bytes=slot_bytes, slots=slots, local_ranks=options.local_ranks,
        available_bytes=options.available_bytes,
    )
    return Copier(options.device, threads=threads, staging_bytes=slot_bytes, slots=slots)
