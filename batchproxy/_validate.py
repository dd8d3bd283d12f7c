"""Argument checks shared by the constructor and the per-call options.

Each raises `TypeError` for the wrong kind of value and `ValueError` for a value
out of range, naming the argument and showing what it got. Every duration goes
through `duration`, which clamps what it accepts to `MAX_WAIT`: the longest any
wait in the library can be given, so no value accepted here fails later (an
`OverflowError` in a thread's wait, say).
"""

from __future__ import annotations

import math
import numbers
import threading
from typing import TypeVar

__all__ = [
    "MAX_WAIT",
    "choice",
    "count",
    "duration",
    "finite",
    "flag",
    "hashable",
    "name",
    "optional_count",
    "priority",
    "timeout",
]

T = TypeVar("T")

MAX_WAIT = threading.TIMEOUT_MAX
"""The longest duration in seconds (about 292 years on Linux): what `threading`'s
waits accept, and far beyond any deadline that matters. Longer ones are clamped."""


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


def finite(name: str, value: object, *, allow_zero: bool) -> float:
    """A finite number > 0 (or >= 0 with `allow_zero`): a quantity, not a duration."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    try:
        number = float(value)
    except OverflowError:  # an int (or Fraction) beyond any float: not a finite number
        number = -math.inf if value < 0 else math.inf
    if not math.isfinite(number) or number < 0 or (number == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")
    return number


def optional_count(name: str, value: object) -> int | None:
    return None if value is None else count(name, value)


def duration(
    name: str,
    value: object,
    *,
    allow_zero: bool,
    allow_inf: bool = False,
    milliseconds: bool = False,
) -> float:
    """A duration in seconds (given in milliseconds with `milliseconds`): > 0 (or >= 0
    with `allow_zero`), finite unless `allow_inf` (infinity is kept as it is), and at
    most `MAX_WAIT` otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    try:
        number = float(value)
    except OverflowError:  # an int (or Fraction) beyond any float: as good as infinite
        number = -math.inf if value < 0 else math.inf
    if math.isnan(number) or number < 0 or (number == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be {bound}, got {value!r}")
    if number == math.inf:
        if not allow_inf:
            raise ValueError(f"{name} must be finite, got {value!r}")
        return number
    return min(number / 1e3 if milliseconds else number, MAX_WAIT)


def timeout(name: str, value: object) -> float | None:
    """A timeout in seconds: None (no deadline), or > 0; infinity means no deadline."""
    if value is None:
        return None
    seconds = duration(name, value, allow_zero=False, allow_inf=True)
    return None if seconds == math.inf else seconds


def name(value: object) -> str | None:
    """A name: None, or a non-empty str."""
    if value is not None and not isinstance(value, str):
        raise TypeError(f"name must be a str or None, got {type(value).__name__} {value!r}")
    if value == "":
        raise ValueError(f"name must be a non-empty str or None, got {value!r}")
    return value


def priority(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"priority must be an int, got {type(value).__name__} {value!r}")
    return int(value)


def hashable(name: str, value: T) -> T:
    """A value used as a dict key (a tenant, a batch key): it must be hashable."""
    try:
        hash(value)
    except TypeError:
        raise TypeError(
            f"{name} must be hashable (a str, int, tuple, ...), got {type(value).__name__}"
        ) from None
    return value
