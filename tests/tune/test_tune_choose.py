"""`batchproxy.tune`'s simulated sweep and choice: for a model of known cost, what it
recommends is what the cost model implies."""

from __future__ import annotations

from typing import Any

import pytest

import batchproxy
from batchproxy.tune import Measurement, Point, TuneError, analyse

SIZES = (1, 2, 4, 8, 16, 32, 64)


def cost(size: int) -> float:
    return 0.010 + 0.001 * size


def measured(lanes: int = 1, shape=cost, factors=(1.0,)) -> Measurement:  # type: ignore[no-untyped-def]
    """Each batch size measured at `shape`'s time, once per factor (times the factor)."""
    points = tuple(Point(size, None, tuple(f * shape(size) for f in factors)) for size in SIZES)
    return Measurement("toy", points, batchproxy.Options(batch_size=64), lanes, None, False)


FAST = {"requests": 400, "sizes": (8, 16, 32, 64), "delays_ms": (5.0,), "paths": 1}


@pytest.mark.parametrize("seed", [0, 1])
def test_for_the_most_throughput_the_largest_batch_and_what_it_serves(seed: int) -> None:
    # 64 serves 865 calls/s at most, 32 serves 762: telling them apart takes rates
    # closer than 9 % of the ceiling, and runs long enough that one run's arrivals do
    # not decide (with 12 rates and 400 calls, one seed in eight picked 32: checked
    # over seeds 0-7 with these)
    fine = {**FAST, "requests": 1000, "rates": 24}
    analysis = analyse(measured(), slots=(1,), seed=seed, **fine)  # type: ignore[arg-type]
    rec = analysis.recommendation
    assert rec.target is None
    assert rec.choice.setting.batch_size == 64  # 865 calls/s; 32 serves 762
    ceiling = 64 / cost(64)
    assert 0.75 * ceiling <= rec.choice.capacity <= ceiling
    assert rec.ranking[0] is rec.choice
    assert [c.capacity for c in rec.ranking[1:]] == sorted(
        (c.capacity for c in rec.ranking[1:]), reverse=True
    )
    # one caller on an idle proxy: its call goes at once, a batch of one
    alone = next(o for o in rec.closed if o.load.value == 1)
    assert alone.p50 == pytest.approx(cost(1))
    assert alone.p99 == pytest.approx(cost(1))
    assert rec.knee is not None
    assert rec.knee.load.value <= rec.choice.capacity
    extras = {e.what: e for e in rec.extras}
    assert 1.6 <= extras["another replica"].capacity / rec.choice.capacity <= 2.3
    assert extras["another replica"].lanes == 2
    # one lane: a second slot lets the next batch form early, it adds no model time
    assert extras["one more batch slot"].capacity <= 1.1 * rec.choice.capacity


def test_a_p99_target_caps_the_batch_at_what_fits_in_it() -> None:
    """p99 <= 60 ms: a caller may wait for a running batch and then its own, so a full
    batch must take at most about half the target: no batch of 64 (74 ms)."""
    target = 0.060
    analysis = analyse(measured(), target=target, slots=(1,), **FAST)  # type: ignore[arg-type]
    rec = analysis.recommendation
    best = rec.choice
    assert cost(best.setting.batch_size) <= target
    assert best.capacity <= 20 / cost(20) * 1.1  # 2 x cost(n) <= 60 ms: n <= 20
    assert best.capacity > 0
    met = [o for o in best.outcomes if o.load.value <= best.capacity]
    assert met
    assert all(o.p99 <= target for o in met)
    loose = analyse(measured(), slots=(1,), **FAST).recommendation  # type: ignore[arg-type]
    assert best.capacity < loose.choice.capacity


def test_with_two_lanes_the_most_throughput_uses_both() -> None:
    analysis = analyse(measured(lanes=2), slots=(1, 2), **FAST)  # type: ignore[arg-type]
    setting = analysis.recommendation.choice.setting
    assert setting.max_concurrent_batches == 2
    assert analysis.recommendation.choice.capacity > 64 / cost(64)  # more than one lane


def test_a_gpu_shaped_cost_recommends_the_flat_part_for_a_tight_target() -> None:
    """5 ms for up to 32 items, then 0.5 ms an item more: under p99 <= 12 ms a batch of
    64 (21 ms) never fits, one of 32 (5 ms) does."""

    def flat_then_linear(size: int) -> float:
        return 0.005 + 0.0005 * max(0, size - 32)

    rec = analyse(
        measured(shape=flat_then_linear),
        target=0.012,
        slots=(1,),
        **FAST,  # type: ignore[arg-type]
    ).recommendation
    assert rec.choice.setting.batch_size == 32
    assert rec.choice.capacity > 16 / 0.005  # more than batches of 16 back to back could


def test_an_impossible_target_is_refused_with_the_reason() -> None:
    with pytest.raises(TuneError, match=r"no setting serves even the lightest load .* 5 ms"):
        analyse(measured(), target=0.005, slots=(1,), **FAST)  # type: ignore[arg-type]


def test_a_model_whose_time_varies_is_predicted_with_its_tail() -> None:
    """The simulation draws each batch's time from the measured spread around the
    curve: at the same light load, a model whose batches take twice their median one
    time in ten gets a higher p99 than one that always takes its median (the p99 is
    made of those slow batches), and the same seed gives the same prediction."""
    varied = measured(factors=(1.0,) * 9 + (2.0,))  # one batch in ten takes twice the median
    assert varied.spread[-1] == pytest.approx(2.0)

    def light_p99(measurement: Measurement) -> float:
        analysis = analyse(measurement, slots=(1,), rates=4, **FAST)  # type: ignore[arg-type]
        lightest = min(o.load.value for o in analysis.outcomes)
        return max(o.p99 for o in analysis.outcomes if o.load.value == lightest)

    steady, spread = light_p99(measured()), light_p99(varied)
    assert spread >= 1.3 * steady  # (1.43x: deterministic, the seed is fixed)
    assert light_p99(varied) == spread


def test_a_runs_arrivals_do_not_repeat_its_lengths_draws(monkeypatch: pytest.MonkeyPatch) -> None:
    """The simulated items' lengths came from `random.Random(seed)`, and the open-loop
    arrivals from `simulation.poisson(seed=seed)`: a second generator of the same seed,
    so every gap between arrivals repeated a length's draw (found reading the code, as
    the batches' factors were, 82b72e9). Each stream now has draws of its own, and the
    same seed still gives the same run."""
    from batchproxy import simulation
    from batchproxy.tune import Setting
    from batchproxy.tune._sweep import Load, Simulator

    seen: list[list[float]] = []
    real_open_loop = simulation.open_loop

    async def recording(call: Any, arrivals: Any) -> Any:
        seen.append(list(arrivals))
        return await real_open_loop(call, arrivals)

    monkeypatch.setattr(simulation, "open_loop", recording)
    simulator = Simulator(lambda n, length: 0.001 + 0.0001 * n, 1, lengths=(3, 9), requests=50)
    setting = Setting(batch_size=8, max_delay_ms=2.0, max_concurrent_batches=1)
    first = simulator.run(setting, Load("open", 500.0))
    again = simulator.run(setting, Load("open", 500.0))
    assert seen[0] == seen[1]  # the same seed, the same run
    assert first == again
    assert seen[0] != simulation.poisson(500.0, 50 / 500.0, seed=simulator.seed)


def test_a_typical_run_is_the_median_of_several_and_says_their_range() -> None:
    """One simulated run is one path of arrivals: near capacity its p99 rests on a few
    bursts. `Simulator.typical` runs `paths` seeds and keeps their medians, and the
    lowest and highest p99; one path is the run itself."""
    from batchproxy.tune import Setting, fit
    from batchproxy.tune._sweep import Load, Simulator

    measurement = measured()
    simulator = Simulator.of(measurement, fit(measurement), requests=400, seed=7)
    setting, load = Setting(16, 1), Load("open", 0.8 * simulator.capacity(Setting(16, 1)))
    runs = [
        simulator.run(setting, load)
        for simulator in (
            Simulator.of(measurement, fit(measurement), requests=400, seed=7 + k) for k in range(5)
        )
    ]
    typical = simulator.typical(setting, load, 5)
    p99s = sorted(o.p99 for o in runs)
    assert len(set(p99s)) > 1  # the paths differ
    assert typical.p99 == p99s[2]
    assert typical.p50 == sorted(o.p50 for o in runs)[2]
    assert typical.throughput == sorted(o.throughput for o in runs)[2]
    assert typical.p99_range == (p99s[0], p99s[-1])
    assert (typical.paths, typical.sustained) == (5, True)
    assert simulator.typical(setting, load, 1) == runs[0]
    with pytest.raises(ValueError, match="paths must be >= 1"):
        simulator.typical(setting, load, 0)


def test_what_to_expect_of_the_recommendation_is_typical_runs() -> None:
    """The sweep ranks the settings on one run each; what the report says to expect of
    the one chosen is the median of `paths` runs at each of its loads (and each closed
    loop), and its knee is found among them."""
    analysis = analyse(measured(), slots=(1,), **{**FAST, "paths": 3})  # type: ignore[arg-type]
    rec = analysis.recommendation
    assert [o.load for o in rec.expected] == [o.load for o in rec.choice.outcomes]
    assert all(o.paths == 3 and o.p99_range is not None for o in rec.expected)
    assert all(o.p99_range[0] <= o.p99 <= o.p99_range[1] for o in rec.expected)  # type: ignore[index]
    assert all(o.paths == 3 for o in rec.closed)
    assert rec.knee in rec.expected
    single = analyse(measured(), slots=(1,), **FAST).recommendation  # type: ignore[arg-type]
    assert single.expected == single.choice.outcomes  # one path: the sweep's own runs


def test_the_capacity_it_states_is_the_one_its_typical_runs_keep() -> None:
    """The settings are ranked on one run each; the capacity it states for the one it
    recommends is by the typical runs it prints. Here (one batch in ten at 1.6x its
    median, seed 1) the ranking's one run kept p99 within 80 ms up to 693 calls/s, and
    the typical run at 672 calls/s did not: stated from the ranking's run, the
    capacity and the table beneath it disagreed."""
    varied = measured(factors=(1.0,) * 9 + (1.6,))
    target = 0.080
    fast = {**FAST, "paths": 5}
    rec = analyse(varied, target=target, slots=(1,), seed=1, **fast).recommendation  # type: ignore[arg-type]
    assert rec.capacity < rec.choice.capacity  # (634 against 693: deterministic)
    kept = [o for o in rec.expected if o.load.value <= rec.capacity]
    assert kept
    assert all(o.sustained for o in kept)
    assert max(o.p99 for o in kept) <= target
    missed = [o for o in rec.expected if o.load.value <= rec.choice.capacity and o.p99 > target]
    assert missed  # what the ranking's own capacity would have claimed
