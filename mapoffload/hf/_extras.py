"""Optional dependencies of the Hugging Face integration, imported when called.

``import mapoffload`` never imports transformers or diffusers; the functions
here do, and say which extra to install when one is missing.
"""

from __future__ import annotations

import importlib
from types import ModuleType

# From a clone (mapoffload is installed from its source tree, not an index).
INSTALL_HINT = 'pip install ".[hf]" in the mapoffload source tree, or pip install "transformers>=5"'
DIFFUSERS_HINT = (
    'pip install ".[diffusers]" in the mapoffload source tree, or pip install "transformers>=5" "diffusers>=0.30"'
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
        return importlib.import_module(name)
    except ImportError as exc:
        raise MissingExtraError(
            f"{what} needs {name}, which is not installed ({exc}). "
            f"Install the extra: {DIFFUSERS_HINT if name == 'diffusers' else INSTALL_HINT}"
        ) from exc
