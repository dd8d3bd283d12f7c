"""A priority's two lanes: small calls' requests, and below them bulk calls'.

A call of more items than `bulk_threshold` is bulk (`Scheduler.is_bulk`; intake
marks its requests, `Request.bulk`), and its requests wait in their priority's
bulk lane (`request.lane`: 2 x priority - 1, just below the small lane, 2 x
priority). While both lanes of a priority wait, the places that priority gets go
to the small lane, but for one of every `BULK_EVERY` that goes to the bulk lane:
an interleave whose count (`Level.passed`) carries over from batch to batch, so
it holds for batches of one too. So a one-item query is not stuck behind another
call's 10,000 items, and the bulk lane keeps at least 1/`BULK_EVERY` of the
places its priority gets: a bulk request with m bulk requests ahead of it in its
lane goes within (m + 1) x `BULK_EVERY` places of its priority, however many
small calls arrive (each run of small places before a bulk one is at most
`BULK_EVERY - 1` long, and it is the bulk lane's first request that takes each
bulk place). With no small call waiting the bulk lane takes every place.

`queue.RequestQueue` keeps the lanes (a `Level` each) and pops by this order;
here are the lane, the merged order (`interleaved`) and how many of the other
lane go first (`across`).
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterator
from typing import Generic, TypeVar

from .request import NO_DEADLINE, Request

__all__ = ["BULK_EVERY", "Level", "across", "aged", "interleaved", "lane_order"]

T = TypeVar("T")

BULK_EVERY = 8
"""While small calls wait, a priority's bulk lane gets one of every `BULK_EVERY` places
(chosen by `benchmarks/scheduling/small_first.py`: see docs/benchmarks.md)."""


class Level(Generic[T]):
    """One lane of a priority level: every request in arrival order, the live ones with
    a deadline also sorted by (deadline, arrival)."""

    __slots__ = ("by_deadline", "fifo", "live", "passed")

    def __init__(self) -> None:
        self.fifo: deque[Request[T]] = deque()
        self.by_deadline: list[tuple[float, int, Request[T]]] = []
        self.live = 0
        # a bulk lane: places its small lane took since it last had one (< BULK_EVERY)
        self.passed = 0

    def unlist(self, request: Request[T]) -> None:
        """Remove a request from the deadline order (it has one, and is in it)."""
        entries = self.by_deadline
        index = bisect.bisect_left(entries, (request.deadline, request.seq))
        del entries[index]


def lane_order(level: Level[T], oldest_first: bool) -> Iterator[Request[T]]:
    """One lane's live requests whose caller still waits, in pop order (earliest
    deadline first, then arrival; arrival alone when it goes `oldest_first`)."""
    if not oldest_first:
        for _, _, request in level.by_deadline:
            if not request.future.done():
                yield request
    for request in level.fifo:
        if (
            request.queued
            and (oldest_first or request.deadline == NO_DEADLINE)
            and not request.future.done()
        ):
            yield request


def across(bulk: bool, mine: int, other: int, passed: int) -> int:
    """How many of the other lane's `other` live requests the interleave serves before
    a new request with `mine` ahead of it in its own lane; `passed`: the bulk lane's
    count. A bulk request waits for the small places before its turn; a small one for
    the bulk places the interleave gives on its way."""
    if bulk:
        return min(other, (mine + 1) * (BULK_EVERY - 1) - passed)
    return min(other, (mine + passed) // (BULK_EVERY - 1))


def aged(order: list[tuple[int, bool]] | tuple[tuple[int, bool], ...], at: int) -> bool:
    """Whether lane `at` goes oldest first in a serving `order` (False: not in it)."""
    for lane_, oldest_first in order:
        if lane_ == at:
            return oldest_first
    return False


def interleaved(
    small: Iterator[Request[T]], bulk: Iterator[Request[T]], passed: int
) -> Iterator[Request[T]]:
    """A priority's two lanes merged as pops take them (`queue.RequestQueue._interleave`):
    `BULK_EVERY - 1` small ones, then a bulk one, starting `passed` into the count."""
    while True:
        for _ in range(BULK_EVERY - 1 - passed):
            request = next(small, None)
            if request is None:
                yield from bulk
                return
            yield request
        request = next(bulk, None)
        if request is None:
            yield from small
            return
        yield request
        passed = 0
