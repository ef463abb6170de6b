"""ctypes helpers to build mappings Python's mmap module cannot: MAP_FIXED
placement and mprotect splits. Tests unmap what they map."""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
from collections.abc import Iterator

import torch

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

PAGE = mmap.PAGESIZE
MAP_FIXED = 0x10
MAP_FAILED = ctypes.c_void_p(-1).value


def mmap_raw(length: int, prot: int, flags: int, fd: int = -1, offset: int = 0, addr: int = 0) -> int:
    p = _libc.mmap(addr or None, length, prot, flags, fd, offset)
    if p in (None, MAP_FAILED):
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return p


def munmap(addr: int, length: int) -> None:
    _libc.munmap(addr, length)


def mprotect(addr: int, length: int, prot: int) -> None:
    if _libc.mprotect(addr, length, prot) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def tensor_at(addr: int, nbytes: int) -> torch.Tensor:
    """A uint8 tensor viewing raw memory (no copy)."""
    return torch.frombuffer((ctypes.c_char * nbytes).from_address(addr), dtype=torch.uint8)


@contextlib.contextmanager
def file_page_then_anonymous_page(folder) -> Iterator[int]:
    """Two adjacent pages: a file page (bytes 7) then an anonymous one; yields the base address."""
    path = os.path.join(folder, "page.bin")
    with open(path, "wb") as f:
        f.write(b"\7" * PAGE)
    base = mmap_raw(2 * PAGE, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            mmap_raw(PAGE, mmap.PROT_READ, mmap.MAP_PRIVATE | MAP_FIXED, fd, 0, addr=base)
        finally:
            os.close(fd)
        yield base
    finally:
        munmap(base, 2 * PAGE)
