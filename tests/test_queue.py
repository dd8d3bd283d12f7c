"""The request queue on its own: priority levels come and go with their requests."""

from __future__ import annotations

import asyncio

from batchproxy._queue import Request, RequestQueue


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
