"""Sections 3 and 4 of `scheduling.py`, on the real clock: CPU per request under load,
and a lone request on an idle proxy.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from batchproxy import Percentiles
from benchmarks.overhead.overhead import CALLERS, Identity, cpu_per_request, direct, identity
from benchmarks.scheduling._setup import (
    CPU_BATCH,
    IDLE_DELAY_MS,
    IDLE_QUIET_S,
    NO_WINDOW,
    Config,
    MinimalBatcher,
    Tally,
)

# -- 3. CPU per request ------------------------------------------------------------------

Call = Callable[[int], Coroutine[Any, Any, Any]]


@dataclass(frozen=True)
class CpuResult:
    side: str
    us: float  # median over repetitions, CPU microseconds per request
    reps_us: list[float]
    mean_batch_size: float | None


WORDS = ["x" * (1 + i % 32) for i in range(CALLERS)]  # lengths 1..32 for length=len


def featured_proxy() -> Identity:
    proxy = Identity(
        batch_size=CPU_BATCH,
        window="adaptive",
        aging_ms=50,
        shed_late=True,
        length=len,
        max_batch_tokens=CPU_BATCH * 32,  # never binding: the batch size still limits
    )
    proxy.add_listener(Tally())
    return proxy


async def measure_cpu(config: Config) -> list[CpuResult]:
    async with (
        MinimalBatcher(identity, CPU_BATCH, IDLE_DELAY_MS) as minimal,
        MinimalBatcher(identity, CPU_BATCH, 0.0) as bare,
        Identity(batch_size=CPU_BATCH) as defaults,
        featured_proxy() as featured,
    ):
        sides: dict[str, tuple[Call, list[Any]]] = {
            "direct await": (direct, list(range(CALLERS))),
            "minimal batcher": (minimal.inference, list(range(CALLERS))),
            NO_WINDOW: (bare.inference, list(range(CALLERS))),
            "batchproxy, defaults": (defaults.inference, list(range(CALLERS))),
            "batchproxy, every feature": (
                lambda i: featured.inference(WORDS[i], timeout=30.0, priority=i % 3),
                WORDS,
            ),
        }
        for call, _ in sides.values():
            await cpu_per_request(call, config.cpu_warmup_rounds)
        reps: dict[str, list[float]] = {side: [] for side in sides}
        order = list(sides)
        for _ in range(config.cpu_repetitions):
            for side in order:  # rotated each repetition: drift favours no side
                call, expected = sides[side]
                us, results = await cpu_per_request(call, config.cpu_rounds)
                if results != expected:
                    raise SystemExit(f"{side}: a caller got the wrong result")
                reps[side].append(us)
            order = order[1:] + order[:1]
        batches = {
            "batchproxy, defaults": defaults.stats.mean_batch_size,
            "batchproxy, every feature": featured.stats.mean_batch_size,
        }
    return [
        CpuResult(side, statistics.median(us), us, batches.get(side)) for side, us in reps.items()
    ]


# -- 4. idle lone request ------------------------------------------------------------------


@dataclass(frozen=True)
class IdleResult:
    side: str
    quiet_ms: float
    samples: int
    added_p50_ms: float
    added_p99_ms: float
    direct_p50_ms: float


async def paired(call: Call, item: int, first: bool) -> tuple[float, float]:
    """Seconds for `call(item)` and for a direct await, in either order."""
    timer = time.perf_counter
    if first:
        t0 = timer()
        await call(item)
        t1 = timer()
        await direct(item)
        t2 = timer()
        return t1 - t0, t2 - t1
    t0 = timer()
    await direct(item)
    t1 = timer()
    await call(item)
    t2 = timer()
    return t2 - t1, t1 - t0


async def measure_idle(config: Config) -> list[IdleResult]:
    async with (
        Identity(batch_size=CPU_BATCH, max_delay_ms=IDLE_DELAY_MS) as proxy,
        MinimalBatcher(identity, CPU_BATCH, IDLE_DELAY_MS) as minimal,
        MinimalBatcher(identity, CPU_BATCH, 0.0) as bare,
    ):
        sides: dict[str, Call] = {
            "batchproxy": proxy.inference,
            "minimal batcher": minimal.inference,
            NO_WINDOW: bare.inference,
        }
        results = []
        for quiet in IDLE_QUIET_S:
            times: dict[str, list[tuple[float, float]]] = {side: [] for side in sides}
            for i in range(config.idle_warmup + config.idle_samples):
                for side, call in sides.items():
                    await asyncio.sleep(quiet)
                    pair = await paired(call, i, first=i % 2 == 0)
                    if i >= config.idle_warmup:
                        times[side].append(pair)
            for side, pairs in times.items():
                added = Percentiles.of([(batched - alone) * 1e3 for batched, alone in pairs])
                results.append(
                    IdleResult(
                        side=side,
                        quiet_ms=quiet * 1e3,
                        samples=len(pairs),
                        added_p50_ms=added.p50,
                        added_p99_ms=added.p99,
                        direct_p50_ms=Percentiles.of([alone * 1e3 for _, alone in pairs]).p50,
                    )
                )
    return results
