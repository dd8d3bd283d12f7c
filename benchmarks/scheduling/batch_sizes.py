"""Preferred batch sizes on a static-shape model: padding vs cutting vs any size.

Run: `python -m benchmarks.scheduling.batch_sizes`; `--quick` for a smoke run. Prints a Markdown
table and writes the numbers as JSON to `benchmarks/results/`. Virtual clock
(`batchproxy.simulation`): deterministic, no timing noise.

The model stands for an engine compiled for batches of 1, 2, 4, 8, 16 and 32 (a
TensorRT engine, CUDA graphs): a call takes `cost(s) = 5 ms + 0.5 ms x s` for the
allowed size s it is given, and raises on any other size. Three proxies over it,
`batch_size=32`, default window (`adaptive`, `max_delay_ms=5`):

- any size: the same cost on whatever size comes (a dynamic-shape model: the
  yardstick, what the static engine would cost if it took any size);
- pad: `batch_sizes=BatchSizes(SIZES, pad_item=0)`: each batch padded up to an allowed size;
- cut: `batch_sizes=SIZES`: each batch cut down to one, the rest waiting.

Open-loop Poisson arrivals (fixed seeds) at 30, 60 and 90 % of capacity
(`32 / cost(32)` per second), with one batch slot, and with two slots on two
replicas (where partial batches leave by the window, and cutting may wait for the
next size). Per proxy: throughput as a share of the offered rate, p50/p99 latency,
real items per model call, and the filler rows as a share of the rows computed.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from batchproxy import BatchSizes, batch, simulation
from benchmarks._harness.report import arguments, environment, headline, no_targets, write_report

SIZES = (1, 2, 4, 8, 16, 32)
BATCH = 32
LOADS = (0.30, 0.60, 0.90)


def cost(size: int) -> float:
    return 0.005 + 0.0005 * size


CAPACITY = BATCH / cost(BATCH)  # requests per second, full batches back to back


def engine(static: bool, calls: list[int]) -> Any:
    """The model; appends each call's size to `calls`."""
    model = simulation.simulated_model(cost, serial=False)  # the slots' replicas

    async def run(items: list[Any]) -> list[Any]:
        if static and len(items) not in SIZES:
            raise ValueError(f"the engine runs batches of {SIZES}, got {len(items)}")
        calls.append(len(items))
        return await model(items)

    return run


MODES: dict[str, dict[str, Any]] = {
    "any size": {},
    "pad": {"batch_sizes": BatchSizes(SIZES, pad_item=0)},
    "cut": {"batch_sizes": SIZES},
}


def measure(mode: str, load: float, slots: int, seconds: float) -> dict[str, Any]:
    options = MODES[mode]
    rate = load * CAPACITY * slots
    arrivals = simulation.poisson(rate, seconds, seed=int(load * 100) + slots)

    calls: list[int] = []

    async def main() -> tuple[simulation.Trace, Any]:
        f = batch(batch_size=BATCH, max_concurrent_batches=slots, **options)(
            engine(static=bool(options), calls=calls)
        )
        trace = await simulation.open_loop(f, arrivals)
        return trace, f.stats

    trace, stats = simulation.run(main())
    rows = sum(calls)
    assert trace.failed == 0, f"{mode}: {trace.failed} calls failed"
    assert rows == stats.items + stats.padded_rows
    return {
        "mode": mode,
        "load": load,
        "slots": slots,
        "throughput_share": trace.throughput / rate,
        "p50_ms": trace.latency(0.50) * 1e3,
        "p99_ms": trace.latency(0.99) * 1e3,
        "items_per_call": stats.items / len(calls) if calls else 0.0,
        "filler_share": stats.padded_rows / rows if rows else 0.0,
    }


def main(argv: Sequence[str] | None = None) -> int:
    cli = arguments("batch_sizes", (__doc__ or "").splitlines()[0], argv)
    env = environment()
    seconds = 3.0 if cli.quick else 20.0
    print(headline("batch sizes", env, quick=cli.quick))
    print(f"\nstatic engine: cost(s) = 5 ms + 0.5 ms x s, sizes {SIZES}, batch_size={BATCH}")
    columns = "slots | load | mode | throughput / offered | p50 ms | p99 ms | items/call | filler"
    print(f"\n| {columns} |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for slots in (1, 2):
        for load in LOADS:
            for mode in MODES:
                row = measure(mode, load, slots, seconds)
                rows.append(row)
                print(
                    f"| {slots} | {load:.0%} | {mode} | {row['throughput_share']:.3f} | "
                    f"{row['p50_ms']:.1f} | {row['p99_ms']:.1f} | "
                    f"{row['items_per_call']:.1f} | {row['filler_share']:.1%} |"
                )
    write_report(
        cli.output,
        env,
        quick=cli.quick,
        config={
            "seconds": seconds,
            "sizes": list(SIZES),
            "batch_size": BATCH,
            "loads": list(LOADS),
            "slots": [1, 2],
            "model_seconds": [cost(0), cost(1) - cost(0)],
        },
        targets=no_targets("a comparison of padding, cutting and any size: no pass mark"),
        results={"rows": rows},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
