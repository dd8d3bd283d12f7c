"""Small calls ahead of bulk calls (`bulk_threshold`): the queue's two lanes per
priority, their interleave (one place in `BULK_EVERY` for the bulk lane while small
calls wait), the no-starvation bound, and how it meets priority, aging, deadlines,
tenants, keys, dedup and `max_batch_tokens`."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest
from _support import Recorder
from hypothesis import given, settings
from hypothesis import strategies as st

import batchproxy
from batchproxy._scheduling.lanes import BULK_EVERY
from batchproxy._scheduling.queue import Request, RequestQueue

RUN = BULK_EVERY - 1  # small places before each bulk one, while both lanes wait


def _request(
    loop: asyncio.AbstractEventLoop,
    item: Any,
    *,
    bulk: bool = False,
    priority: int = 0,
    at: float = 0.0,
    deadline: float = math.inf,
) -> Request[Any]:
    request: Request[Any] = Request(item, loop.create_future(), priority, at, 1, deadline)
    request.bulk = bulk
    return request


@pytest.fixture
def loop() -> Any:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def _expected_interleave(smalls: list[str], bulks: list[str], passed: int = 0) -> list[str]:
    """RUN small ones, then a bulk one, from `passed` into the count; the rest as they come."""
    order: list[str] = []
    s, b = list(smalls), list(bulks)
    while s or b:
        run = RUN - passed
        take, s = s[:run], s[run:]
        order += take
        if len(take) < run:
            return order + b + s
        if b:
            order.append(b.pop(0))
        passed = 0
    return order


# -- the queue on its own -----------------------------------------------------------------


def test_small_calls_go_first_and_the_bulk_lane_keeps_one_place_in_every(loop: Any) -> None:
    queue: RequestQueue[str] = RequestQueue()
    bulks = [f"b{i}" for i in range(20)]
    smalls = [f"s{i}" for i in range(30)]
    for item in bulks:  # the bulk call came first
        queue.push(_request(loop, item, bulk=True))
    for item in smalls:
        queue.push(_request(loop, item))
    expected = _expected_interleave(smalls, bulks)
    assert [r.item for r in queue.in_pop_order(0.0)] == expected
    popped = []
    while queue.live:  # batches of 5: the count carries over from batch to batch
        popped += [r.item for r in queue.pop_batch(5)]
    assert popped == expected
    assert queue._levels.keys() == {0}  # the bulk lane left with its last request


def test_without_small_calls_waiting_the_bulk_lane_takes_every_place(loop: Any) -> None:
    queue: RequestQueue[str] = RequestQueue()
    for i in range(10):
        queue.push(_request(loop, f"b{i}", bulk=True))
    queue.push(_request(loop, "s0"))
    assert [r.item for r in queue.pop_batch(6)] == ["s0", "b0", "b1", "b2", "b3", "b4"]
    assert [r.item for r in queue.pop_batch(6)] == ["b5", "b6", "b7", "b8", "b9"]


@pytest.mark.parametrize("size", [1, 3, 8])
def test_the_interleave_holds_for_batches_of_one_and_any_size(loop: Any, size: int) -> None:
    queue: RequestQueue[str] = RequestQueue()
    for i in range(5):
        queue.push(_request(loop, f"b{i}", bulk=True))
    smalls = [f"s{i}" for i in range(3 * BULK_EVERY)]
    for item in smalls:
        queue.push(_request(loop, item))
    expected = _expected_interleave(smalls, [f"b{i}" for i in range(5)])
    popped = []
    while queue.live:
        read = [r.item for r in queue.in_pop_order(0.0)]
        assert read == expected[len(popped) :]  # reading agrees with popping, at every step
        popped += [r.item for r in queue.pop_batch(size)]
    assert popped == expected


@settings(max_examples=200, deadline=None)
@given(
    bulk_items=st.integers(1, 30),
    sizes=st.lists(st.integers(1, 10), min_size=1, max_size=200),
    refill=st.integers(1, 12),
)
def test_no_bulk_request_waits_more_than_its_bound_however_many_small_calls_come(
    bulk_items: int, sizes: list[int], refill: int
) -> None:
    """Small calls never stop coming (more than the places each batch has): the bulk
    request with m bulk requests ahead is served within (m + 1) x BULK_EVERY places."""
    loop = asyncio.new_event_loop()
    try:
        queue: RequestQueue[str] = RequestQueue()
        for i in range(bulk_items):
            queue.push(_request(loop, i, bulk=True))
        places = 0
        served: dict[int, int] = {}
        smalls = 0
        for size in sizes:
            while queue.live - (bulk_items - len(served)) < size + refill:
                queue.push(_request(loop, f"s{smalls}"))  # a backlog of small calls
                smalls += 1
            for request in queue.pop_batch(size):
                places += 1
                if request.bulk:
                    served[request.item] = places
        for m, place in served.items():
            assert place <= (m + 1) * BULK_EVERY
        assert len(served) == min(bulk_items, places // BULK_EVERY)  # ...and no sooner
    finally:
        loop.close()


def test_explicit_priority_comes_before_the_lanes(loop: Any) -> None:
    queue: RequestQueue[str] = RequestQueue()
    queue.push(_request(loop, "small low", priority=-1))
    queue.push(_request(loop, "bulk high", bulk=True, priority=1))
    queue.push(_request(loop, "bulk", bulk=True))
    queue.push(_request(loop, "small"))
    assert [r.item for r in queue.pop_batch(10)] == ["bulk high", "small", "bulk", "small low"]


def test_with_aging_a_priority_ranks_by_its_oldest_in_either_lane(loop: Any) -> None:
    queue: RequestQueue[str] = RequestQueue(aging=1.0)
    queue.push(_request(loop, "bulk p0", bulk=True, at=0.0))
    queue.push(_request(loop, "small p2", priority=2, at=2.5))
    queue.push(_request(loop, "small p0", at=3.0))
    # priority 0's oldest (the bulk call, at 0) ranks at 0, priority 2's at 2.5 - 2 = 0.5:
    # priority 0 first, and within it the small call still goes before the bulk one
    assert [r.item for r in queue.pop_batch(10, now=3.0)] == ["small p0", "bulk p0", "small p2"]


def test_with_aging_an_old_bulk_request_beats_a_newer_higher_priority(loop: Any) -> None:
    queue: RequestQueue[str] = RequestQueue(aging=1.0)
    queue.push(_request(loop, "bulk p0", bulk=True, at=0.0))
    queue.push(_request(loop, "small p1", priority=1, at=1.5))  # arrived over 1 level later
    assert [r.item for r in queue.pop_batch(10, now=2.0)] == ["bulk p0", "small p1"]


def test_each_lane_keeps_its_earliest_deadline_first(loop: Any) -> None:
    queue: RequestQueue[str] = RequestQueue()
    queue.push(_request(loop, "bulk late", bulk=True, deadline=9.0))
    queue.push(_request(loop, "bulk soon", bulk=True, deadline=2.0))
    queue.push(_request(loop, "small late", deadline=8.0))
    queue.push(_request(loop, "small none"))
    queue.push(_request(loop, "small soon", deadline=3.0))
    assert [r.item for r in queue.pop_batch(10)] == [
        "small soon",
        "small late",
        "small none",
        "bulk soon",
        "bulk late",
    ]
    assert queue.earliest_deadline() == math.inf


def test_the_earliest_deadline_and_oldest_arrival_see_both_lanes(loop: Any) -> None:
    queue: RequestQueue[str] = RequestQueue()
    queue.push(_request(loop, "bulk", bulk=True, at=1.0, deadline=2.0))
    queue.push(_request(loop, "small", at=3.0, deadline=5.0))
    assert queue.earliest_deadline() == 2.0  # the deadline rule still sees the bulk one
    assert queue.oldest_enqueued_at() == 1.0  # and the window its arrival


@pytest.mark.parametrize("bulk_probe", [False, True])
@pytest.mark.parametrize(("smalls", "bulks", "passed"), [(0, 5, 0), (5, 0, 0), (20, 6, 3)])
def test_counting_ahead_follows_the_interleave(
    loop: Any, bulk_probe: bool, smalls: int, bulks: int, passed: int
) -> None:
    """`shed_late`'s count of who goes first is where the probe lands in the pop order."""
    queue: RequestQueue[str] = RequestQueue()
    for i in range(bulks):
        queue.push(_request(loop, f"b{i}", bulk=True, deadline=1.0 + i))
    if bulks:
        queue._levels[-1].passed = passed
    for i in range(smalls):
        queue.push(_request(loop, f"s{i}", deadline=1.0 + i))
    queue.push(_request(loop, "other priority", priority=1))
    probe = _request(loop, "probe", bulk=bulk_probe, deadline=100.0)
    ahead = queue.count_ahead(probe)
    queue.push(probe)
    assert ahead == [r.item for r in queue.in_pop_order(0.0)].index("probe")


# -- on a proxy, on the virtual clock -------------------------------------------------------


async def _bulk_then_query(
    proxy: Recorder,
    items: int = 40,
    bulk: dict[str, Any] | None = None,
    query: dict[str, Any] | None = None,
) -> list[Any]:
    """A bulk call (`bulk`: its keywords), then, once its first batch runs, a one-item
    query (`query`: its keywords): the batches."""
    reindex = asyncio.create_task(proxy.inference_many(list(range(items)), **(bulk or {})))
    await asyncio.sleep(0.001)  # the reindex's first batch is running
    assert await proxy.inference("query", **(query or {})) == ("out", "query")
    await reindex
    return proxy.batches


@pytest.mark.looptime
@pytest.mark.parametrize("threshold", [None, 8])
async def test_a_query_goes_ahead_of_a_reindex_queued_before_it(threshold: int | None) -> None:
    async with Recorder(batch_size=4, delay=0.01, bulk_threshold=threshold) as proxy:
        batches = await _bulk_then_query(proxy)
        where = next(i for i, batch in enumerate(batches) if "query" in batch)
        if threshold is None:  # one lane: it waits behind the whole reindex
            assert where == len(batches) - 1
        else:  # the batch after the one running when it came
            assert where == 1
            assert batches[1][0] == "query"


@pytest.mark.looptime
async def test_the_default_threshold_is_the_measured_one() -> None:
    async with Recorder(batch_size=4, delay=0.01) as proxy:
        assert proxy.options.bulk_threshold == 64
        batches = await _bulk_then_query(proxy, 65)  # one item over it: bulk
        assert "query" in batches[1]
    async with Recorder(batch_size=4, delay=0.01) as proxy:
        batches = await _bulk_then_query(proxy, 64)  # not over it: a small call
        assert "query" in batches[-1]


@pytest.mark.looptime
async def test_a_call_at_the_threshold_is_small_and_one_over_it_bulk() -> None:
    async with Recorder(batch_size=4, delay=0.01, bulk_threshold=3) as proxy:
        first = asyncio.create_task(proxy.inference_many(list(range(8))))  # bulk
        await asyncio.sleep(0.001)
        small = asyncio.create_task(proxy.inference_many(["a", "b", "c"]))  # 3: small
        await asyncio.sleep(0)
        await asyncio.gather(first, small)
        assert proxy.batches[1][:3] == ["a", "b", "c"]


@pytest.mark.looptime
async def test_configure_turns_it_off_for_the_calls_that_follow() -> None:
    async with Recorder(batch_size=4, delay=0.01, bulk_threshold=8) as proxy:
        proxy.configure(bulk_threshold=None)
        assert proxy.options.bulk_threshold is None
        batches = await _bulk_then_query(proxy)
        assert "query" in batches[-1]


@pytest.mark.looptime
async def test_a_steady_flood_of_small_calls_does_not_starve_the_bulk_call() -> None:
    """Eight small calls arrive for every batch of 8 (the model is saturated by them
    alone): the bulk call still gets one place in BULK_EVERY and completes."""
    loop = asyncio.get_running_loop()
    async with Recorder(batch_size=8, delay=0.01, bulk_threshold=1) as proxy:
        reindex = asyncio.create_task(proxy.inference_many([f"b{i}" for i in range(10)]))
        await asyncio.sleep(0)
        started = loop.time()
        flood = []
        while not reindex.done() and loop.time() - started < 5:
            flood += [asyncio.create_task(proxy.inference(i)) for i in range(8)]
            await asyncio.sleep(0.01)
        assert reindex.done()
        took = loop.time() - started
        await asyncio.gather(*flood)
        # its 10 items at one place in BULK_EVERY: within 10 x BULK_EVERY places, that
        # is 10 batches of 8, each 10 ms (and a batch's slack on the virtual clock)
        assert took <= (10 * BULK_EVERY / 8 + 2) * 0.01 + 1e-9


@pytest.mark.looptime
@pytest.mark.parametrize("aging_ms", [None, 20.0])
async def test_with_aging_a_flood_of_higher_priority_does_not_starve_the_bulk_call(
    aging_ms: float | None,
) -> None:
    """A flood of priority-1 single calls fills every batch: without aging the bulk call
    of priority 0 waits as long as the flood lasts (explicit priority); with it, its
    priority ranks first once it has waited one level's `aging_ms`, and then its bulk
    lane takes every place its priority gets (no small call of priority 0 waits)."""
    loop = asyncio.get_running_loop()
    async with Recorder(batch_size=8, delay=0.01, bulk_threshold=1, aging_ms=aging_ms) as proxy:
        reindex = asyncio.create_task(proxy.inference_many([f"b{i}" for i in range(16)]))
        await asyncio.sleep(0)
        started = loop.time()
        flood = []
        while not reindex.done() and loop.time() - started < 1:
            flood += [asyncio.create_task(proxy.inference(i, priority=1)) for i in range(8)]
            await asyncio.sleep(0.01)
        took = loop.time() - started
        if aging_ms is None:
            assert not reindex.done()
            reindex.cancel()
        else:  # the 20 ms of aging, the flood queued by then, its 2 batches: well within
            assert reindex.done()
            assert took <= 0.1
        await asyncio.gather(*flood, reindex, return_exceptions=True)


@pytest.mark.looptime
async def test_explicit_priority_still_wins_over_small_calls() -> None:
    async with Recorder(batch_size=4, delay=0.01, bulk_threshold=8) as proxy:
        batches = await _bulk_then_query(proxy, 40, bulk={"priority": 1}, query={"priority": 0})
        assert "query" in batches[-1]  # the urgent bulk call first, as asked


@pytest.mark.looptime
async def test_per_tenant_a_tenants_own_query_goes_ahead_of_its_own_reindex() -> None:
    async with Recorder(batch_size=4, delay=0.01, bulk_threshold=8) as proxy:
        batches = await _bulk_then_query(proxy, 40, bulk={"tenant": "a"}, query={"tenant": "a"})
        assert batches[1][0] == "query"


@pytest.mark.looptime
async def test_per_key_a_query_goes_ahead_of_a_reindex_of_its_key() -> None:
    async with Recorder(batch_size=4, delay=0.01, bulk_threshold=8) as proxy:
        batches = await _bulk_then_query(proxy, 40, bulk={"key": "k"}, query={"key": "k"})
        assert batches[1][0] == "query"


@pytest.mark.looptime
async def test_with_dedup_a_small_caller_moves_a_bulk_slot_up() -> None:
    async with Recorder(batch_size=4, delay=0.01, bulk_threshold=8, dedup=True) as proxy:
        reindex = asyncio.create_task(proxy.inference_many(list(range(40))))
        await asyncio.sleep(0.001)
        assert await proxy.inference(39) == ("out", 39)  # the reindex's last item
        await reindex
        assert proxy.batches[1][0] == 39  # its slot moved to the small lane
        assert sum(batch.count(39) for batch in proxy.batches) == 1  # computed once


@pytest.mark.looptime
async def test_with_dedup_a_bulk_caller_does_not_move_a_small_slot_down() -> None:
    async with Recorder(batch_size=4, delay=0.01, bulk_threshold=8, dedup=True) as proxy:
        busy = asyncio.create_task(proxy.inference("busy"))
        await asyncio.sleep(0.001)
        query = asyncio.create_task(proxy.inference("x"))
        await asyncio.sleep(0)
        reindex = asyncio.create_task(proxy.inference_many(["x", *range(20)]))
        await asyncio.gather(busy, query, reindex)
        assert proxy.batches[1][0] == "x"


@pytest.mark.looptime
async def test_with_max_batch_tokens_the_query_is_the_next_batchs_first() -> None:
    async with Recorder(
        batch_size=4, delay=0.01, bulk_threshold=8, length=len, max_batch_tokens=40
    ) as proxy:
        reindex = asyncio.create_task(
            proxy.inference_many(["doc" * (1 + i % 3) for i in range(40)])
        )
        await asyncio.sleep(0.001)
        assert await proxy.inference("q") == ("out", "q")
        await reindex
        assert proxy.batches[1][0] == "q"


@pytest.mark.looptime
async def test_with_max_batch_tokens_a_flood_of_small_calls_does_not_starve_the_bulk() -> None:
    loop = asyncio.get_running_loop()
    async with Recorder(
        batch_size=4, delay=0.01, bulk_threshold=1, length=len, max_batch_tokens=40
    ) as proxy:
        reindex = asyncio.create_task(proxy.inference_many(["bulk"] * 6))
        await asyncio.sleep(0)
        started = loop.time()
        flood = []
        while not reindex.done() and loop.time() - started < 10:
            flood += [asyncio.create_task(proxy.inference("s")) for _ in range(4)]
            await asyncio.sleep(0.01)
        assert reindex.done()
        await asyncio.gather(*flood)


@pytest.mark.looptime
async def test_a_bulk_items_deadline_still_fails_it_in_the_queue() -> None:
    async with Recorder(batch_size=4, delay=0.01, bulk_threshold=8) as proxy:
        results = await proxy.inference_many(list(range(40)), timeout=0.05, return_exceptions=True)
        late = [r for r in results if isinstance(r, batchproxy.DeadlineExceeded)]
        sent = [item for batch in proxy.batches for item in batch]
        assert late
        assert len(results) == 40
        assert len(sent) < 40  # the ones still queued at their deadline never reached it


@pytest.mark.parametrize(("value", "error"), [(0, ValueError), (2.5, TypeError), (True, TypeError)])
def test_bulk_threshold_is_a_count_or_none(value: object, error: type[Exception]) -> None:
    with pytest.raises(error, match="bulk_threshold"):
        Recorder(bulk_threshold=value)
