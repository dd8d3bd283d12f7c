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

    __slots__ = (
        "cost",
        "deadline_timer",
        "enqueued_at",
        "future",
        "item",
        "passed_over",
        "priority",
        "queued",
    )

    def __init__(
        self,
        item: T,
        future: asyncio.Future[Any],
        priority: int,
        enqueued_at: float,
        cost: int = 1,
    ) -> None:
        self.item = item
        self.future = future
        self.priority = priority
        self.enqueued_at = enqueued_at
        self.cost = cost
        self.queued = True
        self.passed_over = 0  # times left out of a batch while among the oldest
        self.deadline_timer: asyncio.TimerHandle | None = None


class RequestQueue(Generic[T]):
    """Priority levels of FIFO deques. Higher priority pops first; FIFO within a level."""

    __slots__ = ("_dead", "_levels", "_order", "live", "live_cost")

    def __init__(self) -> None:
        self._levels: dict[int, deque[Request[T]]] = {}
        self._order: list[int] = []  # negated priorities, ascending: highest priority first
        self._dead = 0
        self.live = 0
        self.live_cost = 0  # summed cost of the live requests

    def push(self, request: Request[T]) -> None:
        level = self._levels.get(request.priority)
        if level is None:
            level = self._levels[request.priority] = deque()
            bisect.insort(self._order, -request.priority)
        level.append(request)
        self.live += 1
        self.live_cost += request.cost

    def discard(self, request: Request[T]) -> bool:
        """Take a still-queued request out (lazily). False if it had already left."""
        if not request.queued:
            return False
        self._leave(request)
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
                self._leave(request)
                if not request.future.done():
                    batch.append(request)
            if not level:
                self._drop_level(negated)
            if len(batch) >= limit:
                break
        return batch

    def pop_similar(
        self,
        limit: int,
        budget: int | None,
        window: int,
        *,
        group: bool = True,
        max_passes: int = 3,
    ) -> list[Request[T]]:
        """Up to `limit` requests of similar cost, so a padded batch wastes little.

        Looks at the first `window` live requests in pop order (priority, then
        age). The first of them always goes, alone if its cost alone exceeds
        `budget`. Next come requests passed over `max_passes` times, oldest
        first; then the ones closest in cost to the first (higher priority
        first), or, with `group=False`, the rest in pop order. With a `budget`,
        the padded size (members x largest cost) stays within it. Whoever is
        among the `limit` oldest (the batch FIFO would send) and left out is
        passed over once more, so nobody waits more than `max_passes` batches
        longer than in FIFO order.
        """
        candidates: list[Request[T]] = []
        for negated in self._order:
            for request in self._levels[-negated]:
                if request.queued and not request.future.done():
                    candidates.append(request)
                    if len(candidates) >= window:
                        break
            if len(candidates) >= window:
                break
        if not candidates:
            return []
        anchor = candidates[0]
        batch = [anchor]
        largest = anchor.cost

        def admit(request: Request[T]) -> None:
            nonlocal largest
            if len(batch) < limit and (
                budget is None or max(largest, request.cost) * (len(batch) + 1) <= budget
            ):
                batch.append(request)
                largest = max(largest, request.cost)

        rest = candidates[1:]
        for request in rest:
            if request.passed_over >= max_passes:
                admit(request)
        if group:
            rest = sorted(rest, key=lambda r: (-r.priority, abs(r.cost - anchor.cost)))
        for request in rest:
            if not request.queued or request in batch:
                continue
            admit(request)
        for request in batch:
            self._leave(request)
            self._dead += 1  # still in its deque: skipped and dropped at the head
        for request in candidates[:limit]:
            if request.queued:
                request.passed_over += 1
        self._clean_heads()
        return batch

    def _clean_heads(self) -> None:
        """Drop dead entries from the front of each level, and retire a queued head
        whose caller already left (its future is done); empty levels go."""
        for negated in list(self._order):
            level = self._levels[-negated]
            while level and (not level[0].queued or level[0].future.done()):
                head = level.popleft()
                if head.queued:
                    self._leave(head)
                else:
                    self._dead -= 1
            if not level:
                self._drop_level(negated)

    def oldest_enqueued_at(self) -> float | None:
        """Arrival time of the longest-waiting live request, or None when empty."""
        self._clean_heads()
        heads = (self._levels[-negated][0].enqueued_at for negated in self._order)
        return min(heads, default=None)

    def drain(self) -> list[Request[T]]:
        """Remove and return every live request (used when the event loop is gone)."""
        batch = self.pop_batch(self.live) if self.live else []
        self._levels.clear()
        self._order.clear()
        self._dead = 0
        self.live = 0
        self.live_cost = 0
        return batch

    def _leave(self, request: Request[T]) -> None:
        request.queued = False
        self.live -= 1
        self.live_cost -= request.cost

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
