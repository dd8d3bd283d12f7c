"""Section 1 of `scaleout.py`: throughput of the GIL-bound model on one thread, in worker
processes and in Ray actors, the sides taking turns.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from types import ModuleType

from typing_extensions import override

from batchproxy import (
    Percentiles,
    ProcessWorkers,
    Proxy,
    simulation,
)
from benchmarks.scaleout import _gil_model
from benchmarks.scaleout._setup import (
    BATCH_SIZE,
    CALLERS,
    WORKERS,
    Config,
    ray_actors,
    start_ray,
)

# -- 1. throughput ---------------------------------------------------------------------------


class OneThread(Proxy[int, int]):
    """The model in the proxy's own process, on one worker thread."""

    def __init__(self) -> None:
        self._busy = _gil_model.gil_bound()
        super().__init__(batch_size=BATCH_SIZE, offload=True, name="one thread")

    @override
    def _inference(self, items: list[int]) -> list[int]:
        return self._busy(items)


@dataclass
class Side:
    """One side of a phase, and what its rounds have added up to."""

    key: str
    label: str
    proxy: Proxy[int, int]
    requests: int = 0
    seconds: float = 0.0
    items: int = 0
    batches: int = 0
    cpu_seconds: float = 0.0  # this process's CPU time over the rounds
    per_round: list[float] = field(default_factory=list)  # requests/s
    latencies: list[float] = field(default_factory=list)

    @property
    def throughput(self) -> float:
        return self.requests / self.seconds


@dataclass(frozen=True)
class ThroughputResult:
    phase: str
    side: str
    label: str
    rounds: int
    requests: int
    seconds: float
    throughput: float  # requests/s over all rounds
    rounds_per_s: list[float]
    vs_thread: float  # throughput / the one-thread side's, same phase
    vs_thread_rounds: list[float]  # round by round
    mean_batch_size: float
    p50_ms: float
    p99_ms: float
    own_cpu_cores: float  # this process's CPU time over the rounds' wall time


async def check(side: Side) -> None:
    """Every caller gets the model's own result for its item."""
    items = list(range(CALLERS))
    results = await asyncio.gather(*(side.proxy.inference(i) for i in items))
    if results != _gil_model.busy(_gil_model.WORK, items):
        raise SystemExit(f"{side.label}: a caller got the wrong result")


async def one_round(side: Side, seconds: float) -> None:
    before = side.proxy.stats
    cpu = time.process_time()
    trace = await simulation.closed_loop(side.proxy.inference, CALLERS, seconds)
    side.cpu_seconds += time.process_time() - cpu
    after = side.proxy.stats
    if trace.failed:
        raise SystemExit(f"{side.label}: {trace.failed} calls failed")
    side.requests += trace.succeeded
    side.seconds += trace.duration
    side.items += after.items - before.items
    side.batches += after.batches - before.batches
    side.per_round.append(trace.throughput)
    side.latencies.extend(trace.latencies)


async def take_turns(phase: str, sides: list[Side], config: Config) -> list[ThroughputResult]:
    """Warm every side, then time them round after round in a rotating order; the
    first side is the one-thread baseline the others are divided by."""
    for side in sides:
        await check(side)
        await simulation.closed_loop(side.proxy.inference, CALLERS, config.warmup_seconds)
    order = list(sides)
    for _ in range(config.rounds):
        for side in order:
            await one_round(side, config.round_seconds)
        order = order[1:] + order[:1]
    baseline = sides[0]
    results = []
    for side in sides:
        latencies = Percentiles.of(side.latencies)
        results.append(
            ThroughputResult(
                phase=phase,
                side=side.key,
                label=side.label,
                rounds=len(side.per_round),
                requests=side.requests,
                seconds=side.seconds,
                throughput=side.throughput,
                rounds_per_s=side.per_round,
                vs_thread=side.throughput / baseline.throughput,
                vs_thread_rounds=[
                    ours / theirs
                    for ours, theirs in zip(side.per_round, baseline.per_round, strict=True)
                ],
                mean_batch_size=side.items / side.batches,
                p50_ms=latencies.p50 * 1e3,
                p99_ms=latencies.p99 * 1e3,
                own_cpu_cores=side.cpu_seconds / side.seconds,
            )
        )
    return results


async def measure_throughput(config: Config, ray: ModuleType | None) -> list[ThroughputResult]:
    results = []
    async with contextlib.AsyncExitStack() as stack:
        thread = await stack.enter_async_context(OneThread())
        processes = ProcessWorkers(_gil_model.gil_bound, WORKERS, name="scaleout")
        async with (
            processes,  # started: each worker has built its model
            Proxy[int, int](offload=processes, batch_size=BATCH_SIZE) as proxy,
        ):
            results += await take_turns(
                "without Ray",
                [
                    Side("thread", "(a) one thread", thread),
                    Side("processes", "(b) 2 processes", proxy),
                ],
                config,
            )
        if ray is None:
            return results
        start_ray(ray)  # before any traffic: it blocks the loop for a few seconds
        actors = ray_actors(_gil_model.gil_bound)
        stack.push_async_callback(actors.aclose)  # closes the actors if start() fails
        await actors.start()
        async with Proxy[int, int](offload=actors, batch_size=BATCH_SIZE) as proxy:
            results += await take_turns(
                "Ray running",
                [
                    Side("thread", "(a) one thread", thread),
                    Side("ray", "(c) 2 Ray actors", proxy),
                ],
                config,
            )
    return results
