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
import contextlib
import logging
import multiprocessing
import statistics
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np
from typing_extensions import override

from batchproxy import (
    Executor,
    ModelFactory,
    Percentiles,
    ProcessWorkers,
    Proxy,
    WorkerThread,
    simulation,
)
from batchproxy._executors.base import LoopExecutor, ModelFn
from benchmarks._harness.report import arguments, environment, headline, no_targets, write_report
from benchmarks.overhead.overhead import identity
from benchmarks.scaleout import _gil_model, _step_load

if TYPE_CHECKING:
    from batchproxy.integrations.ray import RayActors

CALLERS = 64
BATCH_SIZE = 16
WORKERS = 2  # worker processes, Ray actors; one CPU each
TARGET_PROCESSES_VS_THREAD = 1.6

DISPATCH_ITEMS = list(range(BATCH_SIZE))
PAYLOAD_ARRAYS = 16
PAYLOAD_FLOATS = 250_000  # float32: 1 MB per array
PAYLOAD_MB = PAYLOAD_ARRAYS * PAYLOAD_FLOATS * 4 / 1e6  # each way


@dataclass(frozen=True)
class Config:
    rounds: int  # turns per side, per phase
    round_seconds: float
    warmup_seconds: float
    calibration_batches: int
    ceiling_rounds: int
    ceiling_seconds: float
    dispatch_batches: int
    dispatch_warmup: int
    payload_round_trips: int


FULL = Config(
    rounds=8,
    round_seconds=1.25,
    warmup_seconds=1.0,
    calibration_batches=40,
    ceiling_rounds=4,
    ceiling_seconds=1.0,
    dispatch_batches=1_000,
    dispatch_warmup=50,
    payload_round_trips=20,
)
QUICK = Config(
    rounds=2,
    round_seconds=1.0,
    warmup_seconds=0.3,
    calibration_batches=5,
    ceiling_rounds=1,
    ceiling_seconds=0.5,
    dispatch_batches=100,
    dispatch_warmup=10,
    payload_round_trips=3,
)


# -- Ray, when installed -------------------------------------------------------------------


def import_ray() -> ModuleType | None:
    try:
        import ray
    except ImportError:
        return None
    return ray


def start_ray(ray: ModuleType) -> None:
    # actors unpickle the factories: send _gil_model by value, not by a name they may
    # not be able to import
    ray.cloudpickle.register_pickle_by_value(_gil_model)
    ray.init(
        num_cpus=WORKERS,
        include_dashboard=False,
        log_to_driver=False,
        logging_level=logging.WARNING,
    )


def ray_actors(factory: ModelFactory) -> RayActors:
    from batchproxy.integrations.ray import RayActors

    return RayActors(factory, WORKERS, num_cpus=1, name="scaleout")


# -- 0. the machine ------------------------------------------------------------------------


@dataclass(frozen=True)
class MachineResult:
    work: int  # loop iterations per item
    item_ms: float  # median over batches of 16, in this process
    item_ms_min: float
    item_ms_max: float
    one_process_items_per_s: float
    two_processes_items_per_s: float
    ceiling: float  # two / one
    ceiling_rounds: list[float]


def calibrate(batches: int) -> list[float]:
    """Milliseconds per item, batch after batch of 16, in this process."""
    items = list(range(BATCH_SIZE))
    costs = []
    for _ in range(batches):
        started = time.perf_counter()
        _gil_model.busy(_gil_model.WORK, items)
        costs.append((time.perf_counter() - started) / BATCH_SIZE * 1e3)
    return costs


def bare_rate(pool: ProcessPoolExecutor, processes: int, seconds: float) -> float:
    """Items/s of `processes` bare processes running the model at once, summed."""
    futures = [pool.submit(_gil_model.spin, _gil_model.WORK, seconds) for _ in range(processes)]
    done: list[tuple[int, float]] = [future.result() for future in futures]
    return sum(items / elapsed for items, elapsed in done)


def measure_machine(config: Config) -> MachineResult:
    costs = calibrate(config.calibration_batches)
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(WORKERS, mp_context=context) as pool:
        bare_rate(pool, WORKERS, 0.3)  # both processes up and warm
        one: list[float] = []
        two: list[float] = []
        for index in range(config.ceiling_rounds):
            if index % 2:
                two.append(bare_rate(pool, 2, config.ceiling_seconds))
                one.append(bare_rate(pool, 1, config.ceiling_seconds))
            else:
                one.append(bare_rate(pool, 1, config.ceiling_seconds))
                two.append(bare_rate(pool, 2, config.ceiling_seconds))
    return MachineResult(
        work=_gil_model.WORK,
        item_ms=statistics.median(costs),
        item_ms_min=min(costs),
        item_ms_max=max(costs),
        one_process_items_per_s=statistics.fmean(one),
        two_processes_items_per_s=statistics.fmean(two),
        ceiling=sum(two) / sum(one),
        ceiling_rounds=[b / a for a, b in zip(one, two, strict=True)],
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


async def run(config: Config, ray: ModuleType | None) -> dict[str, Any]:
    throughput = await measure_throughput(config, ray)
    dispatch, payload = await measure_overheads(config, ray)
    return {"throughput": throughput, "dispatch": dispatch, "payload": payload}


# -- report -----------------------------------------------------------------------------------


def verdict(met: bool) -> str:
    return "met" if met else "**missed**"


def machine_table(machine: MachineResult, config: Config) -> str:
    rounds = ", ".join(f"{r:.2f}" for r in machine.ceiling_rounds)
    return "\n".join(
        [
            "| measure | result |",
            "|---|---|",
            f"| model cost per item, this process ({config.calibration_batches} batches of "
            f"{BATCH_SIZE}) | {machine.item_ms:.3f} ms median ({machine.item_ms_min:.3f} to "
            f"{machine.item_ms_max:.3f} ms) |",
            f"| one bare process, back to back | {machine.one_process_items_per_s:,.0f} items/s |",
            f"| two bare processes at once | {machine.two_processes_items_per_s:,.0f} items/s |",
            f"| ceiling: two ÷ one | {machine.ceiling:.2f}x (rounds: {rounds}) |",
        ]
    )


def throughput_table(results: list[ThroughputResult]) -> str:
    lines = [
        "| phase | side | requests | throughput | ÷ one thread | per round: median (range) "
        "| mean batch | p50 | p99 | this process's CPU |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        ratio = f"{r.vs_thread:.2f}x"
        if r.side == "processes":
            met = r.vs_thread >= TARGET_PROCESSES_VS_THREAD
            ratio += f" (≥ {TARGET_PROCESSES_VS_THREAD:g}: {verdict(met)})"
        spread = (
            f"{statistics.median(r.vs_thread_rounds):.2f}x "
            f"({min(r.vs_thread_rounds):.2f} to {max(r.vs_thread_rounds):.2f})"
        )
        if r.side == "thread":
            ratio, spread = "1 (baseline)", "—"
        lines.append(
            f"| {r.phase} | {r.label} | {r.requests:,} | {r.throughput:,.0f}/s | {ratio} "
            f"| {spread} | {r.mean_batch_size:.1f} | {r.p50_ms:.1f} ms | {r.p99_ms:.1f} ms "
            f"| {r.own_cpu_cores:.2f} cores |"
        )
    return "\n".join(lines)


def throughput_notes(results: list[ThroughputResult], machine: MachineResult) -> str:
    lines = []
    by_side = {r.side: r for r in results if r.side != "thread"}
    if "processes" in by_side:
        r = by_side["processes"]
        lines.append(
            f"- 2 processes ÷ one thread: {r.vs_thread:.2f}x, target ≥ "
            f"{TARGET_PROCESSES_VS_THREAD:g}: {verdict(r.vs_thread >= TARGET_PROCESSES_VS_THREAD)};"
            f" {r.vs_thread / machine.ceiling:.0%} of the machine's own ceiling "
            f"({machine.ceiling:.2f}x, two bare processes ÷ one, measured in rounds of its own "
            f"before these: on a machine whose speed drifts the share is rough, and can pass "
            f"100 %)."
        )
    if "ray" in by_side:
        r = by_side["ray"]
        lines.append(
            f"- 2 Ray actors ÷ one thread: {r.vs_thread:.2f}x; "
            f"{r.vs_thread / machine.ceiling:.0%} of the machine's ceiling."
        )
    else:
        lines.append("- (c) 2 Ray actors: skipped, ray is not installed (`pip install ray`).")
    thread_rows = [r for r in results if r.side == "thread"]
    if len(thread_rows) == 2:
        without, with_ray = thread_rows
        lines.append(
            f"- One thread, without Ray and with Ray running: {without.throughput:,.0f}/s and "
            f"{with_ray.throughput:,.0f}/s."
        )
    lines.append(
        f"- Ideal one thread, from the per-item cost in section 0: "
        f"{1e3 / machine.item_ms:,.0f}/s; the machine's speed drifts, so each ratio compares "
        f"rounds that took turns, never runs far apart in time."
    )
    lines.append(
        "- This process's CPU: its CPU time over the rounds' wall time. For one thread it "
        "includes the model; for the others it is the proxy, the callers and the hand-off "
        "(pickling and pipes, or Ray's client), CPU the workers cannot have on a 2-CPU machine."
    )
    return "\n".join(lines)


def dispatch_table(results: list[DispatchResult]) -> str:
    lines = [
        "| executor | round trip p50 | p99 | added over direct await (p50) | per item (p50) |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.executor} | {r.p50_us:,.1f} µs | {r.p99_us:,.1f} µs | {r.added_p50_us:+,.1f} µs "
            f"| {r.per_item_us:,.2f} µs |"
        )
    return "\n".join(lines)


def payload_table(results: list[PayloadResult]) -> str:
    lines = [
        "| executor | payload | round trips | round trip p50 | min | moved (both ways) |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.executor} | {PAYLOAD_ARRAYS} x float32 of {PAYLOAD_MB / PAYLOAD_ARRAYS:g} MB "
            f"= {r.mb_each_way:g} MB each way | {r.round_trips} | {r.p50_ms:.1f} ms "
            f"| {r.min_ms:.1f} ms | {r.mb_per_s:,.0f} MB/s |"
        )
    return "\n".join(lines)


def report(machine: MachineResult, results: dict[str, Any], config: Config) -> str:
    return "\n\n".join(
        [
            f"### 0. The machine: model of {machine.work:,} loop iterations per item",
            machine_table(machine, config),
            f"### 1. Throughput: {CALLERS} callers, closed loop, batch_size={BATCH_SIZE}, "
            f"{config.rounds} rounds of {config.round_seconds:g} s per side and phase, "
            f"taking turns",
            throughput_table(results["throughput"]),
            throughput_notes(results["throughput"], machine),
            f"### 2. Dispatch cost: identity model, batches of {BATCH_SIZE} small ints one at a "
            f"time, {config.dispatch_batches:,} per executor, taking turns",
            dispatch_table(results["dispatch"]),
            payload_table(results["payload"]),
        ]
    )


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
