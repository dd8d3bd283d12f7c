"""Scale: 100,000 distinct tenants, batch keys and dedup keys in one burst.

Run: `python -m benchmarks.scheduling.scale` (or `make bench-scale`); `--quick` for 10,000.
Prints a Markdown table and writes the numbers as JSON to `benchmarks/results/`.

Each side queues `N` calls at once on a proxy whose model answers at once
(`batch_size=64`, one batch slot), every call distinct in one dimension: its
own tenant (`tenant=i`), its own batch key (`key=i`) or its own item under
`dedup=True`; the plain side (no tenant, no key, no dedup) is the reference.
Reported: the time from the first call to the last answer per call ("per
place"), and the memory `tracemalloc` counts after everything has drained and
the proxy is closed and its event loop has ended, against the baseline taken
before (about zero: the per-tenant and per-key state went back to nothing),
and what a second identical burst in the same process adds to that: a leak
grows with each burst, a table kept at its high-water size does not. Under the
table: the size of asyncio's set of all tasks (a WeakSet: its set keeps the
table it grew to), which is what the keys row's memory after the drain is.
Time is measured with tracemalloc on, which slows every side alike.
"""

from __future__ import annotations

import asyncio
import gc
import sys
import time
import tracemalloc
from collections.abc import Sequence
from typing import Any

import batchproxy
from benchmarks._harness.report import arguments, environment, headline, no_targets, write_report

BATCH_SIZE = 64
MAX_DELAY_MS = 1.0
SIDES = ("nothing (plain)", "tenants", "keys", "dedup keys")


class Echo(batchproxy.Proxy[int, int]):
    async def _inference(self, items: list[int]) -> list[int]:
        return items


async def side(name: str, n: int) -> tuple[float, int]:
    """(seconds per call, batches)."""
    options: dict[str, Any] = {"dedup": True} if name == "dedup keys" else {}
    proxy = Echo(batch_size=BATCH_SIZE, max_delay_ms=MAX_DELAY_MS, **options)
    start = time.perf_counter()
    async with proxy:
        if name == "tenants":
            calls = [proxy.inference(i, tenant=i) for i in range(n)]
        elif name == "keys":
            calls = [proxy.inference(i, key=i) for i in range(n)]
        else:
            calls = [proxy.inference(i) for i in range(n)]
        results = await asyncio.gather(*calls)
    took = time.perf_counter() - start
    assert results == list(range(n))
    return took / n, proxy.stats.batches


def task_table() -> int | None:
    """Bytes of the table of asyncio's set of all tasks (Python 3.11: `_all_tasks`,
    3.12-3.13: `_scheduled_tasks`); None where there is no such set (3.14)."""
    tasks = getattr(asyncio.tasks, "_all_tasks", None)  # falsy when empty: no `or`
    if tasks is None:
        tasks = getattr(asyncio.tasks, "_scheduled_tasks", None)
    data = getattr(tasks, "data", None)
    return None if data is None else sys.getsizeof(data)


def burst(name: str, n: int) -> tuple[float, int, int]:
    """(seconds per call, batches, bytes traced after the drain against before)."""
    gc.collect()
    before = tracemalloc.get_traced_memory()[0]
    per_call, batches = asyncio.run(asyncio.wait_for(side(name, n), 600))
    gc.collect()
    return per_call, batches, tracemalloc.get_traced_memory()[0] - before


def main(argv: Sequence[str] | None = None) -> int:
    cli = arguments("scale", (__doc__ or "").splitlines()[0], argv)
    n = 10_000 if cli.quick else 100_000
    env = environment()
    print(headline("scale", env, quick=cli.quick))
    print(f"\n{n:,} calls queued at once, batch_size={BATCH_SIZE}, a model that answers at once\n")
    print("| distinct | per place | batches | memory after the drain | a second burst adds |")
    print("|---|---:|---:|---:|---:|")
    # a warm-up: asyncio's set of all tasks keeps the table it grew to for n tasks
    asyncio.run(side("nothing (plain)", n))
    tables = [("after the warm-up", task_table())]
    rows = []
    for name in SIDES:
        tracemalloc.start()
        per_call, batches, left = burst(name, n)
        again = burst(name, n)[2]
        tracemalloc.stop()
        tables.append((f"after {name}", task_table()))
        rows.append(
            {
                "distinct": name,
                "per_call_us": per_call * 1e6,
                "batches": batches,
                "bytes_after_drain": left,
                "bytes_second_burst": again,
            }
        )
        print(f"| {name} | {per_call * 1e6:.1f} µs | {batches:,} | {left:+,} B | {again:+,} B |")
    if tables[0][1] is not None:
        sizes = ", ".join(f"{size:,} B {when}" for when, size in tables)
        print(f"\nasyncio's set of all tasks, its table (empty each time): {sizes}")
    write_report(
        cli.output,
        env,
        quick=cli.quick,
        config={"calls": n, "batch_size": BATCH_SIZE, "max_delay_ms": MAX_DELAY_MS},
        targets=no_targets("time and memory per distinct place, read off the table: no pass mark"),
        results={
            "rows": rows,
            "task_table_bytes": [{"when": when, "bytes": size} for when, size in tables],
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
