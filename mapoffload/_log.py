"""The library's logger and byte formatting shared by its modules."""

from __future__ import annotations

import logging
import threading

logger = logging.getLogger("mapoffload")

_logged: set[str] = set()
_logged_lock = threading.Lock()


def log_once(line: str) -> None:
    """An info line, once per process (every manager, reader or pool would repeat it)."""
    with _logged_lock:
        if line in _logged:
            return
        _logged.add(line)
    logger.info("%s", line)


def format_bytes(n: float) -> str:
    """``1536`` -> ``'1.50 KiB'``: binary units, two decimals."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
