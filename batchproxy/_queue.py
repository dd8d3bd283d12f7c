"""Pending requests: one FIFO per priority level, highest level first.

A request leaves the queue exactly once, by whoever flips `queued` to False:
`pop_batch` (dispatch), or `discard` (its caller cancelled, its deadline passed).
Discarded requests stay in their deque as dead entries until skipped at a head;
`live` counts only the queued ones, and dead entries are compacted away when
they outnumber the live ones, so memory stays flat under floods of cancellations.
"""

from __future__ import annotations

import asyncio
import bisect
from collections import deque
from typing import Any, Generic, TypeVar

__all__ = ["Request", "RequestQueue"]

T = TypeVar("T")

_COMPACT_MIN_DEAD = 64


class Request(Generic[T]):
    """One call's item, its future, and where it stands."""

    __slots__ = ("deadline_timer", "enqueued_at", "future", "item", "priority", "queued")

    def __init__(
        self, item: T, future: asyncio.Future[Any], priority: int, enqueued_at: float
    ) -> None:
        self.item = item
        self.future = future
        self.priority = priority
        self.enqueued_at = enqueued_at
        self.queued = True
        self.deadline_timer: asyncio.TimerHandle | None = None


class RequestQueue(Generic[T]):
    """Priority levels of FIFO deques. Higher priority pops first; FIFO within a level."""

    __slots__ = ("_dead", "_levels", "_order", "live")

    def __init__(self) -> None:
        self._levels: dict[int, deque[Request[T]]] = {}
        self._order: list[int] = []  # negated priorities, ascending: highest priority first
        self._dead = 0
        self.live = 0

    def push(self, request: Request[T]) -> None:
        level = self._levels.get(request.priority)
        if level is None:
            level = self._levels[request.priority] = deque()
            bisect.insort(self._order, -request.priority)
        level.append(request)
        self.live += 1

    def discard(self, request: Request[T]) -> bool:
        """Take a still-queued request out (lazily). False if it had already left."""
        if not request.queued:
            return False
        request.queued = False
        self.live -= 1
        self._dead += 1
        if self._dead > _COMPACT_MIN_DEAD and self._dead > self.live:
            self._compact()
        return True

    def pop_batch(self, limit: int) -> list[Request[T]]:
        """Up to `limit` live requests, highest priority first, FIFO within a level.

        Requests whose future is already done (cancelled by their caller a moment
        ago) are dropped here rather than sent to the model.
        """
        batch: list[Request[T]] = []
        for negated in list(self._order):
            level = self._levels[-negated]
            while level and len(batch) < limit:
                request = level.popleft()
                if not request.queued:
                    self._dead -= 1
                    continue
                request.queued = False
                self.live -= 1
                if not request.future.done():
                    batch.append(request)
            if not level:
                self._drop_level(negated)
            if len(batch) >= limit:
                break
        return batch

    def oldest_enqueued_at(self) -> float | None:
        """Arrival time of the longest-waiting live request, or None when empty."""
        oldest: float | None = None
        for negated in list(self._order):
            level = self._levels[-negated]
            while level and (not level[0].queued or level[0].future.done()):
                head = level.popleft()
                if head.queued:
                    head.queued = False
                    self.live -= 1
                else:
                    self._dead -= 1
            if not level:
                self._drop_level(negated)
            elif oldest is None or level[0].enqueued_at < oldest:
                oldest = level[0].enqueued_at
        return oldest

    def drain(self) -> list[Request[T]]:
        """Remove and return every live request (used when the event loop is gone)."""
        batch = self.pop_batch(self.live) if self.live else []
        self._levels.clear()
        self._order.clear()
        self._dead = 0
        self.live = 0
        return batch

    def _drop_level(self, negated: int) -> None:
        del self._levels[-negated]
        self._order.remove(negated)

    def _compact(self) -> None:
        for priority, level in list(self._levels.items()):
            kept = deque(r for r in level if r.queued)
            if kept:
                self._levels[priority] = kept
            else:
                self._drop_level(-priority)
        self._dead = 0
