"""Small calls ahead of a bulk call: one 10,000-item `inference_many` among steady queries.

Run: `python -m benchmarks.scheduling.small_first` (or `make bench-small-first`); `--quick` for
a smoke run. Prints Markdown tables and writes the numbers as JSON to
`benchmarks/results/`. The target is printed next to the numbers, not asserted.

One proxy (`batch_size=64`, one batch slot, default window) whose model takes
`10 ms + 0.2 ms x n` for a batch of n (a full batch: 22.8 ms; capacity 2,807
items/s), on the virtual clock (`batchproxy.simulation`: exact, deterministic).
Interactive traffic arrives at a steady rate for the whole run: single-item calls
(`inference`), at a tenth of their rate queries of `FEW` items, and once a second
a medium call of `MEDIUM` items (`inference_many`). At `BULK_AT` seconds one
caller sends a bulk `inference_many` of `BULK` items (a reindex). Sides:
`bulk_threshold=None` (every call ranked alike, arrival order: the queries wait
behind the reindex) and a few thresholds.

Per side and interactive load: the p50 and p99 latency of the single calls and the
p99 of the few-item queries that arrived while the bulk call was in flight, and the
bulk call's completion time (from its call to its answer), as a ratio to `None`'s
and to its ideal (`None`'s / (1 - load): all the capacity the interactive traffic
leaves). Target: the singles' p99 with the default threshold within 3 full-batch
model times (their floor: the batch running when they arrive, then their own),
and the bulk call's completion time within 1.05x of its ideal at every load below
saturation (the reserve keeps it from starving above).

A second table sweeps `BULK_EVERY` (the bulk lane's share: one place in k while
small calls wait) under interactive traffic near saturation (70, 80, 90 % of
capacity), where the share decides who waits: k = 2, 4, 8, 16 and strict (the bulk
call waits for every small one: it would starve under a steady 100 %).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from batchproxy import Percentiles, batch, simulation
from batchproxy._scheduling import lanes
from benchmarks._harness.report import arguments, environment, headline, write_report

BATCH = 64
FIXED, PER_ITEM = 0.010, 0.0002
BULK = 10_000
FEW = 8  # items in a query of a few (one in ten interactive calls)
MEDIUM = 100  # items in a medium call (a page of documents), one a second
MEDIUM_EVERY = 1.0
BULK_AT = 0.5  # seconds into the run
FULL_BATCH = FIXED + PER_ITEM * BATCH
CAPACITY = BATCH / FULL_BATCH  # items/s at full batches
LOADS = (0.05, 0.25, 0.5)  # interactive items/s as a share of capacity
THRESHOLDS: tuple[int | None, ...] = (None, 1, 8, 32, 64, 128, 1024)
DEFAULT = 64  # the default chosen from this benchmark (Options.bulk_threshold)
SATURATED = (0.7, 0.8, 0.9)  # the interactive loads of the BULK_EVERY sweep
EVERY = (2, 4, 8, 16, 10**9)  # 10**9: strict (never a bulk place while small calls wait)
TARGET_P99_BATCHES = 3.0
TARGET_BULK = 1.05


@dataclass(frozen=True)
class Outcome:
    """What one run's callers saw (latencies in ms, the bulk call's time in s)."""

    singles_p50_ms: float
    singles_p99_ms: float
    few_p99_ms: float
    medium_p99_ms: float
    bulk_s: float
    singles: int  # single calls that arrived while the bulk call was in flight


def rate_for(load: float) -> float:
    """Single calls per second for an interactive `load` (singles, few-item queries and
    medium calls together, as a share of capacity in items)."""
    return max(1.0, load * CAPACITY - MEDIUM / MEDIUM_EVERY) / (0.9 + FEW / 10)


async def scenario(load: float, threshold: int | None, duration: float) -> Outcome:
    """One run on the virtual clock: the steady queries, the bulk call at `BULK_AT`."""
    loop = asyncio.get_running_loop()
    proxy = batch(batch_size=BATCH, bulk_threshold=threshold)(
        simulation.simulated_model(lambda n: FIXED + PER_ITEM * n)
    )
    singles: list[tuple[float, float]] = []  # (arrival, latency)
    few: list[tuple[float, float]] = []
    medium: list[tuple[float, float]] = []
    bulk_span: list[float] = []

    async def single(item: int) -> None:
        started = loop.time()
        await proxy(item)
        singles.append((started, loop.time() - started))

    async def query(item: int) -> None:
        started = loop.time()
        await proxy.inference_many([item] * FEW)
        few.append((started, loop.time() - started))

    async def page(item: int) -> None:
        started = loop.time()
        await proxy.inference_many([item] * MEDIUM)
        medium.append((started, loop.time() - started))

    async def bulk() -> None:
        started = loop.time()
        await proxy.inference_many(list(range(BULK)))
        bulk_span[:] = [started, loop.time()]

    origin = loop.time()
    gap = 1.0 / rate_for(load)
    tasks = []
    count = 0
    pages = 0
    bulk_sent = False
    while count * gap < duration or not bulk_span:
        at = origin + count * gap
        if not bulk_sent and at >= origin + BULK_AT:
            await asyncio.sleep(max(0.0, origin + BULK_AT - loop.time()))
            tasks.append(loop.create_task(bulk()))
            bulk_sent = True
        if at >= origin + (pages + 0.25) * MEDIUM_EVERY:
            await asyncio.sleep(max(0.0, origin + (pages + 0.25) * MEDIUM_EVERY - loop.time()))
            tasks.append(loop.create_task(page(pages)))
            pages += 1
        await asyncio.sleep(max(0.0, at - loop.time()))
        tasks.append(loop.create_task(query(count) if count % 10 == 9 else single(count)))
        count += 1
    await asyncio.gather(*tasks)
    await proxy.aclose()
    start, end = bulk_span
    during = [latency for arrived, latency in singles if start <= arrived <= end]
    during_few = [latency for arrived, latency in few if start <= arrived <= end]
    during_medium = [latency for arrived, latency in medium if start <= arrived <= end]
    p = Percentiles.of(during)
    return Outcome(
        singles_p50_ms=p.p50 * 1e3,
        singles_p99_ms=p.p99 * 1e3,
        few_p99_ms=Percentiles.of(during_few).p99 * 1e3,
        medium_p99_ms=Percentiles.of(during_medium).p99 * 1e3,
        bulk_s=end - start,
        singles=len(during),
    )


def with_every(every: int, load: float, threshold: int, duration: float) -> Outcome:
    """`scenario` with the bulk lane's share set to one place in `every`."""
    kept = lanes.BULK_EVERY
    lanes.BULK_EVERY = every
    try:
        return simulation.run(scenario(load, threshold, duration))
    finally:
        lanes.BULK_EVERY = kept


def ideal(off: float, load: float) -> float:
    """The bulk call's time if it got all the capacity the interactive traffic leaves."""
    return off / (1 - load)


def name(threshold: int | None) -> str:
    return "None (off)" if threshold is None else str(threshold)


def main(argv: Sequence[str] | None = None) -> int:
    cli = arguments("small_first", __doc__, argv)
    duration = 1.0 if cli.quick else 6.0
    loads = LOADS[:2] if cli.quick else LOADS
    thresholds = (None, DEFAULT) if cli.quick else THRESHOLDS
    env = environment()
    print(headline("small calls ahead of a 10,000-item bulk call", env, quick=cli.quick))
    results: dict[str, dict[str, Outcome]] = {}
    print()
    print(
        "| interactive load | bulk_threshold | singles p50 | singles p99 | "
        f"{FEW}-item p99 | {MEDIUM}-item p99 | bulk call | bulk / off | bulk / ideal |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for load in loads:
        row = results[f"{load:.0%}"] = {}
        for threshold in thresholds:
            o = row[name(threshold)] = simulation.run(scenario(load, threshold, duration))
            off = row[name(None)].bulk_s
            print(
                f"| {load:.0%} | {name(threshold)} | {o.singles_p50_ms:.1f} ms | "
                f"{o.singles_p99_ms:.1f} ms | {o.few_p99_ms:.1f} ms | {o.medium_p99_ms:.0f} ms | "
                f"{o.bulk_s:.2f} s | {o.bulk_s / off:.2f}x | {o.bulk_s / ideal(off, load):.2f}x |"
            )
    sweep: dict[str, dict[str, Outcome]] = {}
    print()
    print(f"BULK_EVERY near saturation, bulk_threshold={DEFAULT}:")
    print()
    print("| interactive load | BULK_EVERY | singles p50 | singles p99 | bulk call |")
    print("|---:|---|---:|---:|---:|")
    for load in SATURATED[1:2] if cli.quick else SATURATED:
        row = sweep[f"{load:.0%}"] = {}
        for every in EVERY[1:2] if cli.quick else EVERY:
            label = "strict" if every == EVERY[-1] else str(every)
            o = row[label] = with_every(every, load, DEFAULT, duration)
            print(
                f"| {load:.0%} | {label} | {o.singles_p50_ms:.1f} ms | "
                f"{o.singles_p99_ms:.1f} ms | {o.bulk_s:.2f} s |"
            )
    print()
    floor = TARGET_P99_BATCHES * FULL_BATCH * 1e3
    for load, row in results.items():
        default, off = row[name(DEFAULT)], row[name(None)]
        met_p99 = "met" if default.singles_p99_ms <= floor else "NOT met"
        ratio = default.bulk_s / ideal(off.bulk_s, float(load.rstrip("%")) / 100)
        met_bulk = "met" if ratio <= TARGET_BULK else "NOT met"
        print(
            f"- {load}: singles p99 {default.singles_p99_ms:.1f} ms against <= {floor:.1f} ms "
            f"({met_p99}); bulk call {ratio:.2f}x its ideal ({met_bulk}, <= {TARGET_BULK}x)"
        )
    write_report(
        cli.output,
        env,
        quick=cli.quick,
        config={
            "virtual_seconds": duration,
            "batch_size": BATCH,
            "cost": [FIXED, PER_ITEM],
            "bulk_items": BULK,
            "few_items": FEW,
            "bulk_at": BULK_AT,
            "loads": list(loads),
            "thresholds": [name(t) for t in thresholds],
            "default": DEFAULT,
            "saturated": list(SATURATED),
        },
        targets={"singles_p99_full_batches": TARGET_P99_BATCHES, "bulk_vs_off": TARGET_BULK},
        results={
            "by_load": {
                load: {t: asdict(o) for t, o in row.items()} for load, row in results.items()
            },
            "bulk_every": {
                load: {label: asdict(o) for label, o in row.items()} for load, row in sweep.items()
            },
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
