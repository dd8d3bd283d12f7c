"""Sections 1 and 2 of `scheduling.py`, on the virtual clock: the policy sweep under
open-loop Poisson arrivals, and the closed loop (with its real-clock run beside it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from batchproxy import Batched, batch, simulation
from benchmarks.scheduling._setup import (
    ADAPTIVE_DELAYS_MS,
    CLOSED_BATCH,
    CLOSED_CALLERS,
    DEFAULT_DELAY_MS,
    FIXED_DELAYS_MS,
    SWEEP_BATCH,
    SWEEP_LOADS,
    TARGET_THROUGHPUT_VS_BEST,
    TIE,
    Config,
    cost,
)

# -- 1. policy sweep on the virtual clock -------------------------------------------------


@dataclass(frozen=True)
class Setup:
    key: str
    label: str
    slots: int
    serial: bool
    devices: int  # capacity multiplier

    @property
    def capacity(self) -> float:
        return self.devices * SWEEP_BATCH / cost(SWEEP_BATCH)


SETUPS = (
    Setup("one_slot", "(a) one batch slot", slots=1, serial=True, devices=1),
    Setup("two_replicas", "(b) two slots, two parallel replicas", slots=2, serial=False, devices=2),
    Setup("two_slots_serial", "(c) two slots, one serial device", slots=2, serial=True, devices=1),
)


@dataclass(frozen=True)
class Policy:
    window: Literal["adaptive", "fixed"]
    max_delay_ms: float

    @property
    def label(self) -> str:
        return f"{self.window} {self.max_delay_ms:g} ms"


POLICIES = (
    *(Policy("fixed", delay) for delay in FIXED_DELAYS_MS),
    *(Policy("adaptive", delay) for delay in ADAPTIVE_DELAYS_MS),
)
DEFAULT_POLICY = Policy("adaptive", DEFAULT_DELAY_MS)


@dataclass(frozen=True)
class PolicyResult:
    policy: str
    window: str
    max_delay_ms: float
    requests: int
    throughput_ratio: float  # of the offered rate
    p50_ms: float
    p99_ms: float
    mean_batch_size: float


@dataclass(frozen=True)
class LoadResult:
    load: float  # share of capacity
    offered_rate: float  # requests/s, as drawn
    policies: list[PolicyResult]
    best_fixed: str
    adaptive_throughput_vs_best: float
    adaptive_p99_vs_best: float  # adaptive p99 / best fixed p99

    @property
    def throughput_met(self) -> bool:
        return self.adaptive_throughput_vs_best >= TARGET_THROUGHPUT_VS_BEST

    @property
    def p99_met(self) -> bool:
        return self.adaptive_p99_vs_best <= 1.0

    def row(self, label: str) -> PolicyResult:
        return next(r for r in self.policies if r.policy == label)


def simulate_open(setup: Setup, policy: Policy, arrivals: list[float]) -> PolicyResult:
    async def main() -> tuple[simulation.Trace, float]:
        model = simulation.simulated_model(cost, serial=setup.serial)
        batched: Batched[Any, Any] = batch(
            batch_size=SWEEP_BATCH,
            max_concurrent_batches=setup.slots,
            window=policy.window,
            max_delay_ms=policy.max_delay_ms,
        )(model)
        try:
            trace = await simulation.open_loop(batched, arrivals)
            return trace, batched.stats.mean_batch_size
        finally:
            await batched.aclose()

    trace, mean_batch = simulation.run(main())
    offered = len(arrivals) / (arrivals[-1] - arrivals[0])
    return PolicyResult(
        policy=policy.label,
        window=policy.window,
        max_delay_ms=policy.max_delay_ms,
        requests=trace.succeeded,
        throughput_ratio=trace.throughput / offered,
        p50_ms=trace.latency(0.50) * 1e3,
        p99_ms=trace.latency(0.99) * 1e3,
        mean_batch_size=mean_batch,
    )


def best_fixed(results: Sequence[PolicyResult]) -> PolicyResult:
    """Highest throughput; within 0.1 % of it, the lowest p99."""
    fixed = [r for r in results if r.window == "fixed"]
    top = max(r.throughput_ratio for r in fixed)
    tied = [r for r in fixed if r.throughput_ratio >= top * (1 - TIE)]
    return min(tied, key=lambda r: r.p99_ms)


def sweep_load(setup: Setup, load: float, seconds: float, seed: int) -> LoadResult:
    arrivals = simulation.poisson(load * setup.capacity, seconds, seed=seed)
    results = [simulate_open(setup, policy, arrivals) for policy in POLICIES]
    best = best_fixed(results)
    adaptive = next(r for r in results if r.policy == DEFAULT_POLICY.label)
    return LoadResult(
        load=load,
        offered_rate=len(arrivals) / (arrivals[-1] - arrivals[0]),
        policies=results,
        best_fixed=best.policy,
        adaptive_throughput_vs_best=adaptive.throughput_ratio / best.throughput_ratio,
        adaptive_p99_vs_best=adaptive.p99_ms / best.p99_ms,
    )


def sweep(config: Config) -> dict[str, list[LoadResult]]:
    return {
        setup.key: [
            sweep_load(setup, load, config.sweep_seconds, seed=seed)
            for seed, load in enumerate(SWEEP_LOADS)
        ]
        for setup in SETUPS
    }


# -- 2. closed loop ------------------------------------------------------------------------


@dataclass(frozen=True)
class ClosedResult:
    clock: str
    seconds: float
    requests: int
    throughput: float
    ideal: float
    share: float
    model_busy: float  # share of the run the model was running
    mean_batch_size: float
    p50_ms: float
    p99_ms: float


async def closed_loop(seconds: float, clock: str) -> ClosedResult:
    loop = asyncio.get_running_loop()
    model = simulation.simulated_model(cost)
    busy = 0.0  # seconds the model ran, as the loop's clock saw it (sleeps overshoot)

    async def timed(items: list[Any]) -> list[Any]:
        nonlocal busy
        started = loop.time()
        try:
            return await model(items)
        finally:
            busy += loop.time() - started

    batched = batch(batch_size=CLOSED_BATCH)(timed)
    try:
        trace = await simulation.closed_loop(batched, CLOSED_CALLERS, seconds)
        mean_batch = batched.stats.mean_batch_size
    finally:
        await batched.aclose()
    ideal = CLOSED_BATCH / cost(CLOSED_BATCH)
    return ClosedResult(
        clock=clock,
        seconds=seconds,
        requests=trace.succeeded,
        throughput=trace.throughput,
        ideal=ideal,
        share=trace.throughput / ideal,
        model_busy=busy / trace.duration,
        mean_batch_size=mean_batch,
        p50_ms=trace.latency(0.50) * 1e3,
        p99_ms=trace.latency(0.99) * 1e3,
    )


def closed(config: Config) -> list[ClosedResult]:
    return [
        simulation.run(closed_loop(config.closed_sim_seconds, "virtual")),
        asyncio.run(closed_loop(config.closed_real_seconds, "real")),
    ]
