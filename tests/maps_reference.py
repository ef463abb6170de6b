"""Pure-Python reference of the native maps parser and span classification,
used by the property tests. Deliberately simple, slow and obvious."""

from __future__ import annotations

import bisect
from dataclasses import dataclass


@dataclass
class Vma:
    start: int
    end: int
    perms: str
    offset: int
    dev: tuple[int, int]
    inode: int
    path: str
    cls: str = "anonymous"


def parse(text: str) -> list[Vma]:
    out: list[Vma] = []
    for lineno, line in enumerate(text.split("\n"), 1):
        if not line:
            continue
        addr, perms, offset, dev, rest = line.split(" ", 4)
        rest = rest.lstrip(" ")
        inode, _, path = rest.partition(" ")
        start, end = (int(x, 16) for x in addr.split("-"))
        major, minor = (int(x, 16) for x in dev.split(":"))
        if end <= start or major >= 1 << 32 or minor >= 1 << 32:
            raise ValueError(f"line {lineno}: not a VMA the kernel prints")
        if out and (start < out[-1].start or start < out[-1].end):
            raise ValueError(f"line {lineno}: unsorted or overlapping")
        out.append(Vma(start, end, perms, int(offset, 16), (major, minor), int(inode), path.strip(" ")))
    for v in out:
        v.cls = classify(v.path, v.inode, v.dev, {})
    return out


def classify(path: str, inode: int, dev: tuple[int, int], fs: dict) -> str:
    if not path:
        return "anonymous" if inode == 0 else "special"
    if path.startswith("["):
        if path.startswith("[anon_shmem:"):
            return "shmem"
        if path == "[heap]" or path.startswith("[stack") or path.startswith("[anon:"):
            return "anonymous"
        return "special"
    if not path.startswith("/"):
        return "special"
    for prefix in ("/memfd:", "/SYSV", "/dev/zero", "/anon_hugepage", "/dev/shm/"):
        if path.startswith(prefix):
            return "shmem"
    if dev in fs:
        t = fs[dev]
        if t in ("tmpfs", "ramfs", "hugetlbfs", "shm"):
            return "shmem"
        if t in ("devtmpfs", "proc", "sysfs", "debugfs"):
            return "special"
        return "file"
    return "special" if path.startswith("/dev/") else "file"


def holds_span(vmas: list[Vma], addr: int, nbytes: int) -> bool:
    """Every byte in file VMAs, crossing only between adjacent VMAs of one file."""
    if addr == 0 or nbytes == 0:
        return False
    stop = addr + nbytes
    starts = [v.start for v in vmas]
    i = bisect.bisect_right(starts, addr) - 1
    if i < 0 or addr >= vmas[i].end or vmas[i].cls != "file":
        return False
    while vmas[i].end < stop:
        nxt = i + 1
        if nxt >= len(vmas):
            return False
        a, b = vmas[i], vmas[nxt]
        if b.cls != "file" or b.start != a.end or b.dev != a.dev or b.inode != a.inode or b.path != a.path:
            return False
        i = nxt
    return True


def span_class(vmas: list[Vma], addr: int, nbytes: int) -> str:
    if addr == 0 or nbytes == 0:
        return "unmapped"
    stop = addr + nbytes
    covered = 0
    classes = set()
    for v in vmas:
        lo, hi = max(v.start, addr), min(v.end, stop)
        if lo < hi:
            covered += hi - lo
            classes.add(v.cls)
    if not classes:
        return "unmapped"
    if len(classes) > 1 or covered < nbytes:
        return "mixed"
    return classes.pop()
