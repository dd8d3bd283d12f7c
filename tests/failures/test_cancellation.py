"""Cancellation: dropped before dispatch, discarded when already running.

Guarantee 3 of docs/failures.md: a cancelled caller is dropped before dispatch.
"""

from __future__ import annotations

import asyncio
import gc
import random
import threading
from typing import Any

import pytest
from _support import (
    Recorder,
    ThreadRecorder,
    assert_settled,
    loop_errors,
    outcome,
    wait_until,
)

import batchproxy


async def spin(times: int = 10) -> None:
    """Let the loop run a few iterations without moving (virtual) time."""
    for _ in range(times):
        await asyncio.sleep(0)


async def busy_proxy(**options: Any) -> tuple[Recorder, asyncio.Task[Any]]:
    """A proxy (batch 1, one slot, 10 s model) whose slot a first call holds for 10 s."""
    p = Recorder(delay=10.0, batch_size=1, max_concurrent_batches=1, **options)
    first = asyncio.create_task(p.inference("first"))
    await spin()
    assert p.batches == [["first"]]
    return p, first


async def cancel_and_wait(task: asyncio.Task[Any]) -> None:
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


# -- cancelled while queued ------------------------------------------------------------------


@pytest.mark.looptime
async def test_caller_cancelled_while_queued_never_reaches_the_model(no_leftovers):
    p, first = await busy_proxy()
    tasks = {name: asyncio.create_task(p.inference(name)) for name in "abc"}
    await asyncio.sleep(1.0)
    assert p.stats.queue_depth == 3
    await cancel_and_wait(tasks["b"])
    assert p.stats.queue_depth == 2
    assert p.stats.cancelled == 1

    assert await first == ("out", "first")
    assert await tasks["a"] == ("out", "a")
    assert await tasks["c"] == ("out", "c")
    await asyncio.sleep(20.0)
    assert p.batches == [["first"], ["a"], ["c"]]
    stats = p.stats
    assert (stats.cancelled, stats.succeeded, stats.batches) == (1, 3, 3)
    assert_settled(stats)
    await p.aclose()


@pytest.mark.parametrize("max_delay_ms", [0, 5])
@pytest.mark.looptime
async def test_caller_cancelled_just_before_its_batch_forms_is_left_out(max_delay_ms):
    """With no delay the batch forms in the very iteration the cancellation lands in."""
    p = Recorder(batch_size=8, max_delay_ms=max_delay_ms)
    tasks = [asyncio.create_task(p.inference(i)) for i in range(3)]
    await asyncio.sleep(0)
    assert p.stats.queue_depth == 3  # queued, the batch has not left yet
    tasks[1].cancel()
    await asyncio.wait(tasks)
    assert p.batches == [[0, 2]]
    assert [outcome(t) for t in tasks] == ["ok", "cancelled", "ok"]
    assert (p.stats.cancelled, p.stats.succeeded) == (1, 2)
    assert_settled(p.stats)
    await p.aclose()


@pytest.mark.looptime
async def test_cancelling_a_queued_caller_frees_its_queue_slot():
    p, first = await busy_proxy(max_queue_size=2)
    a = asyncio.create_task(p.inference("a"))
    b = asyncio.create_task(p.inference("b"))
    await spin()
    with pytest.raises(batchproxy.QueueFull):
        await p.inference("refused")
    await cancel_and_wait(a)
    assert p.stats.queue_depth == 1
    c = asyncio.create_task(p.inference("c"))  # room again
    assert await asyncio.gather(first, b, c) == [("out", "first"), ("out", "b"), ("out", "c")]
    assert p.batches == [["first"], ["b"], ["c"]]
    stats = p.stats
    assert (stats.rejected, stats.cancelled, stats.succeeded) == (1, 1, 3)
    assert_settled(stats)
    await p.aclose()


@pytest.mark.looptime
async def test_cancelled_queued_caller_is_not_later_counted_as_timed_out():
    loop = asyncio.get_running_loop()
    p, first = await busy_proxy()
    task = asyncio.create_task(p.inference("a", timeout=3.0))
    loop.call_later(1.0, task.cancel)
    with pytest.raises(asyncio.CancelledError):
        await task
    await first
    await asyncio.sleep(10.0)  # well past the deadline it had
    stats = p.stats
    assert (stats.cancelled, stats.timed_out) == (1, 0)
    assert p.batches == [["first"]]
    assert_settled(stats)
    await p.aclose()


@pytest.mark.looptime
async def test_cancelling_every_queued_caller_sends_nothing_more():
    p, first = await busy_proxy()
    tasks = [asyncio.create_task(p.inference(i)) for i in range(5)]
    await asyncio.sleep(1.0)
    for task in tasks:
        task.cancel()
    await asyncio.wait(tasks)
    assert all(task.cancelled() for task in tasks)
    assert p.stats.queue_depth == 0
    assert await first == ("out", "first")
    await asyncio.sleep(30.0)
    assert p.batches == [["first"]]
    assert p.stats.cancelled == 5
    assert_settled(p.stats)
    assert await p.inference("after") == ("out", "after")  # still serving
    await p.aclose()


# -- cancelled while the batch runs ----------------------------------------------------------


@pytest.mark.looptime
async def test_caller_cancelled_during_its_batch_others_still_get_results(no_leftovers):
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    p = Recorder(delay=10.0, batch_size=4, max_delay_ms=0)
    with loop_errors() as errors:
        tasks = [asyncio.create_task(p.inference(i)) for i in range(4)]
        await asyncio.sleep(5.0)
        assert p.batches == [[0, 1, 2, 3]]
        await cancel_and_wait(tasks[1])
        assert loop.time() - t0 == pytest.approx(5.0)
        assert [await tasks[i] for i in (0, 2, 3)] == [("out", 0), ("out", 2), ("out", 3)]
        assert loop.time() - t0 == pytest.approx(10.0)
        assert await p.inference("next") == ("out", "next")  # the proxy serves on
        gc.collect()
    assert errors == []
    stats = p.stats
    assert (stats.cancelled, stats.succeeded, stats.errors, stats.failed_batches) == (1, 4, 0, 0)
    assert_settled(stats)
    await p.aclose()


@pytest.mark.looptime
async def test_cancelling_everyone_in_a_running_batch_crashes_nothing():
    p = Recorder(delay=10.0, batch_size=4, max_delay_ms=0)
    with loop_errors() as errors:
        tasks = [asyncio.create_task(p.inference(i)) for i in range(4)]
        await asyncio.sleep(5.0)
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks)
        assert p.stats.in_flight == 1  # the batch runs on
        await asyncio.sleep(10.0)
        assert p.stats.in_flight == 0
        assert await p.inference("next") == ("out", "next")
        gc.collect()
    assert errors == []
    assert p.batches == [[0, 1, 2, 3], ["next"]]
    stats = p.stats
    assert (stats.cancelled, stats.succeeded, stats.errors) == (4, 1, 0)
    assert_settled(stats)
    await p.aclose()


@pytest.mark.looptime
async def test_cancelled_caller_of_a_failing_batch_is_counted_once():
    def fail(items: list[Any]) -> list[Any]:
        raise ValueError("model exploded")

    p = Recorder(fail, delay=10.0, batch_size=4, max_delay_ms=0)
    with loop_errors() as errors:
        tasks = [asyncio.create_task(p.inference(i)) for i in range(3)]
        await asyncio.sleep(5.0)
        await cancel_and_wait(tasks[0])
        await asyncio.wait(tasks)
        gc.collect()
    assert errors == []
    assert [outcome(t) for t in tasks] == ["cancelled", "ValueError", "ValueError"]
    stats = p.stats
    assert (stats.cancelled, stats.errors, stats.failed_batches) == (1, 2, 1)
    assert_settled(stats)
    await p.aclose()


async def test_caller_cancelled_while_sync_model_runs(no_leftovers):
    gate = threading.Event()
    p = ThreadRecorder(batch_size=4, max_delay_ms=0, gate=gate)
    with loop_errors() as errors:
        tasks = [asyncio.create_task(p.inference(i)) for i in range(3)]
        await wait_until(p.entered.is_set)
        await cancel_and_wait(tasks[2])
        gate.set()
        assert await asyncio.gather(tasks[0], tasks[1]) == [("out", 0), ("out", 1)]
        assert await p.inference("next") == ("out", "next")
        gc.collect()
    assert errors == []
    assert p.batches == [[0, 1, 2], ["next"]]
    assert p.stats.cancelled == 1
    assert_settled(p.stats)
    await p.aclose()


@pytest.mark.looptime
async def test_cancel_after_result_delivered_is_counted_once():
    """Cancelled between its result being set and the caller resuming: one outcome only."""
    tasks: list[asyncio.Task[Any]] = []

    class CancelOnFinish(batchproxy.Listener):
        def batch_finished(self, proxy: str, size: int, seconds: float, error: object) -> None:
            tasks[1].cancel()  # results are set, no caller has resumed yet

    p = Recorder(delay=1.0, batch_size=4, max_delay_ms=0)
    p.add_listener(CancelOnFinish())
    tasks.extend(asyncio.create_task(p.inference(i)) for i in range(3))
    await asyncio.wait(tasks)
    assert [outcome(t) for t in tasks] == ["ok", "cancelled", "ok"]
    stats = p.stats
    assert (stats.succeeded, stats.cancelled) == (2, 1)  # as the callers saw it
    assert_settled(stats)
    await p.aclose()


@pytest.mark.parametrize("settled_as", ["succeeded", "errors", "timed_out"])
@pytest.mark.looptime
async def test_a_caller_cancelled_after_its_outcome_was_set_is_counted_cancelled(settled_as):
    """Whatever the outcome set on its future (a result, an error in its slot, its
    deadline), a caller cancelled before it resumes sees CancelledError, and the stats
    count what it saw: cancelled, not the outcome it never took."""
    callers: list[asyncio.Task[Any]] = []

    class CancelTheCaller(batchproxy.Listener):
        def request_finished(self, proxy: str, outcome: str, seconds: float) -> None:
            callers[0].cancel()  # its future is settled; it has not resumed yet

    answers = {"succeeded": lambda items: items, "errors": lambda items: [ValueError("bad")]}
    p = Recorder(answers.get(settled_as), delay=1.0, max_delay_ms=0)
    p.add_listener(CancelTheCaller())
    callers.append(
        asyncio.create_task(p.inference(1, timeout=0.5 if settled_as == "timed_out" else None))
    )
    await asyncio.wait(callers)
    assert outcome(callers[0]) == "cancelled"
    await asyncio.sleep(2.0)  # the batch of a timed-out call ends too
    stats = p.stats
    assert (stats.succeeded, stats.errors, stats.timed_out, stats.cancelled) == (0, 0, 0, 1)
    assert_settled(stats)
    await p.aclose()


# -- cancellation mixed with deadlines -------------------------------------------------------


@pytest.mark.parametrize("running", [False, True], ids=["queued", "running"])
@pytest.mark.looptime
async def test_cancel_and_deadline_at_the_same_moment_count_once(running):
    loop = asyncio.get_running_loop()
    p = Recorder(delay=10.0, batch_size=1, max_delay_ms=0)
    others = [] if running else [asyncio.create_task(p.inference("ahead"))]
    await spin()
    target = asyncio.create_task(p.inference("target", timeout=3.0))
    await spin()
    assert (p.stats.in_flight, p.stats.queue_depth) == (1, 0 if running else 1)
    loop.call_at(loop.time() + 3.0, target.cancel)
    await asyncio.wait([target, *others])
    seen = outcome(target)
    assert seen in ("cancelled", "DeadlineExceeded")
    await asyncio.sleep(20.0)
    stats = p.stats
    assert (stats.timed_out, stats.cancelled) == ((0, 1) if seen == "cancelled" else (1, 0))
    assert_settled(stats)
    await p.aclose()


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.looptime
async def test_random_cancellations_and_deadlines_each_request_ends_once(seed, no_leftovers):
    rng = random.Random(seed)
    loop = asyncio.get_running_loop()

    def respond(items: list[Any]) -> list[Any]:
        return [ValueError(f"bad {x}") if x % 7 == 0 else ("out", x) for x in items]

    p = Recorder(respond, delay=0.01, batch_size=4, max_delay_ms=2, max_concurrent_batches=2)

    called: set[int] = set()

    async def call(i: int) -> Any:
        await asyncio.sleep(rng.uniform(0.0, 0.1))
        timeout = rng.choice([None, None, rng.uniform(0.001, 0.05)])
        called.add(i)
        return await p.inference(i, timeout=timeout)

    with loop_errors() as errors:
        tasks = [asyncio.create_task(call(i)) for i in range(80)]
        for task in rng.sample(tasks, 25):
            loop.call_later(rng.uniform(0.0, 0.12), task.cancel)
        await asyncio.wait(tasks)
        await asyncio.sleep(1.0)
        gc.collect()
    assert errors == []

    ends = [outcome(t) for t in tasks]
    for i, task in enumerate(tasks):
        if ends[i] == "ok":
            assert task.result() == ("out", i)
    sent = [x for batch in p.batches for x in batch]
    assert len(sent) == len(set(sent))  # no request went to the model twice
    stats = p.stats
    assert_settled(stats)
    assert stats.requests == len(called)
    assert ends.count("ok") == stats.succeeded
    assert ends.count("ValueError") == stats.errors
    assert ends.count("DeadlineExceeded") == stats.timed_out
    # a caller cancelled before it called inference() was never accepted, nor counted
    assert sum(ends[i] == "cancelled" for i in called) == stats.cancelled
    assert stats.timed_out > 0
    assert stats.cancelled > 0
    await p.aclose()
