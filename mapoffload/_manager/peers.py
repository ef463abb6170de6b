"""Other processes of this host that stream from the page cache under the same memory cap.

Local ranks and replicas each run their own coordinator; they agree through
a small folder of records, one file per process, under ``/dev/shm`` (or
``MAPOFFLOAD_PEERS_DIR``): the file bytes each maps (device, inode, byte
range), how many of them are resident, and its streaming window. Nobody
waits for anybody: each process reads the others' latest records when it
plans. A record whose process is gone (or whose pid was reused: the start
time differs) is ignored and removed.

Processes are peers when they share the tightest memory cgroup (they draw
on one cap) - the record folder is named after it.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass

from .._log import logger

__all__ = ["Peer", "PeerRegistry", "overlap_bytes"]

ENV_PEERS_DIR = "MAPOFFLOAD_PEERS_DIR"


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks (field 22 of ``/proc/PID/stat``); None when gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode("ascii", "replace")
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()[19]


def _cgroup_key() -> str:
    try:
        with open("/proc/self/cgroup") as f:
            text = f.read()
    except OSError:
        text = ""
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Peer:
    """Another process's record: what it maps, what of it is resident, its window."""

    pid: int
    ranges: tuple[tuple[int, int, int, int], ...]  # (dev, inode, first, end) of each mapped file range
    mapped_bytes: int
    resident_bytes: int
    window_bytes: int


def overlap_bytes(a: tuple[tuple[int, int, int, int], ...], b: tuple[tuple[int, int, int, int], ...]) -> int:
    """Bytes of the same files that both range lists cover."""
    by_file: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for dev, ino, first, end in b:
        by_file.setdefault((dev, ino), []).append((first, end))
    total = 0
    for dev, ino, first, end in a:
        for f2, e2 in by_file.get((dev, ino), ()):
            total += max(0, min(end, e2) - max(first, f2))
    return total


class PeerRegistry:
    """This process's record among its peers', in a folder shared by one cgroup."""

    def __init__(self, folder: str | None = None) -> None:
        if folder is None:
            base = os.environ.get(ENV_PEERS_DIR) or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
            folder = os.path.join(base, f"mapoffload-peers-{os.getuid()}", _cgroup_key())
        self.folder = folder
        self._mine: str | None = None

    def _path(self, pid: int) -> str:
        return os.path.join(self.folder, f"{pid}.json")

    def publish(self, ranges, mapped_bytes: int, resident_bytes: int, window_bytes: int) -> None:
        """Write (replace) this process's record. Failures are logged, never raised: peers are an optimisation."""
        pid = os.getpid()
        record = {"pid": pid, "start": _start_time(pid), "ranges": [list(r) for r in ranges],
                  "mapped": int(mapped_bytes), "resident": int(resident_bytes), "window": int(window_bytes)}
        try:
            os.makedirs(self.folder, mode=0o700, exist_ok=True)
            tmp = self._path(pid) + ".tmp"
            with open(tmp, "w") as f:
                json.dump(record, f)
            os.replace(tmp, self._path(pid))
            self._mine = self._path(pid)
        except OSError as e:
            logger.debug("could not publish the page-cache record in %s: %s", self.folder, e)

    def withdraw(self) -> None:
        """Remove this process's record (the last manager closed)."""
        mine, self._mine = self._mine, None
        if mine is not None and mine == self._path(os.getpid()):
            try:
                os.unlink(mine)
            except OSError:
                pass

    def peers(self) -> list[Peer]:
        """The live other processes' records (stale ones are removed)."""
        me = os.getpid()
        out: list[Peer] = []
        try:
            names = os.listdir(self.folder)
        except OSError:
            return out
        for name in names:
            if not name.endswith(".json"):
                continue
            path = os.path.join(self.folder, name)
            try:
                with open(path) as f:
                    rec = json.load(f)
                pid = int(rec["pid"])
                if pid == me:
                    continue
                if _start_time(pid) != rec.get("start"):
                    os.unlink(path)  # gone, or the pid belongs to someone else now
                    continue
                ranges = tuple(tuple(int(x) for x in r) for r in rec["ranges"])
                out.append(Peer(pid, ranges, int(rec["mapped"]), int(rec["resident"]), int(rec["window"])))
            except (OSError, ValueError, KeyError, TypeError) as e:
                logger.debug("ignored page-cache record %s: %s", path, e)
        return out
