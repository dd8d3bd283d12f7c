"""The request queue on its own: priority levels come and go with their requests."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from batchproxy._scheduling.fair_queue import FairQueue
from batchproxy._scheduling.keyed_queue import KeyedQueue
from batchproxy._scheduling.queue import Request, RequestQueue, pick_similar


def _request(loop: asyncio.AbstractEventLoop, item: int, priority: int, at: float) -> Request[int]:
    return Request(item, loop.create_future(), priority, at)


def test_emptied_levels_leave_but_the_default_one_stays() -> None:
    loop = asyncio.new_event_loop()
    try:
        queue: RequestQueue[int] = RequestQueue()
        for priority in range(1, 200):  # many distinct priorities, one request each
            queue.push(_request(loop, priority, priority, float(priority)))
        assert [r.item for r in queue.pop_batch(1000)] == list(range(199, 0, -1))
        assert queue._levels.keys() == {0}  # memory does not grow with priorities used
        assert queue.oldest_enqueued_at() is None
        queue.push(_request(loop, 7, 0, 1.0))
        assert [r.item for r in queue.pop_batch(10)] == [7]
        assert queue.drain() == []
        assert queue._levels.keys() == {0}
    finally:
        loop.close()


def test_aging_and_the_oldest_arrival_skip_an_empty_default_level() -> None:
    loop = asyncio.new_event_loop()
    try:
        queue: RequestQueue[int] = RequestQueue(aging=1.0)
        queue.push(_request(loop, 1, 3, at=5.0))
        queue.push(_request(loop, 2, 2, at=2.0))
        assert queue.oldest_enqueued_at() == 2.0
        # level 2's request arrived 3 s earlier: aged past level 3 (1 s per level)
        assert [r.item for r in queue.pop_batch(10, now=6.0)] == [2, 1]
    finally:
        loop.close()


def test_served_requests_with_deadlines_leave_the_queue_under_a_steady_backlog() -> None:
    # issue 16.1: full batches taken in deadline order left every served request in the
    # arrival deque (with its future and result) while the queue never emptied
    loop = asyncio.new_event_loop()
    try:
        queue: RequestQueue[int] = RequestQueue()
        arrivals = 0

        def arrive(count: int) -> None:
            nonlocal arrivals
            for _ in range(count):
                arrivals += 1
                at = float(arrivals)
                queue.push(Request(arrivals, loop.create_future(), 0, at, deadline=at + 30.0))

        arrive(256)
        served = []
        for _ in range(1000):
            batch = queue.pop_batch(64)
            served.extend(r.item for r in batch)
            arrive(len(batch))  # closed loop: each answered caller calls again
            entries = sum(len(level.fifo) for level in queue._levels.values())
            assert entries <= 2 * queue.live + 64, entries
        assert served == list(range(1, len(served) + 1))  # FIFO, nobody lost or repeated
    finally:
        loop.close()


def test_mixed_deadlines_keep_dead_entries_bounded() -> None:
    # requests without a deadline queue behind an endless stream of ones with a deadline
    loop = asyncio.new_event_loop()
    try:
        queue: RequestQueue[int] = RequestQueue()
        for i in range(10):
            queue.push(Request(-i, loop.create_future(), 0, 0.0))  # no deadline: served last
        for step in range(2000):
            queue.push(Request(step, loop.create_future(), 0, float(step), deadline=step + 1e3))
            if step % 2:
                assert all(r.deadline != float("inf") for r in queue.pop_batch(2))
            entries = len(queue._levels[0].fifo)
            assert entries <= 2 * queue.live + 64, entries
    finally:
        loop.close()


@pytest.mark.parametrize("kind", ["plain", "fair", "keyed"])
def test_reading_the_pop_order_changes_no_count(kind: str) -> None:
    """Found by the combination walk (issue 38 item 3): with aging, a `RequestQueue`
    retired a head whose caller had left while `in_pop_order` was read, so a composite
    queue around it (tenants, keys), which follows its sub-queues' counts only through
    its own calls, kept counting that request: the request's cancellation then found it
    gone (`discard` False), the composite's `live` stayed one too high for good, and the
    scheduler, with `live` requests and nothing to take, spun the event loop forever
    (`length=` batches read the order: `pop_similar`)."""
    loop = asyncio.new_event_loop()
    try:
        queue: Any
        if kind == "plain":
            queue = RequestQueue(aging=1.0)
        elif kind == "fair":
            queue = FairQueue(aging=1.0)
        else:
            queue = KeyedQueue(lambda: 0.0, lambda: 0.0, aging=1.0)
        requests = [_request(loop, item, 0, float(item)) for item in range(3)]
        for request in requests:
            request.tenant, request.key = "a", "k"
            queue.push(request)
        requests[0].future.cancel()  # its caller left; its cancellation is on its way
        assert [r.item for r in queue.in_pop_order(5.0)] == [1, 2]
        assert queue.live == 3  # read, not changed
        assert queue.discard(requests[0])  # the cancellation arrives: it leaves, counted
        assert queue.live == 2
        assert [r.item for r in queue.pop_similar(4, None, 64, now=5.0)] == [1, 2]
        assert (queue.live, queue.live_cost) == (0, 0)
    finally:
        loop.close()


def test_reading_the_pop_order_with_aging_changes_no_queue() -> None:
    """Regression (found by the combination walk on a `TensorProxy`, issue 38): with
    aging, reading a queue's pop order retired a head whose caller had left, behind
    the back of the tenants' queue around it, whose count of live requests then
    stayed 1 with no tenant left; a proxy with `length`, `aging_ms` and a tenant
    whose one queued caller was cancelled spun its event loop forever."""
    from batchproxy._scheduling.fair_queue import FairQueue

    loop = asyncio.new_event_loop()
    try:
        queue: FairQueue[int] = FairQueue(aging=1.0)
        left = _request(loop, 1, 0, at=0.0)
        left.tenant = "b"
        queue.push(left)
        left.future.cancel()  # the caller left; it has not withdrawn its request yet
        assert list(queue.in_pop_order(now=5.0)) == []
        assert queue.live == 1 == sum(t.queue.live for t in queue._tenants.values())
        assert queue.pop_similar(4, None, 64, now=5.0) == []
        assert queue.live == sum(t.queue.live for t in queue._tenants.values())
        assert queue.oldest_enqueued_at() is None  # retired here, and counted
        assert queue.live == 0
    finally:
        loop.close()


def _one_left(
    loop: asyncio.AbstractEventLoop, seed: int
) -> tuple[RequestQueue[int], Request[int], float]:
    """A queue that has seen `seed`'s random traffic (priorities, bulk calls, deadlines,
    costs, aging or not, calls served in either order, then withdrawn), one request left."""
    rng = random.Random(seed)
    queue: RequestQueue[int] = RequestQueue(aging=rng.choice([None, 0.5]))
    now = 0.0
    for item in range(rng.randrange(1, 200)):
        now += rng.random() / 10
        deadline = now + rng.random() * 5 if rng.random() < 0.5 else float("inf")
        request = Request(
            item,
            loop.create_future(),
            rng.choice([0, 0, 1, -2]),
            now,
            rng.randrange(1, 300),
            deadline,
        )
        request.bulk = rng.random() < 0.3
        queue.push(request)
        if rng.random() < 0.3:  # served on the way, in deadline order or not
            queue.pop_batch(rng.randrange(1, 8), now)
    if not queue.live:  # all served: one more arrives
        queue.push(Request(-1, loop.create_future(), 0, now, 1))
    live = list(queue.in_pop_order(now))
    kept = rng.choice(live)
    rng.shuffle(live)
    for request in live:  # the others' callers leave, in random order
        if request is not kept:
            request.future.cancel()
            queue.discard(request)
    return queue, kept, now


@pytest.mark.parametrize("seed", range(60))
def test_one_live_request_is_popped_as_the_general_path_pops_it(seed: int) -> None:
    """`pop_similar` with one live request takes it without ranking (the lone caller's
    path): the batch, and the queue left behind, are what `pick_similar` gives."""
    loop = asyncio.new_event_loop()
    try:
        fast, kept, now = _one_left(loop, seed)
        general, general_kept, _ = _one_left(loop, seed)
        assert fast.live == general.live == 1
        budget = random.Random(seed).choice([None, 100, 1])  # 1: it goes alone even so
        got = fast.pop_similar(64, budget, 256, now=now)
        want = pick_similar(general, 64, budget, 256, now, True, 3)
        assert [r.item for r in got] == [r.item for r in want] == [kept.item]
        assert general_kept.item == kept.item
        assert (fast.live, fast.live_cost) == (general.live, general.live_cost) == (0, 0)
        assert not kept.queued
        assert fast.pop_batch(10, now) == general.pop_batch(10, now) == []
    finally:
        loop.close()


def test_one_live_request_whose_caller_left_leaves_unsent() -> None:
    """The one live request's caller left (its cancellation on its way): `pop_similar`
    sends nothing, and the request leaves the queue, counted."""
    loop = asyncio.new_event_loop()
    try:
        queue: RequestQueue[int] = RequestQueue()
        request = Request(1, loop.create_future(), 0, 0.0, 7, 5.0)
        queue.push(request)
        request.future.cancel()
        assert queue.pop_similar(64, None, 256) == []
        assert (queue.live, queue.live_cost, request.queued) == (0, 0, False)
        assert queue.discard(request) is False  # its cancellation finds it gone
    finally:
        loop.close()
