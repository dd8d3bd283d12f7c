"""Argument checks shared by the constructor and the per-call options.

Each raises `TypeError` for the wrong kind of value and `ValueError` for a value
out of range, naming the argument and showing what it got.
"""

from __future__ import annotations

import math
import numbers

__all__ = ["choice", "count", "duration", "flag", "optional_count", "priority", "timeout"]


def count(name: str, value: object, *, minimum: int = 1) -> int:
    """A whole number >= `minimum` (bool is refused: `True` is not a batch size)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    return int(value)


def flag(name: str, value: object) -> bool:
    """A bool, strictly (1 and "yes" are refused)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def choice(name: str, value: object, options: tuple[str, ...]) -> str:
    """One of the strings in `options`."""
    if not isinstance(value, str) or value not in options:
        wanted = " or ".join(f'"{option}"' for option in options)
        raise ValueError(f"{name} must be {wanted}, got {value!r}")
    return value


def optional_count(name: str, value: object) -> int | None:
    return None if value is None else count(name, value)


def duration(name: str, value: object, *, allow_zero: bool, allow_inf: bool = False) -> float:
    """Seconds or milliseconds as a float: > 0 (or >= 0 with `allow_zero`), finite unless
    `allow_inf`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    try:
        number = float(value)
    except OverflowError:  # an int (or Fraction) beyond any float: as good as infinite
        number = -math.inf if value < 0 else math.inf
    if math.isnan(number) or number < 0 or (number == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be {bound}, got {value!r}")
    if number == math.inf and not allow_inf:
        raise ValueError(f"{name} must be finite, got {value!r}")
    return number


def timeout(name: str, value: object) -> float | None:
    """A timeout in seconds: None (no deadline), or > 0; infinity means no deadline."""
    if value is None:
        return None
    seconds = duration(name, value, allow_zero=False, allow_inf=True)
    return None if seconds == math.inf else seconds


def priority(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"priority must be an int, got {type(value).__name__} {value!r}")
    return int(value)
