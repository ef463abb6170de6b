"""Import of the native core, with a clear error where it cannot work."""

from __future__ import annotations

import sys

if not sys.platform.startswith("linux"):
    raise ImportError(
        f"mapoffload supports Linux only (it reads /proc and uses mincore/madvise); "
        f"this is {sys.platform!r}"
    )

try:
    from . import _core
except ImportError as exc:  # pragma: no cover - a broken install
    raise ImportError(
        "mapoffload's native extension (mapoffload._core) is missing: install the package "
        "with `pip install .` rather than importing it from the source folder"
    ) from exc

__all__ = ["_core"]
