"""Scale-out for a GIL-bound model: one thread, two worker processes, two Ray actors.

Run: `python -m benchmarks.scaleout.scaleout` (or `make bench-scaleout`); `--quick` for a
smoke run. Prints Markdown tables and writes the numbers as JSON to
`benchmarks/results/`. Targets are printed next to the numbers, not asserted.

The model (`benchmarks/scaleout/_gil_model.py`, a module of its own so that worker
processes can import it and Ray can pickle it) is pure-Python integer arithmetic,
about 1 ms per item, one result per item, a plain `def` that holds the GIL all
the while: a second thread cannot speed it up, a second process can.

0. The machine. The model's cost per item in this process (batches of 16 back to
   back), and how far the machine itself scales: the model run back to back for a
   fixed time in one bare spawned process, then in two at once (no batchproxy, no
   pipes; the two take turns, round after round). On 2 CPUs the second process
   shares the machine with everything else, the proxy's own process included, so
   this ratio is the ceiling for the two-process side.
1. Throughput. A closed loop of 64 callers (each calls again as soon as it is
   answered: `simulation.closed_loop`), `batch_size=16`, default policy, the same
   time on every side:
   (a) one thread: a `Proxy` subclass whose plain `def _inference` runs the model,
       `offload=True` (one `WorkerThread`, one batch at a time);
   (b) `Proxy(offload=ProcessWorkers(gil_bound, 2))`: two batches at once;
   (c) `Proxy(offload=RayActors(gil_bound, 2, num_cpus=1))` on
       `ray.init(num_cpus=2)` (skipped, with a note, when ray is not installed).
   Workers and actors are started (`await executor.start()`), each side is
   checked against the model's own results and warmed up before timing. The
   time is cut into rounds of 1.25 s; the sides take turns round after round, in
   a rotating order, so the machine's drift in speed (large on a shared VM) falls
   on every side alike. A side's throughput is its requests over its seconds,
   summed over its rounds; its ratio to one thread is the ratio of those, shown
   beside the median and range of the per-round ratios. (b) takes turns with (a)
   before Ray starts; (c) takes turns with (a) again once Ray runs, since Ray's
   own processes take some CPU even when idle, and neither executor should pay
   for the other's runtime. Target: (b) >= 1.6x (a); (c) / (a) is reported.
   Also per side: the mean batch size, latency p50/p99, and this process's CPU
   time (`time.process_time()`) over the rounds' wall time.
2. Dispatch cost per batch: the identity model, a batch of 16 small ints sent
   one at a time by one caller (`await executor.run(model, items)`), timed with
   `time.perf_counter()` around the await; median and p99 round trip for a
   direct await on the event loop (what `LoopExecutor` does: the baseline), a
   `WorkerThread`, `ProcessWorkers(identity, 2)` and
   `RayActors(identity, 2, num_cpus=1)`, taking turns batch by batch. Then a
   payload: 16 float32 arrays of 1 MB each (16 MB) through the same
   `ProcessWorkers` (pickle protocol 5, array buffers out of band) and back; the
   MB/s is the 32 MB moved (16 MB each way) over the median round trip. The same
   payload through the `RayActors` (Ray's object store) for comparison.
3. Autoscaling (`--autoscale`, alone; needs Ray; `benchmarks/scaleout/_step_load.py`): an
   autoscaled `RayActors` pool of 1 to 8 replicas (0.25 CPU each) under a step
   load, from 1 replica's worth to 8 and back. Reports how long each step takes
   to be followed by a decision, by the replica count (asked for, then ready) and
   by the throughput; writes `scaleout-autoscale.json` and a plot beside it.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from benchmarks._harness.report import arguments, environment, headline, no_targets, write_report
from benchmarks.scaleout import _gil_model, _step_load
from benchmarks.scaleout._dispatch import measure_overheads
from benchmarks.scaleout._machine import measure_machine
from benchmarks.scaleout._setup import (
    BATCH_SIZE,
    CALLERS,
    FULL,
    PAYLOAD_MB,
    QUICK,
    TARGET_PROCESSES_VS_THREAD,
    WORKERS,
    Config,
    import_ray,
)
from benchmarks.scaleout._tables import report
from benchmarks.scaleout._throughput import measure_throughput


async def run(config: Config, ray: ModuleType | None) -> dict[str, Any]:
    throughput = await measure_throughput(config, ray)
    dispatch, payload = await measure_overheads(config, ray)
    return {"throughput": throughput, "dispatch": dispatch, "payload": payload}


def autoscale(quick: bool, output: Path) -> int:
    """Section 3 alone (`--autoscale`)."""
    ray = import_ray()
    if ray is None:
        print("section 3 needs Ray: pip install 'batchproxy[ray]'")
        return 1
    config = _step_load.QUICK if quick else _step_load.FULL
    env = environment(ray=ray.__version__)
    print(headline("scaleout --autoscale", env, quick=quick))
    print()
    results = _step_load.run(config, ray)
    print(_step_load.report(config, results))
    write_report(
        output,
        env,
        quick=quick,
        config=asdict(config),
        targets=no_targets("a trace of the autoscaler under a step load: no pass mark"),
        results=_step_load.document(config, results),
    )
    _step_load.plot(config, results, output.with_suffix(".png"))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    cli = arguments(
        "scaleout",
        (__doc__ or "").splitlines()[0],
        argv,
        mode=("autoscale", "section 3 alone: an autoscaled Ray pool under a step load"),
    )
    if cli.mode:
        return autoscale(cli.quick, cli.output)
    config = QUICK if cli.quick else FULL
    ray = import_ray()
    env = environment(numpy=np.__version__, ray=None if ray is None else ray.__version__)
    print(headline("scaleout", env, quick=cli.quick))
    print()
    machine = measure_machine(config)
    try:
        results = asyncio.run(run(config, ray))
    finally:
        if ray is not None:
            ray.shutdown()
    print(report(machine, results, config))
    write_report(
        cli.output,
        env,
        quick=cli.quick,
        config=asdict(config),
        targets={"processes_vs_one_thread": TARGET_PROCESSES_VS_THREAD},
        results={
            "workload": {
                "callers": CALLERS,
                "batch_size": BATCH_SIZE,
                "workers": WORKERS,
                "work_per_item": _gil_model.WORK,
                "payload_mb_each_way": PAYLOAD_MB,
            },
            "ray_skipped": ray is None,
            "machine": asdict(machine),
            **{name: [asdict(r) for r in results[name]] for name in ("throughput", "dispatch")},
            "payload": [asdict(r) for r in results["payload"]],
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
