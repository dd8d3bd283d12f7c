"""What batchproxy itself costs, next to a no-batching baseline measured in the same run.

Run: `python -m benchmarks.overhead.overhead` (or `make bench`); `--quick` for a smoke run.
Prints a Markdown table and writes the numbers as JSON to `benchmarks/results/`.

The model is the identity (`return items`), so everything measured is overhead:

1. CPU per request under load: 1,000 concurrent callers (`asyncio.gather` of
   1,000 tasks), round after round, through a proxy with `batch_size=64`, versus
   the same 1,000 callers each awaiting the identity coroutine directly. CPU time
   is `time.process_time()`; each side is the median of several interleaved
   repetitions. The difference is the CPU batchproxy adds per request.
2. Latency of a lone request on an idle proxy (`max_delay_ms=5`): sequential
   single calls, each after a quiet spell longer than the delay window, timed with
   `time.perf_counter()` around `await proxy.inference(x)` and, alternately
   before or after it, around the direct `await identity([x])`.
3. The same single caller with no pause between calls. Each request finds the
   proxy empty, so by the idle rule it goes at once rather than waiting for
   company that cannot come (this caller is waiting for its own answer).

Targets are printed next to the numbers, not asserted.
"""

from __future__ import annotations

import asyncio
import gc
import math
import statistics
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from typing_extensions import override

from batchproxy import Percentiles, Proxy
from benchmarks._harness.report import arguments, environment, headline, verdict, write_report

CALLERS = 1_000
BATCH_SIZE = 64
MAX_DELAY_MS = 5.0
IDLE_GAP_S = (MAX_DELAY_MS + 1.0) / 1e3  # a quiet spell just longer than the window

TARGET_ADDED_CPU_US = 4.0
TARGET_IDLE_P50_MS = 0.1


class Identity(Proxy[Any, Any]):
    """The cheapest possible model: every item is its own result."""

    @override
    async def _inference(self, items: list[Any]) -> list[Any]:
        return items


async def identity(items: list[Any]) -> list[Any]:
    """The same model, called directly: the no-batching baseline."""
    return items


async def direct(item: Any) -> Any:
    return (await identity([item]))[0]


@dataclass(frozen=True)
class Config:
    cpu_repetitions: int
    cpu_rounds: int  # rounds of CALLERS concurrent requests per repetition
    cpu_warmup_rounds: int
    idle_calls: int
    idle_warmup: int
    busy_calls: int


FULL = Config(
    cpu_repetitions=9,
    cpu_rounds=20,
    cpu_warmup_rounds=5,
    idle_calls=2_000,
    idle_warmup=200,
    busy_calls=500,
)
QUICK = Config(
    cpu_repetitions=3,
    cpu_rounds=3,
    cpu_warmup_rounds=1,
    idle_calls=150,
    idle_warmup=20,
    busy_calls=50,
)


@dataclass(frozen=True)
class CpuResult:
    requests_per_side: int
    proxy_us: float
    baseline_us: float
    added_us: float
    proxy_reps_us: list[float]
    baseline_reps_us: list[float]
    mean_batch_size: float


@dataclass(frozen=True)
class LatencyResult:
    calls: int
    gap_ms: float
    proxy_p50_us: float
    proxy_p99_us: float
    baseline_p50_us: float
    baseline_p99_us: float
    added_p50_us: float
    added_p99_us: float


# -- 1. CPU per request under load ------------------------------------------------------


async def cpu_per_request(
    call: Callable[[int], Coroutine[Any, Any, Any]], rounds: int
) -> tuple[float, list[Any]]:
    """CPU microseconds per request over `rounds` rounds of CALLERS concurrent calls
    (`call(i)` for i in 0..CALLERS-1); also the last round's results."""
    gc.collect()
    results: list[Any] = []
    started = time.process_time()
    for _ in range(rounds):
        results = await asyncio.gather(*(call(i) for i in range(CALLERS)))
    elapsed = time.process_time() - started
    return elapsed / (rounds * CALLERS) * 1e6, results


async def measure_cpu(config: Config) -> CpuResult:
    expected = list(range(CALLERS))
    proxy_reps: list[float] = []
    baseline_reps: list[float] = []
    async with Identity(batch_size=BATCH_SIZE, max_delay_ms=MAX_DELAY_MS) as proxy:
        await cpu_per_request(proxy.inference, config.cpu_warmup_rounds)
        await cpu_per_request(direct, config.cpu_warmup_rounds)
        for repetition in range(config.cpu_repetitions):
            # alternate which side goes first so drift does not favour either
            order = [("proxy", proxy.inference), ("baseline", direct)]
            if repetition % 2:
                order.reverse()
            for side, call in order:
                us, results = await cpu_per_request(call, config.cpu_rounds)
                if results != expected:
                    raise SystemExit(f"{side}: a caller got the wrong result")
                (proxy_reps if side == "proxy" else baseline_reps).append(us)
        stats = proxy.stats
    proxy_us = statistics.median(proxy_reps)
    baseline_us = statistics.median(baseline_reps)
    return CpuResult(
        requests_per_side=config.cpu_repetitions * config.cpu_rounds * CALLERS,
        proxy_us=proxy_us,
        baseline_us=baseline_us,
        added_us=proxy_us - baseline_us,
        proxy_reps_us=proxy_reps,
        baseline_reps_us=baseline_reps,
        mean_batch_size=stats.mean_batch_size,
    )


# -- 2./3. latency of single sequential calls ---------------------------------------------


async def measure_latency(calls: int, warmup: int, gap: float) -> LatencyResult:
    """Sequential single calls with `gap` seconds of quiet before each; paired timings."""
    timer = time.perf_counter
    proxied: list[float] = []
    baseline: list[float] = []
    async with Identity(batch_size=BATCH_SIZE, max_delay_ms=MAX_DELAY_MS) as proxy:
        for i in range(warmup + calls):
            if gap:
                await asyncio.sleep(gap)
            if i % 2:  # alternate the order within a pair
                t0 = timer()
                got = await proxy.inference(i)
                t1 = timer()
                direct_got = (await identity([i]))[0]
                t2 = timer()
                proxy_s, baseline_s = t1 - t0, t2 - t1
            else:
                t0 = timer()
                direct_got = (await identity([i]))[0]
                t1 = timer()
                got = await proxy.inference(i)
                t2 = timer()
                proxy_s, baseline_s = t2 - t1, t1 - t0
            if got != i or direct_got != i:
                raise SystemExit(f"call {i}: wrong result")
            if i >= warmup:
                proxied.append(proxy_s * 1e6)
                baseline.append(baseline_s * 1e6)
    added = [p - b for p, b in zip(proxied, baseline, strict=True)]
    return LatencyResult(
        calls=calls,
        gap_ms=gap * 1e3,
        proxy_p50_us=Percentiles.of(proxied).p50,
        proxy_p99_us=Percentiles.of(proxied).p99,
        baseline_p50_us=Percentiles.of(baseline).p50,
        baseline_p99_us=Percentiles.of(baseline).p99,
        added_p50_us=Percentiles.of(added).p50,
        added_p99_us=Percentiles.of(added).p99,
    )


# -- report ----------------------------------------------------------------------------


def within(value: float, limit: float) -> str:
    """The verdict of a target that `value` be at most `limit`."""
    return verdict(value <= limit)


def ms(us: float) -> str:
    return f"{us / 1e3:.3f} ms"


def latency_rows(label: str, result: LatencyResult, target: str) -> list[str]:
    return [
        f"| {label}, p50 | {ms(result.proxy_p50_us)} | {ms(result.baseline_p50_us)} "
        f"| {ms(result.added_p50_us)} | {target} |",
        f"| {label}, p99 | {ms(result.proxy_p99_us)} | {ms(result.baseline_p99_us)} "
        f"| {ms(result.added_p99_us)} | — |",
    ]


def table(cpu: CpuResult, idle: LatencyResult, busy: LatencyResult) -> str:
    ratio = cpu.proxy_us / cpu.baseline_us if cpu.baseline_us > 0 else math.inf
    idle_target = (
        f"p50 ≤ {TARGET_IDLE_P50_MS:g} ms: {within(idle.added_p50_us / 1e3, TARGET_IDLE_P50_MS)}"
    )
    rows = [
        "| measurement | batchproxy | no-batching baseline | added by batchproxy | target |",
        "|---|---|---|---|---|",
        f"| CPU per request, {CALLERS:,} concurrent callers, batch_size={BATCH_SIZE} "
        f"| {cpu.proxy_us:.2f} µs | {cpu.baseline_us:.2f} µs "
        f"| {cpu.added_us:.2f} µs ({ratio:.2f}x the baseline) "
        f"| ≤ {TARGET_ADDED_CPU_US:g} µs: {within(cpu.added_us, TARGET_ADDED_CPU_US)} |",
        *latency_rows("lone request, idle proxy", idle, idle_target),
        *latency_rows("one caller back-to-back", busy, "no wait for company"),
    ]
    notes = [
        f"- CPU: time.process_time(), median of {len(cpu.proxy_reps_us)} interleaved repetitions "
        f"of {cpu.requests_per_side // len(cpu.proxy_reps_us):,} requests "
        f"({cpu.requests_per_side:,} per side); mean batch {cpu.mean_batch_size:.1f}; "
        f"repetitions: batchproxy {spread(cpu.proxy_reps_us)} µs, "
        f"baseline {spread(cpu.baseline_reps_us)} µs.",
        f"- Lone request: {idle.calls:,} sequential calls, each after {idle.gap_ms:g} ms of quiet, "
        f"max_delay_ms={MAX_DELAY_MS:g}; time.perf_counter() around each await; "
        f"added = per-call difference.",
        f"- Back-to-back: {busy.calls:,} sequential calls with no pause; each finds the proxy "
        f"empty, so the idle rule sends it at once.",
    ]
    return "\n".join([*rows, "", *notes])


def spread(samples: Sequence[float]) -> str:
    return f"{min(samples):.2f} to {max(samples):.2f}"


async def run(config: Config) -> dict[str, Any]:
    cpu = await measure_cpu(config)
    idle = await measure_latency(config.idle_calls, config.idle_warmup, IDLE_GAP_S)
    busy = await measure_latency(config.busy_calls, config.idle_warmup, 0.0)
    return {"cpu": cpu, "idle": idle, "busy": busy}


def main(argv: Sequence[str] | None = None) -> int:
    cli = arguments("overhead", (__doc__ or "").splitlines()[0], argv)
    config = QUICK if cli.quick else FULL
    env = environment()
    print(headline("overhead", env, quick=cli.quick))
    print()
    results = asyncio.run(run(config))
    print(table(results["cpu"], results["idle"], results["busy"]))
    write_report(
        cli.output,
        env,
        quick=cli.quick,
        config=asdict(config),
        targets={
            "added_cpu_us_per_request": TARGET_ADDED_CPU_US,
            "idle_added_latency_p50_ms": TARGET_IDLE_P50_MS,
        },
        results={name: asdict(result) for name, result in results.items()},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
