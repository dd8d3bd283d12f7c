"""The benchmarks' closed-loop driver over a fixed workload, on the real clock.

`drain(call, items, clients)`: `clients` clients share `items`; each takes the
next one, awaits `call(item)`, and takes another as soon as answered, until none
is left. For load that runs for a time instead of over a list, the benchmarks
use the library's own `batchproxy.simulation.closed_loop`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar, cast

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class Drained(Generic[R]):
    """What the clients saw, per item in the order of `items`."""

    seconds: float  # from the first call to the last answer
    results: list[R]
    latencies: list[float]  # seconds from each item's call to its answer


async def drain(call: Callable[[T], Awaitable[R]], items: Sequence[T], clients: int) -> Drained[R]:
    """`clients` clients (at most one per item) work through `items`, one call at a time
    each: every item is called once, the next as soon as a client is answered."""
    results: list[R | None] = [None] * len(items)
    latencies = [0.0] * len(items)
    pending = iter(range(len(items)))  # shared: each client takes the next index

    async def client() -> None:
        for index in pending:
            started = time.perf_counter()
            results[index] = await call(items[index])
            latencies[index] = time.perf_counter() - started

    began = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(min(clients, len(items)))))
    return Drained(time.perf_counter() - began, cast("list[R]", results), latencies)
