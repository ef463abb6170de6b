"""Numbers read from environment variables, with errors that name the variable
and say what it accepts, in the variable's own unit."""

from __future__ import annotations

import math
import os

__all__ = ["EnvSettingError", "env_number"]


class EnvSettingError(ValueError):
    """An environment variable mapoffload reads holds a value it does not accept.

    ``.name`` is the variable, ``.value`` its raw text.
    """

    def __init__(self, name: str, value: str, accepted: str) -> None:
        super().__init__(f"{name}={value!r} is not accepted: {accepted}")
        self.name = name
        self.value = value


def _plain(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def env_number(
    name: str,
    *,
    low: float,
    high: float,
    unit: str = "",
    integer: bool = False,
    low_inclusive: bool = True,
) -> float | None:
    """``os.environ[name]`` as a number in ``[low, high]``; None when unset or blank.

    Parameters
    ----------
    name
        The variable.
    low, high
        The accepted range, in the variable's unit (``high`` inclusive;
        ``low`` inclusive unless ``low_inclusive`` is False).
    unit
        The unit the variable is read in (``"GiB"``, ``"MiB"``), for the message.
    integer
        Only whole numbers (``"2"``, ``"2.0"``) are accepted.

    Raises
    ------
    EnvSettingError
        A ``ValueError`` naming the variable, its value and the accepted
        range, when the value is not a number, not finite, out of range, or
        (``integer``) not a whole number.
    """
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    kind = "a whole number" if integer else "a number"
    if unit:
        kind += f" of {unit}"
    lower = f"from {_plain(low)}" if low_inclusive else f"above {_plain(low)}"
    accepted = f"expected {kind} {lower} to {_plain(high)}"
    try:
        value = float(raw)
    except ValueError:
        raise EnvSettingError(name, raw, accepted) from None
    if not math.isfinite(value) or value > high or value < low or (value == low and not low_inclusive):
        raise EnvSettingError(name, raw, accepted)
    if integer and not value.is_integer():
        raise EnvSettingError(name, raw, accepted)
    return value
