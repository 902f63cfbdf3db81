"""The environment variables megatron_ep reads, parsed in one place: a switch is on for 1 / true
/ yes / on (any case) and off for 0 / false / no / off or unset; a number that does not parse
or is out of range is an error naming the variable and its value, never a silent default.
Standard library only (commands read their switches before they load torch)."""

from __future__ import annotations

import os
from typing import Optional

_ON, _OFF = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def flag(name: str) -> bool:
    """Whether the switch `name` is on; ValueError for a value that is neither on nor off."""
    raw = os.environ.get(name, "")
    value = raw.strip().lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise ValueError(f"{name}={raw!r} is not a switch: use 1 or 0 (true/false, yes/no, on/off)")


def _parsed(name: str, convert, what: str):
    """`convert` of the value of `name`; None when it is unset or empty."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        return convert(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not {what}") from None


def integer(name: str, default: Optional[int], minimum: Optional[int] = None) -> Optional[int]:
    """The integer `name` holds (`default` when unset or empty), at least `minimum`."""
    value = _parsed(name, int, "an integer")
    if value is None:
        return default
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}={value} must be at least {minimum}")
    return value


def number(name: str, default: Optional[float], above: Optional[float] = None) -> Optional[float]:
    """The number `name` holds (`default` when unset or empty), greater than `above`."""
    value = _parsed(name, float, "a number")
    if value is None:
        return default
    if above is not None and not value > above:
        raise ValueError(f"{name}={value} must be greater than {above}")
    return value
