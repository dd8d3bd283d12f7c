"""The tuner checked against the real thing: `python -m benchmarks.models.tune` (`make bench-tune`).

For each model (`--model`, repeatable: `minilm`, MiniLM on this machine, and `gpu-sim`,
the GPU-shaped model of `benchmarks/servers`; default both):

1. `batchproxy.tune` measures the model through its proxy (its worker thread, its
   lengths) and recommends, from the simulation, the setting that serves the most
   open-loop traffic with p99 within the target (`--p99` in ms; default: twice the
   measured time of a batch of the largest size tried, of items of the median length:
   a call that waits for one such batch and then runs in the next meets it, so every
   size tried can meet it at a light load, and the settings differ in how much load
   they keep within it; twice the smallest batch's time, the first default, was the
   p99 of a lone call already, and so a coin toss for every setting);
2. an exhaustive sweep of real runs: every setting of the tuner's grid, on the real
   clock, under the same open-loop loads (Poisson arrivals, the same rates), each run
   `--calls` calls of sample items drawn at random, or fewer to last at most
   `--seconds` (but at least 30), the settings interleaved at each rate (the same
   calls for each, the order alternating); past the tuner's heaviest rate the rates go on up by
   30 % a step (to 3x it), since the real model may serve more than predicted; a setting
   stops at the first load it cannot keep up with, or whose p99 passes 2x the target;
3. the comparison: the recommended setting's real capacity (the highest rate served
   within the target, as the tuner computes it) over the best real setting's (target:
   >= 0.90), and the predicted p99 over the measured one at each load both keep up with
   (target: within 20 %). The tuner is asked for runs as long as the real ones at most
   are (`--requests`, the `--calls` here), and prints at each load the median of 10
   simulated runs (`--paths`); near capacity a run's p99 grows with its length. A
   real run cut short by `--seconds` (a light load) is compared with the tuner's model
   of a run as long as it (`same_length`), the tuner's own printed beside it.

torch runs on one thread (`torch.set_num_threads(1)`): on a shared 2-core machine two
threads fight the other processes for the cores and the times swing by x3. Once the
models are loaded the process freezes the garbage collector's heap, as the service does
(`Serving`'s default). A real run times each call from its arrival time (a call the
loop starts late, behind gpu-sim's GIL-holding launch, waits that long too). The
numbers are printed with the targets, not asserted; `--quick` runs a small grid
(two batch sizes, one slot) with few calls a run.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from typing import Any

from batchproxy import simulation
from batchproxy._collector import freezes
from batchproxy.tune import Analysis, Load, Outcome, Setting, Simulator, analyse, fit, measure
from batchproxy.tune._choose import capacity
from batchproxy.tune._sweep import outcome_of
from benchmarks._harness.report import arguments, environment, headline, write_report
from benchmarks.models._tune_models import MODELS, ModelUnderTest

MIN_CALLS = 30
CAPACITY_TARGET = 0.90
P99_TARGET = 0.20
PATHS = 10
"""Simulated runs behind each like-for-like prediction (`same_length`)."""


def _extra(parser: Any) -> None:
    parser.add_argument("--model", action="append", choices=sorted(MODELS), default=None)
    parser.add_argument("--p99", type=float, default=None, help="the target, in ms")
    parser.add_argument("--calls", type=int, default=None, help="calls per real run, at most")
    parser.add_argument(
        "--seconds", type=float, default=None, help="a real run's length, at most (>= 30 calls)"
    )


async def _measure(model: ModelUnderTest, sizes: Sequence[int]) -> Any:
    """The model measured as `python -m batchproxy.tune` measures it (its repeats and
    warm-up: the spread the simulation draws from comes from those repeats)."""
    proxy = model.build()
    sample = model.sample()
    async with proxy:
        _as_served()
        return await measure(proxy, sample, sizes=sizes), sample


def _as_served() -> None:
    """Collect once and freeze what is alive (the model, torch, transformers), as the
    service does once loaded (`Serving`'s `freeze_gc`, on by default), through the same
    holder, for the process's life: unfrozen, a full collection walks all of it, and
    takes 170 ms here in one run in a few at 2,000 calls/s, a pause the served model
    does not have."""
    freezes.hold()


async def _real_sweep(
    model: ModelUnderTest,
    settings: Sequence[Setting],
    rates: Sequence[float],
    sample: list[Any],
    calls: int,
    target: float,
    seconds: float,
    latencies: dict[tuple[Setting, float], list[float]],
) -> dict[Setting, list[Outcome]]:
    """Every setting on the real clock under each rate, lightest first, interleaved: at
    each rate every setting still going runs once (the order alternating), so a spell of
    load on the machine falls on all of them; a setting stops as described above. Each
    run's latencies, sorted, go in `latencies` by setting and rate."""
    results: dict[Setting, list[Outcome]] = {setting: [] for setting in settings}
    async with contextlib.AsyncExitStack() as stack:
        proxies = {}
        for setting in settings:
            proxy = await stack.enter_async_context(model.build(**setting.keywords()))
            await proxy.inference_many(sample[: setting.batch_size])  # the first-shape warm-up
            proxies[setting] = proxy
        _as_served()
        going = list(settings)
        for step, rate in enumerate(_beyond(rates)):
            count = max(MIN_CALLS, min(calls, round(rate * seconds)))
            rng = random.Random(step)
            items = [rng.choice(sample) for _ in range(count)]  # the same for every setting
            for setting in going if step % 2 == 0 else going[::-1]:
                done = await _open_run(proxies[setting], items, rate)
                outcome = outcome_of(setting, Load("open", rate), done)
                latencies[setting, rate] = sorted(e - b for b, e in done if e is not None)
                results[setting].append(outcome)
                print(
                    f"  real {setting.label()} at {rate:.1f}/s: {outcome.throughput:.1f}/s, "
                    f"p50 {outcome.p50 * 1e3:.0f} ms, p99 {outcome.p99 * 1e3:.0f} ms"
                    + ("" if outcome.sustained else " (falls behind)"),
                    flush=True,
                )
            going = [
                s for s in going if results[s][-1].sustained and results[s][-1].p99 <= 2 * target
            ]
            if not going:
                break
    return results


def same_length(simulator: Simulator, setting: Setting, rate: float, calls: int) -> float:
    """The tuner's model of a real run as long as the real one: its typical run
    (`Simulator.typical`, the median of `PATHS` runs) of `calls` calls. The tuner's
    own is a typical run of `--calls` calls, and a run cut short by `--seconds` is
    shorter: near capacity a longer run meets bigger bursts (on MiniLM at 73 calls/s,
    10 paths of 2,000 calls had a median p99 of 389 ms, of 585 calls 282)."""
    return replace(simulator, requests=calls).typical(setting, Load("open", rate), PATHS).p99


def _quantiles(spread: Sequence[float]) -> dict[str, float]:
    """The measured batches' times over their shape's median (`Measurement.spread`, what
    the simulation draws each batch's factor from): one slow batch in a hundred sets
    the simulated tail, so the report shows it."""
    n = len(spread)
    return {
        "batches": n,
        **{f"p{q}": spread[min(n - 1, int(q / 100 * n))] for q in (50, 90, 99)},
        "max": spread[-1],
    }


def p99_interval(latencies: Sequence[float]) -> tuple[float, float]:
    """A 95 % interval of the p99 of the population `latencies` (sorted) were drawn
    from, distribution-free: the order statistics around rank 0.99 n, 1.96 binomial
    standard deviations either side (a run of 300 calls knows its p99 only as one of its
    8 slowest calls)."""
    n = len(latencies)
    if n == 0:
        return 0.0, 0.0
    middle, spread = 0.99 * n, 1.96 * math.sqrt(n * 0.99 * 0.01)
    low = max(0, math.floor(middle - spread) - 1)
    high = min(n - 1, math.ceil(middle + spread) - 1)
    return latencies[low], latencies[high]


def _beyond(rates: Sequence[float]) -> list[float]:
    """The tuner's rates, then on by 30 % a step up to 3x its heaviest: the real model
    may serve more than the measured one predicted, and its capacity is where it stops."""
    more = list(rates)
    while more[-1] * 1.3 <= 3 * rates[-1]:
        more.append(more[-1] * 1.3)
    return more


async def _open_run(proxy: Any, items: list[Any], rate: float) -> list[tuple[float, float | None]]:
    """Poisson arrivals at `rate` on the real clock, one call per item: each call's start
    (when it was due: a late start, behind a loop the model's launch held, is part of
    the call's wait, as in `simulation.open_loop`) and end (None: it failed)."""
    loop = asyncio.get_running_loop()
    done: list[tuple[float, float | None]] = []
    arrivals = simulation.poisson(rate, len(items) / rate, seed=0)

    async def call(index: int) -> None:
        started = min(loop.time(), origin + arrivals[index])
        try:
            await proxy.inference(items[index])
        except Exception:
            done.append((started, None))
        else:
            done.append((started, loop.time()))

    origin = loop.time()  # (open_loop's own origin: it takes it before its first await)
    await simulation.open_loop(call, arrivals)
    return done


def check(
    model: ModelUnderTest, quick: bool, p99_ms: float | None, calls: int, seconds: float
) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    sizes = (4, 16) if quick else (4, 8, 16, 32)
    started = time.perf_counter()
    measurement, sample = asyncio.run(_measure(model, (1, *sizes)))
    lengths = sorted(measurement.lengths or [0])
    curve = fit(measurement)
    typical = lengths[len(lengths) // 2]
    target = p99_ms / 1e3 if p99_ms else 2 * curve(sizes[-1], typical)
    analysis: Analysis = analyse(
        measurement,
        target=target,
        sizes=sizes,
        slots=(1,) if quick else (1, 2),
        delays_ms=(5.0,),
        rates=6 if quick else 10,
        requests=calls,  # `--requests`: the tuner predicts runs as long as the real ones
        paths=PATHS,
    )
    rates = sorted({o.load.value for o in analysis.outcomes})
    print(f"{model.name}: {curve.describe()}; p99 target {target * 1e3:.0f} ms", flush=True)
    print(f"  recommended: {analysis.recommendation.choice.setting.label()}", flush=True)
    latencies: dict[tuple[Setting, float], list[float]] = {}
    real = asyncio.run(
        _real_sweep(model, analysis.settings, rates, sample, calls, target, seconds, latencies)
    )
    real_capacity = {s: capacity(o, target) for s, o in real.items()}
    chosen = analysis.recommendation.choice.setting
    best = max(real_capacity, key=lambda s: real_capacity[s])
    share = real_capacity[chosen] / real_capacity[best] if real_capacity[best] > 0 else 0.0
    predicted = {o.load.value: o for o in analysis.recommendation.expected}
    compared = [
        o
        for o in real[chosen]
        if o.sustained and o.load.value in predicted and predicted[o.load.value].sustained
    ]
    errors = []
    for o in compared:
        calls_run = len(latencies[chosen, o.load.value])
        alike = same_length(analysis.simulator, chosen, o.load.value, calls_run)
        errors.append((o.load.value, predicted[o.load.value].p99, alike, o.p99))
    ratios = [alike / meas - 1 for _, _, alike, meas in errors if meas > 0]
    intervals = [p99_interval(latencies[chosen, rate]) for rate, _, _, _ in errors]
    served = analysis.recommendation.capacity
    return {
        "model": model.name,
        "target_p99_ms": target * 1e3,
        "cost_curve": curve.describe(),
        "measured_spread": _quantiles(measurement.spread),
        "rates": rates,
        "recommended": chosen.label(),
        "recommended_predicted_capacity": analysis.recommendation.capacity,
        "real_capacity": {s.label(): c for s, c in real_capacity.items()},
        "best_real": best.label(),
        "capacity_share": share,
        "p99_errors": [
            {
                "rate": r,
                "predicted_ms": tuner * 1e3,
                "predicted_same_length_ms": p * 1e3,
                "measured_ms": m * 1e3,
                "measured_interval_ms": [low * 1e3, high * 1e3],
                "calls": len(latencies[chosen, r]),
                "within_recommended_capacity": r <= served,
                "within_20_percent": m > 0 and abs(p / m - 1) <= P99_TARGET,
                "within_20_percent_as_printed": m > 0 and abs(tuner / m - 1) <= P99_TARGET,
                "within_20_percent_of_interval": (1 - P99_TARGET) * low
                <= p
                <= (1 + P99_TARGET) * high,
            }
            for (r, tuner, p, m), (low, high) in zip(errors, intervals, strict=True)
        ],
        "p99_error_median": statistics.median(ratios) if ratios else None,
        "p99_error_worst": max(ratios, key=abs) if ratios else None,
        "real_runs": [asdict(o) | {"setting": o.setting.label()} for v in real.values() for o in v],
        "seconds": time.perf_counter() - started,
    }


def main(argv: Sequence[str] | None = None) -> None:
    run = arguments("tune", __doc__, argv, extra=_extra)
    env = environment(load_average=os.getloadavg())
    print(headline("tune", env, quick=run.quick))
    calls = run.args.calls or (120 if run.quick else 600)
    seconds = run.args.seconds or (15.0 if run.quick else 120.0)
    results = [
        check(MODELS[name], run.quick, run.args.p99, calls, seconds)
        for name in run.args.model or ["minilm", "gpu-sim"]
    ]
    print(
        "\n| model | recommended | best real | real capacity, recommended / best | "
        "p99 predicted / measured - 1 (median, worst) |"
    )
    print("|---|---|---|---|---|")
    for r in results:
        median, worst = r["p99_error_median"], r["p99_error_worst"]
        errors = "n/a" if median is None else f"{median:+.0%}, {worst:+.0%}"
        print(
            f"| {r['model']} | {r['recommended']} | {r['best_real']} | "
            f"{r['capacity_share']:.2f} | {errors} |"
        )
    for r in results:
        print(f"\n{r['model']}, the recommendation's p99 at each load both keep up with:")
        print(
            "| load (calls/s) | calls | predicted p99 (ms): the tuner's, for a run as long "
            "| measured p99 (ms), 95 % interval | predicted (as long) / measured - 1 "
            "| the tuner's / measured - 1 | within 20 % of the interval |"
        )
        print("|---|---|---|---|---|---|---|")
        for e in r["p99_errors"]:
            alike = e["predicted_same_length_ms"]
            measured = e["measured_ms"]
            error = alike / measured - 1 if measured > 0 else 0.0
            printed = e["predicted_ms"] / measured - 1 if measured > 0 else 0.0
            low, high = e["measured_interval_ms"]
            print(
                f"| {e['rate']:.1f}{'' if e['within_recommended_capacity'] else ' (beyond)'} "
                f"| {e['calls']} | {e['predicted_ms']:.0f}, {alike:.0f} | "
                f"{measured:.0f} ({low:.0f}-{high:.0f}) | {error:+.0%} | {printed:+.0%} | "
                f"{'yes' if e['within_20_percent_of_interval'] else 'no'} |"
            )
    write_report(
        run.output,
        env,
        quick=run.quick,
        config={
            "calls_per_run": calls,
            "seconds_per_run": seconds,
            "tuner_requests": calls,
            "tuner_paths": PATHS,
            "models": [r["model"] for r in results],
        },
        targets={
            "capacity_share": f">= {CAPACITY_TARGET}",
            "p99_error": f"within +-{P99_TARGET:.0%}",
        },
        results={"models": results},
    )


if __name__ == "__main__":
    main()
