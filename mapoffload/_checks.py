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

__all__ = ["check_bool", "check_count", "folder_problem", "parse_device", "user_path"]


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


def parse_device(name: str, value: Any) -> torch.device:
    """``torch.device(value)``, its refusal naming the option.

    Raises
    ------
    TypeError
        Neither a str, an int (a CUDA index) nor a ``torch.device`` (``1.5``, None).
    ValueError
        A string torch does not read as a device (``"gpu"``).
    """
    import torch

    if isinstance(value, torch.device):
        return value
    if isinstance(value, bool) or not isinstance(value, (str, int)):  # an int is a CUDA index, as for torch
        raise TypeError(f"{name} must be a device ('cuda', 'cuda:N' or 'cpu', or a torch.device), not {value!r}")
    try:
        return torch.device(value)
    except (RuntimeError, ValueError):
        raise ValueError(f"{name} must be a device ('cuda', 'cuda:N' or 'cpu'), not {value!r}") from None


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
