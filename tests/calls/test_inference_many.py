"""`inference_many`: each item a request of its own, results in order."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from _support import Recorder, assert_settled
from typing_extensions import override

import batchproxy


async def spin(times: int = 10) -> None:
    """Let the loop run a few iterations without moving (virtual) time."""
    for _ in range(times):
        await asyncio.sleep(0)


class Reversed(Recorder):
    """Later batches finish first (several run at once)."""

    @override
    async def _inference(self, items: list[Any]) -> Sequence[Any]:
        self.batches.append(list(items))
        await asyncio.sleep(10.0 - len(self.batches))
        return [("out", item) for item in items]


async def test_results_come_back_in_order():
    p = Recorder(batch_size=4)
    assert await p.inference_many(range(10)) == [("out", i) for i in range(10)]
    assert [len(b) for b in p.batches] == [4, 4, 2]
    await p.aclose()


@pytest.mark.looptime
async def test_results_in_order_when_batches_finish_out_of_order():
    p = Reversed(batch_size=2, max_concurrent_batches=4)
    assert await p.inference_many(range(8)) == [("out", i) for i in range(8)]
    assert p.batches == [[0, 1], [2, 3], [4, 5], [6, 7]]
    await p.aclose()


async def test_each_item_is_a_request_batched_with_other_callers():
    p = Recorder(batch_size=8)
    many, single, more = await asyncio.gather(
        p.inference_many(["a", "b", "c"]), p.inference("x"), p.inference_many(["d", "e"])
    )
    assert (many, single, more) == (
        [("out", "a"), ("out", "b"), ("out", "c")],
        ("out", "x"),
        [("out", "d"), ("out", "e")],
    )
    assert len(p.batches) == 1  # one model call for all three callers
    assert sorted(p.batches[0]) == ["a", "b", "c", "d", "e", "x"]
    stats = p.stats
    assert (stats.requests, stats.items, stats.succeeded) == (6, 6, 6)
    await p.aclose()


async def test_items_split_across_batches_like_single_calls():
    p = Recorder(batch_size=2)
    assert await p.inference_many("abcde"[i] for i in range(5)) == [("out", c) for c in "abcde"]
    assert p.batches == [["a", "b"], ["c", "d"], ["e"]]
    await p.aclose()


@pytest.mark.parametrize(
    "empty", [[], (), iter([]), range(0)], ids=["list", "tuple", "iter", "range"]
)
async def test_empty_input_returns_empty_list_without_the_model(empty):
    p = Recorder(batch_size=4)
    assert await p.inference_many(empty) == []
    assert p.batches == []
    assert p.stats.requests == 0
    await p.aclose()


@pytest.mark.parametrize(
    "items",
    [(x for x in (1, 2, 3)), range(1, 4), (1, 2, 3), {1: "a", 2: "b", 3: "c"}.keys()],
    ids=["generator", "range", "tuple", "dict-keys"],
)
async def test_any_iterable_of_items_works(items):
    p = Recorder(batch_size=4)
    assert await p.inference_many(items) == [("out", 1), ("out", 2), ("out", 3)]
    assert p.batches == [[1, 2, 3]]
    await p.aclose()


async def test_numpy_array_input_is_one_item_per_row():
    p = Recorder(lambda items: [int(row.sum()) for row in items], batch_size=8)
    rows = np.arange(12).reshape(4, 3)
    assert await p.inference_many(rows) == [3, 12, 21, 30]
    assert len(p.batches[0]) == 4
    await p.aclose()


@pytest.mark.parametrize("items", ["abc", b"abc", bytearray(b"abc"), {"a": 1}], ids=repr)
async def test_str_bytes_or_mapping_input_is_refused(items):
    p = Recorder(batch_size=4)
    with pytest.raises(TypeError, match=rf"iterable of items, got {type(items).__name__}"):
        await p.inference_many(items)
    assert p.batches == []
    assert p.stats.requests == 0
    await p.aclose()


# -- failures ----------------------------------------------------------------------------------


@pytest.mark.looptime
async def test_first_failure_raised_and_remaining_items_withdrawn(no_leftovers):
    bad = ValueError("bad item")
    p = Recorder(
        lambda items: [bad if x == "bad" else ("out", x) for x in items],
        delay=10.0,
        batch_size=2,
        max_concurrent_batches=1,
        max_delay_ms=0,
    )
    with pytest.raises(ValueError, match="bad item") as caught:
        await p.inference_many(["ok", "bad", "queued1", "queued2", "queued3"])
    assert caught.value is bad
    assert p.stats.queue_depth == 0  # withdrawn at once
    await asyncio.sleep(100.0)
    assert p.batches == [["ok", "bad"]]  # the still-queued items were never sent
    stats = p.stats
    assert (stats.succeeded, stats.errors, stats.cancelled) == (1, 1, 3)
    assert_settled(stats)
    await p.aclose()


class Durations(Recorder):
    """Each batch takes as long as its slowest item's entry in `seconds`."""

    seconds: dict[Any, float]

    @override
    async def _inference(self, items: list[Any]) -> Sequence[Any]:
        self.batches.append(list(items))
        await asyncio.sleep(max(self.seconds[x] for x in items))
        return self.respond(items)


@pytest.mark.looptime
async def test_failure_withdraws_an_item_whose_batch_is_running():
    """A withdrawn item already in a running batch: the batch finishes, its result dropped."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    p = Durations(
        lambda items: [ValueError("bad") if x == "bad" else ("out", x) for x in items],
        batch_size=1,
        max_concurrent_batches=2,
        max_delay_ms=0,
    )
    p.seconds = {"bad": 1.0, "running": 10.0}
    with pytest.raises(ValueError, match="bad"):
        await p.inference_many(["bad", "running"])
    assert loop.time() - t0 == pytest.approx(1.0)
    assert p.stats.in_flight == 1  # "running" still runs
    await asyncio.sleep(20.0)
    assert p.batches == [["bad"], ["running"]]
    stats = p.stats
    assert (stats.errors, stats.cancelled, stats.succeeded) == (1, 1, 0)
    assert_settled(stats)
    await p.aclose()


async def test_return_exceptions_puts_failures_in_place():
    bad = ValueError("bad 1")
    p = Recorder(lambda items: [bad if x == 1 else ("out", x) for x in items], batch_size=8)
    results = await p.inference_many(range(4), return_exceptions=True)
    assert results == [("out", 0), bad, ("out", 2), ("out", 3)]
    assert results[1] is bad
    assert p.stats.cancelled == 0
    await p.aclose()


async def test_return_exceptions_with_a_failed_batch_and_a_good_one():
    def respond(items: list[Any]) -> list[Any]:
        return [("out", x) for x in items] if 0 in items else []  # 2nd batch: wrong count

    p = Recorder(respond, batch_size=2, max_delay_ms=0)
    results = await p.inference_many(range(4), return_exceptions=True)
    assert results[:2] == [("out", 0), ("out", 1)]
    assert all(isinstance(r, batchproxy.BatchSizeMismatch) for r in results[2:])
    await p.aclose()


@pytest.mark.looptime
async def test_timeout_bounds_the_whole_call():
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    p = Recorder(delay=10.0, batch_size=1, max_concurrent_batches=1, max_delay_ms=0)
    with pytest.raises(batchproxy.DeadlineExceeded):
        await p.inference_many(range(4), timeout=25.0)
    assert loop.time() - t0 == pytest.approx(25.0)
    await asyncio.sleep(100.0)
    assert p.batches == [[0], [1], [2]]  # item 3 was still queued: never sent
    stats = p.stats
    assert stats.succeeded == 2
    assert stats.timed_out + stats.cancelled == 2
    assert_settled(stats)
    await p.aclose()


@pytest.mark.looptime
async def test_timeout_with_return_exceptions_keeps_the_finished_results():
    p = Recorder(delay=10.0, batch_size=1, max_concurrent_batches=1, max_delay_ms=0)
    results = await p.inference_many(range(4), timeout=25.0, return_exceptions=True)
    assert results[:2] == [("out", 0), ("out", 1)]
    assert all(isinstance(r, batchproxy.DeadlineExceeded) for r in results[2:])
    assert p.stats.timed_out == 2
    await p.aclose()


@pytest.mark.looptime
async def test_cancelling_the_call_withdraws_all_its_items():
    p = Recorder(delay=10.0, batch_size=2, max_concurrent_batches=1, max_delay_ms=0)
    task = asyncio.create_task(p.inference_many(range(6)))
    await asyncio.sleep(5.0)
    assert p.batches == [[0, 1]]
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert p.stats.queue_depth == 0
    await asyncio.sleep(30.0)
    assert p.batches == [[0, 1]]
    stats = p.stats
    assert (stats.cancelled, stats.succeeded) == (6, 0)
    assert_settled(stats)
    assert await p.inference_many([7]) == [("out", 7)]  # still serving
    await p.aclose()


@pytest.mark.looptime
async def test_first_failure_is_raised_when_it_happens_not_after_slower_items():
    """Item 1 fails at once while item 0 still runs: the caller hears of it at once."""
    loop = asyncio.get_running_loop()

    class SlowFirst(Recorder):
        @override
        async def _inference(self, items: list[Any]) -> Sequence[Any]:
            self.batches.append(list(items))
            if items == ["slow"]:
                await asyncio.sleep(10.0)
            return [ValueError(item) if item == "bad" else item for item in items]

    async with SlowFirst(batch_size=1, max_concurrent_batches=2) as p:
        start = loop.time()
        with pytest.raises(ValueError, match="bad"):
            await p.inference_many(["slow", "bad"])
        assert loop.time() == start  # not after the slow item's 10 s
        assert p.stats.cancelled == 1  # the slow item was withdrawn


# Issue 27, item 3: with `dedup`, an item that joins a slot in flight or is answered
# from the cache adds no work. `inference_many` needs room only for the slots its items
# make, as `inference` does for one item: never refused (nor counted against a tenant's
# limit) for the others.


async def held(p: Recorder) -> asyncio.Task[Any]:
    """A first call holding the proxy's one batch slot (its model takes 10 s)."""
    first = asyncio.create_task(p.inference("first"))
    await spin()
    assert p.batches[-1] == ["first"]
    return first


@pytest.mark.looptime
@pytest.mark.parametrize("keyed", [False, True])
async def test_items_that_join_queued_slots_need_no_room(keyed: bool) -> None:
    key = "k" if keyed else None
    p = Recorder(delay=10.0, batch_size=2, max_concurrent_batches=1, max_queue_size=2, dedup=True)
    first = await held(p)
    queued = [asyncio.create_task(p.inference(x, key=key)) for x in ["x", "y"]]
    await spin()
    with pytest.raises(batchproxy.QueueFull):  # the queue is full
        await p.inference("z", key=key)
    assert p.stats.rejected == 1
    many = await p.inference_many(["x", "y", "x"], key=key)  # every one joins
    assert many == [("out", "x"), ("out", "y"), ("out", "x")]
    assert await asyncio.gather(first, *queued) == [("out", v) for v in ["first", "x", "y"]]
    assert p.batches == [["first"], ["x", "y"]]
    stats = p.stats
    assert (stats.rejected, stats.deduplicated, stats.succeeded) == (1, 3, 6)
    assert_settled(stats)
    await p.aclose()


@pytest.mark.looptime
async def test_cached_items_need_no_room() -> None:
    p = Recorder(
        delay=10.0,
        batch_size=1,
        max_concurrent_batches=1,
        max_queue_size=1,
        dedup=batchproxy.Dedup(cache_size=8),
    )
    assert await p.inference("a") == ("out", "a")
    first = await held(p)
    queued = asyncio.create_task(p.inference("b"))
    await spin()
    assert await p.inference_many(["a", "a"]) == [("out", "a")] * 2  # at once, from the cache
    assert p.stats.cache_hits == 2
    assert await asyncio.gather(first, queued) == [("out", "first"), ("out", "b")]
    assert p.stats.rejected == 0
    await p.aclose()


@pytest.mark.looptime
async def test_room_is_needed_for_the_new_slots_only_and_a_refusal_refuses_every_item() -> None:
    """Repeats within the list make one slot; an item that makes a slot with no room
    left refuses the whole list, every item counted as refused."""
    p = Recorder(delay=10.0, batch_size=4, max_concurrent_batches=1, max_queue_size=2, dedup=True)
    first = await held(p)
    queued = asyncio.create_task(p.inference("x"))
    await spin()
    fits = asyncio.create_task(p.inference_many(["x", "n", "n", "x"]))  # one new slot: n
    await spin()
    assert p.stats.queue_depth == 2
    with pytest.raises(batchproxy.QueueFull):
        await p.inference_many(["x", "n", "m"])  # m needs room, there is none
    assert p.stats.rejected == 3
    assert p.stats.deduplicated == 3  # x, n and x of `fits`; none of the refused list
    await asyncio.gather(first, queued)
    assert await fits == [("out", v) for v in ["x", "n", "n", "x"]]
    assert sorted(p.batches[1]) == ["n", "x"]
    assert_settled(p.stats)
    await p.aclose()


@pytest.mark.looptime
async def test_items_that_join_do_not_count_against_the_tenant_limit() -> None:
    p = Recorder(
        delay=10.0,
        batch_size=4,
        max_concurrent_batches=1,
        max_queue_size_per_tenant=1,
        dedup=batchproxy.Dedup(cache_size=8),
    )
    assert await p.inference("cached", tenant="t") == ("out", "cached")
    first = await held(p)
    queued = asyncio.create_task(p.inference("x", tenant="t"))  # t's one place
    await spin()
    joins = asyncio.create_task(p.inference_many(["x", "cached", "x"], tenant="t"))
    other = asyncio.create_task(p.inference_many(["x"], tenant="u"))  # another tenant's slot
    await spin()
    with pytest.raises(batchproxy.QueueFull):
        await p.inference_many(["x", "y"], tenant="t")  # y would be t's second place
    stats = p.stats
    assert (stats.rejected, stats.tenant_rejected) == (2, 2)
    assert await asyncio.gather(first, queued, joins, other) == [
        ("out", "first"),
        ("out", "x"),
        [("out", "x"), ("out", "cached"), ("out", "x")],
        [("out", "x")],
    ]
    assert p.batches == [["cached"], ["first"], ["x"]]
    assert_settled(p.stats)
    await p.aclose()
