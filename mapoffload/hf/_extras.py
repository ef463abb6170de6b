"""Optional dependencies of the Hugging Face integration, imported when called.

``import mapoffload`` never imports transformers or diffusers; the functions
here do, and say which extra to install when one is missing.
"""

from __future__ import annotations

import importlib
from types import ModuleType

# The transformers versions the integration supports, [lowest, first unsupported): the range pyproject.toml
# states and CI runs the suite against (both ends). The load drives transformers' own loader, whose
# internals move between minor versions: outside it, a load is refused rather than possibly wrong.
TRANSFORMERS_RANGE = ((5, 19), (6, 0))
TRANSFORMERS_SPEC = "transformers>=5.19,<6"
# From a clone (mapoffload is installed from its source tree, not an index).
INSTALL_HINT = f'pip install ".[hf]" in the mapoffload source tree, or pip install "{TRANSFORMERS_SPEC}"'
DIFFUSERS_HINT = (
    f'pip install ".[diffusers]" in the mapoffload source tree, or pip install "{TRANSFORMERS_SPEC}" "diffusers>=0.30"'
)


class MissingExtraError(ImportError):
    """An optional dependency of the integration is not installed."""


def require(name: str, what: str) -> ModuleType:
    """Import ``name`` or raise :class:`MissingExtraError` saying how to get it.

    Parameters
    ----------
    name
        The package to import (``"transformers"``, ``"diffusers"``).
    what
        What needs it, for the message (``"mapoffload.from_pretrained"``).
    """
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        raise MissingExtraError(
            f"{what} needs {name}, which is not installed ({exc}). "
            f"Install the extra: {DIFFUSERS_HINT if name == 'diffusers' else INSTALL_HINT}"
        ) from exc
    if name == "transformers":
        _check_transformers_version(what)
    return module


def _check_transformers_version(what: str) -> None:
    """Raise :class:`MissingExtraError` where the installed transformers is outside ``TRANSFORMERS_RANGE``."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("transformers")
    except PackageNotFoundError:  # imported from a source tree: nothing to compare
        return
    numbers = tuple(int(p) for p in found.split("+")[0].split(".")[:2] if p.isdigit())
    low, high = TRANSFORMERS_RANGE
    if len(numbers) == 2 and not low <= numbers < high:
        raise MissingExtraError(
            f"{what} supports {TRANSFORMERS_SPEC}; transformers {found} is installed: {INSTALL_HINT}")
