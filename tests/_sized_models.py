"""Static-shape test models for `batch_sizes`: module-level, so worker processes can
build them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

ALLOWED = (1, 2, 4, 8)


class WrongSize(Exception):
    """The model was given a batch size it does not run."""


def check(size: int, allowed: tuple[int, ...] = ALLOWED) -> None:
    if size not in allowed:
        raise WrongSize(f"this engine runs batches of {allowed}, got {size}")


def strict() -> Callable[[list[Any]], list[Any]]:
    """Doubles each item; raises `WrongSize` on a batch size outside `ALLOWED`."""

    def model(items: list[Any]) -> list[Any]:
        check(len(items))
        return [None if item is None else item * 2 for item in items]

    return model
