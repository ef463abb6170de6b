"""Writer marks on conversion work folders, and the sweep of the ones dead conversions left.

A conversion is written in ``<root>/.<fingerprint>.XXXXXXXX/`` and renamed
into place when whole (:mod:`.cache`); while it runs that folder holds
``.writer``, a lock file its process holds an ``flock`` on. The kernel drops
the lock when the process dies however it dies (``kill -9``, the OOM killer),
so every load sweeps its root: a work folder whose lock can be taken is a dead
conversion's and is removed; a live one's is left alone (an unmarked one, from a
version before marks, only once nothing in it changed for
:data:`UNMARKED_GRACE_S`). A forked child closes its copies of its parent's
marks (:func:`_forget_held_marks`).
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import shutil
import stat
import time

from .._log import logger

WRITER = ".writer"  # in a work folder: the lock file its live writer holds (flock)
# tempfile.mkdtemp(prefix=".<key>.") names: eight of its characters after the prefix
_WORK = re.compile(r"\.[0-9a-f]{24}\.[a-z0-9_]{8}")
_ASIDE = re.compile(r"\.[0-9a-f]{24}\.old\.[a-z0-9_]{8}")  # a damaged folder moved aside to be removed
UNMARKED_GRACE_S = 3600.0  # a work folder without a writer mark, untouched this long, is a dead one's
_HELD: dict[int, int] = {}  # writer-mark fd -> pid that holds it (a forked child closes its copies)


def _forget_held_marks() -> None:
    # A forked child does not own its parent's conversions: its copies of their locks would keep
    # them marked live after the parent died. (flock: closing one copy keeps the parent's lock.)
    for fd in list(_HELD):
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD.clear()


os.register_at_fork(after_in_child=_forget_held_marks)


def mark_writer(work: str) -> int | None:
    """Mark ``work`` as written by this process: :data:`WRITER`, locked (``flock``) until the
    conversion ends. Created under another name, locked, then renamed: a sweep never sees the
    mark unlocked. None where the file system has no flock (the folder is then unmarked)."""
    tmp = os.path.join(work, WRITER + ".new")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, f"{os.getpid()}\n".encode())  # for a person looking; the lock is what counts
        os.rename(tmp, os.path.join(work, WRITER))
    except OSError as exc:
        os.close(fd)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        logger.debug("conversion folder %s: no writer lock (%s)", work, exc)
        return None
    _HELD[fd] = os.getpid()
    return fd


def release_writer(fd: int | None) -> None:
    if fd is not None and _HELD.get(fd) == os.getpid():
        del _HELD[fd]
        os.close(fd)


def _newest_change(path: str) -> float:
    newest = os.lstat(path).st_mtime
    for entry in os.scandir(path):
        try:
            newest = max(newest, entry.stat(follow_symlinks=False).st_mtime)
        except OSError:
            pass
    return newest


def _unmarked_and_old(path: str) -> bool:
    try:
        return time.time() - _newest_change(path) > UNMARKED_GRACE_S
    except OSError:
        return False


def _writer_gone(path: str) -> bool:
    """True when the conversion writing ``path`` is no longer running."""
    try:
        fd = os.open(os.path.join(path, WRITER), os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:  # unmarked: created this instant (its mark follows) or by an older version
        return _unmarked_and_old(path)
    except OSError as exc:  # ELOOP: a link in its place -- no writer made it
        return exc.errno == errno.ELOOP and _unmarked_and_old(path)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO, a folder: no writer made it either
            return _unmarked_and_old(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # EWOULDBLOCK: its writer holds it (any other error: do not guess)
            return False
        return True
    finally:
        os.close(fd)  # a writer that is gone never comes back for its folder: no need to hold it


def sweep(root: str) -> list[str]:
    """Remove what dead conversions left under ``root`` (their work folders, folders moved aside);
    returns the paths removed. Never raises: an unreadable root or a folder that cannot be removed
    is left as it is."""
    try:
        entries = os.listdir(root)
    except OSError:
        return []
    removed = []
    for name in entries:
        aside = _ASIDE.fullmatch(name)
        if not aside and not _WORK.fullmatch(name):
            continue
        path = os.path.join(root, name)
        try:
            if not stat.S_ISDIR(os.lstat(path).st_mode):
                continue
        except OSError:
            continue
        if aside or _writer_gone(path):
            shutil.rmtree(path, ignore_errors=True)
            if not os.path.lexists(path):
                removed.append(path)
                logger.info("removed %s: an unfinished conversion whose process is gone", path)
    return removed
