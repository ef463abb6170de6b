"""Small checkers for what a caller passes: flags, counts, devices and the paths a user types.

Each is used where an option is read (``load_checkpoint``, the offload manager's options, the
conversion folder, the command line), so that a wrong type is refused at the door with a
``TypeError``/``ValueError`` naming the option and the value, never accepted and failing later:
a non-empty string is truthy (``keep_mapping="false"`` would keep the mapping), a float count
(``prefetch_layers=1.5``) fails deep inside as a bare ``TypeError``. A path keeps ``~`` unexpanded
wherever no shell expanded it (a keyword argument, ``--cache-dir=~/x``, a JSON config): it is
expanded here (:func:`user_path`), once, where the path is taken.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["NoCudaDeviceError", "check_bool", "check_count", "check_device", "folder_problem", "user_path"]


def check_bool(name: str, value: Any, *, none: bool = False) -> bool | None:
    """``value`` if it is a bool (or None, where ``none`` allows it); else a ``TypeError``.

    Parameters
    ----------
    name
        The option, for the message.
    none
        None is allowed (it means "decide for me", as ``keep_mapping=None`` asks the gate).

    Raises
    ------
    TypeError
        Anything but True/False (and None where allowed): ``"false"``, ``0``, ``1``.
    """
    if isinstance(value, bool) or (none and value is None):
        return value
    allowed = "True, False or None" if none else "True or False"
    raise TypeError(f"{name} must be {allowed}, not {value!r}")


def check_count(name: str, value: Any, *, minimum: int = 0, none: bool = False) -> int | None:
    """``value`` if it is a whole number (an ``int``, never a ``bool``) of at least ``minimum``.

    Parameters
    ----------
    name
        The option, for the message.
    minimum
        The smallest value accepted.
    none
        None is allowed (a default decided elsewhere).

    Raises
    ------
    TypeError
        Not an int (``1.5``, ``2.0``, ``"2"``, ``True``).
    ValueError
        Less than ``minimum``.
    """
    if none and value is None:
        return None
    what = f"a whole number >= {minimum}" + (" or None" if none else "")
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be {what}, not {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be {what}, not {value!r}")
    return value


class NoCudaDeviceError(RuntimeError, ValueError):
    """CUDA asked for where torch sees no CUDA device (a ``RuntimeError``, as the
    entry points raised it, and a ``ValueError``, as the demo's arguments are)."""


def check_device(device: Any, what: str = "device", *, flag: str | None = None,
                 program: str = "mapoffload") -> torch.device:
    """The one device rule: ``"cuda"``, ``"cuda:N"`` or ``"cpu"``, CUDA only where torch
    sees a device, ``N`` one it sees.

    Parameters
    ----------
    device
        What the caller passed (a ``torch.device`` or its name).
    what
        The keyword it came in as, for the message (``device=``).
    flag
        The command-line flag it came in as (``"--device"``): the messages then
        name the flag as typed, and the fix as a flag.
    program
        What runs there, for the message (``"the demo"``).

    Returns
    -------
    torch.device

    Raises
    ------
    TypeError
        Not a str, an int (a CUDA index) or a ``torch.device`` (``1.5``, None).
    ValueError
        Not a device, or not one mapoffload runs on, a CUDA index torch does not see, or a
        CPU index other than 0 (there is one CPU device).
    NoCudaDeviceError
        CUDA where torch sees none.
    """
    import torch

    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):  # an int: a CUDA index
        raise TypeError(f"{flag} {device!r} is not a device: cuda, cuda:N or cpu" if flag
                        else f"{what} must be 'cuda', 'cuda:N' or 'cpu' (or a torch.device), not {device!r}")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"{flag} {device!r} is not a device: cuda, cuda:N or cpu" if flag
                         else f"{what} must be 'cuda', 'cuda:N' or 'cpu', not {device!r}") from None
    if dev.type not in ("cuda", "cpu"):
        raise ValueError(f"{flag} {device!r}: {program} runs on cuda, cuda:N or cpu" if flag
                         else f"{what} must be 'cuda', 'cuda:N' or 'cpu', not {device!r}")
    if dev.type == "cpu":
        if dev.index not in (None, 0):  # torch takes "cpu:1", yet there is one CPU device
            raise ValueError(f"{flag} {device}: there is one CPU device: cpu" if flag
                             else f"{what}={device!r}: there is one CPU device, 'cpu' (or 'cpu:0')")
        return dev
    said = f"{flag} {device}:" if flag else f"{what}={device!r}, but"
    if not torch.cuda.is_available():
        build = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        fix = f"run with {flag} cpu" if flag else f"pass {what}='cpu'"
        raise NoCudaDeviceError(f"{said} torch sees no CUDA device (torch {torch.__version__}, {build}); {fix}")
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise ValueError(f"{said} torch sees {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    return dev


def user_path(value: Any, name: str = "path") -> str:
    """A path as a user typed it, as a ``str`` with ``~`` (and ``~user``) expanded.

    The shell expands ``~`` only at the start of a word: a keyword argument, ``--cache-dir=~/x``
    or a value in a JSON config keeps it, and ``os.makedirs`` would make a folder named ``~``
    in the current directory.

    Raises
    ------
    TypeError
        Not a path (``str``, ``bytes`` or ``os.PathLike``).
    """
    try:
        path = os.fspath(value)
    except TypeError:
        raise TypeError(f"{name} must be a path (str or os.PathLike), not {value!r}") from None
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    return os.path.expanduser(path)


def folder_problem(path: str) -> str | None:
    """What stops ``path`` from being (or being made as) a folder, or None when nothing does.

    ``path`` itself existing as anything but a folder (a file, a FIFO, a link to one), or an
    existing parent on the way to it that is not a folder: ``os.makedirs`` would fail with
    ``FileExistsError`` or ``NotADirectoryError``. Whether it can be written is left to the
    writer (permissions can change before it writes).
    """
    current = os.path.abspath(path)
    first = True
    while True:
        if os.path.lexists(current):
            if os.path.isdir(current):
                return None
            what = "a file" if os.path.isfile(current) else ("a broken link" if os.path.islink(current)
                                                             else "not a folder")
            if first:
                return f"{current} is {what}, not a folder"
            return f"{current} is {what}, not a folder, so no folder can be made under it"
        parent = os.path.dirname(current)
        if parent == current:
            return None
        current, first = parent, False


def check_cache_dir(value: Any) -> str | None:
    """A conversion folder's root as given (``cache_dir=``, ``--cache-dir``, vLLM's
    ``model_loader_extra_config['cache_dir']``): None, or a path with ``~`` expanded. Refused before
    anything loads: an empty one (a load that converts failed at its end, "creating a conversion folder
    under : ..."), and one that cannot be a folder (a file, or under one: :func:`folder_problem`; a load
    that converts failed after the whole model was read). The one check every entry point makes.

    Raises
    ------
    TypeError
        Not a path.
    ValueError
        Empty, or not a folder nor one that can be made.
    """
    if value is None:
        return None
    path = user_path(value, "cache_dir")
    if not path:
        raise ValueError("cache_dir is empty (''): name a folder, or leave it out for the default")
    problem = folder_problem(path)
    if problem is not None:
        raise ValueError(f"cache_dir={path!r} cannot hold the conversion folders: {problem}; name a folder "
                         "(it is made if missing)")
    return path
