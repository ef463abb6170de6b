"""Residency index: which tensors live on a file mapping, and how much is in RAM.

Everything here is a thin face over the native core (``csrc/maps.cpp``,
``csrc/residency.cpp``): pointer extraction, classification, ``mincore`` and the
``smaps`` parse run in C++, batched, with the GIL released where possible.

VMA classes
-----------
``file``
    A real file on a disk, network or overlay filesystem: its clean pages are
    page cache the kernel can drop and re-read. A file deleted while mapped
    stays ``file``: its inode and blocks live until the last mapping goes, so
    the kernel can still drop and re-read its pages.
``shmem``
    tmpfs-backed memory that looks like a file: memfd, ``/dev/zero`` shared
    mappings, SysV shared memory, ``/dev/shm`` and any other tmpfs, ramfs or
    hugetlbfs file. These pages cannot be dropped without swap.
``anonymous``
    No backing object: no path, ``[heap]``, ``[stack]``, ``[anon:name]``.
``special``
    ``[vdso]``, ``[vvar]``, ``[vsyscall]``, device files, ``anon_inode:`` mappings.

tmpfs is told from disk by the mount table: the device number of each VMA is
looked up in ``/proc/self/mountinfo`` (the kernel prints the superblock's device
in both files), which is right for tmpfs mounted anywhere and for deleted files;
path rules cover the objects on internal mounts that the table never lists
(``/memfd:``, ``/SYSV…``, ``/dev/zero``). Device numbers alone cannot tell:
overlayfs, btrfs, NFS and FUSE also use the anonymous major 0.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .._log import format_bytes, logger
from .._native import _core

if TYPE_CHECKING:
    import torch

__all__ = [
    "CowMapping",
    "CowReport",
    "MappedRegions",
    "component_residency_bytes",
    "cow_report",
    "drop_page_cache",
    "resident_bytes",
    "tensor_bytes",
    "tensor_extent",
    "tensor_spans",
]

PROC_MAPS = "/proc/self/maps"
PROC_SMAPS = "/proc/self/smaps"
PROC_MOUNTINFO = "/proc/self/mountinfo"


def _tensor_type() -> type:
    import torch

    return torch.Tensor


def _devices_in_use() -> bool:
    """Whether any tensor in this process could have its storage off the CPU.

    Reading ``is_cpu`` costs about a quarter of the extraction. Without an
    initialised accelerator runtime no tensor with storage can be off the CPU
    (meta tensors have a null data pointer; XLA-like tensors have no storage
    and read as not held), so :meth:`MappedRegions.classify` skips the read
    then, without changing any answer.
    """
    import torch

    names = ["cuda", "xpu", "mtia", "hpu", "npu"]
    try:
        names.append(torch._C._get_privateuse1_backend_name())
    except Exception:  # pragma: no cover - older torch
        pass
    for name in names:
        is_init = getattr(getattr(torch, name, None), "is_initialized", None)
        if callable(is_init) and is_init():
            return True
    return False


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes of a tensor's values laid out densely: ``numel() * element_size()`` (torch's ``nbytes``).

    What a copy of it holds (and a load copies), on any device, meta
    included. Not where its bytes lie: the range its strides reach in memory
    is :func:`tensor_extent` (a column view's extent spans its rows, an
    expanded tensor's is one element per stride-0 dimension, a meta tensor's
    is empty). These two are the package's only definitions of a tensor's bytes.
    """
    return tensor.numel() * tensor.element_size()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` hold the same values bit for bit (one dtype and shape): a NaN equals its own
    bits, ``-0.0`` is not ``0.0`` (``torch.equal`` says otherwise of both). Two views of the same bytes are
    not read."""
    import torch

    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.data_ptr() == b.data_ptr() and a.stride() == b.stride():
        return True
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def storage_users(tensor: torch.Tensor) -> int:
    """Tensors sharing ``tensor``'s memory now: torch's use count of its storage, the one made to ask
    included (0 where torch does not tell). A reused buffer a view still holds (a weight kept past its
    layer's forward, a tensor autograd saved) must not be handed out again."""
    import torch

    count = getattr(torch._C, "_storage_Use_Count", None)
    return 0 if count is None else count(tensor.untyped_storage()._cdata)


def tensor_extent(tensor: torch.Tensor) -> tuple[int, int]:
    """``(address, nbytes)`` of the bytes a tensor's strides can reach.

    This is mapoffload's one definition of a tensor's bytes (native:
    ``extract_tensor_spans`` in ``csrc/spans.cpp``), used by classification,
    residency and the copy-on-write report: the address is ``data_ptr()`` and
    ``nbytes = (1 + sum((size - 1) * stride)) * itemsize``. A column view spans
    its rows; a stride-0 (expanded) dimension spans one element, so
    ``torch.zeros(1).expand(2**40)`` is 4 bytes. Empty, meta and non-CPU
    tensors, and tensors without storage, give ``(0, 0)``.

    Raises
    ------
    TypeError
        If ``tensor`` is not a ``torch.Tensor``.
    OverflowError
        If the extent does not fit in 64 bits.
    """
    return _core.tensor_extent(tensor, _tensor_type())


def tensor_spans(tensors: Sequence[torch.Tensor]) -> _core.SpanArray:
    """:func:`tensor_extent` of every tensor, extracted in one native call.

    What is extracted is the sequence as it was when the call began: items
    whose methods change it do not change what is extracted (a list of plain
    tensors is read in place, without a copy, because no Python code can run
    while it is read; from the first item that could run some, the rest of the
    list is held as it was).

    Raises
    ------
    TypeError
        If an item is not a tensor (the message names its index).
    RuntimeError
        If a list read in place changed anyway (Python code run by a hook on a
        warning torch raised from an accessor, or by a finalizer).
    """
    return _core.extract_spans(tensors, _tensor_type())


class MappedRegions:
    """One snapshot of ``/proc/self/maps``, parsed natively into sorted intervals.

    Mappings made after construction are invisible: take a new snapshot after
    loading weights.

    Parameters
    ----------
    maps_path, mountinfo_path
        Where to read the snapshot from (tests point these at fixtures or at a
        missing path). A missing mount table only loses the tmpfs-vs-disk
        refinement; a missing maps file makes the snapshot unavailable.
    files
        Files whose mappings count as file-backed whatever their class: a
        loader's own checkpoint and conversion files. A checkpoint on tmpfs
        (``/dev/shm``) is ``shmem`` by its pages, yet a view of its mapping is
        the checkpoint, not memory someone made (matched by device and inode,
        so a file renamed or deleted since it was mapped still matches).
    """

    def __init__(self, *, maps_path: str = PROC_MAPS, mountinfo_path: str = PROC_MOUNTINFO,
                 files: Iterable[str | os.PathLike] = ()) -> None:
        self._table: _core.MapsTable | None
        try:
            self._table = _core.snapshot(maps_path, mountinfo_path)
        except OSError as exc:
            logger.debug("no maps snapshot (%s): every tensor reads as not mapped", exc)
            self._table = None
        self._files = _file_ids(files)

    @property
    def available(self) -> bool:
        """False where ``/proc`` was unreadable; then every query answers False."""
        return self._table is not None

    @property
    def table(self) -> _core.MapsTable | None:
        """The native interval arrays (``starts``, ``ends``, ``paths``, ``classes``…)."""
        return self._table

    def holds_pointer(self, ptr: int) -> bool:
        """True when the byte at ``ptr`` lies in a ``file`` mapping. 0 -> False."""
        if self._table is None or ptr <= 0:
            return False
        return self._table.holds_pointer(ptr)

    def holds(self, tensor: torch.Tensor) -> bool:
        """True when every byte of the tensor's extent lies in ``file`` mappings.

        The extent is :func:`tensor_extent`: a column view must have all of its
        rows mapped, an expanded view only its one element per stride-0
        dimension. Adjacent VMAs of the same file count as one. Non-CPU, meta
        and empty tensors answer False.
        """
        return self.classify([tensor])[0]

    def classify(self, tensors: Sequence[torch.Tensor]) -> list[bool]:
        """:meth:`holds` for a whole sequence in one native call."""
        if not isinstance(tensors, (list, tuple)):
            tensors = list(tensors)
        if self._table is None:
            tensor_spans(tensors)  # same TypeError as when available
            return [False] * len(tensors)
        held = self._table.classify_tensors(tensors, _tensor_type(), _devices_in_use())
        if self._files and not all(held):
            held = self._of_files(tensor_spans(tensors), held)
        return held

    def classify_spans(self, spans: _core.SpanArray) -> list[bool]:
        """:meth:`holds` for raw spans (``_core.SpanArray``)."""
        if self._table is None:
            return [False] * len(spans)
        held = self._table.holds_spans(spans)
        if self._files and not all(held):
            held = self._of_files(spans, held)
        return held

    def _of_files(self, spans: _core.SpanArray, held: list[bool]) -> list[bool]:
        """``held``, with the spans that lie wholly in mappings of :attr:`_files` (adjacent VMAs
        of one of them, without a gap) held too."""
        t = self._table
        starts, ends, devs, inodes = t.starts, t.ends, t.devs, t.inodes
        out = list(held)
        for i, (addr, size) in enumerate(zip(spans.addrs, spans.sizes)):
            if out[i] or size == 0 or addr == 0:
                continue
            k, at, end = t.find(addr), addr, addr + size
            while 0 <= k < len(starts) and starts[k] <= at and (devs[k], inodes[k]) in self._files:
                at = ends[k]
                if at >= end:
                    out[i] = True
                    break
                k += 1
        return out

    def span_classes(self, tensors: Sequence[torch.Tensor]) -> list[str]:
        """Class of each tensor's extent: ``file``, ``shmem``, ``anonymous``,
        ``special``, ``mixed`` (several classes, or partly unmapped) or
        ``unmapped`` (also for empty, meta and non-CPU tensors)."""
        spans = tensor_spans(tensors)
        if self._table is None:
            return ["unmapped"] * len(spans)
        return self._table.span_classes(spans)

    def mapped_bytes(self, tensors: Sequence[torch.Tensor]) -> int:
        """Total extent bytes (:func:`tensor_extent`) of the tensors held by
        file mappings (no dedup)."""
        spans = tensor_spans(tensors)
        held = self.classify_spans(spans)
        return sum(n for n, h in zip(spans.sizes, held) if h)

    def __len__(self) -> int:
        return 0 if self._table is None else len(self._table)

    def __repr__(self) -> str:
        if self._table is None:
            return "MappedRegions(available=False)"
        classes = self._table.classes
        counts = {c: classes.count(c) for c in sorted(set(classes))}
        return f"MappedRegions({len(classes)} VMAs, {counts})"


def _file_ids(files: Iterable[str | os.PathLike]) -> frozenset[tuple[tuple[int, int], int]]:
    """((major, minor), inode) of each file, as ``/proc/self/maps`` prints them (missing ones left out)."""
    ids = set()
    for f in files:
        try:
            st = os.stat(f)
        except (OSError, ValueError):
            continue
        ids.add(((os.major(st.st_dev), os.minor(st.st_dev)), st.st_ino))
    return frozenset(ids)


def resident_bytes(tensors: Sequence[torch.Tensor]) -> list[int]:
    """Bytes of each tensor's extent on pages resident in RAM now (``mincore``).

    File-backed and anonymous memory alike; non-CPU, meta and empty tensors
    give 0. The extent is :func:`tensor_extent` (an expanded view counts its
    one element, not ``numel`` copies of it).
    """
    return _core.resident_bytes(tensor_spans(tensors))


def drop_page_cache(path: str | os.PathLike) -> None:
    """Drop a file's clean pages from the page cache (``POSIX_FADV_DONTNEED``).

    Needs no root; dirty pages are written first. Pages mapped into a process
    stay: unmap (drop every view) before dropping, to test cold reads.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class CowMapping:
    """One file mapping in ``/proc/self/smaps`` and its anonymous bytes."""

    path: str
    start: int
    end: int
    perms: str
    rss: int
    anonymous: int

    @property
    def size(self) -> int:
        return self.end - self.start


@dataclass
class CowReport:
    """Copy-on-write state of file mappings.

    ``anonymous_bytes`` is how much of them turned anonymous (a write to a
    ``MAP_PRIVATE`` file page copies it). "Nothing was copied" is
    ``report.anonymous_bytes == 0`` or, against an earlier report,
    ``later.anonymous_bytes - earlier.anonymous_bytes == 0``.
    """

    mappings: list[CowMapping] = field(default_factory=list)
    available: bool = True

    @property
    def anonymous_bytes(self) -> int:
        return sum(m.anonymous for m in self.mappings)

    @property
    def mapped_bytes(self) -> int:
        return sum(m.size for m in self.mappings)

    def by_path(self) -> dict[str, int]:
        """Anonymous bytes per file path."""
        out: dict[str, int] = {}
        for m in self.mappings:
            out[m.path] = out.get(m.path, 0) + m.anonymous
        return out

    def __str__(self) -> str:
        files = len({m.path for m in self.mappings})
        return (
            f"{len(self.mappings)} file mappings of {files} files, "
            f"{format_bytes(self.mapped_bytes)} mapped, "
            f"{format_bytes(self.anonymous_bytes)} turned anonymous"
        )


def cow_report(
    tensors: Iterable[torch.Tensor] | None = None,
    *,
    smaps_path: str = PROC_SMAPS,
    mountinfo_path: str = PROC_MOUNTINFO,
) -> CowReport:
    """Anonymous bytes inside each ``file`` mapping, from ``/proc/self/smaps``.

    Parameters
    ----------
    tensors
        When given, only the file mappings that hold some byte of one of
        their extents (:func:`tensor_extent`); otherwise every file mapping of
        the process.

    Paths are ``str`` decoded as :func:`os.fsdecode` does: a file name that
    is not UTF-8 comes back with surrogate escapes (``os.fsencode`` gives the
    bytes back).
    """
    try:
        table = _core.read_smaps(smaps_path, mountinfo_path)
    except OSError as exc:
        logger.debug("no smaps (%s): empty copy-on-write report", exc)
        return CowReport(available=False)
    if tensors is None:
        indices: Iterable[int] = range(len(table))
    else:
        indices = table.touching(tensor_spans(list(tensors)))
    classes, starts, ends = table.classes, table.starts, table.ends
    paths, perms, rss, anon = table.paths, table.perms, table.rss, table.anonymous
    mappings = [
        CowMapping(paths[i], starts[i], ends[i], perms[i], rss[i], anon[i])
        for i in indices
        if classes[i] == "file"
    ]
    return CowReport(mappings)


def component_residency_bytes(module: torch.nn.Module) -> dict[str, int]:
    """Where a module's parameters and buffers live, in bytes.

    Keys: ``vram`` (any non-CPU device), ``host_pinned``, ``host_mapped``
    (CPU storage on a file mapping), ``host`` (other CPU memory). Each storage
    is counted once, whole, however many tensors view it; meta tensors count
    nowhere.
    """
    out = {"vram": 0, "host_pinned": 0, "host_mapped": 0, "host": 0}
    seen: set[tuple[str, int]] = set()
    cpu_addrs: list[int] = []
    cpu_sizes: list[int] = []
    for t in list(module.parameters()) + list(module.buffers()):
        if t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr())
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        if t.device.type != "cpu":
            out["vram"] += storage.nbytes()
        elif storage.is_pinned():
            out["host_pinned"] += storage.nbytes()
        else:
            cpu_addrs.append(storage.data_ptr())
            cpu_sizes.append(storage.nbytes())
    if cpu_addrs:
        held = MappedRegions().classify_spans(_core.SpanArray(cpu_addrs, cpu_sizes))
        for n, h in zip(cpu_sizes, held):
            out["host_mapped" if h else "host"] += n
    return out
