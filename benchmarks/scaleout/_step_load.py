"""Section 3 of `scaleout.py` (`--autoscale`): an autoscaled pool under a step load.

`Proxy(offload=RayActors(sleepy, 1, num_cpus=0.25, autoscaling=Autoscaling(...)),
batch_size=8)` on `ray.init(num_cpus=2)` (8 replicas x 0.25 CPU fit). The model
sleeps 50 ms per batch whatever its size (`time.sleep`: the replicas do not compete
for CPU), so one replica serves at most 8 / 0.05 = 160 requests/s, with full
batches. The autoscaler aims at `TARGET` batches in flight per replica.

An open loop of Poisson arrivals steps through the config's `levels`, in
replicas' worth: a level L offers L x TARGET x 160 requests/s, which keeps
L x TARGET batches in flight if they are full, so ceil(L) replicas at the target
(levels 0.8 and 7.5: 1 and 8 replicas, not on the edge between two counts). Every
`SAMPLE` seconds it records the throughput (requests answered per
second), the replica count asked for and the ready count, the load the autoscaler
reads and what it calls for, and the mean batch size.

Per step: how long from the step to the first decision, to the replica count
(asked for, then ready) reaching the count it holds at the end of the phase, and to
the throughput following: its 1 s mean reaching 90% of the new offer (up), or
falling within 110% of it (down: the backlog is served). Writes JSON
and a plot of offered load, throughput and replicas over time.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from batchproxy import Autoscaling, Proxy, simulation
from batchproxy._executors.base import ModelFn

MODEL_SECONDS = 0.05
BATCH_SIZE = 8
REPLICA_RATE = BATCH_SIZE / MODEL_SECONDS  # requests/s one replica serves, full batches
MAX_REPLICAS = 8
CPUS_PER_REPLICA = 0.25
RAY_CPUS = 2
TARGET = 0.8  # batches in flight per replica: 20% headroom
SAMPLE = 0.25  # seconds between samples
FOLLOW_WINDOW = 1.0  # seconds: throughput is averaged over this to say it follows
FOLLOW_TOLERANCE = 0.10


@dataclass(frozen=True)
class StepConfig:
    levels: tuple[float, ...]  # offered load per phase, in replicas' worth
    phase_seconds: float
    upscale_delay: float
    downscale_delay: float
    interval: float


FULL = StepConfig(
    levels=(0.8, 7.5, 0.8),
    phase_seconds=25.0,
    upscale_delay=2.0,
    downscale_delay=8.0,
    interval=0.5,
)
QUICK = StepConfig(
    levels=(0.8, 7.5, 0.8),
    phase_seconds=12.0,
    upscale_delay=1.0,
    downscale_delay=3.0,
    interval=0.25,
)


def sleepy() -> ModelFn:
    """The model factory: a batch takes MODEL_SECONDS, whatever its size."""

    def run(items: list[Any]) -> list[Any]:
        time.sleep(MODEL_SECONDS)
        return items

    return run


def offered_rate(level: float) -> float:
    return level * TARGET * REPLICA_RATE


# -- the run --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    t: float  # seconds since the load started
    offered: float  # requests/s offered now
    answered: int  # calls answered so far (results and errors)
    replicas: int  # the count asked for
    ready: int
    pending: int
    load: float  # what the autoscaler reads
    desired: int | None  # what the last autoscaler sample called for
    batches: int  # batches sent so far
    items: int  # items sent so far
    queued: int


@dataclass(frozen=True)
class Step:
    at: float
    from_level: float
    to_level: float
    settled_replicas: int  # the count asked for at the end of the phase
    first_decision_s: float | None
    replicas_s: float | None  # until the count asked for reached settled_replicas
    ready_s: float | None  # until as many replicas were ready
    throughput_s: float | None  # until the 1 s throughput came within 10% of the offer


@dataclass(frozen=True)
class Phase:
    level: float
    offered: float  # requests/s
    calls: int
    failed: int
    p50_ms: float
    p99_ms: float
    settled_replicas: int
    mean_batch: float  # over the last half of the phase


def arrivals(config: StepConfig) -> tuple[list[float], list[int]]:
    """Poisson arrival times over the phases, and each one's phase."""
    times: list[float] = []
    phases: list[int] = []
    for index, level in enumerate(config.levels):
        start = index * config.phase_seconds
        burst = simulation.poisson(offered_rate(level), config.phase_seconds, seed=index + 1)
        times += [start + t for t in burst]
        phases += [index] * len(burst)
    return times, phases


async def drive(config: StepConfig, ray: Any) -> dict[str, Any]:
    from batchproxy.integrations.ray import RayActors

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    autoscaling = Autoscaling(
        min_replicas=1,
        max_replicas=MAX_REPLICAS,
        target_batches_per_replica=TARGET,
        upscale_delay=config.upscale_delay,
        downscale_delay=config.downscale_delay,
        interval=config.interval,
    )
    loop = asyncio.get_running_loop()
    times, phases = arrivals(config)
    latencies: list[float | None] = [None] * len(times)
    samples: list[Sample] = []
    actors = RayActors(
        sleepy, 1, num_cpus=CPUS_PER_REPLICA, autoscaling=autoscaling, name="autoscale"
    )
    proxy: Proxy[int, Any] = Proxy(offload=actors, batch_size=BATCH_SIZE, name="step")
    async with actors, proxy:
        for i in range(3):  # warm: the replica answers
            await proxy.inference(i)
        start = loop.time()
        done = asyncio.Event()
        answered = 0

        async def call(index: int) -> None:
            nonlocal answered
            issued = loop.time()
            try:
                await proxy.inference(index)
            finally:
                answered += 1
            latencies[index] = loop.time() - issued

        async def sample() -> None:
            base = proxy.stats
            while not done.is_set():
                t = loop.time() - start
                phase = min(int(t // config.phase_seconds), len(config.levels) - 1)
                stats, pool = proxy.stats, actors.stats
                scaling = pool.autoscaler
                samples.append(
                    Sample(
                        t=t,
                        offered=offered_rate(config.levels[phase]),
                        answered=answered,
                        replicas=pool.replicas,
                        ready=pool.ready,
                        pending=pool.pending,
                        load=actors.autoscale_load(),
                        desired=None if scaling is None else scaling.desired,
                        batches=stats.batches - base.batches,
                        items=stats.items - base.items,
                        queued=stats.queue_depth,
                    )
                )
                await asyncio.sleep(SAMPLE - (loop.time() - start) % SAMPLE)

        sampler = loop.create_task(sample())
        trace = await simulation.open_loop(call, times)
        done.set()
        await sampler
        autoscaler = actors.stats.autoscaler
    return {
        "samples": samples,
        "phases": phase_results(config, phases, latencies, samples),
        "steps": step_results(config, samples),
        "calls": trace.issued,
        "failed": trace.failed,
        "autoscaler": None if autoscaler is None else asdict(autoscaler),
    }


# -- the numbers ----------------------------------------------------------------------------


def throughput(samples: Sequence[Sample]) -> list[float]:
    """Requests answered per second at each sample, over the FOLLOW_WINDOW before it."""
    rates = []
    back = round(FOLLOW_WINDOW / SAMPLE)
    for i, s in enumerate(samples):
        earlier = samples[max(0, i - back)]
        dt = s.t - earlier.t
        rates.append((s.answered - earlier.answered) / dt if dt > 0 else 0.0)
    return rates


def step_results(config: StepConfig, samples: Sequence[Sample]) -> list[Step]:
    rates = throughput(samples)
    steps = []
    for index in range(1, len(config.levels)):
        at = index * config.phase_seconds
        during = [
            (s, rate)
            for s, rate in zip(samples, rates, strict=True)
            if at <= s.t < at + config.phase_seconds
        ]
        if during:
            before = [s for s in samples if s.t < at][-1].replicas
            steps.append(one_step(config, index, at, before, during))
    return steps


def one_step(
    config: StepConfig, index: int, at: float, before: int, during: list[tuple[Sample, float]]
) -> Step:
    """The reaction times to the step into phase `index`, from its samples."""
    settled = during[-1][0].replicas
    offer = offered_rate(config.levels[index])
    decided = asked = ready = follows = None
    for s, rate in during:
        since = s.t - at
        if decided is None and s.replicas != before:
            decided = since
        if asked is None and s.replicas == settled:
            asked = since
        if ready is None and s.replicas == settled and s.ready >= settled:
            ready = since
        # up: it serves what is offered; down: the backlog is gone (it serves no more)
        up = config.levels[index] > config.levels[index - 1]
        close = (
            rate >= (1 - FOLLOW_TOLERANCE) * offer if up else rate <= (1 + FOLLOW_TOLERANCE) * offer
        )
        if follows is None and since >= FOLLOW_WINDOW and close:
            follows = since
    return Step(
        at=at,
        from_level=config.levels[index - 1],
        to_level=config.levels[index],
        settled_replicas=settled,
        first_decision_s=decided,
        replicas_s=asked,
        ready_s=ready,
        throughput_s=follows,
    )


def phase_results(
    config: StepConfig,
    phases: Sequence[int],
    latencies: Sequence[float | None],
    samples: Sequence[Sample],
) -> list[Phase]:
    results = []
    for index, level in enumerate(config.levels):
        mine = [latencies[i] for i, p in enumerate(phases) if p == index]
        ok = sorted(x for x in mine if x is not None)
        start = index * config.phase_seconds
        half = [s for s in samples if start + config.phase_seconds / 2 <= s.t]
        half = [s for s in half if s.t < start + config.phase_seconds] or half[-1:]
        batches = half[-1].batches - half[0].batches if half else 0
        items = half[-1].items - half[0].items if half else 0
        results.append(
            Phase(
                level=level,
                offered=offered_rate(level),
                calls=len(mine),
                failed=len(mine) - len(ok),
                p50_ms=1e3 * quantile(ok, 0.50),
                p99_ms=1e3 * quantile(ok, 0.99),
                settled_replicas=half[-1].replicas if half else 0,
                mean_batch=items / batches if batches else 0.0,
            )
        )
    return results


def quantile(ordered: Sequence[float], q: float) -> float:
    if not ordered:
        return math.nan
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


# -- report ---------------------------------------------------------------------------------


def seconds(value: float | None) -> str:
    return "never" if value is None else f"{value:.1f} s"


def report(config: StepConfig, results: dict[str, Any]) -> str:
    lines = [
        f"### 3. Autoscaling: a step load on RayActors(sleepy, num_cpus={CPUS_PER_REPLICA}), "
        f"batch_size={BATCH_SIZE}, {MODEL_SECONDS * 1e3:g} ms a batch; "
        f"Autoscaling(1..{MAX_REPLICAS}, target {TARGET:g}, up after "
        f"{config.upscale_delay:g} s, down after {config.downscale_delay:g} s, "
        f"sampled every {config.interval:g} s)",
        "",
        "| phase | offered (req/s) | calls | failed | p50 | p99 | replicas at the end "
        "| mean batch (2nd half) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for index, phase in enumerate(results["phases"]):
        lines.append(
            f"| {index + 1}: {phase.level:g} replicas' worth | {phase.offered:.0f} | "
            f"{phase.calls:,} | {phase.failed} | {phase.p50_ms:.0f} ms | {phase.p99_ms:.0f} ms | "
            f"{phase.settled_replicas} | {phase.mean_batch:.1f} |"
        )
    lines += [
        "",
        "| step | first decision | replicas asked for | replicas ready | throughput follows |",
        "|---|---:|---:|---:|---:|",
    ]
    for step in results["steps"]:
        lines.append(
            f"| {step.from_level:g} -> {step.to_level:g} at {step.at:g} s "
            f"(to {step.settled_replicas} replicas) | {seconds(step.first_decision_s)} | "
            f"{seconds(step.replicas_s)} | {seconds(step.ready_s)} | "
            f"{seconds(step.throughput_s)} |"
        )
    scaling = results["autoscaler"] or {}
    lines += [
        "",
        f"Decisions: {scaling.get('scale_ups')} up, {scaling.get('scale_downs')} down. "
        f"Times are from the step; the throughput follows once its {FOLLOW_WINDOW:g} s mean "
        f"reaches {1 - FOLLOW_TOLERANCE:.0%} of the new offer (up) or falls within "
        f"{1 + FOLLOW_TOLERANCE:.0%} of it (down).",
    ]
    return "\n".join(lines)


def plot(config: StepConfig, results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples: list[Sample] = results["samples"]
    t = [s.t for s in samples]
    fig, (top, middle, bottom) = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    top.plot(t, [s.offered for s in samples], label="offered", color="grey", drawstyle="steps-post")
    top.plot(t, throughput(samples), label=f"answered ({FOLLOW_WINDOW:g} s mean)")
    top.set_ylabel("requests/s")
    top.legend(loc="upper right")
    middle.plot(t, [s.replicas for s in samples], label="asked for", drawstyle="steps-post")
    middle.plot(t, [s.ready for s in samples], label="ready", drawstyle="steps-post")
    middle.plot(
        t,
        [math.nan if s.desired is None else s.desired for s in samples],
        label="desired (last sample)",
        linestyle=":",
        drawstyle="steps-post",
    )
    middle.set_ylabel("replicas")
    middle.set_ylim(0, MAX_REPLICAS + 1)
    middle.legend(loc="upper right")
    bottom.plot(t, [s.load for s in samples], label="load the autoscaler reads")
    bottom.set_yscale("symlog", linthresh=10)
    bottom.set_ylabel("load (batches)")
    bottom.set_xlabel("seconds")
    sizes = []
    for before, after in itertools.pairwise(samples):
        batches = after.batches - before.batches
        sizes.append((after.items - before.items) / batches if batches else math.nan)
    right = bottom.twinx()
    right.plot(t[1:], sizes, label="mean batch size", color="tab:orange", alpha=0.6)
    right.set_ylim(0, BATCH_SIZE + 1)
    right.set_ylabel("items per batch")
    lines = bottom.get_legend_handles_labels()
    more = right.get_legend_handles_labels()
    bottom.legend(lines[0] + more[0], lines[1] + more[1], loc="upper right")
    for axis in (top, middle, bottom):
        for index in range(1, len(config.levels)):
            axis.axvline(index * config.phase_seconds, color="black", linewidth=0.5)
    fig.suptitle(
        f"Autoscaling under a step load: levels {', '.join(f'{x:g}' for x in config.levels)} "
        f"replicas' worth, up after {config.upscale_delay:g} s, down after "
        f"{config.downscale_delay:g} s"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot written to {path}")


def start_ray(ray: Any) -> None:
    ray.init(
        num_cpus=RAY_CPUS,
        include_dashboard=False,
        log_to_driver=False,
        logging_level=logging.WARNING,
    )


def run(config: StepConfig, ray: Any) -> dict[str, Any]:
    start_ray(ray)
    try:
        return asyncio.run(drive(config, ray))
    finally:
        ray.shutdown()


def document(config: StepConfig, results: dict[str, Any]) -> dict[str, Any]:
    """The results as the JSON document has them (its `config` is `asdict(config)`)."""
    return {
        "workload": {
            "model_seconds": MODEL_SECONDS,
            "batch_size": BATCH_SIZE,
            "replica_rate": REPLICA_RATE,
            "max_replicas": MAX_REPLICAS,
            "cpus_per_replica": CPUS_PER_REPLICA,
            "ray_cpus": RAY_CPUS,
            "target_batches_per_replica": TARGET,
            "offered": [offered_rate(level) for level in config.levels],
        },
        "calls": results["calls"],
        "failed": results["failed"],
        "autoscaler": results["autoscaler"],
        "phases": [asdict(p) for p in results["phases"]],
        "steps": [asdict(s) for s in results["steps"]],
        "samples": [asdict(s) for s in results["samples"]],
    }
