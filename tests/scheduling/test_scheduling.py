"""The dispatch policy on a virtual clock: full batches, the delay window, the idle
rule, slot-freed dispatch, same-tick coalescing, and no timers when idle."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest
from _support import Recorder, scheduler_of

pytestmark = pytest.mark.looptime


def armed_timers(loop: asyncio.AbstractEventLoop) -> list[asyncio.TimerHandle]:
    return [h for h in loop._scheduled if not h.cancelled()]  # type: ignore[attr-defined]


async def arrive_every(proxy: Recorder, gap: float, items: range) -> list[object]:
    """Callers arriving one by one, `gap` seconds apart; returns their results."""
    tasks = []
    for item in items:
        tasks.append(asyncio.create_task(proxy.inference(item)))
        await asyncio.sleep(gap)
    return list(await asyncio.gather(*tasks))


async def test_lone_request_on_idle_proxy_goes_at_once() -> None:
    loop = asyncio.get_running_loop()
    async with Recorder(batch_size=64, max_delay_ms=50) as proxy:
        start = loop.time()
        assert await proxy.inference("x") == ("out", "x")
        assert proxy.started_at == [start]


async def test_idle_arrival_reaches_the_model_one_loop_iteration_after_it_queues() -> None:
    async with Recorder(batch_size=64, max_delay_ms=50, delay=0.01) as proxy:
        caller = asyncio.create_task(proxy.inference("x"))
        await asyncio.sleep(0)  # the caller queues its request
        assert proxy.batches == []
        await asyncio.sleep(0)  # the very next iteration, the model has it
        assert proxy.batches == [["x"]]
        assert await caller == ("out", "x")


async def test_idle_arrival_cancelled_before_its_batch_forms_frees_the_slot() -> None:
    async with Recorder(batch_size=64, max_delay_ms=50) as proxy:
        caller = asyncio.create_task(proxy.inference("gone"))
        await asyncio.sleep(0)  # queued; its batch task has not run yet
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        assert proxy.batches == []
        assert proxy.stats.in_flight == 0
        assert proxy.stats.cancelled == 1
        assert await proxy.inference("next") == ("out", "next")
        assert proxy.batches == [["next"]]


async def test_request_after_quiet_spell_goes_at_once_even_after_a_burst() -> None:
    loop = asyncio.get_running_loop()
    async with Recorder(batch_size=64, max_delay_ms=50) as proxy:
        await asyncio.gather(*(proxy.inference(i) for i in range(10)))
        await asyncio.sleep(1.0)  # much longer than the window
        start = loop.time()
        await proxy.inference("late")
        assert proxy.started_at[-1] == start
        assert proxy.batches[-1] == ["late"]


async def test_arrivals_in_one_loop_iteration_share_a_batch() -> None:
    async with Recorder(batch_size=64, max_delay_ms=50) as proxy:
        results = await asyncio.gather(*(proxy.inference(i) for i in range(10)))
        assert results == [("out", i) for i in range(10)]
        assert proxy.batches == [list(range(10))]


async def test_caller_awaiting_call_after_call_never_waits() -> None:
    loop = asyncio.get_running_loop()
    async with Recorder(batch_size=64, max_delay_ms=50, delay=0.001) as proxy:
        for i in range(20):
            called = loop.time()
            await proxy.inference(i)
            assert proxy.started_at[-1] == called


async def test_stream_the_model_keeps_up_with_goes_one_by_one_without_waiting() -> None:
    async with Recorder(batch_size=64, max_delay_ms=50, delay=0.0005) as proxy:
        await arrive_every(proxy, 0.001, range(10))
        assert proxy.batches == [[i] for i in range(10)]
        assert proxy.stats.queue_wait.max == 0.0


OVERLAPPING = {"max_concurrent_batches": 2, "delay": 0.050}
"""A slow model with a spare slot: arrivals overlap pending work while a slot is free."""


async def test_overlapping_traffic_waits_for_company_but_never_past_the_window() -> None:
    loop = asyncio.get_running_loop()
    async with Recorder(batch_size=64, max_delay_ms=10.5, **OVERLAPPING) as proxy:
        start = loop.time()
        results = await arrive_every(proxy, 0.001, range(60))
        assert results == [("out", i) for i in range(60)]
        # 0 goes at once; 1.. wait for company in the free slot until the window
        # (less one expected gap) runs out; the rest accumulate while both run
        assert proxy.batches[0] == [0]
        assert proxy.batches[1] == list(range(1, 11))
        assert [t - start for t in proxy.started_at[:2]] == pytest.approx([0.0, 0.0105])
        assert proxy.stats.queue_wait.max <= 0.050 + 1e-6


async def test_full_batch_leaves_without_waiting() -> None:
    loop = asyncio.get_running_loop()
    async with Recorder(batch_size=4, max_delay_ms=1000, **OVERLAPPING) as proxy:
        start = loop.time()
        await arrive_every(proxy, 0.001, range(5))
        assert proxy.batches[:2] == [[0], [1, 2, 3, 4]]
        # the full batch left the moment its 4th member arrived, not after 1 s
        assert [t - start for t in proxy.started_at[:2]] == pytest.approx([0.0, 0.004])


async def test_burst_stragglers_do_not_wait_for_the_window() -> None:
    loop = asyncio.get_running_loop()
    async with Recorder(batch_size=64, max_delay_ms=1000, **OVERLAPPING) as proxy:
        await arrive_every(proxy, 0.001, range(3))  # history: overlapping, 1 ms apart
        await asyncio.sleep(1.0)
        burst_at = loop.time()
        await asyncio.gather(*(proxy.inference(i) for i in range(10)))
        assert proxy.batches[-1] == list(range(10))
        assert proxy.started_at[-1] - burst_at < 0.005  # not the 1 s window


async def test_zero_delay_never_waits_for_company() -> None:
    loop = asyncio.get_running_loop()
    async with Recorder(batch_size=64, max_delay_ms=0, **OVERLAPPING) as proxy:
        start = loop.time()
        await arrive_every(proxy, 0.001, range(3))
        assert proxy.batches[:2] == [[0], [1]]
        assert [t - start for t in proxy.started_at[:2]] == pytest.approx([0.0, 0.001])


async def test_busy_model_accumulates_and_next_batch_leaves_when_slot_frees() -> None:
    loop = asyncio.get_running_loop()
    async with Recorder(batch_size=64, max_delay_ms=5, delay=10.0) as proxy:
        start = loop.time()
        first = asyncio.create_task(proxy.inference("first"))
        await asyncio.sleep(1.0)  # the first batch is running alone
        rest = [asyncio.create_task(proxy.inference(i)) for i in range(100)]
        await asyncio.sleep(0)
        assert proxy.stats.queue_depth == 100
        await asyncio.gather(first, *rest)
        assert [len(b) for b in proxy.batches] == [1, 64, 36]
        # each next batch left the moment the slot freed, not a window later
        assert [t - start for t in proxy.started_at] == pytest.approx([0.0, 10.0, 20.0])


async def test_an_arrival_the_loop_handles_as_a_batch_ends_joins_the_next_one() -> None:
    """Found by `make bench-tune` on the GPU-shaped model, whose launch holds the GIL:
    the loop stalls while a batch launches, then handles what arrived meanwhile in the
    iteration that takes the batch's answer. Such an arrival's task queues its call
    when it first runs, an iteration later; the freed slot, filled one iteration
    after the batch ended, went without it, every batch, and each call waited a
    whole batch more (the median call doubled from 716 calls/s on)."""
    loop = asyncio.get_running_loop()
    arrivals: list[asyncio.Task[Any]] = []

    def arrive() -> None:  # as a server does with a request's data: a task for it
        arrivals.append(asyncio.create_task(proxy.inference("arrived")))

    def respond(items: list[Any]) -> list[Any]:
        if items == ["first"]:  # the first batch ends as the loop takes in an arrival
            loop.call_soon(arrive)
        return [("out", item) for item in items]

    async with Recorder(respond, batch_size=64, max_delay_ms=5, delay=1.0) as proxy:
        first = asyncio.create_task(proxy.inference("first"))
        await asyncio.sleep(0.5)
        waiting = asyncio.create_task(proxy.inference("waiting"))
        await asyncio.gather(first, waiting)
        assert await asyncio.gather(*arrivals) == [("out", "arrived")]
        assert proxy.batches == [["first"], ["waiting", "arrived"]]
        assert proxy.started_at[1] - proxy.started_at[0] == pytest.approx(1.0)


async def test_burst_stragglers_go_when_slot_frees() -> None:
    loop = asyncio.get_running_loop()
    async with Recorder(batch_size=64, max_delay_ms=100, delay=0.002) as proxy:
        start = loop.time()
        await asyncio.gather(*(proxy.inference(i) for i in range(70)))
        assert [len(b) for b in proxy.batches] == [64, 6]
        assert [t - start for t in proxy.started_at] == pytest.approx([0.0, 0.002])


async def test_concurrent_batches_fill_free_slots() -> None:
    loop = asyncio.get_running_loop()
    options = {"batch_size": 4, "max_delay_ms": 5, "max_concurrent_batches": 2}
    async with Recorder(delay=1.0, **options) as proxy:
        start = loop.time()
        await asyncio.gather(*(proxy.inference(i) for i in range(12)))
        assert [len(b) for b in proxy.batches] == [4, 4, 4]
        assert [t - start for t in proxy.started_at] == pytest.approx([0.0, 0.0, 1.0])


async def test_priority_decides_who_joins_the_next_batch() -> None:
    async with Recorder(batch_size=2, max_delay_ms=5, delay=1.0) as proxy:
        blocker = asyncio.create_task(proxy.inference("blocker"))
        await asyncio.sleep(0.1)
        low = [asyncio.create_task(proxy.inference(f"low{i}", priority=0)) for i in range(2)]
        high = [asyncio.create_task(proxy.inference(f"high{i}", priority=5)) for i in range(2)]
        await asyncio.gather(blocker, *low, *high)
        assert proxy.batches == [["blocker"], ["high0", "high1"], ["low0", "low1"]]


async def test_idle_proxy_has_no_timer_armed() -> None:
    loop = asyncio.get_running_loop()
    async with Recorder(batch_size=64, max_delay_ms=10) as proxy:
        await arrive_every(proxy, 0.001, range(20))
        await asyncio.sleep(0.1)  # past any window
        assert proxy.stats.queue_depth == 0
        assert armed_timers(loop) == []


async def test_a_batch_that_leaves_nobody_waiting_schedules_no_decision() -> None:
    """Nothing is left to decide when the last batch ends with an empty queue: no
    callback is queued for it (the next arrival finds the proxy idle and goes at once)."""
    loop = asyncio.get_running_loop()
    async with Recorder(batch_size=64, max_delay_ms=10) as proxy:
        assert await proxy.inference("x") == ("out", "x")
        ready = list(loop._ready)  # type: ignore[attr-defined]  # what runs next iteration
        assert not [h for h in ready if "_decide" in repr(h)]
        assert proxy.stats.in_flight == 0
        assert await proxy.inference("y") == ("out", "y")
        assert proxy.batches == [["x"], ["y"]]


async def test_deadline_timers_are_cancelled_once_answered() -> None:
    loop = asyncio.get_running_loop()
    async with Recorder(batch_size=8, max_delay_ms=1, timeout=60.0) as proxy:
        await asyncio.gather(*(proxy.inference(i) for i in range(20)))
        await asyncio.sleep(0.01)
        assert armed_timers(loop) == []


async def test_timer_is_disarmed_as_soon_as_the_queue_empties() -> None:
    async with Recorder(batch_size=3, max_delay_ms=1000, max_concurrent_batches=2) as proxy:
        proxy.delay = 0.5
        first = asyncio.create_task(proxy.inference("first"))
        await asyncio.sleep(0.001)
        waiting = [asyncio.create_task(proxy.inference(i)) for i in range(2)]
        for _ in range(3):  # the callers queue, then the decision runs
            await asyncio.sleep(0)
        scheduler = scheduler_of(proxy)
        assert scheduler._timer is not None  # two requests wait for company
        waiting.append(asyncio.create_task(proxy.inference(2)))  # fills the batch
        for _ in range(3):
            await asyncio.sleep(0)
        assert proxy.stats.queue_depth == 0
        assert scheduler._timer is None
        await asyncio.gather(first, *waiting)


async def test_a_waiting_full_batch_starts_before_the_last_batch_callers_wake() -> None:
    resumed: list[int] = []
    resumed_at_start: list[int] = []

    class Watching(Recorder):
        async def _inference(self, items: list[Any]) -> Sequence[Any]:
            resumed_at_start.append(len(resumed))
            return await super()._inference(items)

    async def caller(proxy: Recorder, item: int) -> None:
        await proxy.inference(item)
        resumed.append(item)

    async with Watching(batch_size=4, delay=0.01) as proxy:
        await asyncio.gather(*(caller(proxy, i) for i in range(12)))
        assert proxy.batches == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
        assert resumed_at_start == [0, 0, 4]  # each next batch began before its forerunner's
        assert proxy.started_at[1] - proxy.started_at[0] == pytest.approx(0.01)


async def test_after_a_failed_item_the_next_batch_waits_for_the_woken_callers() -> None:
    # a caller woken with an error may withdraw queued requests (inference_many does)
    async with Recorder(
        lambda items: [ValueError() if i == 0 else i for i in items], batch_size=2, delay=0.01
    ) as proxy:
        many = asyncio.create_task(proxy.inference_many([0, 1, 2, 3, 4, 5]))
        with pytest.raises(ValueError):
            await many
        assert proxy.batches == [[0, 1]]
