"""`max_queue_size` and priorities: higher first, FIFO within a level.

`max_queue_size` is guarantee 7 of docs/failures.md: with it set, a call that would
overflow the queue raises `QueueFull` immediately.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from _support import Recorder, assert_settled

import batchproxy

pytestmark = pytest.mark.looptime


async def spin(times: int = 10) -> None:
    """Let the loop run a few iterations without moving (virtual) time."""
    for _ in range(times):
        await asyncio.sleep(0)


async def busy_proxy(**options: Any) -> tuple[Recorder, asyncio.Task[Any]]:
    """A proxy (one slot, 10 s model) whose slot a first call holds for 10 s."""
    options = {"batch_size": 1, **options}
    p = Recorder(delay=10.0, max_concurrent_batches=1, **options)
    first = asyncio.create_task(p.inference("first"))
    await spin()
    assert p.batches == [["first"]]
    return p, first


# -- max_queue_size --------------------------------------------------------------------------


async def test_overflow_raises_queue_full_at_once(no_leftovers):
    loop = asyncio.get_running_loop()
    p, first = await busy_proxy(max_queue_size=2)
    accepted = [asyncio.create_task(p.inference(i)) for i in range(2)]
    await spin()
    assert p.stats.queue_depth == 2

    t0 = loop.time()
    call = p.inference("overflow")
    with pytest.raises(batchproxy.QueueFull) as caught:
        call.send(None)  # the first step raises: it never suspends to wait for room
    call.close()
    assert loop.time() == t0
    assert isinstance(caught.value, batchproxy.BatchProxyError)
    assert caught.value.max_queue_size == 2
    assert "Recorder" in str(caught.value)
    assert "2" in str(caught.value)

    with pytest.raises(batchproxy.QueueFull):
        await p.inference("overflow again")
    assert loop.time() == t0
    stats = p.stats
    assert (stats.rejected, stats.requests, stats.queue_depth) == (2, 3, 2)

    assert await asyncio.gather(first, *accepted) == [("out", "first"), ("out", 0), ("out", 1)]
    assert p.batches == [["first"], [0], [1]]
    assert p.stats.succeeded == 3
    assert_settled(p.stats)
    await p.aclose()


async def test_running_batch_does_not_use_queue_room():
    """The limit counts waiting requests; the one the model is running has left the queue."""
    p, first = await busy_proxy(max_queue_size=1)
    waiting = asyncio.create_task(p.inference("waiting"))
    await spin()
    with pytest.raises(batchproxy.QueueFull):
        await p.inference("refused")
    assert await asyncio.gather(first, waiting) == [("out", "first"), ("out", "waiting")]
    await p.aclose()


async def test_room_comes_back_once_the_queue_drains():
    p, first = await busy_proxy(max_queue_size=1)
    waiting = asyncio.create_task(p.inference("waiting"))
    await spin()
    with pytest.raises(batchproxy.QueueFull):
        await p.inference("refused")
    await first  # "waiting" leaves the queue for the model
    await spin()
    later = asyncio.create_task(p.inference("later"))
    assert await asyncio.gather(waiting, later) == [("out", "waiting"), ("out", "later")]
    assert p.stats.rejected == 1
    assert p.batches == [["first"], ["waiting"], ["later"]]
    await p.aclose()


async def test_flood_past_the_limit_accepts_exactly_the_limit():
    p, first = await busy_proxy(max_queue_size=5, batch_size=8)
    tasks = [asyncio.create_task(p.inference(i)) for i in range(20)]
    await asyncio.wait(tasks)
    refused = [i for i, t in enumerate(tasks) if isinstance(t.exception(), batchproxy.QueueFull)]
    assert refused == list(range(5, 20))
    assert [tasks[i].result() for i in range(5)] == [("out", i) for i in range(5)]
    await first
    assert p.batches == [["first"], [0, 1, 2, 3, 4]]
    stats = p.stats
    assert (stats.rejected, stats.requests, stats.succeeded) == (15, 6, 6)
    assert_settled(stats)
    await p.aclose()


async def test_inference_many_that_would_overflow_is_refused_whole():
    p, first = await busy_proxy(max_queue_size=3, batch_size=4)
    waiting = asyncio.create_task(p.inference("waiting"))
    await spin()
    with pytest.raises(batchproxy.QueueFull):
        await p.inference_many(["a", "b", "c"])
    stats = p.stats
    assert stats.queue_depth == 1  # none of the three was queued
    assert stats.requests == 2
    assert stats.rejected == 3  # counted per item, like requests

    fits = asyncio.create_task(p.inference_many(["d", "e"]))  # exactly fills the queue
    assert await fits == [("out", "d"), ("out", "e")]
    assert await asyncio.gather(first, waiting) == [("out", "first"), ("out", "waiting")]
    sent = [x for batch in p.batches for x in batch]
    assert sorted(sent) == ["d", "e", "first", "waiting"]
    assert_settled(p.stats)
    await p.aclose()


# -- priorities ------------------------------------------------------------------------------


async def queue_in_order(p: Recorder, calls: list[tuple[str, int]]) -> list[asyncio.Task[Any]]:
    """Queue `(item, priority)` calls one after the other, 0.1 s apart."""
    tasks = []
    for item, priority in calls:
        tasks.append(asyncio.create_task(p.inference(item, priority=priority)))
        await asyncio.sleep(0.1)
    return tasks


async def test_higher_priority_goes_first_fifo_within_a_level(no_leftovers):
    p, first = await busy_proxy(batch_size=2)
    calls = [("a", 0), ("b", 1), ("c", 0), ("d", 2), ("e", 1), ("f", 0), ("g", -1), ("h", 2)]
    tasks = await queue_in_order(p, calls)
    results = await asyncio.gather(first, *tasks)
    assert results == [("out", "first")] + [("out", item) for item, _ in calls]
    assert p.batches == [["first"], ["d", "h"], ["b", "e"], ["a", "c"], ["f", "g"]]
    await p.aclose()


async def test_priority_order_one_item_per_batch():
    p, first = await busy_proxy(batch_size=1)
    calls = [("low1", -5), ("mid1", 0), ("top", 100), ("mid2", 0), ("low2", -5), ("mid3", 0)]
    tasks = await queue_in_order(p, calls)
    await asyncio.gather(first, *tasks)
    order = [batch[0] for batch in p.batches]
    assert order == ["first", "top", "mid1", "mid2", "mid3", "low1", "low2"]
    await p.aclose()


async def test_high_priority_arriving_later_overtakes_a_long_wait():
    """A low-priority request queued long ago still yields to a fresh high-priority one."""
    p = Recorder(delay=10.0, batch_size=1, max_concurrent_batches=1, max_delay_ms=1)
    first = asyncio.create_task(p.inference("first"))
    await spin()
    old = asyncio.create_task(p.inference("old", priority=0))
    await asyncio.sleep(9.9)  # far beyond max_delay_ms, but no slot is free
    urgent = asyncio.create_task(p.inference("urgent", priority=1))
    await asyncio.gather(first, old, urgent)
    assert p.batches == [["first"], ["urgent"], ["old"]]
    await p.aclose()


async def test_priority_does_not_split_a_level_out_of_order_across_batches():
    p, first = await busy_proxy(batch_size=3)
    calls = [(f"n{i}", 0) for i in range(5)] + [(f"h{i}", 1) for i in range(2)]
    tasks = await queue_in_order(p, calls)
    await asyncio.gather(first, *tasks)
    assert p.batches == [["first"], ["h0", "h1", "n0"], ["n1", "n2", "n3"], ["n4"]]
    await p.aclose()
