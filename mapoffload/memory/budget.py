"""Host memory budget: how many bytes this process may still fill with copies.

Inside containers ``psutil.virtual_memory().available`` reports the machine,
not the cgroup, so the budget also reads the process's own memory cgroup and
takes the tightest headroom on the path from the leaf up to the mount.

A cgroup's usage (v2 ``memory.current``, v1 ``memory.usage_in_bytes``) counts
the page cache its processes filled, mapped checkpoint pages included; the
kernel reclaims the inactive part of that cache before it reclaims anything
else or kills. Counting it as used made the answer depend on how warm the
cache was, and in a capped cgroup made a mapped checkpoint's own pages eat
the budget that keeping it mapped was meant to save. So usage here leaves out
inactive file cache (v2 ``inactive_file``, v1 ``total_inactive_file`` from
``memory.stat``, hierarchical like the usage it is taken from), and the cap is
the tighter of v2 ``memory.max`` and ``memory.high`` (above ``high`` the
kernel throttles and reclaims hard), v1 ``memory.limit_in_bytes``.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

from .cgroup import CgroupLevel, _read, cgroup_levels, tightest_cgroup
from .._env import env_number
from .._log import format_bytes

__all__ = [
    "CapRoom",
    "CgroupLevel",
    "ENV_HOST_AVAILABLE_GIB",
    "ENV_PAGE_CACHE_MARGIN_MIB",
    "GIB_BYTES",
    "HOST_COPY_RESERVE_BYTES",
    "HostMemory",
    "NoRoomError",
    "PageCacheBudget",
    "cap_room",
    "cgroup_levels",
    "cgroup_memory_limit_bytes",
    "describe_host",
    "host_copies_would_not_fit",
    "host_copy_room",
    "host_memory",
    "host_memory_available_bytes",
    "page_cache_budget",
    "rss_anon_bytes",
    "tightest_cgroup",
]

GIB_BYTES = 1 << 30
# Free memory kept out of every copy decision: activations, staging buffers and
# allocator slack are not in the weight total and cannot be spent on copies.
HOST_COPY_RESERVE_BYTES = 4 * GIB_BYTES
ENV_HOST_AVAILABLE_GIB = "MAPOFFLOAD_HOST_AVAILABLE_GIB"
# Replaces the page-cache budget's default margin (64 MiB + 1/32 of the limit).
ENV_PAGE_CACHE_MARGIN_MIB = "MAPOFFLOAD_PAGE_CACHE_MARGIN_MIB"
def cgroup_memory_limit_bytes(*, root: str = "/") -> tuple[int, int] | None:
    """(cap, usage) of the tightest memory cap that applies to this process.

    ``cap`` is the tighter of ``memory.max`` and ``memory.high`` (v2) or
    ``memory.limit_in_bytes`` (v1). ``usage`` is the cgroup's usage *less its
    inactive file cache* (v2 ``inactive_file``, v1 ``total_inactive_file``),
    which the kernel reclaims first: ``cap - usage`` is the headroom, and it
    does not change with cache warmth. "Tightest" is the smallest headroom on
    the path from the leaf to the mount (:func:`tightest_cgroup`).

    Tries cgroup v2 before v1; "max", missing files, garbage and the v1
    sentinel (>= 2**62) mean uncapped. ``root`` prefixes every ``/proc`` and
    ``/sys`` path read, so tests build fake trees. None when nothing caps.
    """
    found = tightest_cgroup(root=root)
    return None if found is None else (found.cap, found.usage_less_cache)


def rss_anon_bytes(*, root: str = "/") -> int:
    """This process's anonymous resident bytes (``RssAnon`` in ``/proc/self/status``)."""
    text = _read(os.path.join(root, "proc/self/status")) or ""
    for line in text.splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def release_freed_memory() -> bool:
    """Give the C allocator's freed but retained memory back to the kernel
    (glibc ``malloc_trim``): after a load that made and dropped large
    temporaries, glibc keeps them (its mmap threshold grows after the first
    large free), and RssAnon — what a cgroup or the OOM killer sees — stays
    as high as the peak. False where there is no glibc."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    """glibc's ``malloc_trim`` from the symbols already loaded (no library search, no subprocess)."""
    import ctypes

    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


# The largest host the override may describe: 1 EiB keeps every byte count an int64.
MAX_HOST_GIB = 1 << 30


def _env_host_gib() -> float | None:
    """``MAPOFFLOAD_HOST_AVAILABLE_GIB`` in GiB, checked: 0 to :data:`MAX_HOST_GIB`."""
    return env_number(ENV_HOST_AVAILABLE_GIB, low=0, high=MAX_HOST_GIB, unit="GiB")


def _as_if_host(root: str) -> tuple[float, int, int] | None:
    """``(X, host bytes, other bytes)`` of ``MAPOFFLOAD_HOST_AVAILABLE_GIB=X``; None when unset.

    Its one meaning, for the copy gate and the page-cache budget alike: the
    process behaves like a host of X GiB on which only its own anonymous
    memory (``RssAnon``) is in use - *in place of* the machine's available
    memory and every cgroup cap, never in addition to them (a test can then
    describe a host larger than the cgroup it runs in, or smaller).
    """
    gib = _env_host_gib()
    if gib is None:
        return None
    return gib, int(gib * GIB_BYTES), rss_anon_bytes(root=root)


@dataclass(frozen=True)
class HostMemory:
    """What the budget sees, for logs, the CLI and JSON.

    ``cgroup_usage`` is the usage less reclaimable file cache, as
    :func:`cgroup_memory_limit_bytes` returns it.
    """

    available: int
    machine_available: int
    cgroup_cap: int | None
    cgroup_usage: int | None
    swap_free: int
    override_gib: float | None

    def __str__(self) -> str:
        parts = [f"available {format_bytes(self.available)}"]
        if self.override_gib is not None:
            parts.append(f"as if a {self.override_gib:g} GiB host ({ENV_HOST_AVAILABLE_GIB})")
        parts.append(f"machine {format_bytes(self.machine_available)} available")
        if self.cgroup_cap is not None:
            parts.append(
                f"cgroup cap {format_bytes(self.cgroup_cap)}, "
                f"usage {format_bytes(self.cgroup_usage or 0)} (less reclaimable file cache)"
            )
        else:
            parts.append("no cgroup cap")
        parts.append(f"swap free {format_bytes(self.swap_free)}")
        return "host memory: " + "; ".join(parts)


def host_memory(*, root: str = "/") -> HostMemory:
    """The whole picture :func:`host_memory_available_bytes` decides from."""
    import psutil

    machine = int(psutil.virtual_memory().available)
    swap_free = int(psutil.swap_memory().free)
    cg = cgroup_memory_limit_bytes(root=root)
    as_if = _as_if_host(root)
    if as_if is not None:
        available = max(0, as_if[1] - as_if[2])
    else:
        available = machine
        if cg is not None:
            available = min(available, max(0, cg[0] - cg[1]))
    return HostMemory(
        available=available,
        machine_available=machine,
        cgroup_cap=cg[0] if cg else None,
        cgroup_usage=cg[1] if cg else None,
        swap_free=swap_free,
        override_gib=None if as_if is None else as_if[0],
    )


def host_memory_available_bytes(*, root: str = "/") -> int:
    """min(psutil available, cgroup cap - usage), in bytes.

    The cgroup's usage leaves out reclaimable file cache and its cap honours
    ``memory.high`` (see :func:`cgroup_memory_limit_bytes`), so the answer
    does not flip with cache warmth.

    With ``MAPOFFLOAD_HOST_AVAILABLE_GIB=X`` the process behaves like a host of
    X GiB: ``max(0, X GiB - RssAnon)``, in place of the machine's and the
    cgroup's headroom (the page-cache budget reads it the same way).

    Raises
    ------
    EnvSettingError
        A ``ValueError``: the environment variable is not a number of GiB
        from 0 to 2**30 (the variable, its value and the range are named).
    """
    return host_memory(root=root).available


def describe_host(*, root: str = "/") -> str:
    """One human-readable line: available, cap, usage, swap."""
    return str(host_memory(root=root))


def host_copy_room(available_bytes: int, local_ranks: int = 1) -> int:
    """Bytes the local ranks' host copies may take together: ``available - local_ranks * HOST_COPY_RESERVE_BYTES``.

    The one definition of what copies may spend (negative where the reserves
    alone do not fit): the copy gate (:func:`host_copies_would_not_fit`),
    the manager's pinned-store budget (a rank's share of it) and the
    summary's explanation all read it.
    """
    return available_bytes - local_ranks * HOST_COPY_RESERVE_BYTES


def host_copies_would_not_fit(
    weight_bytes: int, *, available_bytes: int | None = None, local_ranks: int | None = None
) -> bool:
    """Whether copying ``weight_bytes`` into host memory, on every local rank, would fill the host.

    ``weight_bytes > 0 and n * weight_bytes >= available - n * HOST_COPY_RESERVE_BYTES``
    with ``n`` the ranks sharing this host: each rank would hold its own copy
    and needs its own reserve, while ``available`` (the machine's and the
    cgroup's headroom) is shared by all of them - it is counted once. With one
    rank this is ``weight_bytes >= available - HOST_COPY_RESERVE_BYTES``: the
    reserve is never spendable, and 0 bytes always fit.

    Parameters
    ----------
    weight_bytes
        What one rank would copy.
    available_bytes
        The host's headroom (default :func:`host_memory_available_bytes`).
    local_ranks
        Ranks on this host; None detects (``LOCAL_WORLD_SIZE``, else an
        initialised ``torch.distributed``'s world size, else 1; see
        :mod:`mapoffload.memory.ranks`).

    Raises
    ------
    TypeError, ValueError
        ``weight_bytes`` or ``available_bytes`` not an int (a float, NaN, a bool), ``local_ranks``
        not a whole number >= 1.
    """
    from .ranks import local_world

    for name, value in (("weight_bytes", weight_bytes), ("available_bytes", available_bytes)):
        # NaN compared False everywhere: "copies fit", whatever the host had. So did True.
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"{name} must be a whole number of bytes (an int), not {value!r}")
    if weight_bytes <= 0:
        return False
    n = local_world(local_ranks).size
    if available_bytes is None:
        available_bytes = host_memory_available_bytes()
    return n * weight_bytes >= host_copy_room(available_bytes, n)


# --- page cache for a mapped checkpoint ----------------------------------------------------


class NoRoomError(MemoryError):
    """The memory cap leaves no room for the least a stack streams in (its largest part, or layer):
    raised before any forward reads a weight, naming the cap, what the process holds, the room left and
    what is needed (``cap``, ``held``, ``room``, ``need``); under it a forward would thrash or be killed."""

    def __init__(self, message: str, *, cap: int, held: int, room: int, need: int) -> None:
        super().__init__(message)
        self.cap, self.held, self.room, self.need = cap, held, room, need


@dataclass(frozen=True)
class CapRoom:
    """The room under the tightest cgroup cap beside what the process cannot give back: the cap less
    its anonymous and kernel memory (its files' cache is reclaimable) and the thin margin."""

    cap: int
    held: int  # anonymous and kernel memory charged there (usage less file cache)
    margin: int  # 8 MiB + 1/1024 of the cap (the user's margin where less)

    @property
    def room(self) -> int:
        return self.cap - self.held - self.margin


def cap_room(*, root: str = "/") -> CapRoom | None:
    """:class:`CapRoom` of the cgroup cap with the least of it on this process's path (None: uncapped);
    the margin is the thin one, or the user's ``MAPOFFLOAD_PAGE_CACHE_MARGIN_MIB`` where that is less."""
    best: CapRoom | None = None
    users = _margin_override()
    for lv in cgroup_levels(root=root):
        held = lv.usage - min(lv.active_file + lv.inactive_file, lv.usage)
        thin = 8 * (1 << 20) + lv.cap // 1024
        found = CapRoom(lv.cap, held, thin if users is None else min(users, thin))
        if best is None or found.room < best.room:
            best = found
    return best


@dataclass(frozen=True)
class PageCacheBudget:
    """How many bytes of a mapped checkpoint's pages can stay in the page cache.

    ``usable = limit - other_bytes - margin``, where ``other_bytes`` is what
    else holds memory under that limit: anonymous and kernel memory, and
    the page cache of every *other* file (torch's libraries alone keep
    hundreds of MiB of their code cached, and a plan that forgot them
    thrashed). The checkpoint's own cached pages (``weights_cached``,
    measured by mincore) are not in ``other_bytes``: they are what the budget
    is for, so the answer does not shrink as the cache warms.

    ``cache_margin`` is the thinner margin that pages the kernel can reclaim
    (the cached set) may keep under a cgroup's cap: a plan may cache
    ``cache_extra`` more bytes of weights, checks at each cached layer's use
    that its pages stayed resident, and drops back to ``margin`` once they
    did not (:class:`~mapoffload.pagecache.coordinator.PageCacheCoordinator`).
    Anonymous memory the plan sizes (uncached buffers) is never taken
    from it: too little room there is the OOM killer, not a re-read.
    """

    usable: int
    limit: int  # the cap the budget is taken against (cgroup cap, override host, or machine)
    other_bytes: int
    weights_cached: int
    margin: int
    source: str  # "cgroup", "machine" or the override's variable name
    cache_margin: int | None = None  # None: the same as ``margin``

    @property
    def cache_extra(self) -> int:
        """Bytes beyond ``usable`` that only cached (reclaimable) weights may fill."""
        return 0 if self.cache_margin is None else max(0, self.margin - self.cache_margin)

    def __str__(self) -> str:
        thin = f"; {format_bytes(self.cache_margin)} for the cached set" if self.cache_extra else ""
        return (
            f"page cache for the weights: {format_bytes(self.usable)} usable of a {format_bytes(self.limit)} "
            f"{self.source} limit (other memory {format_bytes(self.other_bytes)}, weights cached now "
            f"{format_bytes(self.weights_cached)}, margin {format_bytes(self.margin)}{thin})"
        )


def _margin(limit: int) -> int:
    """Headroom kept out of the plan: activations, allocator slack, code paged in mid-forward.

    64 MiB + 1/32 of the limit, or ``MAPOFFLOAD_PAGE_CACHE_MARGIN_MIB`` MiB
    where set: thinner where a forward's activations are known to be small
    (each MiB given back is a MiB of weights that stays cached), thicker for
    long prefills whose activations outgrow the default.
    """
    mib = _margin_override()
    if mib is not None:
        return mib
    return 64 * (1 << 20) + limit // 32


def _margin_override() -> int | None:
    mib = env_number(ENV_PAGE_CACHE_MARGIN_MIB, low=0, high=1 << 20, unit="MiB")
    return None if mib is None else int(mib * (1 << 20))


def _cache_margin(limit: int) -> int | None:
    """The cached set's thinner margin under a cgroup's cap (None: no thinner one).

    8 MiB + 1/1024 of the limit: the kernel's per-CPU charge batches and
    what moves between two reads of the cgroup. None where the margin is
    the user's (``MAPOFFLOAD_PAGE_CACHE_MARGIN_MIB``).
    """
    if _margin_override() is not None:
        return None
    return 8 * (1 << 20) + limit // 1024


def _measured_margin(limit: int, forward_bytes: int | None) -> tuple[int, int | None]:
    """``(margin, cache_margin)`` under ``limit``: the defaults, or where a forward's growth of anonymous
    memory was measured (``forward_bytes``), that growth over the thin margin (the user's
    ``MAPOFFLOAD_PAGE_CACHE_MARGIN_MIB`` wins over both)."""
    if forward_bytes is None or _margin_override() is not None:
        return _margin(limit), _cache_margin(limit)
    thin = 8 * (1 << 20) + limit // 1024
    return thin + max(0, int(forward_bytes)), thin


def _cgroup_page_cache(weights_cached: int, root: str, forward_bytes: int | None = None) -> PageCacheBudget | None:
    """The tightest page-cache budget of the capped cgroups on this process's path (None: uncapped)."""
    best: PageCacheBudget | None = None
    for lv in cgroup_levels(root=root):
        files = min(lv.active_file + lv.inactive_file, lv.usage)
        # The weights' cached pages may be charged here (then they are part
        # of ``files``) or to the cgroup that first read them (then they
        # cost this one nothing): either way they are not "other".
        other = (lv.usage - files) + max(0, files - weights_cached)
        margin, thin = _measured_margin(lv.cap, forward_bytes)
        found = PageCacheBudget(max(0, lv.cap - other - margin), lv.cap, other, weights_cached, margin, "cgroup", thin)
        if best is None or found.usable < best.usable:
            best = found
    return best


def page_cache_budget(weights_cached: int = 0, *, root: str = "/", forward_bytes: int | None = None
                      ) -> PageCacheBudget:
    """The page cache a mapped checkpoint's weights may fill without thrashing.

    The tightest of: every memory cgroup cap on the path from this process's
    cgroup to the mount (v2 ``memory.max``/``memory.high``, v1
    ``memory.limit_in_bytes``), less that cgroup's anonymous and kernel
    memory and its other files' cache (``memory.stat``); the machine's
    available memory (psutil; it counts cached file pages as available).
    With ``MAPOFFLOAD_HOST_AVAILABLE_GIB=X``, in place of all of them (the
    one meaning the copy gate gives it too): X GiB less ``RssAnon``. Each
    keeps a margin of 64 MiB plus 1/32 of its limit
    (``MAPOFFLOAD_PAGE_CACHE_MARGIN_MIB`` replaces it).

    Parameters
    ----------
    weights_cached
        Bytes of the weights' pages resident now (``resident_bytes`` over
        their spans): left out of "other memory".
    root
        Prefix of every ``/proc`` and ``/sys`` path read (tests).
    forward_bytes
        The most anonymous memory a forward was seen to add above what the
        process held at its start (its activations, first uses of torch).
        Where known, a cgroup's margin is that plus 8 MiB + 1/1024 of the
        limit instead of the default, which is a guess made before any
        forward ran: what the process holds now is measured as "other"
        memory, the forward's growth above it is what the margin keeps.
    """
    import psutil

    as_if = _as_if_host(root)
    if as_if is not None:
        _, limit, other = as_if
        margin = _margin(limit)
        return PageCacheBudget(
            max(0, limit - other - margin), limit, other, weights_cached, margin, ENV_HOST_AVAILABLE_GIB
        )
    vm = psutil.virtual_memory()
    margin = _margin(int(vm.total))
    # ``available`` already counts reclaimable cache, the weights' own pages included.
    machine = PageCacheBudget(
        max(0, int(vm.available) - margin), int(vm.total), max(0, int(vm.total) - int(vm.available)),
        weights_cached, margin, "machine",
    )
    cg = _cgroup_page_cache(weights_cached, root, forward_bytes)
    if cg is not None and cg.usable < machine.usable:
        return cg
    return machine
