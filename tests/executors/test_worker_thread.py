"""`WorkerThread`'s two ways of waiting: idle on its queue, or running its loop while an
async model's batch is in flight there, and the hand-overs between them."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import random
import sys
import threading
import time
import warnings
from collections.abc import Awaitable
from typing import Any

import pytest
from _support import wait_until

from batchproxy import WorkerThread


def _idle(worker: WorkerThread) -> bool:
    """Whether the thread waits on its queue (its loop not running)."""
    thread = worker._thread
    assert thread is not None
    assert thread.ident is not None
    frame = sys._current_frames().get(thread.ident)
    return frame is not None and frame.f_code is WorkerThread._serve.__code__


def _sync(items: list[int]) -> list[tuple[str, int]]:
    return [("sync", item) for item in items]


async def _async(items: list[int]) -> list[tuple[str, int]]:
    await asyncio.sleep(0)
    return [("async", item) for item in items]


async def test_between_batches_of_either_kind_the_thread_waits_on_its_queue() -> None:
    async with WorkerThread(name="waits-on-queue") as worker:
        for model, kind in [(_sync, "sync"), (_async, "async"), (_sync, "sync"), (_async, "async")]:
            assert await asyncio.wait_for(worker.run(model, [1]), 10) == [(kind, 1)]
            await wait_until(lambda: _idle(worker))


async def test_a_batch_submitted_while_an_async_one_awaits_there_runs_meanwhile() -> None:
    """The thread runs its loop then: the new batch must wake it, not wait in the queue
    until the async batch ends."""
    entered = threading.Event()
    ran: list[asyncio.Event] = []  # made on the thread's loop, set by the other batch there

    async def waits_for_the_other(items: list[int]) -> bool:
        ran.append(asyncio.Event())
        entered.set()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(ran[0].wait(), 5)
        return ran[0].is_set()

    def the_other(items: list[int]) -> list[int]:
        ran[0].set()  # (on the thread, inside its loop: the batch was started there)
        return items

    async with WorkerThread(name="wakes-its-loop") as worker:
        first = asyncio.ensure_future(worker.run(waits_for_the_other, [0]))
        await wait_until(entered.is_set)
        assert await asyncio.wait_for(worker.run(the_other, [1]), 10) == [1]
        assert await asyncio.wait_for(first, 10) is True
        await wait_until(lambda: _idle(worker))


async def test_sync_and_async_batches_mixed_at_random_are_each_answered_once() -> None:
    """Batches that arrive as the loop stops, or as it starts, are still run once."""
    rng = random.Random(39)
    ran: list[int] = []

    def sync_model(items: list[int]) -> list[tuple[str, int]]:
        time.sleep(rng.random() * 0.0005)
        ran.extend(items)
        return _sync(items)

    async def async_model(items: list[int]) -> list[tuple[str, int]]:
        await asyncio.sleep(rng.random() * 0.001)
        ran.extend(items)
        return [("async", item) for item in items]

    async def one(worker: WorkerThread, item: int) -> Any:
        await asyncio.sleep(rng.random() * 0.002)
        model = async_model if item % 3 else sync_model
        return await worker.run(model, [item])

    async with WorkerThread(name="mixed") as worker:
        results = await asyncio.wait_for(
            asyncio.gather(*(one(worker, item) for item in range(400))), 60
        )
        assert results == [[("async" if i % 3 else "sync", i)] for i in range(400)]
        assert sorted(ran) == list(range(400))
        await wait_until(lambda: _idle(worker))


async def test_a_close_as_the_thread_takes_up_an_async_batch_fails_that_batch() -> None:
    """Closed between starting an async batch and running its loop for it: the batch fails
    as any batch in flight at a stop does, the thread ends, and the model's coroutine is
    closed, not left to warn that it was never awaited."""
    worker = WorkerThread(name="closed-as-it-starts")

    def closes_then_awaits(items: list[int]) -> Awaitable[list[int]]:
        worker.close(wait=False)  # (from the thread: it does not wait for itself)
        return _async(items)

    with warnings.catch_warnings(record=True) as caught:  # (the thread's too: global)
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError, match="closed before the batch ran"):
            await asyncio.wait_for(worker.run(closes_then_awaits, [1]), 10)
        thread = worker._thread
        assert thread is not None
        await wait_until(lambda: not thread.is_alive())
        gc.collect()
    assert not [w for w in caught if "never awaited" in str(w.message)]


async def test_a_close_from_an_async_batch_answers_the_batch_queued_behind_it() -> None:
    """The sync batch submitted before the stop runs or fails, once; the async one fails."""
    entered = threading.Event()

    async def stuck(items: list[int]) -> list[int]:
        entered.set()
        await asyncio.sleep(3600)
        return items

    worker = WorkerThread(name="closed-while-looping")
    first = asyncio.ensure_future(worker.run(stuck, [0]))
    await wait_until(entered.is_set)
    second = asyncio.ensure_future(worker.run(_sync, [1]))
    await asyncio.wait_for(worker.aclose(), 10)
    with pytest.raises(RuntimeError, match="closed"):
        await asyncio.wait_for(first, 10)
    outcome = await asyncio.wait_for(asyncio.gather(second, return_exceptions=True), 10)
    assert outcome == [[("sync", 1)]] or isinstance(outcome[0], RuntimeError)


async def test_a_plain_def_model_runs_outside_any_event_loop() -> None:
    """As on a thread pool: it may start an event loop of its own (`asyncio.run`), which
    a model run from inside the thread's running loop could not (as it still is while
    an async model's batch is in flight on the same thread)."""

    def runs_its_own_loop(items: list[int]) -> list[int]:
        return asyncio.run(_async_double(items))

    async with WorkerThread(name="no-running-loop") as worker:
        assert await asyncio.wait_for(worker.run(runs_its_own_loop, [1, 2]), 10) == [2, 4]


async def _async_double(items: list[int]) -> list[int]:
    await asyncio.sleep(0)
    return [2 * item for item in items]
