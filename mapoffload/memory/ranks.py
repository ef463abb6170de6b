"""Many ranks on one host: how many share it, and what each may spend.

Every local rank's mapping of one checkpoint file shares the same page-cache
pages, so a mapped checkpoint costs the host its bytes once; host copies cost
them once per local rank, in anonymous memory the kernel can never drop.

How many ranks share this host is read, never negotiated:

1. ``LOCAL_WORLD_SIZE``, which ``torchrun`` (torch elastic) sets for every
   worker it starts;
2. else, when ``torch.distributed`` is initialised, its world size: exact on
   one host (``torch.multiprocessing.spawn``), an upper bound across hosts;
3. else 1.

The gate never runs a collective to count ranks (an ``all_gather`` of host
names, say): it is called per component, sometimes by some ranks only, and a
collective that not every rank enters hangs the job. Counting too many local
ranks only ever keeps a checkpoint mapped that copies would have fit - the
safe direction; counting too few is how an 8-rank host gets OOM-killed.

The host's headroom (machine available memory, and the cgroup's, which
``torchrun``'s workers share with their agent in one container) is shared by
all local ranks: it is divided by the local world once, never counted once per
rank. See ``docs/ranks.md``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from .._env import env_number
from .._log import format_bytes, logger

__all__ = ["ENV_LOCAL_WORLD_SIZE", "LocalWorld", "local_world", "staging_ring_settings"]

ENV_LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
# A rank's staging ring may take at most this fraction of its share of the
# host's headroom; the rest is for layer buffers, activations and slack.
RING_SHARE_DIVISOR = 8
MIN_SLOTS = 2
# A shrunk ring's slots stay at least this large (or as large as they were, where
# that is smaller): a different bound from the copier's own smallest slot
# (mapoffload.copier.MIN_SLOT_BYTES, one page), which any setting may use.
SHRUNK_SLOT_FLOOR_BYTES = 1 << 20


@dataclass(frozen=True)
class LocalWorld:
    """How many ranks share this host, and where that number came from."""

    size: int
    source: str

    def __str__(self) -> str:
        return f"{self.size} local rank{'s' if self.size != 1 else ''} ({self.source})"


MAX_LOCAL_RANKS = 1 << 16  # more ranks than that on one host is a typo


def _from_env() -> int | None:
    """``LOCAL_WORLD_SIZE`` read as every variable the package reads (:func:`~mapoffload._env.env_number`)."""
    value = env_number(ENV_LOCAL_WORLD_SIZE, low=1, high=MAX_LOCAL_RANKS, integer=True)
    return None if value is None else int(value)


def _from_torch_distributed() -> int | None:
    # Never import torch here: if torch.distributed was never imported, no
    # process group can be initialised.
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return None
    try:
        if dist.is_available() and dist.is_initialized():
            return int(dist.get_world_size())
    except Exception:  # pragma: no cover - a broken or torn-down group
        logger.debug("torch.distributed world size unreadable", exc_info=True)
    return None


def local_world(local_ranks: int | None = None) -> LocalWorld:
    """The number of ranks sharing this host (see the module docstring).

    Parameters
    ----------
    local_ranks
        A number to use as it is (validated); None detects.

    Raises
    ------
    TypeError
        ``local_ranks`` not a whole number (``1.5``, ``"2"``, ``True``).
    ValueError
        ``local_ranks`` < 1, or ``LOCAL_WORLD_SIZE`` not a whole number from
        1 to 2**16 (an ``EnvSettingError`` naming the variable and the range).
    """
    if local_ranks is not None:
        from .._checks import check_count

        return LocalWorld(check_count("local_ranks", local_ranks, minimum=1), "given")  # 1.5, "2": refused
    env = _from_env()
    if env is not None:
        return LocalWorld(env, ENV_LOCAL_WORLD_SIZE)
    dist = _from_torch_distributed()
    if dist is not None:
        return LocalWorld(dist, "torch.distributed world size")
    return LocalWorld(1, "single process")


def staging_ring_settings(
    *, threads: int, slot_bytes: int, slots: int, local_ranks: int, available_bytes: int
) -> tuple[int, int, int]:
    """Copier settings ``(threads, slot_bytes, slots)`` whose rings fit the host.

    Every local rank has its own ring of ``slot_bytes * slots`` pinned (or, on
    the CPU, page-aligned) bytes. When ``local_ranks`` rings would take more
    than ``1/8`` of the host's available memory (each rank: more than an
    eighth of its share), the ring is divided by the local ranks: first the
    slot count (down to 2), then, if that is not enough, the slot size (down
    to 1 MiB, never up: slots already smaller stay as they are); threads
    never outnumber slots. Settings that fit come back unchanged.
    """
    allowed = max(0, available_bytes) // RING_SHARE_DIVISOR
    if local_ranks <= 1 or local_ranks * slot_bytes * slots <= allowed:
        return threads, slot_bytes, slots
    new_slots = max(MIN_SLOTS, slots // local_ranks)
    new_slot_bytes = slot_bytes
    if local_ranks * slot_bytes * new_slots > allowed:
        new_slot_bytes = max(min(slot_bytes, SHRUNK_SLOT_FLOOR_BYTES), slot_bytes // local_ranks)
    new_threads = max(1, min(threads, new_slots))
    logger.info(
        "staging rings: %d local ranks x %s would take more than 1/%d of %s available; "
        "each rank's ring is %d slots of %s (was %d of %s), %d threads",
        local_ranks, format_bytes(slot_bytes * slots), RING_SHARE_DIVISOR, format_bytes(available_bytes),
        new_slots, format_bytes(new_slot_bytes), slots, format_bytes(slot_bytes), new_threads,
    )
    return new_threads, new_slot_bytes, new_slots
