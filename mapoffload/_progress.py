"""Progress bars for long host work: tqdm when it is installed, nothing
otherwise. A bar appears only once the work has taken a second (tqdm's
``delay``), so quick loads stay quiet."""

from __future__ import annotations

from typing import Any


class _Quiet:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def byte_bar(total: int, desc: str, *, enabled: bool | None = None, delay: float = 1.0) -> Any:
    """A bar over ``total`` bytes (``update(nbytes)``, ``close()``); ``enabled=False``: none."""
    if enabled is False or total <= 0:
        return _Quiet()
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _Quiet()
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                delay=0 if enabled else delay, leave=False)
