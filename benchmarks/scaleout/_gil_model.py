"""The models `benchmarks/scaleout/scaleout.py` runs in worker processes and Ray actors.

In a module of their own, not in the script: a spawned worker process unpickles a
factory by importing its module by name (the parent's `sys.path` goes with it),
and the script itself runs as `__main__`. Ray pickles this module by value.
Factories are module-level functions (with `functools.partial` for parameters),
so they pickle; each returns the model: a plain `def` that takes one batch.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

WORK = 20_000  # loop iterations per item: about 1 ms of pure Python on the machine measured


def busy(work: int, items: list[int]) -> list[int]:
    """Pure-Python integer arithmetic per item, holding the GIL the whole time."""
    results = []
    for item in items:
        total = 0
        for i in range(work):
            total += (i * item) % 7
        results.append(total)
    return results


def gil_bound(work: int = WORK) -> Callable[[list[int]], list[int]]:
    """Factory: the GIL-bound model, `work` loop iterations per item."""
    return functools.partial(busy, work)


def spin(work: int, seconds: float) -> tuple[int, float]:
    """The model one item at a time, back to back, for `seconds`, in a bare process:
    (items done, seconds taken). Sets the machine's ceiling, without batchproxy."""
    done = 0
    started = time.perf_counter()
    while (elapsed := time.perf_counter() - started) < seconds:
        busy(work, [done % 64])
        done += 1
    return done, elapsed


def echo(items: list[Any]) -> list[Any]:
    """Every item is its own result."""
    return items


def identity() -> Callable[[list[Any]], list[Any]]:
    """Factory: the identity model, so a round trip measures dispatch alone."""
    return echo
