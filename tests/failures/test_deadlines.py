"""Deadlines: per-call `timeout` and the proxy default, on looptime's virtual clock."""

from __future__ import annotations

import asyncio
import math

import pytest
from _support import Recorder, assert_settled

import batchproxy

pytestmark = pytest.mark.looptime


async def ended_at(awaitable: object) -> tuple[float, object]:
    """(loop time when it ended, its result or exception)."""
    loop = asyncio.get_running_loop()
    try:
        result = await awaitable  # type: ignore[misc]
    except Exception as exc:
        return loop.time(), exc
    return loop.time(), result


async def busy_proxy(**options: object) -> tuple[Recorder, asyncio.Task[object]]:
    """A proxy (batch 1, one slot, 10 s model) whose slot a first call holds until t0+10."""
    p = Recorder(delay=10.0, batch_size=1, max_concurrent_batches=1, **options)
    first = asyncio.create_task(p.inference("first"))
    for _ in range(10):  # a few loop iterations, no virtual time
        await asyncio.sleep(0)
    assert p.batches == [["first"]]
    return p, first


async def test_queued_request_expires_at_its_deadline_and_never_reaches_the_model(no_leftovers):
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    p, first = await busy_proxy()
    late = asyncio.create_task(p.inference("late", timeout=3.0))
    await asyncio.sleep(0)
    assert p.stats.queue_depth == 1

    with pytest.raises(batchproxy.DeadlineExceeded) as caught:
        await late
    assert loop.time() - t0 == pytest.approx(3.0)
    assert isinstance(caught.value, TimeoutError)
    assert isinstance(caught.value, batchproxy.BatchProxyError)
    assert caught.value.timeout == 3.0
    assert "3" in str(caught.value)
    assert p.stats.queue_depth == 0  # removed from the queue at once
    assert p.stats.timed_out == 1

    assert await first == ("out", "first")
    await asyncio.sleep(20.0)  # a free slot and plenty of time: still never sent
    assert p.batches == [["first"]]
    stats = p.stats
    assert (stats.timed_out, stats.succeeded, stats.batches) == (1, 1, 1)
    assert_settled(stats)
    await p.aclose()


async def test_deadline_during_the_batch_fails_that_caller_only():
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    p = Recorder(delay=10.0, batch_size=4, max_delay_ms=0)
    outcomes = await asyncio.gather(
        ended_at(p.inference(0, timeout=4.0)), ended_at(p.inference(1)), ended_at(p.inference(2))
    )
    assert p.batches == [[0, 1, 2]]
    (t_late, error), *others = outcomes
    assert isinstance(error, batchproxy.DeadlineExceeded)
    assert t_late - t0 == pytest.approx(4.0)  # at the deadline, not when the batch ends
    assert [(t - t0, r) for t, r in others] == [
        (pytest.approx(10.0), ("out", 1)),
        (pytest.approx(10.0), ("out", 2)),
    ]
    stats = p.stats
    assert (stats.timed_out, stats.succeeded, stats.errors, stats.cancelled) == (1, 2, 0, 0)
    assert_settled(stats)
    await p.aclose()


async def test_default_timeout_applies_to_every_call():
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    p, first = await busy_proxy(timeout=2.0)
    t, error = await ended_at(p.inference("queued"))
    assert isinstance(error, batchproxy.DeadlineExceeded)
    assert t - t0 == pytest.approx(2.0)
    # the first call has the default deadline too, though its batch is running
    t, error = await ended_at(first)
    assert isinstance(error, batchproxy.DeadlineExceeded)
    assert t - t0 == pytest.approx(2.0)
    assert p.batches == [["first"]]
    await asyncio.sleep(10.0)
    assert p.stats.timed_out == 2
    assert_settled(p.stats)
    await p.aclose()


@pytest.mark.parametrize(("default", "per_call"), [(2.0, 6.0), (5.0, 1.0)])
async def test_per_call_timeout_overrides_the_default(default, per_call):
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    p, first = await busy_proxy(timeout=default)
    outcomes = await asyncio.gather(
        ended_at(p.inference("own", timeout=per_call)), ended_at(p.inference("by-default"))
    )
    (t_own, own), (t_default, by_default) = outcomes
    assert isinstance(own, batchproxy.DeadlineExceeded)
    assert isinstance(by_default, batchproxy.DeadlineExceeded)
    assert t_own - t0 == pytest.approx(per_call)
    assert t_default - t0 == pytest.approx(default)
    assert (own.timeout, by_default.timeout) == (per_call, default)
    with pytest.raises(batchproxy.DeadlineExceeded):
        await first  # also on the default deadline
    await asyncio.sleep(10.0)
    assert p.batches == [["first"]]
    await p.aclose()


async def test_longer_per_call_timeout_outlives_the_default():
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    p = Recorder(delay=10.0, batch_size=4, timeout=2.0)
    assert await p.inference("patient", timeout=15.0) == ("out", "patient")
    assert loop.time() - t0 == pytest.approx(10.0)
    assert p.stats.timed_out == 0
    await p.aclose()


async def test_infinite_per_call_timeout_means_no_deadline():
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    p = Recorder(delay=1e6, batch_size=4, timeout=2.0)  # virtual: 11.6 days
    assert await p.inference("patient", timeout=math.inf) == ("out", "patient")
    assert loop.time() - t0 == pytest.approx(1e6)
    assert p.stats.timed_out == 0
    await p.aclose()


async def test_infinite_default_timeout_means_no_deadline():
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    p = Recorder(delay=1e6, batch_size=4, timeout=math.inf)
    assert await p.inference("patient") == ("out", "patient")
    assert loop.time() - t0 == pytest.approx(1e6)
    assert p.stats.timed_out == 0
    await p.aclose()


async def test_result_before_deadline_wins_and_leaves_no_timer():
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    p = Recorder(delay=1.0, batch_size=4)
    assert await p.inference("quick", timeout=5.0) == ("out", "quick")
    assert loop.time() - t0 == pytest.approx(1.0)
    await asyncio.sleep(10.0)  # the deadline passes after the result: nothing happens
    stats = p.stats
    assert (stats.succeeded, stats.timed_out) == (1, 0)
    assert_settled(stats)
    await p.aclose()


async def test_expired_requests_leave_without_blocking_the_ones_behind_them():
    """Several queued requests expire; those behind them still go in order."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    p, first = await busy_proxy()
    tasks = [
        asyncio.create_task(ended_at(p.inference(name, timeout=timeout)))
        for name, timeout in [("a", 1.0), ("b", 30.0), ("c", 2.0), ("d", 40.0)]
    ]
    outcomes = await asyncio.gather(*tasks)
    await first
    assert p.batches == [["first"], ["b"], ["d"]]
    (ta, a), (tb, b), (tc, c), (td, d) = outcomes
    assert isinstance(a, batchproxy.DeadlineExceeded)
    assert isinstance(c, batchproxy.DeadlineExceeded)
    assert (ta - t0, tc - t0) == (pytest.approx(1.0), pytest.approx(2.0))
    assert (b, d) == (("out", "b"), ("out", "d"))
    assert (tb - t0, td - t0) == (pytest.approx(20.0), pytest.approx(30.0))
    stats = p.stats
    assert (stats.timed_out, stats.succeeded) == (2, 3)
    assert_settled(stats)
    await p.aclose()
