"""Section 2 of `scaleout.py`: what each executor costs per batch (an identity model's
round trip) and per megabyte (arrays each way).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from batchproxy import (
    Executor,
    Percentiles,
    ProcessWorkers,
    WorkerThread,
)
from batchproxy._executors.base import LoopExecutor, ModelFn
from benchmarks.overhead.overhead import identity
from benchmarks.scaleout import _gil_model
from benchmarks.scaleout._setup import (
    BATCH_SIZE,
    DISPATCH_ITEMS,
    PAYLOAD_ARRAYS,
    PAYLOAD_FLOATS,
    PAYLOAD_MB,
    WORKERS,
    Config,
    ray_actors,
)

# -- 2. dispatch cost per batch -------------------------------------------------------------


@dataclass(frozen=True)
class DispatchResult:
    executor: str
    batches: int
    p50_us: float
    p99_us: float
    added_p50_us: float  # over the direct await's p50
    per_item_us: float  # p50 / batch size


@dataclass(frozen=True)
class PayloadResult:
    executor: str
    mb_each_way: float
    round_trips: int
    p50_ms: float
    min_ms: float
    mb_per_s: float  # both ways (2 x mb_each_way) over the median round trip


async def round_trip(executor: Executor, fn: ModelFn, items: list[Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    results = await executor.run(fn, items)
    return time.perf_counter() - started, results


async def measure_dispatch(
    sides: dict[str, tuple[Executor, ModelFn]], config: Config
) -> list[DispatchResult]:
    times: dict[str, list[float]] = {name: [] for name in sides}
    order = list(sides)
    for index in range(config.dispatch_warmup + config.dispatch_batches):
        for name in order:
            executor, fn = sides[name]
            seconds, results = await round_trip(executor, fn, DISPATCH_ITEMS)
            if results != DISPATCH_ITEMS:
                raise SystemExit(f"{name}: the batch came back changed")
            if index >= config.dispatch_warmup:
                times[name].append(seconds)
        order = order[1:] + order[:1]
    baseline = Percentiles.of(next(iter(times.values()))).p50
    results = []
    for name, samples in times.items():
        percentiles = Percentiles.of(samples)
        results.append(
            DispatchResult(
                executor=name,
                batches=len(samples),
                p50_us=percentiles.p50 * 1e6,
                p99_us=percentiles.p99 * 1e6,
                added_p50_us=(percentiles.p50 - baseline) * 1e6,
                per_item_us=percentiles.p50 / BATCH_SIZE * 1e6,
            )
        )
    return results


async def measure_payload(name: str, executor: Executor, config: Config) -> PayloadResult:
    arrays = [np.full(PAYLOAD_FLOATS, i, dtype=np.float32) for i in range(PAYLOAD_ARRAYS)]
    times = []
    for index in range(1 + config.payload_round_trips):  # the first one warms up
        seconds, results = await round_trip(executor, _gil_model.echo, arrays)
        if index == 0 and not (
            len(results) == len(arrays)
            and all(np.array_equal(a, b) for a, b in zip(results, arrays, strict=True))
        ):
            raise SystemExit(f"{name}: the arrays came back changed")
        if index:
            times.append(seconds)
    median = statistics.median(times)
    return PayloadResult(
        executor=name,
        mb_each_way=PAYLOAD_MB,
        round_trips=len(times),
        p50_ms=median * 1e3,
        min_ms=min(times) * 1e3,
        mb_per_s=2 * PAYLOAD_MB / median,
    )


async def measure_overheads(
    config: Config, ray: ModuleType | None
) -> tuple[list[DispatchResult], list[PayloadResult]]:
    async with contextlib.AsyncExitStack() as stack:
        thread = await stack.enter_async_context(WorkerThread(name="scaleout-dispatch"))
        processes = await stack.enter_async_context(
            ProcessWorkers(_gil_model.identity, WORKERS, name="scaleout-identity")
        )
        sides: dict[str, tuple[Executor, ModelFn]] = {
            "direct await (baseline)": (LoopExecutor(), identity),
            "WorkerThread": (thread, _gil_model.echo),
            f"ProcessWorkers({WORKERS})": (processes, _gil_model.echo),
        }
        if ray is not None:
            actors = ray_actors(_gil_model.identity)
            stack.push_async_callback(actors.aclose)
            await actors.start()
            sides[f"RayActors({WORKERS})"] = (actors, _gil_model.echo)
        dispatch = await measure_dispatch(sides, config)
        payload = [
            await measure_payload(name, executor, config)
            for name, (executor, _) in sides.items()
            if name.startswith(("ProcessWorkers", "RayActors"))
        ]
    return dispatch, payload
