"""The drain's deadline, `aclose(timeout=...)`: until it the proxy drains as without one;
at it every call still queued or running gets `DrainDeadline` (a `ProxyClosed`; never a
bare `CancelledError`), the running batches are abandoned, and `aclose()` returns.
Every accepted call has its outcome by then, on every executor and run kind, and in
combination with the options that settle calls themselves."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from _support import Hangs, assert_settled, outcome

import batchproxy
from batchproxy import DrainDeadline, ProxyClosed


def calls(
    proxy: batchproxy.Proxy[Any, Any], items: list[Any], **call: Any
) -> list[asyncio.Task[Any]]:
    return [asyncio.ensure_future(proxy.inference(item, **call)) for item in items]


def drain_errors(tasks: list[asyncio.Task[Any]]) -> list[DrainDeadline]:
    errors = []
    for task in tasks:
        assert task.done(), task
        error = task.exception()
        assert isinstance(error, DrainDeadline), outcome(task)
        errors.append(error)
    return errors


@pytest.mark.looptime
async def test_a_hung_model_on_the_loop_is_abandoned_at_the_deadline() -> None:
    loop = asyncio.get_running_loop()
    proxy = Hangs(batch_size=2, max_concurrent_batches=1)
    tasks = calls(proxy, ["hang", "a", "b", "c", "d"])
    await asyncio.sleep(0.1)
    start = loop.time()
    await proxy.aclose(timeout=1)
    assert loop.time() - start == pytest.approx(1.0)
    errors = drain_errors(tasks)  # every caller has its outcome as aclose returns
    assert [e.running for e in errors] == [True, True, False, False, False]
    assert all(isinstance(e, ProxyClosed) and e.timeout == 1 for e in errors)
    assert "drain deadline (timeout=1 s) passed while this call's batch was running" in str(
        errors[0]
    )
    assert "before this queued call reached the model" in str(errors[2])
    await asyncio.sleep(0)
    assert proxy.cancelled == 1  # the model call was cancelled (the loop executor can)
    assert proxy.closed
    stats = proxy.stats
    assert stats.errors == 5
    assert stats.failed_batches == 1
    assert_settled(stats)
    with pytest.raises(ProxyClosed):
        await proxy.inference("late")


@pytest.mark.looptime
async def test_a_model_that_ignores_cancellation_still_lets_aclose_return() -> None:
    loop = asyncio.get_running_loop()
    proxy = Hangs(stubborn=True, batch_size=1)
    tasks = calls(proxy, ["hang", "a"])
    await asyncio.sleep(0.1)
    start = loop.time()
    await proxy.aclose(timeout=2)
    assert loop.time() - start == pytest.approx(2.0)
    assert [e.running for e in drain_errors(tasks)] == [True, False]


@pytest.mark.looptime
async def test_a_drain_that_ends_before_its_deadline_is_the_drain_without_one() -> None:
    loop = asyncio.get_running_loop()

    class Slow(batchproxy.Proxy[int, int]):
        async def _inference(self, items: list[int]) -> list[int]:
            await asyncio.sleep(0.5)
            return [n * 2 for n in items]

    for timeout in (None, 10.0):
        proxy = Slow(batch_size=2, max_concurrent_batches=1)
        tasks = calls(proxy, list(range(6)))
        await asyncio.sleep(0)
        start = loop.time()
        await proxy.aclose(timeout=timeout)
        assert loop.time() - start == pytest.approx(1.5)  # three batches, one at a time
        assert [t.result() for t in tasks] == [0, 2, 4, 6, 8, 10]
        assert_settled(proxy.stats)


@pytest.mark.looptime
async def test_timeout_zero_cuts_at_once_and_infinity_is_no_deadline() -> None:
    proxy = Hangs(batch_size=1)
    tasks = calls(proxy, ["hang", "a"])
    await asyncio.sleep(0.1)
    await proxy.aclose(timeout=0)
    assert [e.running for e in drain_errors(tasks)] == [True, False]

    fine = Hangs(batch_size=1)
    tasks = calls(fine, ["a", "b"])
    await asyncio.sleep(0)  # the calls are in
    await fine.aclose(timeout=math.inf)
    assert [t.result() for t in tasks] == [("out", "a"), ("out", "b")]


@pytest.mark.parametrize(
    ("timeout", "error"),
    [
        (-1, ValueError),
        (math.nan, ValueError),
        (-math.inf, ValueError),
        ("1", TypeError),
        (True, TypeError),
    ],
)
async def test_a_bad_timeout_is_refused_before_anything_closes(timeout: Any, error: type) -> None:
    proxy = Hangs()
    with pytest.raises(error, match="timeout"):
        await proxy.aclose(timeout=timeout)
    assert not proxy.closed
    assert await proxy.inference("a") == ("out", "a")
    await proxy.aclose()


@pytest.mark.looptime
async def test_of_two_acloses_under_way_the_earlier_deadline_wins() -> None:
    loop = asyncio.get_running_loop()
    proxy = Hangs(batch_size=1)
    tasks = calls(proxy, ["hang", "a"])
    await asyncio.sleep(0.1)
    start = loop.time()
    late = asyncio.ensure_future(proxy.aclose(timeout=10))
    unbounded = asyncio.ensure_future(proxy.aclose())
    await asyncio.sleep(0.5)
    await proxy.aclose(timeout=1)  # due at 1.5 s, before the first's 10 s
    assert loop.time() - start == pytest.approx(1.5)
    await asyncio.wait_for(asyncio.gather(late, unbounded), 0.01)  # they return with it
    drain_errors(tasks)
    # a later, longer deadline does not postpone an earlier one
    second = Hangs(batch_size=1)
    tasks = calls(second, ["hang"])
    await asyncio.sleep(0.1)
    start = loop.time()
    first = asyncio.ensure_future(second.aclose(timeout=1))
    await asyncio.sleep(0)
    await second.aclose(timeout=5)
    assert loop.time() - start == pytest.approx(1.0)
    await first
    drain_errors(tasks)


async def test_a_hung_model_on_a_worker_thread_is_abandoned_at_the_deadline() -> None:
    release = threading.Event()

    class OnThread(batchproxy.Proxy[Any, Any]):
        def _inference(self, items: list[Any]) -> list[Any]:
            if "hang" in items:
                release.wait(30)
            return items

    for offload in (True, batchproxy.WorkerThread(name="drain-shared")):
        proxy = OnThread(batch_size=2, max_concurrent_batches=1, offload=offload)
        tasks = calls(proxy, ["hang", "a", "b"])
        await asyncio.sleep(0.1)
        start = time.monotonic()
        await proxy.aclose(timeout=0.5)
        assert 0.4 < time.monotonic() - start < 1.5  # the thread stays in the model
        assert [e.running for e in drain_errors(tasks)] == [True, True, False]
        assert_settled(proxy.stats)
        release.set()  # the model call ends; its result is dropped
        if isinstance(offload, batchproxy.WorkerThread):
            await offload.aclose()
        release.clear()


async def test_a_batch_in_a_worker_process_is_abandoned_at_the_deadline() -> None:
    import _workers

    async with batchproxy.ProcessWorkers(_workers.tagging, 1) as workers:
        proxy = batchproxy.Proxy[Any, Any](batch_size=1, offload=workers)
        await proxy.inference("warm")  # the worker is up
        tasks = calls(proxy, [("sleep", 2.0), "b"])
        await asyncio.sleep(0.2)
        start = time.monotonic()
        await proxy.aclose(timeout=0.5)
        assert 0.2 < time.monotonic() - start < 1.5
        assert [e.running for e in drain_errors(tasks)] == [True, False]
        assert_settled(proxy.stats)


@pytest.mark.looptime
async def test_the_batched_function_and_its_aclose_timeout() -> None:
    @batchproxy.batch(batch_size=1)
    async def slow(items: list[int]) -> list[int]:
        await asyncio.sleep(3600)
        return items

    tasks = [asyncio.ensure_future(slow(n)) for n in range(2)]
    await asyncio.sleep(0.1)
    await slow.aclose(timeout=1)
    assert [e.running for e in drain_errors(tasks)] == [True, False]


def test_a_background_loop_close_is_the_drain_deadline_of_its_proxies() -> None:
    release = threading.Event()

    class OnThread(batchproxy.Proxy[Any, Any]):
        def _inference(self, items: list[Any]) -> list[Any]:
            release.wait(30)
            return items

    background = batchproxy.BackgroundLoop(name="drain-deadline-loop")
    proxy = OnThread(batch_size=1)
    futures = [background.submit(proxy.inference(n)) for n in range(3)]
    time.sleep(0.2)
    start = time.monotonic()
    background.close(timeout=0.5)
    assert time.monotonic() - start < 2.0
    errors = [f.exception(timeout=1) for f in futures]
    assert all(isinstance(e, DrainDeadline) for e in errors), errors
    release.set()


# -- in combination -----------------------------------------------------------------------


@pytest.mark.looptime
@pytest.mark.parametrize(
    "options",
    [
        {"dedup": True},
        {"key": lambda item: item[0]},
        {"isolate_errors": True},
        {"batch_timeout": 5.0},
        {"max_queue_size_per_tenant": 10, "max_queue_size": 20},
        {"dedup": True, "isolate_errors": True, "batch_timeout": 5.0},
    ],
    ids=["dedup", "keys", "isolate_errors", "batch_timeout", "tenants", "dedup+isolate+watchdog"],
)
async def test_the_deadline_in_combination(options: dict[str, Any]) -> None:
    loop = asyncio.get_running_loop()

    class Pairs(batchproxy.Proxy[Any, Any]):
        async def _inference(self, items: list[Any], *args: Any) -> list[Any]:
            if any(item[1] == "hang" for item in items):
                await asyncio.sleep(3600)
            return list(items)

    proxy = Pairs(batch_size=2, max_concurrent_batches=1, max_delay_ms=0, **options)
    tenants = "max_queue_size_per_tenant" in options
    items = [("k", "hang"), ("k", "hang"), ("k", 1), ("j", 2), ("k", 1), ("j", 3)]
    tasks = [
        asyncio.ensure_future(proxy.inference(item, tenant=f"t{i % 2}" if tenants else None))
        for i, item in enumerate(items)
    ]
    await asyncio.sleep(0.1)
    start = loop.time()
    await proxy.aclose(timeout=1)
    assert loop.time() - start == pytest.approx(1.0)
    errors = drain_errors(tasks)  # dedup's joined callers too
    assert errors[0].running
    assert errors[1].running
    if "dedup" not in options:  # (with it, the second "hang" joins the first: 1 goes too)
        assert not any(e.running for e in errors[2:])
    assert_settled(proxy.stats)


@pytest.mark.looptime
async def test_the_watchdog_fires_first_then_the_deadline_cuts_the_rest() -> None:
    proxy = Hangs(batch_size=1, batch_timeout=0.5, stubborn=True)
    tasks = calls(proxy, ["hang", "hang", "hang", "hang", "a"])
    await asyncio.sleep(0.1)
    await proxy.aclose(timeout=1.2)  # overruns at 0.5 and 1.0; the deadline at 1.3
    assert [outcome(t) for t in tasks] == ["BatchTimeout"] * 2 + ["DrainDeadline"] * 3
    assert [e.running for e in drain_errors(tasks[2:])] == [True, False, False]
    stats = proxy.stats  # every call ended; the batch that ignores its cancellation runs on
    assert (stats.requests, stats.errors, stats.queue_depth, stats.in_flight) == (5, 5, 0, 1)


# -- streams and continuous batching -----------------------------------------------------


class Streams(batchproxy.Proxy[Any, Any]):
    async def _inference(self, items: list[Any]) -> AsyncIterator[list[Any]]:
        yield [f"{item}-first" for item in items]
        await asyncio.sleep(3600)
        yield [batchproxy.END for _ in items]


async def read(stream: AsyncIterator[Any]) -> tuple[list[Any], BaseException | None]:
    chunks: list[Any] = []
    try:
        async for chunk in stream:
            chunks.append(chunk)
    except Exception as exc:  # the stream's error
        return chunks, exc
    return chunks, None


def assert_streams_cut(
    proxy: batchproxy.Proxy[Any, Any],
    readers: list[asyncio.Future[tuple[list[Any], BaseException | None]]],
    chunks: list[list[Any]],
) -> None:
    """Two streams were running at the deadline and a third queued: each reader got its
    chunks, then `DrainDeadline`."""
    results = [r.result() for r in readers]
    assert [got for got, _ in results] == chunks
    errors = [error for _, error in results]
    assert all(isinstance(e, DrainDeadline) for e in errors), errors
    assert [e.running for e in errors if isinstance(e, DrainDeadline)] == [True, True, False]
    assert_settled(proxy.stats)


@pytest.mark.looptime
async def test_streams_end_with_the_drain_deadline() -> None:
    proxy = Streams(batch_size=2, max_concurrent_batches=1)
    readers = [asyncio.ensure_future(read(proxy.stream(n))) for n in range(3)]
    await asyncio.sleep(0.1)
    await proxy.aclose(timeout=1)
    await asyncio.sleep(0)  # the readers take their end
    assert_streams_cut(proxy, readers, [["0-first"], ["1-first"], []])
    stats = proxy.stats  # the batch was counted once, failed when cut (issue 38)
    assert (stats.batches, stats.failed_batches, stats.model_time.count) == (1, 1, 0)


class Generates(batchproxy.GenerationProxy[Any, Any]):
    async def _step(self, step: batchproxy.Step[Any]) -> list[Any]:
        if any(slot.chunks >= 1 for slot in step.active):
            await asyncio.sleep(3600)
        return [f"{slot.item}-{slot.chunks}" for slot in step.active]


@pytest.mark.looptime
async def test_generation_sequences_end_with_the_drain_deadline() -> None:
    loop = asyncio.get_running_loop()
    proxy = Generates(batch_size=2)
    readers = [asyncio.ensure_future(read(proxy.stream(n))) for n in range(3)]
    await asyncio.sleep(0.1)
    start = loop.time()
    await proxy.aclose(timeout=1)
    assert loop.time() - start == pytest.approx(1.0)
    await asyncio.sleep(0)
    assert_streams_cut(proxy, readers, [["0-0"], ["1-0"], []])
    stats = proxy.stats  # the step that hung: failed when cut, not a finished one
    assert (stats.batches, stats.failed_batches, stats.model_time.count) == (2, 1, 1)


@pytest.mark.looptime
async def test_aclose_from_another_loop_honours_the_deadline() -> None:
    proxy = Hangs(batch_size=1)
    tasks = calls(proxy, ["hang", "a"])
    await asyncio.sleep(0.1)

    def close_elsewhere() -> None:
        asyncio.run(proxy.aclose(timeout=0.5))

    await asyncio.get_running_loop().run_in_executor(None, close_elsewhere)
    assert [e.running for e in drain_errors(tasks)] == [True, False]
