"""Autoscaling: the pure policy with explicit times, then the runner on looptime's virtual
clock, driving a fake pool whose load is scripted over (virtual) time."""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import re
import weakref
from collections.abc import Callable
from typing import Any

import pytest

from batchproxy._executors.autoscaling import (
    Autoscaler,
    AutoscalerStats,
    Autoscaling,
    Scalable,
    ScalingDecision,
    ScalingPolicy,
)

Load = Callable[[float], float]


def steps(*changes: tuple[float, float]) -> Load:
    """A load that is `load` from time `at` on, for each `(at, load)` (0 before the first)."""

    def load(t: float) -> float:
        current = 0.0
        for at, value in changes:
            if t >= at:
                current = value
        return current

    return load


class FakePool:
    """A `Scalable` whose load follows `load(t)`, t in seconds since it was made."""

    def __init__(self, load: Load, replicas: int = 1, name: str = "pool") -> None:
        self.name = name
        self.load = load
        self.replicas = replicas
        self.loop = asyncio.get_running_loop()
        self.start = self.loop.time()
        self.scaled: list[tuple[float, int]] = []  # (t, n) of each autoscale_to that took
        self.load_error: Callable[[float], Exception | None] = lambda t: None
        self.scale_errors: list[Exception] = []  # raised by the next autoscale_to calls
        self.attempts: list[tuple[float, int]] = []

    def now(self) -> float:
        return round(self.loop.time() - self.start, 6)

    @property
    def num_replicas(self) -> int:
        return self.replicas

    def autoscale_load(self) -> float:
        error = self.load_error(self.now())
        if error is not None:
            raise error
        return self.load(self.now())

    def autoscale_to(self, n: int) -> None:
        self.attempts.append((self.now(), n))
        if self.scale_errors:
            raise self.scale_errors.pop(0)
        self.scaled.append((self.now(), n))
        self.replicas = n


def config(**changes: Any) -> Autoscaling:
    defaults: dict[str, Any] = {"max_replicas": 8, "upscale_delay": 10.0, "downscale_delay": 60.0}
    return Autoscaling(**(defaults | changes))


async def run(pool: FakePool, settings: Autoscaling, seconds: float) -> Autoscaler:
    """Autoscale `pool` for `seconds` of (virtual) time from its start, then stop."""
    scaler = Autoscaler(pool, settings)
    scaler.start()
    await asyncio.sleep(seconds)
    await scaler.aclose()
    return scaler


# -- the pure policy -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("target", "load", "desired"),
    [
        (1.0, 0.0, 1),  # min_replicas
        (1.0, 2.0, 2),
        (1.0, 2.0000001, 2),  # a float's noise does not round up
        (1.0, 2.01, 3),
        (1.0, 3.6, 4),
        (1.0, 100.0, 8),  # max_replicas
        (1.0, math.inf, 8),
        (0.5, 1.0, 2),
        (2.0, 5.0, 3),
    ],
)
def test_desired_replicas(target: float, load: float, desired: int) -> None:
    policy = ScalingPolicy(config(target_batches_per_replica=target))
    assert policy.desired_replicas(load) == desired


def test_the_policy_scales_up_once_the_load_has_lasted_the_delay() -> None:
    policy = ScalingPolicy(config())
    assert policy.decide(0.0, 0.5, 1) is None
    for t in range(1, 11):  # above from t=1: a decision at t=11, not before
        assert policy.decide(float(t), 3.6, 1) is None
        assert policy.desired == 4
    decision = policy.decide(11.0, 3.6, 1)
    assert decision == ScalingDecision(11.0, 1, 4, 3.6, "load", 10.0)
    assert decision.up


def test_up_goes_to_the_smallest_desired_of_the_window_and_then_restarts() -> None:
    policy = ScalingPolicy(config(upscale_delay=4.0))
    loads = [5.0, 2.5, 7.0, 7.0, 7.0]  # desired 5, 3, 7, 7, 7: sustained, 3
    decisions = [policy.decide(float(t), load, 1) for t, load in enumerate(loads)]
    assert decisions[:4] == [None] * 4
    assert decisions[4] == ScalingDecision(4.0, 1, 3, 2.5, "load", 4.0)
    # a new window from the next sample: the full delay again
    assert [policy.decide(float(t), 7.0, 3) for t in range(5, 9)] == [None] * 4
    assert policy.decide(9.0, 7.0, 3) == ScalingDecision(9.0, 3, 7, 7.0, "load", 4.0)


def test_down_goes_to_the_largest_desired_of_the_window() -> None:
    policy = ScalingPolicy(config(downscale_delay=3.0))
    loads = [0.0, 2.5, 0.0, 0.5]  # desired 1, 3, 1, 1: it needed 3
    decisions = [policy.decide(float(t), load, 6) for t, load in enumerate(loads)]
    assert decisions == [None, None, None, ScalingDecision(3.0, 6, 3, 2.5, "load", 3.0)]


def test_down_when_idle_says_so() -> None:
    policy = ScalingPolicy(config(downscale_delay=2.0, min_replicas=2))
    decisions = [policy.decide(float(t), 0.0, 5) for t in range(3)]
    assert decisions[-1] == ScalingDecision(2.0, 5, 2, 0.0, "idle", 2.0)


def test_a_sample_at_the_target_closes_the_window() -> None:
    policy = ScalingPolicy(config(upscale_delay=3.0))
    loads = [3.0, 3.0, 2.0, 3.0, 3.0, 3.0, 3.0]  # the third sample needs 2 = replicas
    decisions = [policy.decide(float(t), load, 2) for t, load in enumerate(loads)]
    assert decisions[:6] == [None] * 6  # a new window from t=3: 3 s at t=6
    assert decisions[6] == ScalingDecision(6.0, 2, 3, 3.0, "load", 3.0)


def test_a_sample_the_other_way_closes_the_window() -> None:
    policy = ScalingPolicy(config(upscale_delay=2.0, downscale_delay=2.0))
    loads = [3.0, 3.0, 1.0, 3.0, 3.0, 1.0, 1.0]  # never the same way for 2 s
    assert [policy.decide(float(t), load, 2) for t, load in enumerate(loads)] == [None] * 7


def test_a_count_changed_by_hand_restarts_the_window() -> None:
    policy = ScalingPolicy(config(upscale_delay=3.0))
    assert [policy.decide(float(t), 6.0, 2) for t in range(3)] == [None] * 3
    assert policy.decide(3.0, 6.0, 3) is None  # scaled by hand to 3: a new window
    assert policy.decide(5.0, 6.0, 3) is None
    assert policy.decide(6.0, 6.0, 3) == ScalingDecision(6.0, 3, 6, 6.0, "load", 3.0)


@pytest.mark.parametrize(("replicas", "bounded"), [(12, 8), (1, 2)])
def test_a_count_out_of_bounds_goes_back_at_once(replicas: int, bounded: int) -> None:
    policy = ScalingPolicy(config(min_replicas=2))
    assert policy.decide(0.0, 4.0, replicas) == ScalingDecision(
        0.0, replicas, bounded, 4.0, "bounds", 0.0
    )


def test_zero_delays_decide_at_the_first_sample() -> None:
    policy = ScalingPolicy(config(upscale_delay=0, downscale_delay=0))
    assert policy.decide(0.0, 3.0, 1) == ScalingDecision(0.0, 1, 3, 3.0, "load", 0.0)
    assert policy.decide(1.0, 0.0, 3) == ScalingDecision(1.0, 3, 1, 0.0, "idle", 0.0)


@pytest.mark.parametrize("load", [math.nan, -0.5])
def test_the_policy_refuses_a_load_that_is_not_one(load: float) -> None:
    with pytest.raises(ValueError, match="load must be a number >= 0"):
        ScalingPolicy(config()).decide(0.0, load, 1)


# -- validation ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "error", "message"),
    [
        ({"max_replicas": 0}, ValueError, "max_replicas must be >= 1, got 0"),
        ({"max_replicas": 2.0}, TypeError, "max_replicas must be an int, got float 2.0"),
        ({"max_replicas": True}, TypeError, "max_replicas must be an int, got bool True"),
        ({"min_replicas": 0}, ValueError, "min_replicas must be >= 1, got 0"),
        ({"min_replicas": False}, TypeError, "min_replicas must be an int, got bool"),
        (
            {"min_replicas": 3, "max_replicas": 2},
            ValueError,
            "min_replicas must be <= max_replicas, got min_replicas=3 and max_replicas=2",
        ),
        ({"target_batches_per_replica": 0}, ValueError, "must be a finite number > 0, got 0"),
        ({"target_batches_per_replica": math.inf}, ValueError, "finite number > 0, got inf"),
        ({"target_batches_per_replica": math.nan}, ValueError, "finite number > 0, got nan"),
        ({"target_batches_per_replica": True}, TypeError, "must be a number, got bool"),
        ({"target_batches_per_replica": "1"}, TypeError, "must be a number, got str '1'"),
        ({"upscale_delay": -1}, ValueError, "upscale_delay must be >= 0, got -1"),
        ({"upscale_delay": math.inf}, ValueError, "upscale_delay must be finite"),
        ({"downscale_delay": -0.1}, ValueError, "downscale_delay must be >= 0, got -0.1"),
        ({"downscale_delay": None}, TypeError, "downscale_delay must be a number, got NoneType"),
        ({"interval": 0}, ValueError, "interval must be > 0, got 0"),
        ({"interval": True}, TypeError, "interval must be a number, got bool True"),
    ],
)
def test_autoscaling_refuses_bad_values(
    changes: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=re.escape(message)):
        config(**changes)


def test_autoscaling_defaults_and_normal_forms() -> None:
    settings = Autoscaling(max_replicas=4)
    assert settings == Autoscaling(4, 1, 1.0, 10.0, 60.0, 1.0)
    assert Autoscaling(max_replicas=4, upscale_delay=0, interval=2).interval == 2.0
    assert type(Autoscaling(max_replicas=4, interval=2).interval) is float
    with pytest.raises(AttributeError):
        settings.max_replicas = 5  # type: ignore[misc]
    with pytest.raises(TypeError, match="must be an Autoscaling"):
        ScalingPolicy({"max_replicas": 4})  # type: ignore[arg-type]


# -- the runner, on the virtual clock ------------------------------------------------------


@pytest.mark.looptime
async def test_a_step_up_scales_after_the_delay_not_before() -> None:
    pool = FakePool(steps((5.5, 3.6)))  # above from the sample at t=6
    await run(pool, config(), 40.0)
    assert pool.scaled == [(16.0, 4)]


@pytest.mark.looptime
async def test_a_step_up_is_capped_at_max_replicas() -> None:
    pool = FakePool(steps((5.5, 20.0)))
    await run(pool, config(max_replicas=8), 40.0)
    assert pool.scaled == [(16.0, 8)]


@pytest.mark.looptime
async def test_a_rising_load_scales_to_what_each_window_sustained() -> None:
    pool = FakePool(steps((5.5, 2.5), (10.5, 6.0)))  # 3 replicas' worth, then 6
    await run(pool, config(), 60.0)
    # the first window (t=6..16) saw 3 then 6: it goes to 3; a new window from t=17
    assert pool.scaled == [(16.0, 3), (27.0, 6)]


@pytest.mark.looptime
async def test_a_step_down_scales_after_the_delay_then_idle_to_min_replicas() -> None:
    pool = FakePool(steps((0.0, 5.5), (20.5, 2.2), (100.5, 0.0)), replicas=6)
    scaler = await run(pool, config(min_replicas=1), 200.0)
    assert pool.scaled == [(81.0, 3), (161.0, 1)]
    last = scaler.stats.last_decision
    assert last is not None
    assert (last.from_replicas, last.to_replicas, last.load, last.reason) == (3, 1, 0.0, "idle")
    assert last.time - pool.start == pytest.approx(161.0, abs=1e-6)
    assert last.window == pytest.approx(60.0, abs=1e-6)


@pytest.mark.looptime
async def test_idle_goes_to_min_replicas_not_below() -> None:
    pool = FakePool(steps(), replicas=5)
    await run(pool, config(min_replicas=2), 120.0)
    assert pool.scaled == [(60.0, 2)]


@pytest.mark.parametrize(
    ("lasting", "scaled"),
    [
        (9.0, []),  # samples t=11..19: 8 s of it
        (10.0, []),  # t=11..20: 9 s
        (11.0, [(21.0, 5)]),  # t=11..21: 10 s, the delay: it scales
    ],
)
@pytest.mark.looptime
async def test_a_burst_shorter_than_the_delay_adds_nothing(
    lasting: float, scaled: list[tuple[float, int]]
) -> None:
    pool = FakePool(steps((10.5, 5.0), (10.5 + lasting, 0.0)))
    await run(pool, config(), 60.0)
    assert pool.scaled == scaled


@pytest.mark.looptime
async def test_a_load_alternating_around_the_target_never_flaps() -> None:
    pool = FakePool(lambda t: 3.0 if int(t) % 2 else 1.0, replicas=2)
    scaler = await run(pool, config(), 600.0)
    assert pool.scaled == []
    assert scaler.stats.scale_ups == scaler.stats.scale_downs == 0


@pytest.mark.looptime
async def test_a_sine_around_the_target_never_flaps() -> None:
    """Between 0.1 and 3.9 replicas' worth with a period of 8 s: above (or below) 2 for
    at most 4 s at a time, less than either delay."""
    pool = FakePool(lambda t: 2.0 + 1.9 * math.sin(2 * math.pi * t / 8), replicas=2)
    await run(pool, config(), 600.0)
    assert pool.scaled == []


@pytest.mark.looptime
async def test_a_sine_above_the_pool_scales_once_to_what_it_sustains() -> None:
    """From 1 replica, a load between 3.1 and 4.9 (desired 4 or 5): every sample calls
    for more, so after 10 s it goes to 4, the least it needed; then 5 is called for 3 s
    at a time, and 4 between: no more decisions."""
    pool = FakePool(lambda t: 4.0 + 0.9 * math.sin(2 * math.pi * t / 8), replicas=1)
    await run(pool, config(), 600.0)
    assert pool.scaled == [(10.0, 4)]


@pytest.mark.looptime
async def test_a_count_out_of_bounds_is_brought_back_at_the_first_sample() -> None:
    pool = FakePool(steps((0.0, 12.0)), replicas=11)  # scaled by hand beyond max_replicas
    await run(pool, config(max_replicas=8), 30.0)
    assert pool.scaled == [(0.0, 8)]


# -- logs and counters ---------------------------------------------------------------------


@pytest.mark.looptime
async def test_each_decision_is_one_debug_line_and_nothing_at_info(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="batchproxy")
    pool = FakePool(steps((0.5, 3.6), (30.5, 2.2), (100.5, 0.0)), name="embed")
    await run(pool, config(), 200.0)
    assert pool.scaled == [(11.0, 4), (91.0, 3), (161.0, 1)]
    assert [(r.name, r.levelno) for r in caplog.records] == [("batchproxy", logging.DEBUG)] * 3
    assert [r.getMessage() for r in caplog.records] == [
        "FakePool 'embed': autoscale 1 -> 4 replicas "
        "(load at least 3.6 batches for 10.0 s, target 1.0 per replica)",
        "FakePool 'embed': autoscale 4 -> 3 replicas "
        "(load at most 2.2 batches for 60.0 s, target 1.0 per replica)",
        "FakePool 'embed': autoscale 3 -> 1 replica (idle for 60.0 s)",
    ]


@pytest.mark.looptime
async def test_a_bounds_decision_and_an_odd_target_in_the_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="batchproxy")
    pool = FakePool(steps((0.0, 1.3)), replicas=9)
    await run(pool, config(max_replicas=8, target_batches_per_replica=0.25), 70.0)
    assert [r.getMessage() for r in caplog.records] == [
        "FakePool 'pool': autoscale 9 -> 8 replicas (outside min_replicas 1, max_replicas 8)",
        "FakePool 'pool': autoscale 8 -> 6 replicas "
        "(load at most 1.3 batches for 60.0 s, target 0.25 per replica)",
    ]


@pytest.mark.looptime
async def test_nothing_is_logged_unless_debug_is_on(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="batchproxy")
    await run(FakePool(steps((0.5, 3.6), (30.5, 0.0))), config(), 200.0)
    assert caplog.records == []


@pytest.mark.looptime
async def test_the_counters_and_the_last_decision() -> None:
    pool = FakePool(steps((0.5, 3.6), (20.5, 6.0), (40.5, 0.0)))
    scaler = Autoscaler(pool, config())
    assert scaler.stats == AutoscalerStats(0, 0, 0, None, None)
    scaler.start()
    await asyncio.sleep(31.5)
    assert scaler.stats.scale_ups == 2  # to 4 at t=11, to 6 at t=31 (window from t=21)
    assert scaler.stats.desired == 6
    await asyncio.sleep(80.0)
    await scaler.aclose()
    assert pool.scaled == [(11.0, 4), (31.0, 6), (101.0, 1)]
    stats = scaler.stats
    assert (stats.scale_ups, stats.scale_downs, stats.errors, stats.desired) == (2, 1, 0, 1)
    assert stats.last_decision is not None
    assert stats.last_decision.reason == "idle"
    assert (stats.last_decision.from_replicas, stats.last_decision.to_replicas) == (6, 1)


# -- failures of the target ----------------------------------------------------------------


@pytest.mark.looptime
async def test_a_raising_load_is_logged_once_and_the_runner_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="batchproxy")
    pool = FakePool(steps((0.5, 3.6)))

    def unavailable(t: float) -> Exception | None:
        if 3 <= t < 8:
            return RuntimeError("metrics unavailable")
        return KeyError("gone") if t == 20 else None

    pool.load_error = unavailable
    scaler = await run(pool, config(), 30.0)
    # the samples at t=3..7 are missing from the window, which still runs from t=1
    assert pool.scaled == [(11.0, 4)]
    assert scaler.stats.errors == 6
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [(r.levelno, r.getMessage()) for r in warnings] == [
        (
            logging.WARNING,
            "FakePool 'pool': autoscaling sample failed (the autoscaler goes on): "
            "RuntimeError('metrics unavailable')",
        ),
        (
            logging.WARNING,
            "FakePool 'pool': autoscaling sample failed (the autoscaler goes on): KeyError('gone')",
        ),
    ]
    assert all(r.exc_info is not None for r in warnings)
    again = [r.getMessage() for r in caplog.records if "failed again" in r.getMessage()]
    assert len(again) == 4
    assert all(r.levelno == logging.DEBUG for r in caplog.records if r not in warnings)


@pytest.mark.looptime
async def test_a_failed_scale_is_retried_after_a_full_delay(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="batchproxy")
    pool = FakePool(steps((0.0, 3.6)))
    pool.scale_errors.append(RuntimeError("no resources"))
    scaler = await run(pool, config(), 30.0)
    assert pool.attempts == [(10.0, 4), (21.0, 4)]
    assert pool.scaled == [(21.0, 4)]
    assert (scaler.stats.scale_ups, scaler.stats.errors) == (1, 1)
    assert [r.getMessage().rsplit(": ", 1)[-1] for r in caplog.records] == [
        "RuntimeError('no resources')"
    ]


@pytest.mark.looptime
async def test_a_load_that_is_not_a_number_is_an_error_of_the_target(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="batchproxy")
    scaler = await run(FakePool(lambda t: math.nan), config(), 5.5)
    assert scaler.stats.errors == 6  # t = 0..5
    assert "load must be a number >= 0, got nan" in caplog.records[0].getMessage()


# -- lifecycle -----------------------------------------------------------------------------


def autoscaler_tasks() -> set[asyncio.Task[Any]]:
    return {t for t in asyncio.all_tasks() if t.get_name().endswith("-autoscaler")}


@pytest.mark.looptime
async def test_start_is_idempotent_and_aclose_leaves_no_task(no_leftovers: None) -> None:
    pool = FakePool(steps((0.0, 3.6)))
    scaler = Autoscaler(pool, config())
    assert "not started" in repr(scaler)
    scaler.start()
    scaler.start()
    assert scaler.running
    assert [t.get_name() for t in autoscaler_tasks()] == ["batchproxy-pool-autoscaler"]
    assert "running" in repr(scaler)
    await asyncio.sleep(5.0)
    await scaler.aclose()
    assert not scaler.running
    assert autoscaler_tasks() == set()
    await scaler.aclose()  # again: nothing to do
    assert "closed" in repr(scaler)
    await asyncio.sleep(30.0)
    assert pool.scaled == []  # it stopped sampling before the delay ended
    with pytest.raises(RuntimeError, match="autoscaler of FakePool 'pool' is closed"):
        scaler.start()


@pytest.mark.looptime
async def test_aclose_before_start_is_fine(no_leftovers: None) -> None:
    scaler = Autoscaler(FakePool(steps()), config())
    await scaler.aclose()
    assert not scaler.running


@pytest.mark.looptime
async def test_aclose_from_a_cancelled_caller_still_stops_the_task(no_leftovers: None) -> None:
    scaler = Autoscaler(FakePool(steps()), config())
    scaler.start()
    closing = asyncio.create_task(scaler.aclose())
    await asyncio.sleep(0)
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing
    await asyncio.sleep(0)
    assert autoscaler_tasks() == set()


def test_start_needs_a_running_loop() -> None:
    class Pool:
        name = "offline"
        num_replicas = 1

        def autoscale_load(self) -> float:
            return 0.0

        def autoscale_to(self, n: int) -> None:
            raise AssertionError

    scaler = Autoscaler(Pool(), config())
    with pytest.raises(RuntimeError, match="Pool 'offline' needs a running event loop"):
        scaler.start()


@pytest.mark.looptime
async def test_a_dropped_pool_is_not_kept_alive_and_the_task_ends(no_leftovers: None) -> None:
    pool = FakePool(steps((0.0, 3.6)))
    scaler = Autoscaler(pool, config())
    scaler.start()
    await asyncio.sleep(2.5)
    ref = weakref.ref(pool)
    del pool
    gc.collect()
    assert ref() is None
    await asyncio.sleep(1.0)  # the next sample finds it gone
    assert not scaler.running
    await scaler.aclose()


def test_the_fake_is_a_scalable() -> None:
    """mypy checks this assignment against the protocol."""

    async def check() -> None:
        pool: Scalable = FakePool(steps())
        assert pool.num_replicas == 1

    asyncio.run(check())


def test_a_pools_load_is_counted_in_items_over_the_batch_size() -> None:
    from batchproxy._executors.autoscaling import load_in_batches

    assert load_in_batches(6, (10, 8), 3) == 2.0  # 16 items, batches of 8
    assert load_in_batches(6, (0, 0), 3) == 2.0  # no proxy: the largest batch seen
    assert load_in_batches(0, (0, 0), 0) == 0.0  # nothing seen yet
    assert load_in_batches(5, (0, 0), 0) == 5.0
