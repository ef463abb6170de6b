"""The conversion cache: tensors transformers *makes* while it loads (experts
stacked into one 3-D parameter, a cast to another dtype, fp8 weights
dequantized where there is no GPU) written once, a bounded batch at a time,
into safetensors files in the runtime layout, and mapped.

A model converted this way holds no anonymous copy of its weights: at most
:data:`PART_BYTES` (plus the largest single conversion) exist in anonymous
memory during the load, so a 90 GB MoE converts on a 32 GB host. The files
are reused by the next load of the same folder and invalidated by any change
of what made them: the fingerprint names the folder they live in, under a root
chosen for the checkpoint (both: :mod:`.naming`).

Layout: ``<root>/<fingerprint>/part-00000.safetensors …`` and
``manifest.json`` (written last, so a folder without it is an unfinished
conversion). A conversion is written in ``<root>/.<fingerprint>.XXXXXXXX/``
and renamed into place when whole; while it runs that folder holds a writer
mark, and every load sweeps its root of the work folders dead conversions
left (:mod:`.marks`).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import stat
import tempfile
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .._checks import user_path
from .._log import format_bytes, logger
from .naming import FORMAT, MANIFEST
from .writer import reserve_safetensors, write_safetensors
from .marks import WRITER, mark_writer, release_writer, sweep
from ..memory.regions import tensor_bytes

if TYPE_CHECKING:
    import torch

PART_BYTES = 256 << 20  # pending converted bytes written out as one part
_PART = re.compile(r"part-\d{5}\.safetensors")


class ConversionWriteError(OSError):
    """Converted weights could not be written (a full disk, a folder that cannot be written):
    ``.path`` is the folder they were going to, ``.bytes_needed`` the bytes the conversion needs
    there (all of them when it failed at the manifest, else at least that many); ``.errno`` is
    the system's. The unfinished files are removed before it is raised."""

    def __init__(self, code: int | None, message: str, *, path: str, bytes_needed: int) -> None:
        super().__init__(errno.EIO if code is None else code, message)
        self.path = path
        self.bytes_needed = bytes_needed


def _umask() -> int:
    """This process's umask, read without changing it (``/proc/self/status``, Linux 4.7+; else
    set and set back)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _make_folder(prefix: str, root: str) -> str:
    """A fresh folder under ``root`` with the mode any folder this user makes gets (``0777`` less
    the umask): ``mkdtemp``'s ``0700`` would keep a conversion in a shared cache folder (or beside
    a shared checkpoint) from every other user, who would then convert again and fail to put
    theirs in place."""
    path = tempfile.mkdtemp(prefix=prefix, dir=root)
    os.chmod(path, 0o777 & ~_umask())
    return path


def _remove_aside(path: str, aside: str) -> None:
    """Move the folder ``path`` into the fresh folder ``aside`` and remove both, or, where it
    cannot be moved (another user's, in a sticky folder), remove ``aside`` and raise."""
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        pass
    except OSError:
        os.rmdir(aside)  # never left behind
        raise
    shutil.rmtree(aside, ignore_errors=True)


def _is_plain_file(path: str) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _stamp(path: str) -> list[int] | None:
    """A part file's size and modification time (ns), as its manifest records them; None where it is gone."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns]


def read_manifest(folder: str) -> Any:
    """The parsed ``manifest.json`` of the conversion folder ``folder`` (unchecked JSON), read as
    the loader reads checkpoint files: a FIFO or a device under its name is refused at once,
    never waited on.

    Raises
    ------
    FileNotFoundError
        No manifest (an unfinished conversion).
    OSError, ValueError, RecursionError
        Not a regular file (``CheckpointError``), unreadable, or not JSON.
    """
    from ..loading.files import open_regular

    with open_regular(os.path.join(folder, MANIFEST)) as (f, _):
        return json.loads(f.read())


@dataclass
class ConversionCache:
    """One conversion folder: parts written so far, what each target consumed."""

    root: str
    key: str
    tensors: dict[str, dict[str, Any]] = field(default_factory=dict)  # target -> {"file", "sources", "bytes"}
    reused: bool = False
    _work: str | None = None
    _parts: int = 0
    _mark: int | None = None  # the writer lock's fd while _work is being written
    _written: int = 0  # bytes of the parts on disk so far
    meta: dict[str, Any] = field(default_factory=dict)  # what a caller stores beside the tensors (the manifest's "meta")
    origin: str | None = None  # the checkpoint folder it was made from (real path): `mapoffload inspect` finds it by that
    _reserved: list[str] = field(default_factory=list)  # parts written through a shared mapping: synced at commit
    _shared: list[tuple[str, Any]] = field(default_factory=list)  # (path, storage): reserved parts' shared mappings, until sealed
    _views: dict[str, Any] | None = None  # a reused conversion's tensors, mapped as it was opened (see mapped())

    def __post_init__(self) -> None:
        # The one place a conversion folder's root is taken (from_pretrained's and the pipelines'
        # cache_dir, `mapoffload convert --cache-dir`, vLLM's): "~/conv" is the home folder's, never
        # a folder named "~" in the current directory.
        self.root = user_path(self.root, "cache_dir")

    @property
    def path(self) -> str:
        """The folder the finished conversion lives in."""
        return os.path.join(self.root, self.key)

    @property
    def bytes(self) -> int:
        """Bytes of converted tensors."""
        return sum(e["bytes"] for e in self.tensors.values())

    @classmethod
    def open(cls, root: str, key: str, origin: str | None = None) -> ConversionCache:
        """The cache for ``key`` under ``root`` (made from the checkpoint folder ``origin``, recorded in
        its manifest): reused when a finished manifest
        matches, otherwise empty (written on :meth:`add`)."""
        cache = cls(root, key, origin=os.path.realpath(origin) if origin is not None else None)
        sweep(cache.root)
        manifest = os.path.join(cache.path, MANIFEST)
        from ..loading.files import CheckpointError
        from ..loading.header import read_safetensors_header

        try:
            data = read_manifest(cache.path)
        except FileNotFoundError:
            return cache
        except (OSError, ValueError, RecursionError) as exc:  # CheckpointError: not a regular file
            logger.warning("conversion cache %s is unreadable (%s): converting again", manifest, exc)
            return cache
        if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("key") != key \
                or not isinstance(data.get("tensors"), dict):
            logger.warning("conversion cache %s is from another version: converting again", manifest)
            return cache
        try:
            files = {e["file"] for e in data["tensors"].values()}
            valid = all(_PART.fullmatch(f) for f in files) and all(
                isinstance(e["sources"], list) and all(isinstance(x, str) for x in e["sources"])
                and type(e["bytes"]) is int and e["bytes"] >= 0 for e in data["tensors"].values())
        except (KeyError, TypeError, AttributeError):
            valid = False
        if not valid:  # only names this module writes: nothing outside the folder is ever opened
            logger.warning("conversion cache %s is malformed: converting again", manifest)
            return cache
        if not all(_is_plain_file(os.path.join(cache.path, f)) for f in files):  # never a link: it writes none
            logger.warning("conversion cache %s lacks some of its files: converting again", cache.path)
            return cache

        try:  # every part whole (its header fits the file) and holding what the manifest names
            stored = {f: set(read_safetensors_header(os.path.join(cache.path, f))) for f in files}
        except (CheckpointError, OSError) as exc:
            logger.warning("conversion cache %s is damaged (%s): converting again", cache.path, exc)
            return cache
        if not all(k in stored[e["file"]] for k, e in data["tensors"].items()):
            logger.warning("conversion cache %s lacks tensors its manifest names: converting again", cache.path)
            return cache
        meta = data.get("meta", {})
        if not isinstance(meta, dict):
            logger.warning("conversion cache %s is malformed: converting again", manifest)
            return cache
        stamps = data.get("parts")
        if not isinstance(stamps, dict) or any(stamps.get(f) != _stamp(os.path.join(cache.path, f)) for f in files):
            # Written since the conversion finished (a stray writer, a hand edit): the bytes of a part are
            # mapped as they are, so a part whose size or modification time moved is not trusted.
            logger.warning("conversion cache %s was changed after it was written (a part's size or modification "
                           "time differs from its manifest's): converting again", cache.path)
            return cache
        cache.tensors = data["tensors"]
        try:  # mapped now: another process's discard() or rewrite of the folder after this can no longer reach
            cache._views = cache._map_parts()  # what is reused (it removed or replaced the parts under mapped())
            replaced = any(stamps.get(f) != _stamp(os.path.join(cache.path, f)) for f in files)
        except (CheckpointError, OSError, KeyError) as exc:
            replaced = exc
        if replaced:  # between the checks above and the mapping: what was mapped may not be what was checked
            logger.warning("conversion cache %s changed as it was opened (%s): converting again", cache.path,
                           replaced if replaced is not True else "another process rewrote it")
            return cls(root, key, origin=cache.origin)
        cache.meta = meta
        cache.reused = True
        return cache

    def discard(self) -> None:
        """Remove this finished conversion: its user found it unusable, and the one written next must
        take its place (:meth:`commit` otherwise keeps a finished folder of the same key). Views
        already mapped from it stay valid."""
        try:
            _remove_aside(self.path, tempfile.mkdtemp(prefix=f".{self.key}.old.", dir=self.root))
        except OSError as exc:
            logger.warning("conversion %s cannot be removed (%s)", self.path, exc)
            return
        self.tensors, self.meta, self.reused, self._views = {}, {}, False, None

    def part_files(self) -> list[str]:
        """The parts this conversion's views are mapped from: those written so far while it is
        being written (in the work folder), else the finished folder's."""
        folder = self._work if self._work is not None else self.path
        if not self.tensors:
            return []
        return [os.path.join(folder, f) for f in sorted({e["file"] for e in self.tensors.values()})]

    def consumed_sources(self) -> set[str]:
        """Checkpoint keys the cached targets were made from."""
        return {s for e in self.tensors.values() for s in e["sources"]}

    def mapped(self) -> dict[str, torch.Tensor]:
        """Every cached target as a view of its mapped file (a reused conversion's: mapped as it was opened)."""
        return dict(self._views) if self._views is not None else self._map_parts()

    def _map_parts(self) -> dict[str, torch.Tensor]:
        from ..loading.read import read_file

        out: dict[str, torch.Tensor] = {}
        by_file: dict[str, list[str]] = {}
        for k, e in self.tensors.items():
            by_file.setdefault(e["file"], []).append(k)
        for name, keys in by_file.items():
            views = read_file(os.path.join(self.path, name))
            out.update({k: views[k] for k in keys})
        return out

    def _begin(self, payload: int) -> None:
        """The work folder, made (and marked as this process's) on the first write."""
        if self._work is not None:
            return
        try:
            os.makedirs(self.root, exist_ok=True)
            self._work = _make_folder(f".{self.key}.", self.root)
            self._mark = mark_writer(self._work)
        except OSError as exc:
            not_a_folder = os.path.lexists(self.root) and not os.path.isdir(self.root)
            raise self._failed(f"creating a conversion folder under {self.root}", exc,
                               self._written + payload, whole=False,
                               why=f"{self.root} is a file, not a folder" if not_a_folder else None) from exc

    def _next_part(self) -> tuple[str, str]:
        name = f"part-{self._parts:05d}.safetensors"
        self._parts += 1
        return name, os.path.join(self._work, name)

    def add(self, tensors: dict[str, torch.Tensor], sources: dict[str, list[str]]) -> dict[str, torch.Tensor]:
        """Write ``tensors`` as one part; returns their mapped views.

        Raises :class:`ConversionWriteError` (the unfinished conversion removed) when it cannot.
        """
        from ..loading.read import read_file

        payload = sum(tensor_bytes(t) for t in tensors.values())
        self._begin(payload)
        name, path = self._next_part()
        try:
            write_safetensors(path, tensors)
            self._written += os.path.getsize(path)
        except OSError as exc:
            raise self._failed(f"writing converted weights ({format_bytes(payload)}) to {path}", exc,
                               self._written + payload, whole=False) from exc
        for k, t in tensors.items():
            self.tensors[k] = {"file": name, "sources": sorted(sources.get(k, ())),
                               "bytes": tensor_bytes(t)}
        views = read_file(path)
        return {k: views[k] for k in tensors}

    def reserve(self, specs: dict[str, tuple[tuple[int, ...], Any]]) -> dict[str, torch.Tensor]:
        """A part laid out for ``specs`` (name -> (shape, dtype)), returned as writable views of a
        shared mapping of it (:func:`reserve_safetensors`): a caller that computes into them
        converts with no anonymous copy at all. Every name counts as converted until
        :meth:`forget` takes it back; the part is synced to disk at :meth:`commit`. Once written,
        :meth:`seal` turns the views private: the caller keeps none of the shared ones.

        Raises :class:`ConversionWriteError` (the unfinished conversion removed) when it cannot.
        """
        import torch

        payload = sum(torch.empty((), dtype=d).element_size() * int(torch.Size(s).numel()) for s, d in specs.values())
        self._begin(payload)
        name, path = self._next_part()
        try:
            views = reserve_safetensors(path, specs)
        except (OSError, RuntimeError) as exc:
            err = exc if isinstance(exc, OSError) else OSError(errno.EIO, str(exc))
            raise self._failed(f"creating {path} for {format_bytes(payload)} of converted weights", err,
                               self._written + payload, whole=False) from exc
        self._reserved.append(path)
        if views:
            self._shared.append((path, next(iter(views.values())).untyped_storage()))
        for k, v in views.items():
            self.tensors[k] = {"file": name, "sources": [], "bytes": tensor_bytes(v)}
        return views

    def seal(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The reserved parts are written: each of ``tensors`` that is a view of one's shared mapping,
        as the same view of a private (copy-on-write) mapping of that part -- what a load reusing the
        conversion maps -- the others unchanged. This cache drops the shared mappings: once the caller
        drops its own views of them too, whatever a process writes into its weights stays in that
        process, never in the conversion folder (an RLHF weight update, any in-place write).

        Raises :class:`ConversionWriteError` (the unfinished conversion removed) when a part cannot be mapped.
        """
        import torch

        private: dict[int, torch.UntypedStorage] = {}
        for path, shared in self._shared:
            try:
                private[shared.data_ptr()] = torch.UntypedStorage.from_file(path, shared=False, nbytes=shared.nbytes())
            except (OSError, RuntimeError) as exc:
                err = exc if isinstance(exc, OSError) else OSError(errno.EIO, str(exc))
                raise self._failed(f"mapping the written part {path} privately", err, self._written,
                                   whole=False) from exc
        self._shared.clear()
        out = {}
        for k, t in tensors.items():
            storage = private.get(t.untyped_storage().data_ptr()) if t.device.type == "cpu" else None
            out[k] = t if storage is None else \
                torch.empty(0, dtype=t.dtype).set_(storage, t.storage_offset(), t.size(), t.stride())
        return out

    def forget(self, names: Any) -> None:
        """Take ``names`` back out of the conversion (they were not converted after all)."""
        for k in names:
            self.tensors.pop(k, None)

    def _sync_reserved(self) -> None:
        for path in self._reserved:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fsync(fd)  # the shared mapping's dirty pages too
                self._written += os.fstat(fd).st_blocks * 512
            finally:
                os.close(fd)
        self._reserved.clear()

    def commit(self) -> None:
        """Finish the conversion: the manifest, then the folder moved into place
        (a concurrent load that finished first keeps its folder; ours goes).

        Raises :class:`ConversionWriteError` (the work folder removed) when either fails.
        """
        if self._work is None:
            return
        needed = self._written
        doing = f"writing the converted weights of {self.key} to disk"
        try:
            self._sync_reserved()
            # Each part's size and modification time, once written: a later load reuses only parts unchanged.
            parts = sorted({e["file"] for e in self.tensors.values()})
            stamps = {f: _stamp(os.path.join(self._work, f)) for f in parts}
            text = json.dumps({"format": FORMAT, "key": self.key, "tensors": self.tensors, "meta": self.meta,
                               "parts": stamps, "origin": self.origin}, indent=1, sort_keys=True).encode()
            needed += len(text)
            doing = f"writing {MANIFEST} of the conversion {self.key}"
            with open(os.path.join(self._work, MANIFEST), "wb") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())  # on disk before the rename publishes it (a crash leaves no empty manifest)
            doing = f"moving the finished conversion into place at {self.path}"
            # The mark (and its lock) stays through the rename: killed before it, the work folder is a dead
            # writer's, swept by the next load (unmarked, a whole copy stayed an hour). Then it goes.
            if self._put_in_place():
                try:
                    os.unlink(os.path.join(self.path, WRITER))
                except FileNotFoundError:
                    pass
        except OSError as exc:
            raise self._failed(doing, exc, needed, whole=True) from exc
        except BaseException:
            self.abandon()
            raise
        self._work = None
        release_writer(self._mark)
        self._mark = None
        logger.info("converted %d tensors (%s) into %s", len(self.tensors), format_bytes(self.bytes), self.path)

    def _put_in_place(self) -> bool:
        """Rename the work folder to :attr:`path`, replacing whatever is there that is not a
        finished conversion of the same key (a damaged folder, a file, a link). Whether ours is the
        folder in place (not: another load's finished one, or one this user cannot replace)."""
        try:
            os.rename(self._work, self.path)
            return True
        except OSError:
            pass
        if type(self).open(self.root, self.key).reused:
            # another load finished the same conversion; our mapped files stay valid until unmapped
            shutil.rmtree(self._work, ignore_errors=True)
            return False
        # A damaged or unfinished folder under our name: replace it (else it is converted forever).
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            st = None
        try:
            if st is not None and stat.S_ISDIR(st.st_mode):
                _remove_aside(self.path, tempfile.mkdtemp(prefix=f".{self.key}.old.", dir=self.root))
            elif st is not None:  # a file or a link (dangling or not) under a conversion's name
                try:
                    os.unlink(self.path)
                except FileNotFoundError:
                    pass
        except PermissionError as exc:  # another user's, in a sticky folder: this load's stays unkept
            logger.warning("the conversion %s cannot replace %s (%s): this load uses it, the next one converts "
                           "again; remove that folder, or pass cache_dir= for a folder of your own", self.key,
                           self.path, exc.strerror or exc)
            shutil.rmtree(self._work, ignore_errors=True)
            return False
        try:
            os.rename(self._work, self.path)
        except OSError:
            if not type(self).open(self.root, self.key).reused:
                raise
            shutil.rmtree(self._work, ignore_errors=True)  # a concurrent load put its own in place meanwhile
            return False
        return True

    def _failed(self, doing: str, exc: OSError, needed: int, *, whole: bool,
                why: str | None = None) -> ConversionWriteError:
        """The error for a failed write, the unfinished conversion removed first."""
        self.abandon()
        amount = f"{needed} bytes" if whole else f"at least {needed} bytes"
        full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
        way = ("free that space, or pass cache_dir= (or set MAPOFFLOAD_CONVERT_DIR) to write elsewhere" if full
               else "pass cache_dir= (or set MAPOFFLOAD_CONVERT_DIR) to write where this process can")
        return ConversionWriteError(
            exc.errno,
            f"{doing}: {why or exc.strerror or exc}; the conversion needs {amount} ({format_bytes(needed)}) in "
            f"{self.root} and left nothing there (its unfinished files are removed): {way}",
            path=self.root, bytes_needed=needed)

    def abandon(self) -> None:
        """Drop an unfinished conversion's files (mapped views stay valid)."""
        self._shared.clear()
        if self._work is not None:
            shutil.rmtree(self._work, ignore_errors=True)  # under its lock: no sweep takes it meanwhile
            self._work = None
        release_writer(self._mark)
        self._mark = None
