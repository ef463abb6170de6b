"""Import of the native core, with a clear error where it cannot work."""

from __future__ import annotations

import sys

if not sys.platform.startswith("linux"):
    raise ImportError(
        f"mapoffload supports Linux only (it reads /proc and uses mincore/madvise); "
        f"this is {sys.platform!r}"
    )



def _missing_core_message(here: str | None = None) -> str:
    """Why ``_core`` is missing from the package folder ``here`` (this one by default), and what to
    do: most often the source folder shadows the installed package (Python run from the repository
    root puts the current directory first on ``sys.path``)."""
    import os

    here = here or os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    if os.path.exists(os.path.join(root, "pyproject.toml")) and os.path.isdir(os.path.join(root, "csrc")):
        return (
            f"mapoffload's native extension (mapoffload._core) is missing: Python imported the source folder "
            f"{here}, not the installed package. Python was started in the repository root, so the current "
            f"directory comes first on sys.path and its mapoffload/ folder shadows what `pip install .` installed. "
            f"Run it from another directory (e.g. `cd tests` or `cd ..`), use the `pytest` or `mapoffload` scripts "
            f"(they do not put the current directory on sys.path), or install in place: "
            f"`pip install --no-build-isolation -e .`"
        )
    return f"mapoffload's native extension (mapoffload._core) is missing from {here}: reinstall with `pip install .`"


try:
    from . import _core
except ImportError as exc:  # pragma: no cover - a broken install
    raise ImportError(_missing_core_message()) from exc

__all__ = ["_core"]
