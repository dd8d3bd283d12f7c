"""Deadline-aware dispatch on a virtual clock: earliest deadline first within a
priority, aging against starvation, and shedding calls that cannot finish in time."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from _support import Recorder

import batchproxy

pytestmark = pytest.mark.looptime


async def queue_behind_a_running_batch(
    proxy: Recorder, calls: list[tuple[str, dict[str, Any]]]
) -> list[asyncio.Task[Any]]:
    """Occupy the one batch slot, then queue `calls` (item, options) in this order."""
    blocker = asyncio.create_task(proxy.inference("blocker"))
    await asyncio.sleep(0.001)  # the blocker's batch is running
    tasks = []
    for item, options in calls:
        tasks.append(asyncio.create_task(proxy.inference(item, **options)))
        await asyncio.sleep(0)  # queued in this order
    tasks.append(blocker)
    return tasks


def order(proxy: Recorder) -> list[Any]:
    return [item for batch in proxy.batches[1:] for item in batch]


async def test_earliest_deadline_goes_first_within_a_priority() -> None:
    async with Recorder(batch_size=1, delay=0.01) as proxy:
        tasks = await queue_behind_a_running_batch(
            proxy,
            [
                ("none", {}),
                ("late", {"timeout": 5.0}),
                ("soon", {"timeout": 1.0}),
                ("middle", {"timeout": 3.0}),
            ],
        )
        await asyncio.gather(*tasks)
        assert order(proxy) == ["soon", "middle", "late", "none"]


async def test_one_timeout_for_every_call_keeps_fifo_order() -> None:
    async with Recorder(batch_size=2, delay=0.01, timeout=10.0) as proxy:
        tasks = await queue_behind_a_running_batch(proxy, [(i, {}) for i in range(7)])
        await asyncio.gather(*tasks)
        assert order(proxy) == list(range(7))


async def test_priority_outranks_a_deadline() -> None:
    async with Recorder(batch_size=1, delay=0.01) as proxy:
        tasks = await queue_behind_a_running_batch(
            proxy,
            [("low-urgent", {"timeout": 1.0}), ("high-relaxed", {"timeout": 9.0, "priority": 1})],
        )
        await asyncio.gather(*tasks)
        assert order(proxy) == ["high-relaxed", "low-urgent"]


async def test_a_batch_takes_the_earliest_deadlines_then_the_rest_in_arrival_order() -> None:
    async with Recorder(batch_size=3, delay=0.01) as proxy:
        tasks = await queue_behind_a_running_batch(
            proxy,
            [("a", {}), ("b", {"timeout": 4.0}), ("c", {}), ("d", {"timeout": 2.0}), ("e", {})],
        )
        await asyncio.gather(*tasks)
        assert proxy.batches[1:] == [["d", "b", "a"], ["c", "e"]]


async def test_expired_and_cancelled_requests_leave_the_deadline_order() -> None:
    async with Recorder(batch_size=1, delay=0.05) as proxy:
        tasks = await queue_behind_a_running_batch(
            proxy,
            [("expires", {"timeout": 0.01}), ("cancelled", {"timeout": 0.5}), ("kept", {})],
        )
        tasks[1].cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert isinstance(results[0], batchproxy.DeadlineExceeded)
        assert isinstance(results[1], asyncio.CancelledError)
        assert order(proxy) == ["kept"]


async def stream(proxy: Recorder, until: float, **options: Any) -> None:
    """A request every 4 ms until `until` (faster than the model serves one: 10 ms);
    each item is its arrival time."""
    loop = asyncio.get_running_loop()
    pending: set[asyncio.Task[Any]] = set()
    while loop.time() < until:
        pending.add(asyncio.create_task(proxy.inference(loop.time(), **options)))
        await asyncio.sleep(0.004)
    await asyncio.gather(*pending)


async def wait_in_a_stream(aging_ms: float | None, **stream_options: Any) -> tuple[float, float]:
    """A request without priority or deadline amid a 1 s stream; returns when it arrived and
    the latest arrival among the stream's requests served before it."""
    loop = asyncio.get_running_loop()
    async with Recorder(batch_size=1, delay=0.01, aging_ms=aging_ms) as proxy:
        busy = asyncio.create_task(stream(proxy, loop.time() + 1.0, **stream_options))
        await asyncio.sleep(0.05)
        asked = loop.time()
        await proxy.inference("mine")
        await busy
        served = [b[0] for b in proxy.batches]
        before = served[: served.index("mine")]
        return asked, max(before)


async def test_without_aging_a_low_priority_request_waits_out_a_busy_stream() -> None:
    asked, latest = await wait_in_a_stream(None, priority=5)
    assert latest > asked + 0.9  # everything that came during the next second went first


async def test_aging_bounds_how_much_later_a_higher_priority_request_may_overtake() -> None:
    asked, latest = await wait_in_a_stream(20.0, priority=5)
    assert asked + 0.020 < latest <= asked + 5 * 0.020  # 5 levels, 20 ms each


async def test_without_aging_deadlines_hold_back_a_request_without_one() -> None:
    asked, latest = await wait_in_a_stream(None, timeout=10.0)
    assert latest > asked + 0.9


async def test_aging_bounds_how_much_later_a_deadline_request_may_overtake() -> None:
    asked, latest = await wait_in_a_stream(30.0, timeout=10.0)
    assert latest <= asked + 0.030


async def warm_up(proxy: batchproxy.Proxy[Any, Any], batches: int = 8) -> None:
    """Run enough batches, one at a time, for the cost model to have a line."""
    for i in range(batches):
        await proxy.inference(i)
    assert proxy.stats.cost_model is not None


async def test_a_call_that_cannot_make_its_deadline_is_shed_at_once() -> None:
    loop = asyncio.get_running_loop()
    shed: list[str] = []

    class Counting(batchproxy.Listener):
        def request_shed(self, proxy: str) -> None:
            shed.append(proxy)

    async with Recorder(batch_size=4, delay=0.01, shed_late=True, name="m") as proxy:
        proxy.add_listener(Counting())
        await warm_up(proxy)
        backlog = [asyncio.create_task(proxy.inference(i, priority=1)) for i in range(40)]
        await asyncio.sleep(0)  # 40 queued ahead of it: ten 10 ms batches
        accepted = proxy.stats.requests
        asked = loop.time()
        with pytest.raises(batchproxy.DeadlineExceeded) as caught:
            await proxy.inference("hopeless", timeout=0.05)
        assert loop.time() == asked  # refused at once, not after 50 ms
        assert caught.value.predicted is not None
        assert caught.value.predicted > 0.05
        assert "shed_late" in str(caught.value)
        assert proxy.stats.shed == 1
        assert proxy.stats.requests == accepted  # never accepted
        assert shed == ["m"]
        assert await proxy.inference("in time", timeout=1.0) == ("out", "in time")
        await asyncio.gather(*backlog)
        assert proxy.stats.timed_out == 0


async def test_an_urgent_call_is_not_shed_for_requests_it_would_overtake() -> None:
    async with Recorder(batch_size=4, delay=0.01, shed_late=True) as proxy:
        await warm_up(proxy)
        relaxed = [asyncio.create_task(proxy.inference(i, timeout=10.0)) for i in range(40)]
        await asyncio.sleep(0)
        # earliest deadline first: it goes in the next batch, well within 50 ms
        assert await proxy.inference("urgent", timeout=0.05) == ("out", "urgent")
        await asyncio.gather(*relaxed)
        assert proxy.stats.shed == 0


async def test_without_shed_late_the_same_call_waits_and_times_out() -> None:
    loop = asyncio.get_running_loop()
    async with Recorder(batch_size=4, delay=0.01) as proxy:
        await warm_up(proxy)
        backlog = [asyncio.create_task(proxy.inference(i, priority=1)) for i in range(40)]
        await asyncio.sleep(0)
        asked = loop.time()
        with pytest.raises(batchproxy.DeadlineExceeded) as caught:
            await proxy.inference("hopeless", timeout=0.05)
        assert loop.time() - asked == pytest.approx(0.05)
        assert caught.value.predicted is None
        await asyncio.gather(*backlog)
        assert proxy.stats.shed == 0


async def test_nothing_is_shed_before_the_cost_model_has_a_line() -> None:
    async with Recorder(batch_size=4, delay=0.01, shed_late=True) as proxy:
        backlog = [asyncio.create_task(proxy.inference(i, priority=1)) for i in range(40)]
        await asyncio.sleep(0)
        with pytest.raises(batchproxy.DeadlineExceeded) as caught:
            await proxy.inference("hopeless", timeout=0.05)
        assert caught.value.predicted is None  # waited and timed out: no prediction yet
        await asyncio.gather(*backlog)


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"aging_ms": 0}, ValueError, "aging_ms must be > 0"),
        ({"aging_ms": "1"}, TypeError, "aging_ms must be a number"),
        ({"shed_late": 1}, TypeError, "shed_late must be a bool"),
        ({"window": "smart"}, ValueError, "window must be"),
    ],
)
def test_bad_scheduling_options_are_refused(
    options: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        Recorder(**options)
