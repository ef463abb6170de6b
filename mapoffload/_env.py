"""Numbers read from environment variables, with errors that name the variable."""

from __future__ import annotations

import math
import os


def env_number(name: str) -> float | None:
    """``float(os.environ[name])``; None when unset or blank.

    Raises
    ------
    ValueError
        When the value is not a finite number (the variable is named).
    """
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None
    if not math.isfinite(value):
        raise ValueError(f"{name}={raw!r} must be a finite number")
    return value
