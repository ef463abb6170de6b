"""The files behind a manager's mappings, held open by inode.

A checkpoint's path can come to name another file while the old one stays
mapped: a downloader writes a new file and renames it over the path. The
mapping still holds the old inode, whole and readable; the path tells
nothing about it. So the manager opens each file it computes from once, at
the moment it first maps its spans, checks that the descriptor is the inode
``/proc/self/maps`` shows for the mapping (device and inode number), and from
then on asks the descriptor: ``fstat`` for its size (a truncation of *that*
inode is what would be a SIGBUS) and ``posix_fadvise`` to drop its pages.
"""

from __future__ import annotations

import os
import threading

from .._log import logger

__all__ = ["MappedFile", "MappedFiles"]


class MappedFile:
    """One open descriptor on the inode a mapping holds.

    Parameters
    ----------
    path
        The path ``/proc/self/maps`` names for the mapping (for messages).
    fd
        A read-only descriptor on the same inode.
    """

    __slots__ = ("path", "fd", "verified")

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self.fd = fd
        self.verified = False  # the descriptor is known to be the mapped inode

    def size(self) -> int:
        """The inode's size now (``fstat``)."""
        return os.fstat(self.fd).st_size

    def drop(self, first: int, end: int) -> None:
        """``POSIX_FADV_DONTNEED`` over ``[first, end)``: drop the clean pages nobody maps.

        When the kernel meets a page it cannot drop there (one still mapped,
        or one still waiting in a CPU's LRU-add batch), it drains every CPU's
        batch (mm/fadvise.c ``lru_add_drain_all``), so that a following
        ``MADV_PAGEOUT`` can take pages it could not isolate before.
        """
        if end > first:
            os.posix_fadvise(self.fd, first, end - first, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


class MappedFiles:
    """The open files of one manager, by ``(device, inode)``; closed together."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._files: dict[tuple[int, int, int], MappedFile | None] = {}

    def get(self, path: str, dev: tuple[int, int], inode: int) -> MappedFile | None:
        """The open file behind a mapping of ``path``; None when it cannot be opened.

        The descriptor is the mapped inode when ``/proc/self/maps`` shows the
        same device and inode number for the mapping. Where they differ the
        path was either replaced since it was mapped, or it lies on a stacked
        file system (overlayfs maps the file beneath, under another device and
        inode): the two cannot be told apart from here, so the descriptor is
        kept all the same (``verified`` False) and a debug line says so.
        """
        key = (dev[0], dev[1], inode)
        with self._lock:
            if key in self._files:
                return self._files[key]
            f = None
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
            except OSError as exc:
                logger.info("%s cannot be opened (%s): its mapped bytes are not checked for truncation", path, exc)
            else:
                st = os.fstat(fd)
                f = MappedFile(path, fd)
                f.verified = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino) == key
                if not f.verified:
                    logger.debug("%s: the open file is not the inode /proc/self/maps shows (%s); replaced, or a "
                                 "stacked file system", path, key)
            self._files[key] = f
            return f

    def held(self) -> int:
        """Files looked up and not closed (those that could not be opened included)."""
        with self._lock:
            return len(self._files)

    def close(self) -> None:
        with self._lock:
            files, self._files = list(self._files.values()), {}
        for f in files:
            if f is not None:
                f.close()
