"""Scheduling policies on a virtual clock, and what the scheduler costs on a real one.

Run: `python -m benchmarks.scheduling.scheduling` (or `make bench-scheduling`); `--quick` for a
smoke run. Prints Markdown tables and writes the numbers as JSON to
`benchmarks/results/`. Targets are printed next to the numbers, not asserted.

1. Policy sweep (`batchproxy.simulation`, virtual clock, deterministic). The model
   takes `cost(n) = 0.010 + 0.0002 n` seconds per batch of n; `batch_size=32`, so
   one device serves at most `32 / cost(32)` requests/s (its capacity). Open-loop
   Poisson arrivals (fixed seeds, 20 s of virtual traffic) at 30, 60 and 90 % of
   capacity meet `window="fixed"` with `max_delay_ms` 0, 1, 2, 5 and 10, and
   `window="adaptive"` with `max_delay_ms` 5 (the default) and 10. Per policy:
   throughput as a share of the offered rate (each over its own span: first
   arrival to last arrival, and to last answer), p50/p99 latency, mean batch size.
   "Best fixed" at a load is the fixed policy with the highest throughput, ties
   within 0.1 % going to the lowest p99; the default adaptive policy should reach
   >= 98 % of its throughput with no higher p99. Three configurations:
   (a) one batch slot; (b) two slots on two parallel replicas (capacity doubled);
   (c) two slots on one serial device (batches queue for it; capacity not doubled).
   (a) and (c) get the same arrivals, so the notes compare their p99 directly.
2. Closed loop: 150 callers, each calling again as soon as answered, one slot,
   `batch_size=64`, default policy; throughput as a share of the ideal
   `64 / cost(64)` (full batches back to back), and the share of the run the model
   was busy. 10 s on the virtual clock, then 5 s on a real event loop with the same
   model as an `asyncio.sleep`, where the proxy's own CPU time between batches
   counts too (and each sleep overshoots its cost a little).
3. CPU per request (real clock, `time.process_time()`), identity model, 1,000
   concurrent callers, `batch_size=64`, round after round; each side the median of
   interleaved repetitions: callers awaiting the model directly (no batching), a
   minimal hand-written batcher (a deque, an `asyncio.Event` and one collector
   task; in this file) with a 5 ms window and with none (it takes what is queued,
   up to the batch size: the yardstick, target ≤ 1.3x), `batchproxy.Proxy` with
   defaults, and `batchproxy.Proxy` with every scheduling feature on (adaptive
   window, `timeout=30` and `priority=i % 3` on every call, `aging_ms=50`,
   `shed_late=True`, `length=len` with `max_batch_tokens`, a listener).
4. A lone request on an idle proxy (real clock, `max_delay_ms=5`): one call after
   each quiet spell (1, 5 and 20 ms; the target is judged at 20 ms), timed with
   `time.perf_counter()` next to a direct await of the model; the added latency,
   and the same for the minimal batcher (which, like most hand-written batchers,
   waits out its window) and for the minimal batcher with no window at all: a bare
   hand-off to a collector task, the floor for any batcher that hands a request to
   another task on this machine. Target: batchproxy's added p50 after 20 ms of
   quiet ≤ 2x that floor's, measured interleaved in the same run.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from benchmarks._harness.report import arguments, environment, headline, write_report
from benchmarks.scheduling._real import measure_cpu, measure_idle
from benchmarks.scheduling._setup import (
    FULL,
    QUICK,
    TARGET_CLOSED_SHARE,
    TARGET_IDLE_FLOOR_RATIO,
    TARGET_MINIMAL_RATIO,
    TARGET_THROUGHPUT_VS_BEST,
    Config,
)
from benchmarks.scheduling._tables import report
from benchmarks.scheduling._virtual import SETUPS, closed, sweep


def run(config: Config) -> dict[str, Any]:
    return {
        "sweep": sweep(config),
        "closed": closed(config),
        "cpu": asyncio.run(measure_cpu(config)),
        "idle": asyncio.run(measure_idle(config)),
    }


def main(argv: Sequence[str] | None = None) -> int:
    cli = arguments("scheduling", (__doc__ or "").splitlines()[0], argv)
    config = QUICK if cli.quick else FULL
    env = environment()
    print(headline("scheduling", env, quick=cli.quick))
    print()
    results = run(config)
    print(report(results, config))
    write_report(
        cli.output,
        env,
        quick=cli.quick,
        config=asdict(config),
        targets={
            "adaptive_throughput_vs_best_fixed": TARGET_THROUGHPUT_VS_BEST,
            "adaptive_p99_vs_best_fixed": 1.0,
            "closed_loop_share_of_ideal": TARGET_CLOSED_SHARE,
            "defaults_cpu_vs_no_window_batcher": TARGET_MINIMAL_RATIO,
            "idle_added_p50_vs_no_window_batcher": TARGET_IDLE_FLOOR_RATIO,
        },
        results={
            "sweep": {
                setup.key: {
                    "capacity": setup.capacity,
                    "loads": [asdict(load) for load in results["sweep"][setup.key]],
                }
                for setup in SETUPS
            },
            **{name: [asdict(r) for r in results[name]] for name in ("closed", "cpu", "idle")},
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
