"""Pad values: which number pads each leaf of a batch, and whether it fits the leaf's
dtype (a mistake said when a batch is collated, naming the key, not a silent cast)."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from ._items import _is_tensor, _Path


def pad_value_for(pad_value: float | int | Mapping[str, float | int], path: _Path) -> Any:
    """The number that pads the leaf at `path`: `pad_value` itself, or its entry for the
    leaf's dict key (0 for a key it lacks). A mapping is for dict items alone."""
    return pad_value.get(str(path[0]), 0) if isinstance(pad_value, Mapping) else pad_value


def check_pad_value(value: object, leaf: Any, path: _Path) -> None:
    """A pad value must be a number that the leaf's dtype holds exactly (integer dtypes),
    or within its range (floating dtypes; NaN and infinities are fine)."""
    where = f" for key {path[0]!r}" if path and isinstance(path[0], str) else ""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number, np.bool_)):
        raise TypeError(f"pad_value{where} must be a number, got {type(value).__name__} {value!r}")
    kind: Any = type(value)  # (a key of the cache below: 1, 1.0 and True differ)
    problem = _pad_value_problem(kind, value, _is_tensor(leaf), leaf.dtype)
    if problem is not None:
        raise ValueError(f"pad_value{where} {value!r} {problem}")


@functools.lru_cache(maxsize=256)  # one answer per (number, dtype): asked once per batch
def _pad_value_problem(kind: type, value: Any, tensor: bool, dtype: Any) -> str | None:
    """Why the number `value` (of type `kind`: 1, 1.0 and True are not one key) does not
    fit `dtype` (a torch dtype if `tensor`, else a NumPy one), or None if it does."""
    name = str(dtype).removeprefix("torch.")
    largest: float | None = None  # a floating dtype's largest finite value
    if tensor:
        if dtype.is_complex:
            return None
        import torch

        if dtype.is_floating_point:
            largest = float(torch.finfo(dtype).max)
    elif np.issubdtype(dtype, np.complexfloating):
        return None
    elif np.issubdtype(dtype, np.floating):
        largest = float(np.finfo(dtype).max)
    if largest is not None:
        try:
            number = float(value)
            fits = not math.isfinite(number) or abs(number) <= largest
        except OverflowError:  # an int beyond any float
            fits = False
        return None if fits else f"does not fit dtype {name}"
    if tensor:
        try:
            held: object = torch.tensor(value, dtype=dtype).item()
        except (RuntimeError, OverflowError, ValueError, TypeError):
            held = None
    else:
        try:
            with np.errstate(invalid="ignore", over="ignore"):  # NaN, inf: refused below
                held = np.asarray(value).astype(dtype).item()
        except (OverflowError, ValueError, TypeError):
            held = None
    if held is None or held != value:
        return f"does not fit dtype {name} exactly"
    return None
