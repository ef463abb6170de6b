"""The one walk of this process's memory cgroups: every capped level from the leaf up to the mount.

What each level holds (cap, usage, file cache) is read here, once per call,
and every decision taken against a cgroup starts from these levels: the
host headroom and the page-cache budget (:mod:`mapoffload.memory.budget`) and the
peers' registry (:mod:`mapoffload.pagecache.peers`: the processes that draw on
one cap).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["CgroupLevel", "cgroup_levels", "tightest_cgroup"]

# cgroup v1 reports "no limit" as PAGE_COUNTER_MAX * PAGE_SIZE, about 2^63.
_V1_UNLIMITED = 1 << 62


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _read_int(path: str) -> int | None:
    text = _read(path)
    if text is None:
        return None
    text = text.strip()
    if not text.isdigit():  # "max", garbage, empty
        return None
    return int(text)


def _own_cgroup_paths(root: str) -> tuple[str | None, str | None]:
    """This process's (v2 path, v1 memory path) from ``/proc/self/cgroup``."""
    text = _read(os.path.join(root, "proc/self/cgroup")) or ""
    v2 = v1 = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, path = parts
        if hid == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return v2, v1


def _candidate_dirs(mount: str, path: str) -> list[str]:
    """Directories from the leaf up to the mount, for the tightest-cap walk.

    In a container the path in ``/proc/self/cgroup`` is the host's; under the
    container's mount only a suffix of it (or the mount itself) exists.
    """
    parts = [p for p in path.split("/") if p]
    leaf = mount
    for i in range(len(parts) + 1):
        cand = os.path.join(mount, *parts[i:])
        if os.path.isdir(cand):
            leaf = cand
            break
    dirs = []
    cur = os.path.normpath(leaf)
    top = os.path.normpath(mount)
    while True:
        dirs.append(cur)
        if cur == top or not cur.startswith(top):
            break
        cur = os.path.dirname(cur)
    return dirs


@dataclass(frozen=True)
class _Version:
    """Where one cgroup version keeps what the budget reads."""

    mount: str  # relative to root
    caps: tuple[str, ...]  # the tightest of these applies; "max"/garbage = none
    usage: str
    unlimited: int | None  # caps at or above this mean none (v1's sentinel)
    files: tuple[str, str]  # the file-cache fields of memory.stat (active, inactive: reclaimed first)


_V2 = _Version(
    "sys/fs/cgroup", ("memory.max", "memory.high"), "memory.current", None,
    ("active_file", "inactive_file"),
)
_V1 = _Version(
    "sys/fs/cgroup/memory", ("memory.limit_in_bytes",), "memory.usage_in_bytes", _V1_UNLIMITED,
    ("total_active_file", "total_inactive_file"),
)


@dataclass(frozen=True)
class CgroupLevel:
    """One capped memory cgroup on the path from this process's cgroup up to the mount.

    The one reading of a cgroup that every budget decides from: the host
    headroom (:func:`cgroup_memory_limit_bytes`), the page-cache budget
    (:func:`page_cache_budget`) and the peers' registry (processes drawing on
    one cap: :mod:`mapoffload.pagecache.peers`).
    """

    version: str  # "v2" or "v1"
    path: str  # the cgroup, relative to its hierarchy's mount ("/" is the mount itself)
    cap: int  # the tightest of the version's caps there
    usage: int  # as the cgroup reports it (page cache included)
    active_file: int  # memory.stat's file-cache fields (v1: the hierarchical total_*)
    inactive_file: int

    @property
    def usage_less_cache(self) -> int:
        """Usage without the inactive file cache the kernel reclaims first (never below 0:
        usage and memory.stat are read at different moments)."""
        return max(0, self.usage - self.inactive_file)

    @property
    def headroom(self) -> int:
        return self.cap - self.usage_less_cache


def _stat_fields(path: str, names: tuple[str, ...]) -> dict[str, int]:
    """The ``name value`` lines of a ``memory.stat`` file for ``names``; absent or garbage ones left out."""
    out: dict[str, int] = {}
    for line in (_read(path) or "").splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] in names and parts[1].isdigit():
            out.setdefault(parts[0], int(parts[1]))
    return out


def _level(mount: str, d: str, v: _Version, version: str) -> CgroupLevel | None:
    """One cgroup directory read; None when nothing caps it."""
    caps = [c for c in (_read_int(os.path.join(d, f)) for f in v.caps) if c is not None]
    caps = [c for c in caps if v.unlimited is None or c < v.unlimited]
    if not caps:
        return None
    usage = _read_int(os.path.join(d, v.usage)) or 0
    stat = _stat_fields(os.path.join(d, "memory.stat"), v.files)
    rel = os.path.relpath(d, mount)
    return CgroupLevel(version, "/" if rel == "." else "/" + rel, min(caps), usage,
                       stat.get(v.files[0], 0), stat.get(v.files[1], 0))


def cgroup_levels(*, root: str = "/") -> list[CgroupLevel]:
    """Every capped memory cgroup on this process's path, leaf first: cgroup v2's where any caps, else v1's.

    The one walk of the cgroup tree (see :class:`CgroupLevel`); ``root``
    prefixes every path read.
    """
    v2, v1 = _own_cgroup_paths(root)
    for path, version, name in ((v2, _V2, "v2"), (v1, _V1, "v1")):
        if path is None:
            continue
        mount = os.path.normpath(os.path.join(root, version.mount))
        levels = [lv for d in _candidate_dirs(mount, path) if (lv := _level(mount, d, version, name)) is not None]
        if levels:
            return levels
    return []


def tightest_cgroup(*, root: str = "/") -> CgroupLevel | None:
    """The capped cgroup with the least headroom on this process's path (the leaf-most of equals); None: uncapped."""
    levels = cgroup_levels(root=root)
    return min(levels, key=lambda lv: lv.headroom) if levels else None
