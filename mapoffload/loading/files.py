"""A checkpoint's file set: the one definition that the loader, the gate's byte
count (``checkpoint_bytes``) and ``mapoffload inspect`` share.

The rule (DESIGN.md): a ``*.safetensors.index.json`` file stands for the shards
it names; a folder stands for its index's shards when it has an index, else for
its top-level weight files (``.safetensors``, else ``.pt``/``.pth``/``.bin``),
else — a pipeline root — for the same rule applied to each component folder;
any other path stands for itself. Sub-folders of a folder that has its own
checkpoint are never read (``original/consolidated.safetensors`` beside the
shards, say).

Every file in the set is a regular file, checked with ``stat`` before anything
opens it: opening a FIFO blocks until a writer comes, which may be never.
Shards an index names stay inside the index's folder by name (no ``..``, no
absolute path: an index is data, read from wherever it came). A shard that is
a symlink is followed wherever it points, as transformers follows it: a link
is made by whoever can write the folder, as the shards themselves are (the hub
cache's ``snapshots/<rev>/`` files link into ``blobs/``; older hub ``local_dir``
downloads link into the cache). Its target is what is mapped.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import stat
from collections.abc import Iterator
from typing import BinaryIO

from .._checks import user_path

__all__ = [
    "NotLocalError",
    "looks_remote",
    "INDEX_SUFFIX",
    "CheckpointError",
    "checkpoint_bytes",
    "checkpoint_components",
    "checkpoint_files",
    "diffusers_files",
    "vllm_files",
    "open_regular",
    "pretrained_files",
]

INDEX_SUFFIX = ".safetensors.index.json"
SAFETENSORS_SUFFIX = ".safetensors"
TORCH_SUFFIXES = (".pt", ".pth", ".bin")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_HUB_REPO_PREFIXES = ("models--", "datasets--", "spaces--")


class NotLocalError(FileNotFoundError, ValueError):
    """A hub id or URL where mapoffload takes a local path: every entry point (the loaders, the
    ``mapoffload`` command, ``from_pretrained``, the pipelines, ``mapoffload convert``, vLLM's load
    format) refuses one with this one type, saying to download it first. ``.path`` names it. It is a
    ``FileNotFoundError`` (nothing is there) and a ``ValueError`` (a name is not a path)."""

    def __init__(self, path: str, *, what: str, kind: str = "path") -> None:
        url = "://" in path
        how = "download it first and pass its local path" if url else \
            f"download it first, e.g. `hf download {path} --local-dir DIR`, and pass DIR"
        super().__init__(f"{path!r} is not a local {kind} and looks like a {'URL' if url else 'hub id'}: "
                         f"{what} loads local {kind}s only ({how})")
        self.path = path


def looks_remote(path: str) -> bool:
    """``path`` (which does not exist) reads as a hub id (``org/name``) or a URL, not as a local path
    mistyped (absolute, ``./``, ``~``, or under a folder that exists)."""
    return _looks_remote(path)


class CheckpointError(ValueError):
    """A checkpoint file that cannot be read as one (``.path`` names it)."""

    def __init__(self, path: str | os.PathLike, message: str) -> None:
        super().__init__(f"{os.fspath(path)}: {message}")
        self.path = os.fspath(path)


# --- regular files only ------------------------------------------------------------


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a plain file"


def _regular(path: str) -> os.stat_result:
    """``stat`` of ``path`` (symlinks followed), which must be a regular file."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as exc:  # ValueError: an embedded NUL
        raise CheckpointError(path, f"cannot be read ({exc})") from None
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(path, f"is {_kind(st.st_mode)}, not a regular file")
    return st


@contextlib.contextmanager
def open_regular(path: str) -> Iterator[tuple[BinaryIO, os.stat_result]]:
    """Open ``path`` for reading, refusing anything but a regular file.

    ``O_NONBLOCK`` makes the open itself return at once even if the path is
    swapped for a FIFO after a ``stat`` check; ``fstat`` on the open file then
    decides. Yields the binary file and its ``stat``.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as exc:
        raise CheckpointError(path, f"cannot be read ({exc})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(path, f"is {_kind(st.st_mode)}, not a regular file")
        f = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with f:
        yield f, st


# --- indexes ----------------------------------------------------------------------


def _inside(path: str, folder: str) -> bool:
    return os.path.commonpath([path, folder]) == folder


def _hub_blobs(real_folder: str) -> str | None:
    """``<repo>/blobs`` when ``real_folder`` is in a hub cache snapshot
    (``.../models--org--name/snapshots/<rev>[/component]``)."""
    parts = real_folder.split(os.sep)
    for i in range(len(parts) - 2, 0, -1):
        if parts[i] == "snapshots" and parts[i - 1].startswith(_HUB_REPO_PREFIXES):
            return os.sep.join(parts[:i] + ["blobs"])
    return None


def _index_shards(index_path: str) -> list[str]:
    """The shards an index names, in natural order (``-00002-`` before
    ``-00010-``), each named inside the index's folder (see the module
    docstring)."""
    with open_regular(index_path) as (f, _):
        try:
            text = f.read()
        except OSError as exc:
            raise CheckpointError(index_path, f"cannot be read ({exc})") from None
    try:
        doc = json.loads(text)
    except RecursionError:
        raise CheckpointError(index_path, "not a safetensors index: not JSON (nested too deeply)") from None
    except ValueError as exc:  # UnicodeDecodeError included
        raise CheckpointError(index_path, f"not a safetensors index: not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise CheckpointError(index_path, f"not a safetensors index: a JSON {type(doc).__name__}, not an object")
    weight_map = doc.get("weight_map")
    if not isinstance(weight_map, dict):
        what = "no" if weight_map is None else f"a {type(weight_map).__name__} as its"
        raise CheckpointError(index_path, f"not a safetensors index: {what} \"weight_map\" (an object is needed)")
    if not weight_map:
        raise CheckpointError(index_path, "the weight_map names no shard")
    folder = os.path.dirname(os.path.abspath(index_path))
    shards: dict[str, None] = {}
    for key, name in weight_map.items():
        if not isinstance(name, str) or not name or "\0" in name:
            raise CheckpointError(index_path, f"weight_map[{key!r}] = {name!r} is not a shard file name")
        path = os.path.normpath(os.path.join(folder, name))
        if os.path.isabs(name) or not _inside(path, folder):
            raise CheckpointError(index_path, f"weight_map[{key!r}] = {name!r} is outside the checkpoint folder")
        # Named as the caller named the index (relative stays relative).
        shards[os.path.normpath(os.path.join(os.path.dirname(index_path), name))] = None
    return sorted(shards, key=_natural_key)


# --- the rule -----------------------------------------------------------------------


def _looks_local(p: str) -> bool:
    """A path the user meant as a local one: absolute, ``./``/``../``/``~``, or
    one whose parent folder exists (``models/lama`` beside ``models/llama``)."""
    if p.startswith(("/", "./", "../", "~")) or p in (".", ".."):
        return True
    parent = os.path.dirname(p.rstrip("/"))
    return bool(parent) and os.path.isdir(os.path.expanduser(parent))


def _looks_remote(p: str) -> bool:
    return "://" in p or (bool(_HUB_ID.match(p)) and not _looks_local(p))


def _natural_key(path: str) -> list:
    """Sort key that orders ``-2-`` before ``-10-`` (shards as a person counts them)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path)]


CHECKPOINT_SUFFIXES = (SAFETENSORS_SUFFIX, INDEX_SUFFIX, *TORCH_SUFFIXES)


def _own_files(folder: str) -> list[str] | None:
    """A folder's own checkpoint by the rule (index, else top-level weight
    files), unchecked; None when it has none."""
    entries = sorted(os.listdir(folder))
    index = [e for e in entries if e.endswith(INDEX_SUFFIX)]
    if len(index) > 1:
        raise CheckpointError(
            folder, f"holds {len(index)} safetensors indexes ({', '.join(index)}): name the one to load"
        )
    if index:
        return _index_shards(os.path.join(folder, index[0]))
    for suffixes in (SAFETENSORS_SUFFIX, TORCH_SUFFIXES):
        found = sorted((os.path.join(folder, e) for e in entries if e.endswith(suffixes)), key=_natural_key)
        if found:
            return found
    return None


def _components(p: str) -> list[tuple[str, str, list[str]]]:
    """(name, path, files) for each component ``p`` stands for (files unchecked)."""
    if not os.path.isdir(p):
        if not os.path.exists(p):
            if _looks_remote(p):
                raise NotLocalError(p, what="mapoffload")
            try:
                os.stat(p)
            except OSError as exc:  # a link loop (ELOOP), a name too long: said as it is, not "no such file"
                if exc.errno != errno.ENOENT:
                    raise CheckpointError(p, f"cannot be opened: {exc.strerror or exc}") from None
            raise FileNotFoundError(f"no such file or folder: {p}")
        if not p.endswith(CHECKPOINT_SUFFIXES):
            raise CheckpointError(
                p, "is not a checkpoint file (.safetensors, *.safetensors.index.json, .pt, .pth or .bin); "
                "give the file itself or the folder that holds it"
            )
        files = _index_shards(p) if p.endswith(INDEX_SUFFIX) else [p]
        return [(os.path.basename(p), p, files)]
    own = _own_files(p)
    if own is not None:
        return [(os.path.basename(os.path.normpath(p)), p, own)]
    rows = []
    for entry in sorted(os.listdir(p)):
        sub = os.path.join(p, entry)
        if os.path.isdir(sub):
            files = _own_files(sub)
            if files is not None:
                rows.append((entry, sub, files))
    if not rows:
        raise CheckpointError(p, "no .safetensors, .pt or .bin checkpoint in this folder or its component folders")
    return rows


def checkpoint_components(path: str | os.PathLike) -> list[tuple[str, str]]:
    """(component name, path) pairs a checkpoint path stands for (``~`` is the home folder).

    One pair for a file or a folder with its own checkpoint; one per component
    folder (``vae``, ``transformer``, ...) for a pipeline root.

    Raises
    ------
    FileNotFoundError
        For a missing path that looks local (absolute, ``./``, ``../``, ``~``,
        or in a folder that exists).
    ValueError
        For a hub id or URL (only local paths are loaded).
    CheckpointError
        For a folder with no checkpoint in it or in its component folders, or
        a malformed index.
    """
    return [(name, sub) for name, sub, _ in _components(user_path(path))]


def _file_set(p: str) -> list[tuple[str, os.stat_result]]:
    """The files ``p`` stands for, each with its ``stat`` (regular files only)."""
    out = []
    for _, _, files in _components(p):
        for f in files:
            try:
                out.append((f, _regular(f)))
            except FileNotFoundError:
                raise FileNotFoundError(f"{f} is missing (named by the checkpoint {p})") from None
    return out


def checkpoint_files(path: str | os.PathLike) -> list[str]:
    """The files a checkpoint path stands for, in load order (the rule in the
    module docstring); ``load_checkpoint`` reads exactly these. ``~`` in
    ``path`` is the home folder (the files are named with it expanded).

    Raises
    ------
    FileNotFoundError
        For a missing path, or a shard an index names that is missing.
    ValueError
        For a hub id or URL (only local paths are loaded).
    CheckpointError
        For a file that is not a checkpoint by its name (``config.json``),
        a folder with no checkpoint in it, a malformed index, an index
        naming files outside its folder, or a file that is not a regular file
        (a FIFO, a device, a directory).
    """
    return [f for f, _ in _file_set(user_path(path))]


def checkpoint_bytes(path: str | os.PathLike) -> int:
    """On-disk bytes of exactly :func:`checkpoint_files` (sizes only, no data
    read); 0 for a path that does not exist (a hub id, say). ``~`` is the
    home folder.

    Raises
    ------
    CheckpointError, FileNotFoundError
        As :func:`checkpoint_files`, for a path that exists.
    """
    p = user_path(path)
    if not os.path.exists(p):
        return 0
    return sum(st.st_size for _, st in _file_set(p))


def _checked(files: list[str], archive: str) -> list[str]:
    """``files`` (named by ``archive``), each checked a regular file that exists."""
    for f in files:
        try:
            _regular(f)
        except FileNotFoundError:
            raise FileNotFoundError(f"{f} is missing (named by {archive})") from None
    return files


# --- transformers' rule -------------------------------------------------------------

# transformers' own names (its utils/constants: SAFE_WEIGHTS_NAME, ...), in the order it tries them.
_PRETRAINED_NAMES = (
    ("model.safetensors", True), ("model.safetensors.index.json", True),
    ("pytorch_model.bin", False), ("pytorch_model.bin.index.json", False),
)


def _add_variant(name: str, variant: str | None) -> str:
    """``model.safetensors`` with ``variant="fp16"``: ``model.fp16.safetensors`` (transformers'
    ``_add_variant``; an index: ``model.safetensors.index.fp16.json``)."""
    if variant is None:
        return name
    stem, ext = name.rsplit(".", 1)
    return f"{stem}.{variant}.{ext}"


def _pretrained_archive(base: str, variant: str | None, use_safetensors: bool | None,
                        explicit: str | None) -> str:
    """The one weights file (or index) transformers' ``from_pretrained`` picks in the local folder
    ``base`` (its ``_get_resolved_checkpoint_files``, the same in every transformers 5 release):
    the config's ``transformers_weights`` where set, else the first existing regular file of
    ``model.safetensors``, its index, ``pytorch_model.bin``, its index (each with ``variant``), the
    safetensors ones unless ``use_safetensors=False``, the PyTorch ones unless it is True."""
    if explicit is not None:
        path = os.path.normpath(os.path.join(base, explicit))
        if os.path.isabs(explicit) or not _inside(os.path.abspath(path), os.path.abspath(base)):
            raise CheckpointError(base, f"transformers_weights {explicit!r} is outside the model folder")
        return path
    for name, safetensors in _PRETRAINED_NAMES:
        if use_safetensors is (not safetensors):  # False skips safetensors, True skips the rest
            continue
        path = os.path.join(base, _add_variant(name, variant))
        if os.path.isfile(path):  # transformers' own test: a FIFO or a folder of that name is passed over
            return path
    tried = [_add_variant(n, variant) for n, s in _PRETRAINED_NAMES if use_safetensors is not (not s)]
    raise FileNotFoundError(f"no {' or '.join(tried)} in {base} (what transformers' from_pretrained reads"
                            f"{'' if use_safetensors is None else f' with use_safetensors={use_safetensors}'})")


def pretrained_files(folder: str | os.PathLike, *, variant: str | None = None, use_safetensors: bool | None = None,
                     subfolder: str = "", explicit: str | None = None, gguf_file: str | None = None,
                     extra: tuple[str, ...] = (), index: bool = False) -> list[str]:
    """The weight files transformers' own ``from_pretrained(folder, ...)`` reads from a local
    folder, for the same arguments: what a Hugging Face load is keyed on (its conversion's
    fingerprint) and reports.

    Not :func:`checkpoint_files`' rule: transformers takes ``model.safetensors`` over an index
    beside it (a folder saved whole over a sharded save keeps the old index), takes
    ``variant``'s files and, with ``use_safetensors=False``, ``pytorch_model.bin``.

    Parameters
    ----------
    folder
        The local model folder (``~`` expanded).
    variant, use_safetensors, subfolder, gguf_file
        transformers' arguments of the same names.
    explicit
        The config's ``transformers_weights`` (a file or index inside the folder), if any.
    extra
        The config class's ``extra_files`` (weights some models keep beside the checkpoint):
        those that exist are read too.
    index
        The index of a sharded checkpoint too, last: what the load depends on beside the weights
        (transformers takes an ``"auto"`` dtype from its metadata where the config has none).

    Raises
    ------
    FileNotFoundError
        No file transformers would read (the names tried are listed), or a shard its index
        names is missing.
    CheckpointError
        A malformed index, a name outside the folder, or a file that is not a regular file.
    """
    base = os.path.join(user_path(folder), subfolder)
    if gguf_file is not None:  # transformers: the path itself when it is a file, else inside the folder
        archive = gguf_file if os.path.isfile(gguf_file) else os.path.join(base, gguf_file)
        files = [archive]
    else:
        archive = _pretrained_archive(base, variant, use_safetensors, explicit)
        files = _index_shards(archive) if archive.endswith(".index.json") else [archive]
    files += [p for p in (os.path.join(base, name) for name in extra) if os.path.isfile(p) and p not in files]
    if index and archive.endswith(".index.json"):
        files.append(archive)
    return _checked(files, archive)


# --- diffusers' rule ----------------------------------------------------------------

# diffusers' own names (its utils/constants), in the order its ModelMixin.from_pretrained tries them in a
# local folder when use_safetensors and variant are not given: the index first (a sharded save), then the
# single safetensors file, then the PyTorch file.
_DIFFUSERS_NAMES = (
    "diffusion_pytorch_model.safetensors.index.json", "diffusion_pytorch_model.safetensors",
    "diffusion_pytorch_model.bin",
)


def diffusers_files(folder: str | os.PathLike) -> list[str]:
    """The weight files diffusers' own ``ModelMixin.from_pretrained(folder)`` reads from a local
    component folder: what a diffusers component's load is keyed on and reads its stored dtype from.

    Not :func:`checkpoint_files`' rule: a component folder often holds other variants beside the main
    checkpoint (``diffusion_pytorch_model.fp16.safetensors``, ``..._ema.safetensors``), which diffusers
    never reads; counted, they would decide an ``"auto"`` dtype and the conversion's key.

    Raises
    ------
    FileNotFoundError
        No file diffusers would read (the names tried are listed), or a shard its index names is missing.
    CheckpointError
        A malformed index, a shard named outside the folder, or a file that is not a regular file.
    """
    base = user_path(folder)
    for name in _DIFFUSERS_NAMES:
        archive = os.path.join(base, name)
        if os.path.isfile(archive):  # diffusers' own test
            break
    else:
        raise FileNotFoundError(f"no {' or '.join(_DIFFUSERS_NAMES)} in {base} (what diffusers' from_pretrained reads)")
    files = _index_shards(archive) if archive.endswith(INDEX_SUFFIX) else [archive]
    return _checked(files, archive)


# --- vLLM's rule --------------------------------------------------------------------------


VLLM_INDEX = "model.safetensors.index.json"  # the one index vLLM's safetensors loading filters by


def vllm_files(folder: str | os.PathLike) -> list[str]:
    """The weight files vLLM's own safetensors loading reads from a local model folder (its
    ``DefaultModelLoader`` with ``load_format="safetensors"``, which the ``mapoffload`` format loads
    as): the shards ``model.safetensors.index.json`` names where it is there, else every top-level
    ``.safetensors`` file. Another index beside it (Mistral's ``consolidated.safetensors.index.json``)
    and the files only it names are not read; :func:`checkpoint_files`' rule would ask which to load.

    Raises
    ------
    FileNotFoundError
        No ``.safetensors`` file in the folder, or a shard the index names is missing.
    CheckpointError
        A malformed index, a shard named outside the folder, or a file that is not a regular file.
    """
    base = user_path(folder)
    index = os.path.join(base, VLLM_INDEX)
    if os.path.isfile(index):
        return _checked(_index_shards(index), index)
    found = sorted((os.path.join(base, e) for e in os.listdir(base)  # a glob's: hidden files are not matched
                    if e.endswith(SAFETENSORS_SUFFIX) and not e.startswith(".")), key=_natural_key)
    if not found:
        raise FileNotFoundError(f"no .safetensors file in {base} (what vLLM's safetensors loading reads)")
    return _checked(found, base)


def files_bytes(files: list[str]) -> int:
    """On-disk bytes of ``files`` (sizes only, no data read)."""
    return sum(os.stat(f).st_size for f in files)
