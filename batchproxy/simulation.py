"""Try a batching policy against synthetic traffic on a virtual clock.

A simulation runs the real proxy, unchanged, on an event loop whose clock jumps
straight to the next timer instead of sleeping: a minute of traffic against a
model that "takes" 10 ms per batch runs in the CPU time of the proxy alone, and
the same seed gives the same numbers every time. The tests prove the scheduling
claims with it, and `benchmarks/scheduling/scheduling.py` sweeps policies with it.

    from batchproxy import batch, simulation

    async def main() -> simulation.Trace:
        model = simulation.simulated_model(lambda n: 0.010 + 0.0002 * n)
        proxy = batch(batch_size=32)(model)
        return await simulation.open_loop(proxy, simulation.poisson(rate=500, duration=10))

    trace = simulation.run(main())
    print(trace.throughput, trace.latency(0.99))

Only the clock is virtual: a model that really computes, or runs on a worker
thread, costs its real time and none of the virtual one. Simulate models with
`simulated_model` (an `asyncio.sleep` of the batch's cost).
"""

from __future__ import annotations

import asyncio
import math
import random
import selectors
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from ._stats import nearest_rank

__all__ = [
    "Trace",
    "VirtualClockLoop",
    "bursts",
    "closed_loop",
    "on_off",
    "open_loop",
    "poisson",
    "run",
    "simulated_model",
]

T = TypeVar("T")
Call = Callable[[Any], Awaitable[Any]]


class _ClockAdvancingSelector(selectors.DefaultSelector):
    """Polls without blocking; when nothing is ready, moves the loop's clock forward
    by the timeout the loop asked to sleep for (to its next timer)."""

    def __init__(self, loop: VirtualClockLoop) -> None:
        super().__init__()
        self._loop = loop

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = super().select(0)
        if ready:
            return ready
        if timeout is None:  # no timer at all: only another thread can wake the loop
            return super().select(None)
        self._loop.advance(timeout)
        return []


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose `time()` is virtual: it stands still while callbacks run
    and jumps to the next timer when the loop would otherwise sleep."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start
        super().__init__(_ClockAdvancingSelector(self))

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        self._now += max(0.0, seconds)


def run(main: Coroutine[Any, Any, T], *, start: float = 0.0) -> T:
    """Run `main` to completion on a fresh `VirtualClockLoop`, like `asyncio.run`."""
    loop = VirtualClockLoop(start)
    try:
        return loop.run_until_complete(main)
    finally:
        try:
            leftovers = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for task in leftovers:
                task.cancel()
            if leftovers:
                loop.run_until_complete(asyncio.gather(*leftovers, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()


# -- models --------------------------------------------------------------------------------


def simulated_model(
    cost: Callable[[int], float], *, serial: bool = True
) -> Callable[[list[T]], Coroutine[Any, Any, list[T]]]:
    """An async batch function that takes `cost(len(items))` seconds and returns its
    items. `serial=True` models one accelerator: batches run one after another even
    when the proxy lets several be in flight (later ones wait their turn)."""
    lock = asyncio.Lock() if serial else None

    async def model(items: list[T]) -> list[T]:
        if lock is None:
            await asyncio.sleep(cost(len(items)))
        else:
            async with lock:
                await asyncio.sleep(cost(len(items)))
        return items

    return model


# -- arrival processes ----------------------------------------------------------------------


def poisson(rate: float, duration: float, *, seed: int = 0) -> list[float]:
    """Arrival times (seconds from 0) of a Poisson process of `rate` per second."""
    _positive("rate", rate)
    rng = random.Random(seed)
    times: list[float] = []
    at = rng.expovariate(rate)
    while at < duration:
        times.append(at)
        at += rng.expovariate(rate)
    return times


def bursts(
    size: int, every: float, duration: float, *, spread: float = 0.0, seed: int = 0
) -> list[float]:
    """`size` arrivals every `every` seconds, each burst spread uniformly over
    `spread` seconds (0: all at once)."""
    _positive("every", every)
    rng = random.Random(seed)
    times: list[float] = []
    start = 0.0
    while start < duration:
        times.extend(sorted(start + rng.uniform(0.0, spread) for _ in range(size)))
        start += every
    return times


def on_off(rate: float, on: float, off: float, duration: float, *, seed: int = 0) -> list[float]:
    """Poisson arrivals at `rate` for `on` seconds, then an idle gap of `off` seconds,
    repeated: traffic that keeps going quiet."""
    _positive("on", on)
    times: list[float] = []
    start, period = 0.0, 0
    while start < duration:
        burst = poisson(rate, min(on, duration - start), seed=seed * 1_000_003 + period)
        times.extend(start + t for t in burst)
        start += on + off
        period += 1
    return times


def _positive(name: str, value: float) -> None:
    if not value > 0 or math.isinf(value):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


# -- traffic drivers ------------------------------------------------------------------------


@dataclass(frozen=True)
class Trace:
    """What the callers saw: one latency per successful call, seconds of (virtual) time."""

    issued: int
    succeeded: int
    failed: int
    """Calls that raised (any exception, `DeadlineExceeded` included)."""
    duration: float
    """From the first arrival to the last answer (closed loop: the run's length)."""
    latencies: Sequence[float]

    @property
    def throughput(self) -> float:
        """Successful calls per second."""
        return self.succeeded / self.duration if self.duration > 0 else 0.0

    def latency(self, quantile: float) -> float:
        """Nearest-rank latency percentile over the successful calls (0.0 when none)."""
        return nearest_rank(sorted(self.latencies), quantile) if self.latencies else 0.0


class _Tally:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.latencies: list[float] = []
        self.issued = self.failed = 0
        self.first = math.inf
        self.last = -math.inf

    async def call(self, call: Call, item: object, due: float = math.inf) -> None:
        # a call is timed from when it was due, if the loop got to it late: on a real
        # clock, a loop that something held (a GIL-bound model thread, a slow step)
        # starts the overdue arrivals together, and timing them from their start would
        # leave out the very wait a client would see (coordinated omission)
        started = min(self.loop.time(), due)
        self.first = min(self.first, started)
        self.issued += 1
        try:
            await call(item)
        except Exception:
            self.failed += 1
        else:
            self.latencies.append(self.loop.time() - started)
        self.last = self.loop.time()

    def trace(self, duration: float) -> Trace:
        return Trace(self.issued, len(self.latencies), self.failed, duration, self.latencies)


async def open_loop(call: Call, arrivals: Sequence[float]) -> Trace:
    """Open loop: call `call(i)` at each arrival time (seconds from now), whether or
    not earlier calls have been answered; wait for every answer. Each call's latency
    counts from its arrival time, even where the loop started it late."""
    loop = asyncio.get_running_loop()
    tally = _Tally(loop)
    tasks: list[asyncio.Task[None]] = []
    origin = loop.time()
    for index, at in enumerate(arrivals):
        delay = origin + at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(loop.create_task(tally.call(call, index, origin + at)))
    await asyncio.gather(*tasks)
    return tally.trace(tally.last - tally.first if tasks else 0.0)


async def closed_loop(call: Call, callers: int, duration: float) -> Trace:
    """Closed loop: `callers` callers each call again as soon as answered, until
    `duration` seconds have passed; the trace runs until the last answer."""
    loop = asyncio.get_running_loop()
    tally = _Tally(loop)
    start = loop.time()
    end = start + duration

    async def caller(who: int) -> None:
        while loop.time() < end:
            await tally.call(call, who)

    await asyncio.gather(*(caller(who) for who in range(callers)))
    return tally.trace(tally.last - start)
