"""What the page cache holds of a file, for tests that read files in: pages
cached, and pages reclaim took back.

The kernel keeps a clean page in the page cache only until reclaim takes it
back, which it may do at any moment, with memory to spare too: this
project's machines run a proactive reclaimer (DAMON, ``kdamond``, with a
scheme that pages out file pages no process maps). Seen (issue 24): a file
read into the cache and left alone lost 1.3 of 128 MiB in 40 s, with 17 GiB
free and no reclaim counted in ``/proc/vmstat`` (its mapped half lost
nothing). A test that reads a file in and then counts its resident bytes
accounts for what reclaim took back instead of assuming it stayed: reclaim
leaves a shadow entry in the file's page cache, which ``cachestat(2)``
counts (``nr_evicted``); a drop (``POSIX_FADV_DONTNEED``) or a truncation
leaves none, and clears those there were.

Where the machine runs short of memory (kswapd or direct reclaim: other work
beside the tests), reclaim also drops shadow entries, and read-ahead gives
up where it cannot allocate: then nothing about what the cache holds can be
held (``memory_pressure``).
"""

from __future__ import annotations

import ctypes
import mmap

__all__ = ["PAGE", "cachestat", "memory_pressure", "taken_back_bytes"]

PAGE = mmap.PAGESIZE

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_SYS_CACHESTAT = 451  # one number on every architecture (Linux 6.5+)


class _CacheRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _CacheStat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64)
                for name in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]


def cachestat(fd: int, offset: int, nbytes: int) -> tuple[int, int] | None:
    """(pages in the page cache, reads in flight included; pages reclaim took back) of a file range.

    None where the kernel has no ``cachestat(2)`` (before 6.5).
    """
    rng, out = _CacheRange(offset, nbytes), _CacheStat()
    if _libc.syscall(_SYS_CACHESTAT, fd, ctypes.byref(rng), ctypes.byref(out), 0) != 0:
        return None
    return out.nr_cache, out.nr_evicted


def taken_back_bytes(fd: int, offset: int, nbytes: int) -> int:
    """Bytes of a file range that reclaim took back from the page cache (0 without ``cachestat``)."""
    if nbytes <= 0:
        return 0
    return (cachestat(fd, offset, nbytes) or (0, 0))[1] * PAGE


_SHORT_OF_MEMORY = ("pgscan_kswapd", "pgscan_direct", "allocstall_normal", "allocstall_movable")


def memory_pressure() -> int:
    """Pages kswapd and direct reclaim scanned, and allocations that stalled, on the whole machine.

    Event counters, summed over the CPUs when read: exact (unlike the node
    counters beside them, ``workingset_*`` among them). A proactive reclaimer
    (DAMON) counts in none of them.
    """
    total = 0
    with open("/proc/vmstat") as f:
        for line in f:
            name, _, value = line.partition(" ")
            if name in _SHORT_OF_MEMORY:
                total += int(value)
    return total
