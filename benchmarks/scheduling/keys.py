"""Batches by key: two adapters' calls interleaved, on one model thread.

Run: `python -m benchmarks.scheduling.keys` (or `make bench-keys`); `--quick` for a smoke run.
Prints a Markdown table and writes the numbers as JSON to `benchmarks/results/`.

The model stands for one GPU serving two LoRA adapters: a plain `def` on a
worker thread that sleeps `0.004 + 0.0001 n` seconds for a batch of n (the
fixed cost dominates, as for a GPU), and must see one adapter per call.
Closed loop: 64 callers per adapter, two adapters, their calls interleaved; each
caller calls again as soon as answered. Three sides, interleaved repetitions
(median of each), real clock:

1. `key=`: one proxy, `key=` per call, the model reads `batch_key()`; also with
   `max_concurrent_batches=2` (the next batch waits on the thread, as in 2.);
2. one proxy per adapter, both on one shared `WorkerThread` (what one does
   without keys, when the adapters are known in advance);
3. one model call per request (`batch_size=1`): keeping adapters apart without
   batching.

Reported: requests/s, p50/p99 latency, mean batch size; the ratio to side 1.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import batchproxy
from batchproxy import simulation
from benchmarks._harness.report import arguments, environment, headline, no_targets, write_report

CALLERS = 64  # per adapter
ADAPTERS = ("lora-a", "lora-b")
FIXED, PER_ITEM = 0.004, 0.0001


def run_model(batch: list[Any], adapter: object) -> list[Any]:
    time.sleep(FIXED + PER_ITEM * len(batch))
    return [(adapter, item) for item in batch]


class KeyedModel(batchproxy.Proxy[int, Any]):
    def _inference(self, items: list[int]) -> list[Any]:
        return run_model(items, batchproxy.batch_key())


class AdapterModel(batchproxy.Proxy[int, Any]):
    def __init__(self, adapter: str, **options: Any) -> None:
        super().__init__(**options)
        self.adapter = adapter

    def _inference(self, items: list[int]) -> list[Any]:
        return run_model(items, self.adapter)


Call = Callable[[str, int], Awaitable[Any]]


async def closed_loop(call: Call, seconds: float) -> simulation.Trace:
    """CALLERS callers per adapter, their calls interleaved, each calling again as soon as
    answered (`simulation.closed_loop` on the real clock); every answer checked."""

    async def checked(who: int) -> None:
        adapter, i = ADAPTERS[who % len(ADAPTERS)], who // len(ADAPTERS)
        answer = await call(adapter, i)
        if answer != (adapter, i):
            raise AssertionError(f"{adapter} caller {i} got {answer!r}")

    trace = await simulation.closed_loop(checked, CALLERS * len(ADAPTERS), seconds)
    if trace.failed:
        raise SystemExit(f"{trace.failed} of {trace.issued} calls failed or got a wrong answer")
    return trace


async def side(name: str, seconds: float) -> dict[str, Any]:
    proxies: Sequence[batchproxy.Proxy[int, Any]]
    if name.startswith("key="):
        slots = 2 if "2 slots" in name else None
        keyed = KeyedModel(batch_size=64, offload=True, max_concurrent_batches=slots)
        proxies = [keyed]

        def call(adapter: str, i: int) -> Awaitable[Any]:
            return keyed.inference(i, key=adapter)

    elif name == "a proxy per adapter":
        thread = batchproxy.WorkerThread()
        by_adapter = {a: AdapterModel(a, batch_size=64, offload=thread) for a in ADAPTERS}
        proxies = list(by_adapter.values())

        def call(adapter: str, i: int) -> Awaitable[Any]:
            return by_adapter[adapter].inference(i)

    else:
        thread = batchproxy.WorkerThread()
        single = {a: AdapterModel(a, batch_size=1, offload=thread) for a in ADAPTERS}
        proxies = list(single.values())

        def call(adapter: str, i: int) -> Awaitable[Any]:
            return single[adapter].inference(i)

    trace = await closed_loop(call, seconds)
    batches = sum(p.stats.batches for p in proxies)
    items = sum(p.stats.items for p in proxies)
    for proxy in proxies:
        await proxy.aclose()
    if not name.startswith("key="):
        thread.close()
    cuts = statistics.quantiles(trace.latencies, n=100)
    return {
        "side": name,
        "requests_per_s": trace.throughput,
        "p50_ms": cuts[49] * 1e3,
        "p99_ms": cuts[98] * 1e3,
        "mean_batch": items / batches,
    }


SIDES = ("key=", "key=, 2 slots", "a proxy per adapter", "one call per request")


def main(argv: Sequence[str] | None = None) -> None:
    cli = arguments("keys", __doc__, argv)
    seconds, repetitions = (1.0, 1) if cli.quick else (3.0, 5)
    env = environment()
    print(headline("Batches by key", env, quick=cli.quick))
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in SIDES}
    for _ in range(repetitions):  # interleaved: the machine's drift hits every side
        for name in SIDES:
            runs[name].append(asyncio.run(side(name, seconds)))
    rows = []
    for name in SIDES:
        row = {
            field: statistics.median(run[field] for run in runs[name])
            for field in ("requests_per_s", "p50_ms", "p99_ms", "mean_batch")
        }
        rows.append({"side": name, **row})
    base = rows[0]["requests_per_s"]
    print("\n| side | requests/s | vs `key=` | p50 | p99 | mean batch |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['side']} | {row['requests_per_s']:.0f} | "
            f"{row['requests_per_s'] / base:.2f}x | {row['p50_ms']:.1f} ms | "
            f"{row['p99_ms']:.1f} ms | {row['mean_batch']:.1f} |"
        )
    write_report(
        cli.output,
        env,
        quick=cli.quick,
        config={
            "seconds": seconds,
            "repetitions": repetitions,
            "callers_per_adapter": CALLERS,
            "adapters": list(ADAPTERS),
            "model_seconds": [FIXED, PER_ITEM],
            "batch_size": 64,
        },
        targets=no_targets("a comparison of ways to keep adapters apart: ratios, no pass mark"),
        results={"rows": rows, "runs": runs},
    )


if __name__ == "__main__":
    main(sys.argv[1:])
