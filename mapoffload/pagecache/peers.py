"""Other processes of this host that stream from the page cache under the same memory cap.

Local ranks and replicas each run their own coordinator; they agree through
a small folder of records, one file per process, under ``/dev/shm`` (or
``MAPOFFLOAD_PEERS_DIR``): the file bytes each maps (device, inode, byte
range), how many of them are resident, and its streaming window. Nobody
waits for anybody: each process reads the others' latest records when it
plans. A record whose process is gone (or whose pid was reused: the start
time differs) is ignored and removed.

Processes are peers when they share the tightest memory cgroup, the one
the budget plans against (they draw on one cap; uncapped, on the machine:
two ranks of one job on a host without a cap would otherwise each plan the
whole machine's memory) - the record folder is named after it - and a pid
namespace (where a record's pid names its writer). The plan's words say
which: "under this cap", or "on this host (no cgroup cap)".
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field

from ..memory.cgroup import tightest_cgroup
from .._log import logger

__all__ = ["REPLICA_SHARE", "Peer", "PeerLink", "PeerRegistry", "PeerShare", "measure_resident", "overlap_bytes",
           "resident_now", "share_room"]

REPLICA_SHARE = 0.5  # a peer mapping at least this share of our bytes (or of its own) is a replica

ENV_PEERS_DIR = "MAPOFFLOAD_PEERS_DIR"
RECORD_MAX_BYTES = 1 << 20  # a record names a few ranges per file; anything larger is not one


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks (field 22 of ``/proc/PID/stat``); None when gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode("ascii", "replace")
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()[19]


def _cgroup_key(root: str = "/") -> str:
    """The folder's name: the cgroup whose cap the budget plans against, and this process's namespaces.

    That cgroup is the tightest capped one on this process's path
    (:func:`~mapoffload.memory.cgroup.tightest_cgroup`, the one the budget
    reads), not the leaf: processes in sibling cgroups under one capped
    parent draw on one cap and must split it. Uncapped, every process of
    this user draws on the machine: they are all peers. It is read once,
    when the registry is made (a record folder that changed under a running
    plan would lose its peers).

    A record's pid and start time mean something only to processes of the
    same pid namespace (elsewhere the pid is another process, or none, and a
    live peer's record would be removed as stale), and a cgroup's path names
    the same cgroup only within one cgroup namespace (every container with
    its own reads ``0::/``): both namespaces are part of the key.
    """
    level = tightest_cgroup(root=root)
    text = "uncapped" if level is None else f"{level.version}:{level.path}"
    for ns in ("pid", "cgroup"):
        try:
            text += "\n" + os.readlink(f"/proc/self/ns/{ns}")
        except OSError:
            pass
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Peer:
    """Another process's record: what it maps, what of it is resident, its window."""

    pid: int
    ranges: tuple[tuple[int, int, int, int], ...]  # (dev, inode, first, end) of each mapped file range
    mapped_bytes: int
    resident_bytes: int
    window_bytes: int
    paths: tuple[tuple[int, int, str], ...] = ()  # (dev, inode, path) of each file, to measure it here
    buffer_bytes: int = 0  # anonymous uncached buffers holding its streaming window


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


def _count(value) -> int:
    """A byte count or pid from a record: a JSON integer in [0, 2**63) (ValueError otherwise)."""
    if type(value) is not int or not 0 <= value < 1 << 63:
        raise ValueError(f"not a count: {value!r}")
    return value


def _read_record(path: str) -> dict:
    """A record's JSON, read only from a regular file of bounded size (no FIFO, device or link).

    Raises OSError or ValueError for anything else: a FIFO would block the
    plan (and the coordinator's lock) forever, ``/dev/zero`` would be read
    without end.
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > RECORD_MAX_BYTES:
            raise ValueError("not a regular file of a record's size")
        if st.st_uid != os.geteuid():
            raise ValueError("written by another user")
        data = os.read(fd, RECORD_MAX_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > RECORD_MAX_BYTES:
        raise ValueError("larger than a record")
    try:
        rec = json.loads(data)
    except RecursionError:
        raise ValueError("nested too deep") from None
    if not isinstance(rec, dict):
        raise ValueError("not a record")
    return rec


def _peer(rec: dict) -> Peer:
    """A validated record (ValueError, KeyError or TypeError when any field is not what it should be)."""
    pid = _count(rec["pid"])
    ranges = []
    for r in rec["ranges"]:
        if not isinstance(r, list) or len(r) != 4:
            raise ValueError(f"not a range: {r!r}")
        dev, ino, first, end = (_count(x) for x in r)
        if end < first:
            raise ValueError(f"not a range: {r!r}")
        ranges.append((dev, ino, first, end))
    paths = []
    for r in rec.get("paths", []):
        if not isinstance(r, list) or len(r) != 3 or not isinstance(r[2], str):
            raise ValueError(f"not a path entry: {r!r}")
        paths.append((_count(r[0]), _count(r[1]), r[2]))
    return Peer(pid, tuple(ranges), _count(rec["mapped"]), _count(rec["resident"]), _count(rec["window"]),
                tuple(paths), _count(rec.get("buffers", 0)))


def measure_resident(peer: Peer) -> int | None:
    """Bytes of the peer's ranges resident in the page cache now (mincore, measured here).

    Each path is opened without blocking and used only when it is a regular
    file with the record's device and inode (a path is a peer's word, checked
    like the rest of its record). None when any file cannot be measured.
    """
    from .._native import _core

    paths = {(dev, ino): path for dev, ino, path in peer.paths}
    total = 0
    for dev, ino, first, end in peer.ranges:
        path = paths.get((dev, ino))
        if path is None:
            return None
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != (dev, ino) or end > st.st_size:
                return None
            got = _core.fd_range_resident_bytes(fd, first, end)
        finally:
            os.close(fd)
        if got < 0:
            return None
        total += got
    return total


def _private(path: str) -> bool:
    """Whether ``path`` is a directory (not a link) of this user that no other user can write.

    One of this user's that others may write (made by an earlier version
    under a umask of 002) is made ``0o700`` - through the opened directory,
    so that it is the one checked.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            return False
        if st.st_mode & 0o022:
            os.fchmod(fd, 0o700)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


class PeerRegistry:
    """This process's record among its peers', in a folder shared by one cgroup.

    The folder and the per-user folder above it are made ``0o700`` and used
    only while they are directories (not links) of this user, made ``0o700``
    again where others could write them; only this user's records are read:
    ``/dev/shm`` is writable by everyone, and a folder made there beforehand
    by another user (or a link to somewhere else) would let them feed this
    process records, or make it write and remove files where they point.

    ``MAPOFFLOAD_PEERS_DIR`` has ``~`` expanded (a unit file or a quoted
    assignment leaves it to the program, as ``MAPOFFLOAD_CONVERT_DIR``'s).
    """

    def __init__(self, folder: str | None = None, *, root: str = "/") -> None:
        if folder is None:
            env = os.environ.get(ENV_PEERS_DIR) or ""
            base = os.path.expanduser(env)
            if base and not os.path.isabs(base):  # each process would look in its own current folder: no peers
                from .._env import EnvSettingError

                raise EnvSettingError(ENV_PEERS_DIR, env, "an absolute path (or one starting with ~/): a relative "
                                      "one names another folder in each process's current directory, and "
                                      "processes started from different folders would never see each other")
            base = base or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
            top = os.path.join(base, f"mapoffload-peers-{os.getuid()}")
            folder = os.path.join(top, _cgroup_key(root))
            self._levels = (top, folder)
        else:
            self._levels = (folder,)
        self.folder = folder
        self._mine: str | None = None
        self._refused = False
        self._unmade = False

    def _safe(self, make: bool = False) -> bool:
        """Whether the folder (and the per-user one above it) is this user's alone; made first when ``make``."""
        if make:
            try:
                os.makedirs(os.path.dirname(self._levels[0]), exist_ok=True)
                for level in self._levels:
                    try:
                        os.mkdir(level, 0o700)
                    except FileExistsError:
                        pass
            except OSError as e:
                if not self._unmade:  # once: a plan publishes at every change
                    self._unmade = True
                    logger.warning("could not make the page-cache peers' folder %s (%s): other processes under "
                                   "this cap are not planned with; set %s to a folder this user can write",
                                   self.folder, e, ENV_PEERS_DIR)
                return False
        for level in self._levels:
            if not _private(level):
                if not self._refused and os.path.lexists(level):
                    self._refused = True
                    logger.warning("%s is not a folder of this user that only it can write: page-cache records "
                                   "of other processes are not read there, nor this one's written", level)
                return False
        return True

    def _path(self, pid: int) -> str:
        return os.path.join(self.folder, f"{pid}.json")

    def publish(self, ranges, mapped_bytes: int, resident_bytes: int, window_bytes: int,
                paths: dict | None = None, buffers: int = 0) -> None:
        """Write (replace) this process's record. Failures are logged, never raised: peers are an optimisation."""
        pid = os.getpid()
        start = _start_time(pid)
        if start is None:
            return  # /proc unreadable: a record without a start time could never be told from a dead one
        record = {"pid": pid, "start": start, "ranges": [list(r) for r in ranges],
                  "mapped": int(mapped_bytes), "resident": int(resident_bytes), "window": int(window_bytes),
                  "paths": [[dev, ino, path] for (dev, ino), path in sorted((paths or {}).items())],
                  "buffers": int(buffers)}
        if not self._safe(make=True):
            return
        try:
            tmp = self._path(pid) + ".tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            with open(fd, "w") as f:
                json.dump(record, f)
            os.replace(tmp, self._path(pid))
            self._mine = self._path(pid)
        except OSError as e:
            logger.debug("could not publish the page-cache record in %s: %s", self.folder, e)

    def withdraw(self) -> None:
        """Remove this process's record (the last manager closed)."""
        mine, self._mine = self._mine, None
        if mine is not None and mine == self._path(os.getpid()) and self._safe():
            try:
                os.unlink(mine)
            except OSError:
                pass

    def stamp(self) -> tuple:
        """What the other processes' records are now, cheaply: ``(name, inode, size, mtime, writer's
        start time)`` of each (the last None once the writer is gone).

        Every publish replaces a record with a new file (a new inode), so a
        record that changed changes the stamp even where the folder's and the
        file's times are coarse (a tick of a few ms before Linux 6.13); this
        process's own record is left out, so its own publish changes nothing
        (nor its making the folder: no folder reads as an empty one).
        """
        mine = f"{os.getpid()}.json"
        out = []
        try:
            with os.scandir(self.folder) as entries:
                for e in entries:
                    if not e.name.endswith(".json") or e.name == mine:
                        continue
                    try:
                        st = e.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    # And whether its writer still lives: one killed (kill -9, the OOM killer)
                    # leaves its record as it was, and only its pid's start time changes.
                    pid = e.name[:-len(".json")]
                    alive = _start_time(int(pid)) if pid.isdigit() else None
                    out.append((e.name, st.st_ino, st.st_size, st.st_mtime_ns, alive))
        except OSError:
            return ()
        return tuple(sorted(out))

    def peers(self) -> list[Peer]:
        """The live other processes' records (stale ones are removed)."""
        me = os.getpid()
        out: list[Peer] = []
        if not self._safe():
            return out
        try:
            names = os.listdir(self.folder)
        except OSError:
            return out
        for name in names:
            if not name.endswith(".json"):
                continue
            path = os.path.join(self.folder, name)
            try:
                rec = _read_record(path)
                peer = _peer(rec)
                if peer.pid == me:
                    continue
                start = _start_time(peer.pid)
                if start is None or start != rec.get("start"):
                    os.unlink(path)  # gone, or the pid belongs to someone else now
                    continue
                out.append(peer)
            except (OSError, ValueError, KeyError, TypeError) as e:
                logger.debug("ignored page-cache record %s: %s", path, e)
        return out


def resident_now(peer: Peer) -> int:
    """What a peer holds of its ranges now, measured here (mincore); its record's number where it cannot be.

    A record's own number is from when it was written: records are written
    again only when what they map changes, so it goes stale as the peer
    streams.
    """
    found = measure_resident(peer)
    return peer.resident_bytes if found is None else min(found, peer.mapped_bytes)


@dataclass
class PeerShare:
    """This process's page-cache room among its peers: ``replicas`` (pids mapping the same bytes: they
    share the cached set), ``ranks`` (pids mapping other bytes: the room is split with them by mapped
    bytes, ``others`` theirs)."""

    room: int
    replicas: list[int] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    others: int = 0


def share_room(peers: list[Peer], ranges_of: Callable[[], tuple], room: int, mine: int,
               source: str = "cgroup") -> PeerShare:
    """Split ``room`` (measured by the budget's ``source``) with the peers under the same cap.

    ``mine`` is this process's mapped bytes, ``ranges_of()`` its file ranges (read only when there are
    peers). What a rank holds now that the measure counted as "other memory" is added back, then the
    room is split by mapped bytes; replicas take nothing of it. What the measure counted depends on its
    source: a cgroup's counts the rank's cache and its uncached buffers; the machine's available memory
    counts every file's cache as available, so only the rank's buffers (anonymous) were "other"; the
    ``MAPOFFLOAD_HOST_AVAILABLE_GIB`` host counts only this process's own anonymous memory, so nothing
    of the rank's was. (Adding back what was never taken counted a rank's cache twice: two ranks on a
    host with no cap planned more page cache than it had.)
    """
    share = PeerShare(room)
    if not peers or not mine:
        return share
    ranges = ranges_of()
    for p in peers:
        if overlap_bytes(ranges, p.ranges) >= REPLICA_SHARE * min(mine, max(p.mapped_bytes, 1)):
            share.replicas.append(p.pid)
        else:
            share.ranks.append(p.pid)
            if source == "cgroup":
                share.room += resident_now(p) + p.buffer_bytes  # its cache and its uncached buffers
            elif source == "machine":
                share.room += p.buffer_bytes  # its cache was counted available, its buffers used
            share.others += p.mapped_bytes
    if share.others:
        share.room = share.room * mine // (mine + share.others)
    return share


class PeerLink:
    """The page-cache coordinator's side of the peers' folder: the registry (made when first needed, keyed
    on the cgroup ``root()`` names when it is made), the peers' stamp at the last share, and what this
    process published last (published again only when it changed: peers plan again at every change).

    A registry is made only to share or publish, never to withdraw: at interpreter exit, a collected
    manager's callback could not make one.
    """

    def __init__(self, registry: PeerRegistry | None, root: Callable[[], str]) -> None:
        self.made = registry
        self._root = root
        self.stamp: tuple | None = None  # the peers' stamp when the last share read their records
        self.published: tuple | None = None  # (ranges, mapped, window, buffers) of the record published last

    def registry(self) -> PeerRegistry:
        if self.made is None:
            self.made = PeerRegistry(root=self._root())  # keyed on the cgroup the budget reads
        return self.made

    def stamp_now(self) -> tuple:
        """The peers' records' stamp now (our own record is not in it)."""
        return self.registry().stamp()

    def share(self, ranges_of: Callable[[], tuple], room: int, mine: int, source: str = "cgroup") -> PeerShare:
        """This process's room among its peers' (:func:`share_room`, ``source`` the budget's); the stamp
        taken first."""
        # The stamp before the read: a record landing after it (before or after our own publish) changes
        # the stamp again, and the next forward plans with it.
        self.stamp = self.stamp_now()
        return share_room(self.registry().peers(), ranges_of, room, mine, source)

    def publish(self, ranges: tuple, mapped: int, cached: int, window: int, paths_of: Callable[[], dict],
                buffers: int) -> None:
        """Publish this process's record, unless it is the one published last (``paths_of()``: the files'
        paths by identity, read only to publish)."""
        key = (ranges, mapped, window, buffers)
        if key == self.published:
            return  # unchanged: peers need not plan again
        self.registry().publish(ranges, mapped, cached, window, paths_of(), buffers=buffers)
        self.published = key

    def withdraw(self) -> None:
        """Remove this process's record, if one was published (no registry is made for it)."""
        self.published = None
        if self.made is not None:
            self.made.withdraw()
