"""Lifecycle: lazy start, start(), async with, draining aclose(), other loops and threads."""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import itertools
import logging
import threading
from collections.abc import AsyncIterator
from typing import Any

import pytest
from _support import (
    LoopThread,
    Recorder,
    ThreadRecorder,
    assert_settled,
    batch_tasks,
    cancel_batches_before_they_run,
    tag_with_thread,
    thread_alive,
    wait_until,
)

import batchproxy
from batchproxy import ProxyClosed

# -- lazy start and start() ---------------------------------------------------------------


def test_proxy_is_built_without_a_loop_and_starts_on_first_call() -> None:
    """Constructing needs no event loop; the first call binds it and gets its result."""
    proxy = Recorder()

    async def main() -> object:
        try:
            return await asyncio.wait_for(proxy.inference(1), 10)
        finally:
            await proxy.aclose()

    assert asyncio.run(main()) == ("out", 1)
    assert proxy.batches == [[1]]


async def test_owned_worker_thread_starts_on_first_call(no_leftovers: None) -> None:
    proxy = Recorder(respond=tag_with_thread, offload=True, name="lazy-start")
    assert not thread_alive("batchproxy-lazy-start")
    assert await asyncio.wait_for(proxy.inference(1), 10) == ("batchproxy-lazy-start", 1)
    assert thread_alive("batchproxy-lazy-start")
    await proxy.aclose()
    assert not thread_alive("batchproxy-lazy-start")


async def test_start_starts_worker_and_is_idempotent(no_leftovers: None) -> None:
    proxy = Recorder(offload=True, name="started")
    await proxy.start()
    assert thread_alive("batchproxy-started")
    await proxy.start()
    names = [t.name for t in threading.enumerate()]
    assert names.count("batchproxy-started") == 1
    assert await asyncio.wait_for(proxy.inference(2), 10) == ("out", 2)
    await proxy.aclose()
    assert not thread_alive("batchproxy-started")


async def test_start_binds_the_loop_so_submit_works_before_any_call(no_leftovers: None) -> None:
    proxy = Recorder()
    await proxy.start()
    results: list[object] = []
    thread = threading.Thread(target=lambda: results.append(proxy.submit(7).result(10)))
    thread.start()
    await wait_until(lambda: not thread.is_alive())
    assert results == [("out", 7)]
    await proxy.aclose()


async def test_start_after_aclose_raises_proxy_closed() -> None:
    proxy = Recorder()
    await proxy.start()
    await proxy.aclose()
    with pytest.raises(ProxyClosed):
        await proxy.start()


async def test_async_with_starts_and_closes(no_leftovers: None) -> None:
    proxy = Recorder(respond=tag_with_thread, offload=True, name="ctx")
    async with proxy as entered:
        assert entered is proxy
        assert thread_alive("batchproxy-ctx")
        assert not proxy.closed
        assert await asyncio.wait_for(proxy.inference(3), 10) == ("batchproxy-ctx", 3)
    assert proxy.closed
    assert not thread_alive("batchproxy-ctx")
    with pytest.raises(ProxyClosed):
        await proxy.inference(4)


async def test_async_with_closes_on_error_too() -> None:
    proxy = Recorder()

    async def fail_inside() -> None:
        async with proxy:
            await proxy.inference(1)
            raise KeyError("boom")

    with pytest.raises(KeyError):
        await fail_inside()
    assert proxy.closed


# -- aclose() drains -----------------------------------------------------------------------


@pytest.mark.looptime
async def test_aclose_finishes_running_and_slot_waiting_calls(no_leftovers: None) -> None:
    """Calls accepted before aclose() all get their results, queued ones included."""
    proxy = Recorder(batch_size=2, delay=1.0)
    tasks = [asyncio.create_task(proxy.inference(i)) for i in range(5)]
    await asyncio.sleep(0.5)
    assert proxy.stats.in_flight == 1
    assert proxy.stats.queue_depth == 3  # waiting for the busy slot
    await asyncio.wait_for(proxy.aclose(), 10)
    assert all(task.done() for task in tasks)
    assert [task.result() for task in tasks] == [("out", i) for i in range(5)]
    assert proxy.batches == [[0, 1], [2, 3], [4]]
    with pytest.raises(ProxyClosed):
        await proxy.inference(9)
    with pytest.raises(ProxyClosed):
        await proxy.inference_many([9, 10])


@pytest.mark.looptime
async def test_aclose_sends_a_partial_batch_without_waiting_out_the_delay(
    no_leftovers: None,
) -> None:
    loop = asyncio.get_running_loop()
    # a slow model with a spare slot: a trickle overlapping it waits for company
    proxy = Recorder(batch_size=100, max_delay_ms=10_000, max_concurrent_batches=2, delay=0.05)
    tasks = []
    for i in range(5):
        tasks.append(asyncio.create_task(proxy.inference(i)))
        await asyncio.sleep(0.001)
    assert proxy.stats.queue_depth > 0
    start = loop.time()
    await asyncio.wait_for(proxy.aclose(), 60)
    assert loop.time() - start < 0.1
    assert [task.result() for task in tasks] == [("out", i) for i in range(5)]
    assert sorted(item for batch in proxy.batches for item in batch) == list(range(5))


@pytest.mark.looptime
async def test_calls_during_aclose_are_refused_while_accepted_ones_finish(
    no_leftovers: None,
) -> None:
    proxy = Recorder(batch_size=1, delay=1.0)
    accepted = [asyncio.create_task(proxy.inference(i)) for i in range(3)]
    await asyncio.sleep(0.1)
    closing = asyncio.create_task(proxy.aclose())
    await asyncio.sleep(0)
    assert not closing.done()
    with pytest.raises(ProxyClosed):
        await proxy.inference(99)
    await asyncio.wait_for(closing, 10)
    assert [task.result() for task in accepted] == [("out", i) for i in range(3)]
    assert 99 not in [item for batch in proxy.batches for item in batch]


@pytest.mark.looptime
async def test_aclose_is_idempotent_and_concurrent_closers_both_wait(
    no_leftovers: None,
) -> None:
    proxy = Recorder(delay=1.0)
    call = asyncio.create_task(proxy.inference(1))
    await asyncio.sleep(0.1)
    await asyncio.wait_for(asyncio.gather(proxy.aclose(), proxy.aclose()), 10)
    assert call.done()
    assert call.result() == ("out", 1)
    await proxy.aclose()
    assert proxy.closed


async def test_aclose_of_offloaded_proxy_is_idempotent_and_stops_its_thread(
    no_leftovers: None,
) -> None:
    proxy = Recorder(offload=True, name="close-twice")
    assert await asyncio.wait_for(proxy.inference(1), 10) == ("out", 1)
    await asyncio.wait_for(proxy.aclose(), 10)
    await asyncio.wait_for(proxy.aclose(), 10)
    assert not thread_alive("batchproxy-close-twice")


async def test_aclose_of_a_never_used_proxy_closes_it(no_leftovers: None) -> None:
    proxy = Recorder(offload=True)
    await proxy.aclose()
    assert proxy.closed
    with pytest.raises(ProxyClosed):
        await proxy.inference(1)


SELF_CALLS = ["inference", "inference_many", "decorated", "inference_sync", "submit"]


@pytest.mark.parametrize("how", SELF_CALLS)
async def test_a_model_calling_its_own_proxy_gets_a_clear_error(
    how: str, no_leftovers: None
) -> None:
    """Issue 16.8: a model awaiting its own proxy (or, on its worker thread, blocking on
    it) waited for a batch that could only start once its own had ended: a silent
    deadlock. The call now fails at once, inside the model; other callers are served."""
    seen: list[BaseException] = []

    @batchproxy.batch(batch_size=4, offload=how in ("inference_sync", "submit"))
    def blocking(items: list[int]) -> list[int]:
        if 0 in items:
            try:
                if how == "inference_sync":
                    blocking.inference_sync(99)
                else:
                    blocking.proxy.submit(99).result(5)
            except RuntimeError as exc:
                seen.append(exc)
        return [i * 10 for i in items]

    @batchproxy.batch(batch_size=4)
    async def awaiting(items: list[int]) -> list[int]:
        if 0 in items:
            try:
                if how == "inference":
                    await awaiting.proxy.inference(99)
                elif how == "inference_many":
                    await awaiting.inference_many([98, 99])
                else:
                    await awaiting(99)
            except RuntimeError as exc:
                seen.append(exc)
        return [i * 10 for i in items]

    model = blocking if how in ("inference_sync", "submit") else awaiting
    results = await asyncio.wait_for(asyncio.gather(*(model(i) for i in range(3))), 10)
    assert results == [0, 10, 20]
    (error,) = seen
    assert "its own model" in str(error)
    assert "deadlock" in str(error)
    assert model.stats.requests == 3  # the refused call was never accepted
    await model.aclose()


async def test_a_model_may_call_another_proxy() -> None:
    """The check is about a proxy's own batch: a pipeline of two proxies still works."""

    @batchproxy.batch(batch_size=4)
    async def inner(items: list[int]) -> list[int]:
        return [i + 1 for i in items]

    @batchproxy.batch(batch_size=4)
    async def outer(items: list[int]) -> list[int]:
        return await inner.inference_many(items)

    assert await asyncio.wait_for(asyncio.gather(*(outer(i) for i in range(3))), 10) == [1, 2, 3]
    await outer.aclose()
    await inner.aclose()


@pytest.mark.parametrize("offload", [False, True])
async def test_aclose_inside_inference_completes_after_that_batch(
    offload: bool, no_leftovers: None
) -> None:
    """A model that closes its own proxy: intake stops at once, its own batch and the
    queued ones still get results, and the close then completes (worker released)."""

    class SelfClosing(batchproxy.Proxy[int, int]):
        async def _inference(self, items: list[int]) -> list[int]:
            if 0 in items:
                await self.aclose()
                assert self.closed
            return [i * 10 for i in items]

    proxy = SelfClosing(batch_size=1, offload=offload)
    calls = [asyncio.create_task(proxy.inference(i)) for i in range(3)]
    assert await asyncio.wait_for(asyncio.gather(*calls), 5) == [0, 10, 20]
    with pytest.raises(ProxyClosed):
        await proxy.inference(3)
    await asyncio.wait_for(proxy.aclose(), 5)  # returns once the close has completed
    assert proxy.stats.succeeded == 3


def test_aclose_elsewhere_while_its_loop_is_stopped_still_ends_every_call() -> None:
    """Closed from another loop while its own loop is paused: once that loop runs again,
    the running call gets its result and the queued one ends too (guarantees 1 and 9)."""
    proxy = Recorder(batch_size=1, delay=0.05)
    paused = asyncio.new_event_loop()
    try:
        running = paused.create_task(proxy.inference(1))
        queued = paused.create_task(proxy.inference(2))
        paused.run_until_complete(asyncio.sleep(0.01))
        assert (proxy.stats.in_flight, proxy.stats.queue_depth) == (1, 1)

        asyncio.run(proxy.aclose())
        assert proxy.closed

        both = asyncio.gather(running, queued, return_exceptions=True)
        try:
            outcomes = paused.run_until_complete(asyncio.wait_for(both, 1))
        except asyncio.TimeoutError:
            pytest.fail("calls accepted before aclose() never ended")
        assert outcomes[0] == ("out", 1)
        assert outcomes[1] == ("out", 2) or isinstance(outcomes[1], ProxyClosed)
    finally:
        for task in asyncio.all_tasks(paused):
            task.cancel()
        paused.run_until_complete(asyncio.sleep(0))
        paused.close()


# -- guarantee 8: successive event loops -------------------------------------------------


def test_same_proxy_works_in_successive_asyncio_runs() -> None:
    proxy = Recorder(batch_size=4)

    async def burst(base: int) -> list[object]:
        calls = (proxy.inference(base + i) for i in range(6))
        return await asyncio.wait_for(asyncio.gather(*calls), 10)

    assert asyncio.run(burst(0)) == [("out", i) for i in range(6)]
    assert asyncio.run(burst(10)) == [("out", 10 + i) for i in range(6)]
    asyncio.run(proxy.aclose())
    assert proxy.batches == [[0, 1, 2, 3], [4, 5], [10, 11, 12, 13], [14, 15]]
    assert proxy.stats.succeeded == 12


def test_offloaded_proxy_works_in_successive_asyncio_runs() -> None:
    proxy = Recorder(respond=tag_with_thread, offload=True, name="two-runs")

    async def call(item: int) -> object:
        return await asyncio.wait_for(proxy.inference(item), 10)

    async def call_then_close(item: int) -> object:
        try:
            return await call(item)
        finally:
            await proxy.aclose()

    assert asyncio.run(call(1)) == ("batchproxy-two-runs", 1)
    assert asyncio.run(call_then_close(2)) == ("batchproxy-two-runs", 2)
    assert not thread_alive("batchproxy-two-runs")


def test_plain_def_proxy_works_in_successive_asyncio_runs() -> None:
    proxy = ThreadRecorder(name="sync-two-runs")

    async def call(item: int) -> object:
        return await asyncio.wait_for(proxy.inference(item), 10)

    assert asyncio.run(call(1)) == ("out", 1)
    assert asyncio.run(call(2)) == ("out", 2)
    asyncio.run(proxy.aclose())
    assert len(set(proxy.threads)) == 1
    assert not thread_alive("batchproxy-sync-two-runs")


def test_requests_left_on_a_stopped_loop_give_a_clear_error_elsewhere() -> None:
    """A loop that stopped (not closed) with a call still pending: another loop is refused."""
    gate = threading.Event()
    proxy = ThreadRecorder(gate=gate)
    first = asyncio.new_event_loop()
    try:
        pending = first.create_task(proxy.inference(1))
        first.run_until_complete(asyncio.sleep(0.01))
        assert proxy.entered.wait(10)

        async def other_call() -> object:
            return await asyncio.wait_for(proxy.inference(2), 10)

        with pytest.raises(RuntimeError, match="still has requests"):
            asyncio.run(other_call())
        gate.set()
        assert first.run_until_complete(asyncio.wait_for(pending, 10)) == ("out", 1)
        first.run_until_complete(proxy.aclose())
    finally:
        gate.set()
        first.close()
    assert proxy.batches == [[1]]


async def test_proxy_moves_on_after_its_loop_thread_ended(no_leftovers: None) -> None:
    proxy = Recorder(respond=tag_with_thread)
    with LoopThread("first-home") as other:
        assert await other.arun(proxy.inference(1)) == ("first-home", 1)
    here = threading.current_thread().name
    assert await asyncio.wait_for(proxy.inference(3), 10) == (here, 3)
    await proxy.aclose()


# -- other threads and loops ---------------------------------------------------------------


async def test_call_from_another_loop_is_routed_to_the_proxys_loop(no_leftovers: None) -> None:
    proxy = Recorder(respond=tag_with_thread)
    with LoopThread("proxy-loop") as other:
        await other.arun(proxy.start())
        assert await asyncio.wait_for(proxy.inference(1), 10) == ("proxy-loop", 1)
        many = await asyncio.wait_for(proxy.inference_many([2, 3]), 10)
        assert many == [("proxy-loop", 2), ("proxy-loop", 3)]
        await other.arun(proxy.aclose())
    assert proxy.stats.succeeded == 3


async def test_start_from_another_loop_while_bound_elsewhere_is_refused(
    no_leftovers: None,
) -> None:
    proxy = Recorder()
    with LoopThread() as other:
        await other.arun(proxy.start())
        with pytest.raises(RuntimeError, match="another event loop"):
            await asyncio.wait_for(proxy.start(), 10)
        await other.arun(proxy.aclose())


def test_submit_from_plain_threads_returns_concurrent_futures() -> None:
    proxy = Recorder(batch_size=8)
    with LoopThread() as other:
        other.run(proxy.start())
        future = proxy.submit(5)
        assert isinstance(future, concurrent.futures.Future)
        assert future.result(10) == ("out", 5)

        results: dict[int, object] = {}

        def worker(i: int) -> None:
            results[i] = proxy.submit(i).result(10)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        assert results == {i: ("out", i) for i in range(6)}
        other.run(proxy.aclose())


def test_submit_honours_the_timeout() -> None:
    gate = threading.Event()
    proxy = ThreadRecorder(gate=gate, batch_size=1)
    with LoopThread() as other:
        other.run(proxy.start())
        busy = proxy.submit(0)
        assert proxy.entered.wait(10)
        late = proxy.submit(1, timeout=0.05)
        with pytest.raises(batchproxy.DeadlineExceeded):
            late.result(10)
        gate.set()
        assert busy.result(10) == ("out", 0)
        other.run(proxy.aclose())
    assert proxy.batches == [[0]]


def test_submit_before_the_proxy_runs_starts_it_on_the_background_loop() -> None:
    proxy = Recorder(respond=tag_with_thread)
    assert proxy.submit(1).result(10) == ("batchproxy-loop", 1)
    batchproxy.BackgroundLoop.default().close()
    assert proxy.closed


def test_submit_after_its_loop_ended_moves_to_the_background_loop() -> None:
    proxy = Recorder(respond=tag_with_thread)
    assert asyncio.run(proxy.inference(1)) == (threading.current_thread().name, 1)
    assert proxy.submit(2).result(10) == ("batchproxy-loop", 2)
    batchproxy.BackgroundLoop.default().close()


async def test_submit_from_the_proxys_own_loop_thread_raises() -> None:
    proxy = Recorder()
    assert await proxy.inference(1) == ("out", 1)
    with pytest.raises(RuntimeError, match="own event-loop thread"):
        proxy.submit(2)
    await proxy.aclose()


async def test_submit_from_the_proxys_loop_in_another_thread_raises(no_leftovers: None) -> None:
    proxy = Recorder()

    async def submit_here() -> object:
        return proxy.submit(2)

    with LoopThread() as other:
        await other.arun(proxy.start())
        with pytest.raises(RuntimeError, match="own event-loop thread"):
            await other.arun(submit_here())
        await other.arun(proxy.aclose())


async def test_cancelled_routed_call_is_withdrawn_on_the_proxys_loop(no_leftovers: None) -> None:
    gate = threading.Event()
    proxy = ThreadRecorder(gate=gate, batch_size=1)
    with LoopThread() as other:
        try:
            await other.arun(proxy.start())
            busy = proxy.submit(0)
            await wait_until(proxy.entered.is_set)
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(proxy.inference(1), 0.05)
            await wait_until(lambda: proxy.stats.cancelled == 1)
        finally:
            gate.set()
        assert await asyncio.wait_for(asyncio.wrap_future(busy), 10) == ("out", 0)
        await other.arun(proxy.aclose())
    assert proxy.batches == [[0]]


@pytest.mark.parametrize("offload", [False, True])
async def test_aclose_from_another_loop_drains_on_the_proxys_loop(
    no_leftovers: None, offload: bool
) -> None:
    proxy = Recorder(batch_size=2, delay=0.02, offload=offload, name="remote-close")
    with LoopThread() as other:
        await other.arun(proxy.start())
        futures = [proxy.submit(i) for i in range(5)]
        await wait_until(lambda: proxy.stats.requests == 5)
        await asyncio.wait_for(proxy.aclose(), 10)
        assert proxy.closed
        assert sorted(item for batch in proxy.batches for item in batch) == list(range(5))
        assert max(len(batch) for batch in proxy.batches) <= 2
        results = await asyncio.wait_for(
            asyncio.gather(*(asyncio.wrap_future(f) for f in futures)), 10
        )
        assert results == [("out", i) for i in range(5)]
        with pytest.raises(ProxyClosed):
            await asyncio.wait_for(proxy.inference(9), 10)
        with pytest.raises(ProxyClosed):
            await asyncio.wait_for(asyncio.wrap_future(proxy.submit(9)), 10)
    assert not thread_alive("batchproxy-remote-close")


def test_event_loop_ending_mid_batch_leaves_the_proxy_usable(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """asyncio.run() returning while a batch runs cancels it with the callers; nothing
    is reported to the loop's exception handler, and the next loop is served."""
    proxy = Recorder(delay=10.0)

    async def leave_a_batch_running() -> None:
        caller = asyncio.create_task(proxy.inference("abandoned"))
        await asyncio.sleep(0.01)
        assert not caller.done()
        assert proxy.stats.in_flight == 1

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        asyncio.run(leave_a_batch_running())
    assert caplog.records == []
    proxy.delay = 0.0
    assert asyncio.run(proxy.inference("next")) == ("out", "next")


async def test_batch_task_cancelled_from_outside_fails_its_callers() -> None:
    """If something cancels the batch task itself, its callers get InferenceError at
    once instead of waiting forever, and the proxy serves the next batch."""
    proxy = Recorder(delay=10.0, batch_size=2)
    calls = [asyncio.create_task(proxy.inference(i)) for i in range(2)]
    await asyncio.sleep(0.01)
    (batch_task,) = batch_tasks(proxy)
    batch_task.cancel()
    outcomes = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 5)
    assert all(isinstance(o, batchproxy.InferenceError) for o in outcomes)
    assert isinstance(outcomes[0].__cause__, asyncio.CancelledError)
    proxy.delay = 0.0
    assert await asyncio.wait_for(proxy.inference("next"), 5) == ("out", "next")
    await proxy.aclose()


@pytest.mark.parametrize("offload", [False, True], ids=["on-loop", "offloaded"])
async def test_a_batch_task_cancelled_from_outside_ends_cancelled_and_blames_no_model(
    offload: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """The cancellation propagates (the task ends cancelled, as "cancel every task"
    expects) and is not logged as the model raising `CancelledError`. On Python 3.10,
    whose tasks keep no count of cancellation requests, the batch task keeps its own
    (before, 3.10 logged "_inference raised CancelledError" and the task swallowed it)."""
    proxy = Recorder(delay=10.0, batch_size=2, offload=offload)
    calls = [asyncio.create_task(proxy.inference(i)) for i in range(2)]
    await wait_until(lambda: proxy.batches == [[0, 1]])  # the model is running
    (batch_task,) = batch_tasks(proxy)
    with caplog.at_level(logging.DEBUG, logger="batchproxy"):
        batch_task.cancel()
        await asyncio.wait([batch_task], timeout=5)
    assert batch_task.cancelled()
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    outcomes = await asyncio.gather(*calls, return_exceptions=True)
    assert all(isinstance(o, batchproxy.InferenceError) for o in outcomes)
    assert "cancelled from outside" in str(outcomes[0])
    await proxy.aclose()


def test_a_batch_left_on_a_closed_loop_does_not_touch_the_next_loops_slots(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A loop closed (without cancelling its tasks) while a batch ran: when garbage
    collection later closes that batch, it frees no slot of the new loop's scheduler
    (which would let two batches overlap) and logs nothing of its own."""
    proxy = Recorder(delay=0.2, batch_size=1)
    first = asyncio.new_event_loop()
    left_behind: list[asyncio.Task[object]] = []

    async def leave_a_batch_in_the_model() -> None:
        left_behind.append(first.create_task(proxy.inference("abandoned")))
        await asyncio.sleep(0.01)

    first.run_until_complete(leave_a_batch_in_the_model())
    first.close()  # its pending tasks are not cancelled

    async def next_loop() -> list[object]:
        await proxy.start()  # a fresh scheduler, on this loop
        left_behind.clear()
        with caplog.at_level(logging.ERROR, logger="batchproxy"):
            gc.collect()  # closes the old batch's coroutine (GeneratorExit)
        assert proxy.stats.in_flight == 0
        results = await asyncio.wait_for(asyncio.gather(*map(proxy.inference, range(3))), 10)
        assert proxy.stats.in_flight == 0
        await proxy.aclose()
        return results

    assert asyncio.run(next_loop()) == [("out", i) for i in range(3)]
    starts = proxy.started_at[1:]
    gaps = [later - earlier for earlier, later in itertools.pairwise(starts)]
    assert all(gap >= 0.19 for gap in gaps), gaps  # one at a time: batch_size=1, one slot
    assert [r for r in caplog.records if r.name == "batchproxy"] == []


@pytest.mark.parametrize("streaming", [False, True], ids=["batch", "stream"])
@pytest.mark.parametrize("busy", [False, True], ids=["idle", "busy"])
async def test_a_batch_task_cancelled_before_its_first_step_settles_and_frees_its_slot(
    busy: bool, streaming: bool, no_leftovers: None
) -> None:
    """Issue 16.5: "cancel every other task" reaching a batch task that has not run yet
    (its coroutine never starts, so nothing in it runs) left its callers hanging, its
    slot taken and every later call stuck. Both ways a batch starts: an arrival to an
    idle proxy (its requests still queued) and a decision (its batch taken)."""
    gate = asyncio.Event()

    class Model(batchproxy.Proxy[int, int]):
        async def _inference(self, items: list[int]) -> list[int]:
            await gate.wait()
            return [i * 10 for i in items]

    class Streams(batchproxy.Proxy[int, int]):
        async def _inference(self, items: list[int]) -> AsyncIterator[list[Any]]:
            await gate.wait()
            yield [batchproxy.Last(i * 10) for i in items]

    proxy: batchproxy.Proxy[int, int] = (Streams if streaming else Model)(batch_size=4)
    # idle: the first batch task; busy: the second, which a decision starts with its batch
    cancel_batches_before_they_run(proxy, lambda n: n == (1 if busy else 0))

    async def call(item: int) -> int:
        if not streaming:
            return await proxy.inference(item)
        (chunk,) = [chunk async for chunk in proxy.stream(item)]
        return chunk

    first = None
    if busy:  # a batch runs: the next one is formed by a decision when it ends
        first = asyncio.create_task(call(0))
        await asyncio.sleep(0.01)
    calls = [asyncio.create_task(call(i)) for i in (1, 2)]
    await asyncio.sleep(0.01)
    gate.set()
    outcomes = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 5)
    for outcome in outcomes:
        assert isinstance(outcome, batchproxy.InferenceError), outcome
        assert "cancelled" in str(outcome)
    if first is not None:
        assert await first == 0
    assert proxy.stats.in_flight == 0
    assert await asyncio.wait_for(call(3), 5) == 30  # the proxy serves on
    await proxy.aclose()
    assert_settled(proxy.stats)
