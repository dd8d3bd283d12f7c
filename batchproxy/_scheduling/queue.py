"""Pending requests: one level per priority, highest level first.

Within a level, requests with a deadline go earliest deadline first, then those
without one in arrival order (so with one timeout for every call, the order is
FIFO). With `aging` (seconds), levels are served in order of their oldest
request's arrival time minus `aging` per level of priority, and a level whose
oldest request has waited `aging` is served oldest first. So a request is never
overtaken by one of Δp levels more that arrived more than Δp x `aging` after it,
nor, in its own level, by one that arrived more than `aging` after it: neither a
busier level nor a stream of tighter deadlines holds it back for ever.

A request leaves the queue exactly once, by whoever flips `queued` to False:
a pop (dispatch), or `discard` (its caller cancelled, its deadline passed).
Each level keeps every request in an arrival-order deque; a request that leaves
out of order (discarded, or popped in deadline order) stays there as a dead
entry until skipped at the head. Every operation that leaves dead entries ends
in `_collect`, which compacts them away once they outnumber the live ones: so
the deque holds at most about twice the live requests, under floods of
cancellations and under a steady backlog served in deadline order alike (a dead
entry still holds its request's future, and so its result). The deadline order
is a sorted list of the live requests with a deadline, kept exact, so it can
also count who is ahead.

`Queue` is the interface the scheduler, intake and generation use, which
composites of `RequestQueue`s (`FairQueue`: one per tenant; `KeyedQueue`: one
per batch key; `_scheduling.placement` nests them) also have; `pick_similar` forms a
length-aware batch from any of them.
"""

from __future__ import annotations

import asyncio
import bisect
import contextvars
import math
from collections import deque
from collections.abc import Hashable, Iterator
from typing import Any, Generic, Protocol, TypeVar

__all__ = ["Composite", "Queue", "Request", "RequestQueue", "full_reason", "pick_similar"]

T = TypeVar("T")

_COMPACT_MIN_DEAD = 64
_DEFAULT_ONLY = ((0, False),)  # the serving order when only the default level is in use
_NO_DEADLINE = math.inf  # a request's deadline when it has none


class Request(Generic[T]):
    """One call's item, its future, and where it stands. `context`, a copy of the
    caller's `contextvars` context, is set (by intake) only with `caller_context`."""

    __slots__ = (
        "context",
        "cost",
        "deadline",
        "deadline_timer",
        "enqueued_at",
        "future",
        "item",
        "key",
        "passed_over",
        "priority",
        "queued",
        "seq",
        "tenant",
    )
    context: contextvars.Context  # unset unless intake sets it

    def __init__(
        self,
        item: T,
        future: asyncio.Future[Any],
        priority: int,
        enqueued_at: float,
        cost: int = 1,
        deadline: float = _NO_DEADLINE,
    ) -> None:
        self.item = item
        self.future = future
        self.priority = priority
        self.enqueued_at = enqueued_at
        self.cost = cost
        self.deadline = deadline  # loop time; inf: none
        self.seq = 0  # arrival order, set by the queue
        self.queued = True
        self.passed_over = 0  # times left out of a batch while among the oldest
        self.deadline_timer: asyncio.TimerHandle | None = None
        self.tenant: Hashable | None = None  # whose call (fair sharing); set by intake
        self.key: Hashable | None = None  # batched only with its own key; set by intake


class _Level(Generic[T]):
    """One priority level: every request in arrival order, the live ones with a
    deadline also sorted by (deadline, arrival)."""

    __slots__ = ("by_deadline", "fifo", "live")

    def __init__(self) -> None:
        self.fifo: deque[Request[T]] = deque()
        self.by_deadline: list[tuple[float, int, Request[T]]] = []
        self.live = 0

    def unlist(self, request: Request[T]) -> None:
        """Remove a request from the deadline order (it has one, and is in it)."""
        entries = self.by_deadline
        index = bisect.bisect_left(entries, (request.deadline, request.seq))
        del entries[index]


class RequestQueue(Generic[T]):
    """Priority levels; within one, earliest deadline first, then FIFO; optional aging."""

    __slots__ = ("_dead", "_levels", "_order", "_seq", "aging", "live", "live_cost")

    def __init__(self, aging: float | None = None) -> None:
        # the default level stays even when empty (it is the common one); others come
        # and go with their requests, so memory does not grow with priorities ever used
        self._levels: dict[int, _Level[T]] = {0: _Level()}
        self._order: list[int] = [0]  # negated priorities, ascending: highest priority first
        self._dead = 0
        self._seq = 0
        self.aging = aging  # seconds of waiting per level of priority gained; None: off
        self.live = 0
        self.live_cost = 0  # summed cost of the live requests

    def push(self, request: Request[T]) -> None:
        level = self._levels.get(request.priority)
        if level is None:
            level = self._levels[request.priority] = _Level()
            bisect.insort(self._order, -request.priority)
        self._seq += 1
        request.seq = self._seq
        level.fifo.append(request)
        if request.deadline != _NO_DEADLINE:
            bisect.insort(level.by_deadline, (request.deadline, request.seq, request))
        level.live += 1
        self.live += 1
        self.live_cost += request.cost

    def discard(self, request: Request[T]) -> bool:
        """Take a still-queued request out (lazily). False if it had already left."""
        if not request.queued:
            return False
        self._take_out(request)
        self._collect()
        return True

    def pop_batch(self, limit: int, now: float = 0.0) -> list[Request[T]]:
        """Up to `limit` live requests in pop order (see the module docstring).

        Requests whose future is already done (cancelled by their caller a moment
        ago) are dropped here rather than sent to the model.
        """
        batch: list[Request[T]] = []
        default_only = self.aging is None and self._order == [0]
        order = _DEFAULT_ONLY if default_only else self._serving_order(now)
        for priority, oldest_first in order:
            level = self._levels[priority]
            if not oldest_first and level.by_deadline:
                entries = level.by_deadline
                taken = entries[: limit - len(batch)]
                del entries[: len(taken)]
                for _, _, request in taken:
                    self._leave(request)
                    self._dead += 1  # still in the arrival deque: dropped at its head
                    if not request.future.done():
                        batch.append(request)
            fifo = level.fifo
            left = cost = 0  # (`_leave` for each, summed: this loop is per request)
            while fifo and (len(batch) < limit or not fifo[0].queued):
                request = fifo.popleft()
                if not request.queued:  # left earlier, out of order: a dead entry
                    self._dead -= 1
                    continue
                if request.deadline != _NO_DEADLINE:
                    level.unlist(request)
                request.queued = False
                left += 1
                cost += request.cost
                if not request.future.done():
                    batch.append(request)
            level.live -= left
            self.live -= left
            self.live_cost -= cost
            if not fifo and priority:
                self._drop_level(-priority)
            if len(batch) >= limit:
                break
        if self._dead > _COMPACT_MIN_DEAD:  # (`_collect`, inline: once per batch)
            self._collect()  # served out of arrival order: dead entries behind a live head
        return batch

    def pop_similar(
        self,
        limit: int,
        budget: int | None,
        window: int,
        *,
        now: float = 0.0,
        group: bool = True,
        max_passes: int = 3,
    ) -> list[Request[T]]:
        """Up to `limit` requests of similar cost, so a padded batch wastes little
        (see `pick_similar`)."""
        return pick_similar(self, limit, budget, window, now, group, max_passes)

    def take(self, requests: list[Request[T]]) -> None:
        """These live requests, picked from `in_pop_order`, leave the queue as served."""
        for request in requests:
            if request.queued:
                self._take_out(request)
        self._clean_heads()
        self._collect()

    def full_reason(self, limit: int, budget: int | None) -> str | None:
        """Why one batch may leave now by size alone (see `full_reason`)."""
        return full_reason(self, limit, budget)

    def next_live(self, limit: int, budget: int | None) -> int:
        """A batch may take any of the live requests."""
        return self.live

    def count_ahead(self, probe: Request[T]) -> int:
        """How many live requests go before `probe` (a new request, not queued) by its
        priority and deadline, ignoring aging: every one in a higher level, and in its
        own level those whose deadline is no later."""
        priority, deadline = probe.priority, probe.deadline
        ahead = 0
        for negated in self._order:
            if -negated > priority:
                ahead += self._levels[-negated].live
            elif -negated == priority:
                entries = self._levels[priority].by_deadline
                ahead += bisect.bisect_right(entries, (deadline, math.inf))
        return ahead

    def peek(self, now: float = 0.0) -> Request[T] | None:
        """The live request a `pop_batch(1, now)` would take, left in the queue."""
        return next(self.in_pop_order(now), None)

    def earliest_deadline(self) -> float:
        """The earliest deadline among the live requests (`inf`: none has one)."""
        return min(
            (level.by_deadline[0][0] for level in self._levels.values() if level.by_deadline),
            default=_NO_DEADLINE,
        )

    def oldest_enqueued_at(self) -> float | None:
        """Arrival time of the longest-waiting live request, or None when empty."""
        self._clean_heads()
        heads = (level.fifo[0].enqueued_at for level in self._levels.values() if level.fifo)
        return min(heads, default=None)

    def drain(self) -> list[Request[T]]:
        """Remove and return every live request (used when the event loop is gone)."""
        batch = [r for level in self._levels.values() for r in level.fifo if r.queued]
        for request in batch:
            request.queued = False
        self._levels = {0: _Level()}
        self._order = [0]
        self._dead = 0
        self.live = 0
        self.live_cost = 0
        return [r for r in batch if not r.future.done()]

    # -- internals ---------------------------------------------------------------------

    def _serving_order(self, now: float, *, retire: bool = True) -> list[tuple[int, bool]]:
        """Levels to serve, as (priority, oldest first?), most urgent first. With aging,
        a level ranks by its oldest request's arrival minus `aging` per priority level.
        `retire=False` (`in_pop_order`) leaves the queue as it is: the heads whose
        caller left are skipped, not retired (a queue that holds this one, a tenant's
        or a key's, counts its live requests and is not told of a retirement here)."""
        aging = self.aging
        if aging is None:
            return [(-negated, False) for negated in self._order]
        if retire:
            self._clean_heads()
        ranked = []
        for negated in self._order:
            fifo = self._levels[-negated].fifo
            head = next((r for r in fifo if r.queued and not r.future.done()), None)
            if head is None:
                continue
            arrived = head.enqueued_at
            ranked.append((arrived + negated * aging, negated, now - arrived >= aging))
        ranked.sort()
        return [(-negated, aged) for _, negated, aged in ranked]

    def in_pop_order(self, now: float) -> Iterator[Request[T]]:
        """Live requests whose caller still waits, in the order a pop would take them."""
        for priority, oldest_first in self._serving_order(now, retire=False):
            level = self._levels[priority]
            if not oldest_first:
                for _, _, request in level.by_deadline:
                    if not request.future.done():
                        yield request
            for request in level.fifo:
                if (
                    request.queued
                    and (oldest_first or request.deadline == _NO_DEADLINE)
                    and not request.future.done()
                ):
                    yield request

    def _take_out(self, request: Request[T]) -> None:
        """A queued request leaves out of arrival order: a dead entry in its deque."""
        if request.deadline != _NO_DEADLINE:
            self._levels[request.priority].unlist(request)
        self._leave(request)
        self._dead += 1

    def _clean_heads(self) -> None:
        """Drop dead entries from the front of each level, and retire a queued head
        whose caller already left (its future is done); empty levels go (but the default one)."""
        for negated in list(self._order):
            level = self._levels[-negated]
            fifo = level.fifo
            while fifo and (not fifo[0].queued or fifo[0].future.done()):
                head = fifo.popleft()
                if head.queued:
                    if head.deadline != _NO_DEADLINE:
                        level.unlist(head)
                    self._leave(head)
                else:
                    self._dead -= 1
            if not fifo:
                self._drop_level(negated)

    def _leave(self, request: Request[T]) -> None:
        request.queued = False
        self._levels[request.priority].live -= 1
        self.live -= 1
        self.live_cost -= request.cost

    def _drop_level(self, negated: int) -> None:
        """An emptied level goes, except the default one."""
        if not negated:
            return
        del self._levels[-negated]
        self._order.remove(negated)

    def _collect(self) -> None:
        """Compact the deques once dead entries outnumber the live requests (amortised:
        each compaction removes at least as many entries as it keeps)."""
        if self._dead > _COMPACT_MIN_DEAD and self._dead > self.live:
            self._compact()

    def _compact(self) -> None:
        for level in self._levels.values():
            level.fifo = deque(r for r in level.fifo if r.queued)
        for negated in list(self._order):
            if not self._levels[-negated].fifo:
                self._drop_level(negated)
        self._dead = 0


class Queue(Protocol[T]):
    """What the scheduler, intake and generation use of a queue of pending requests:
    a `RequestQueue`, or a composite that holds several (`FairQueue`, one per tenant;
    `KeyedQueue`, one per batch key),
    each made by a factory taking `aging`, so composites nest. `live` and `live_cost`
    count (and sum the costs of) the live requests; setting `aging` reorders the
    next pops. A request leaves exactly once: popped, taken, drained or discarded."""

    live: int
    live_cost: int
    aging: float | None

    def push(self, request: Request[T]) -> None: ...

    def discard(self, request: Request[T]) -> bool:
        """Out without being served (cancelled, expired); False if it had left."""
        ...

    def pop_batch(self, limit: int, now: float = 0.0) -> list[Request[T]]: ...

    def pop_similar(
        self,
        limit: int,
        budget: int | None,
        window: int,
        *,
        now: float = 0.0,
        group: bool = True,
        max_passes: int = 3,
    ) -> list[Request[T]]: ...

    def in_pop_order(self, now: float) -> Iterator[Request[T]]:
        """The live requests whose caller still waits, in pop order (do not change the
        queue while iterating)."""
        ...

    def take(self, requests: list[Request[T]]) -> None:
        """These live requests, picked from `in_pop_order` (or `peek`), leave as served."""
        ...

    def count_ahead(self, probe: Request[T]) -> int:
        """How many live requests a pop would serve before `probe` (a new request)."""
        ...

    def full_reason(self, limit: int, budget: int | None) -> str | None:
        """Why one batch may leave now by size alone: a pop of `limit` would be full
        ("full"), or its cost reaches `budget` ("token budget"); None: not full."""
        ...

    def next_live(self, limit: int, budget: int | None) -> int:
        """How many live requests the next pop (of `limit`, under `budget`) draws its
        batch from: all of them, or with batch keys the next key's only. (`batch_sizes`
        without a filler sizes the batch, and waits for the next size, by it.)"""
        ...

    def peek(self, now: float = 0.0) -> Request[T] | None: ...

    def earliest_deadline(self) -> float: ...

    def oldest_enqueued_at(self) -> float | None: ...

    def drain(self) -> list[Request[T]]: ...


class Composite(Generic[T]):
    """What the composite queues share: sub-queues that follow the composite's `aging`."""

    __slots__ = ("_aging",)

    def subqueues(self) -> list[Queue[T]]:
        """The sub-queues holding requests now."""
        raise NotImplementedError

    @property
    def aging(self) -> float | None:
        return self._aging

    @aging.setter
    def aging(self, aging: float | None) -> None:
        self._aging = aging
        for sub in self.subqueues():
            sub.aging = aging


def full_reason(queue: Queue[T], limit: int, budget: int | None) -> str | None:
    """`Queue.full_reason` for a queue whose batch may take any of its requests."""
    if queue.live >= limit:
        return "full"
    return "token budget" if budget is not None and queue.live_cost >= budget else None


def pick_similar(
    queue: Queue[T],
    limit: int,
    budget: int | None,
    window: int,
    now: float,
    group: bool,
    max_passes: int,
) -> list[Request[T]]:
    """`pop_similar` for any queue: up to `limit` requests of similar cost, so a padded
    batch wastes little.

    Looks at the first `window` live requests in pop order. The first of them
    always goes, alone if its cost alone exceeds `budget`. Next come requests
    passed over `max_passes` times, oldest first; then the ones closest in cost
    to the first (higher priority first), or, with `group=False`, the rest in pop
    order. With a `budget`, the padded size (members x largest cost) stays within
    it. Whoever is among the `limit` first in pop order (the batch a plain pop
    would send) and left out is passed over once more, so nobody waits more than
    `max_passes` batches longer than in that order.
    """
    candidates: list[Request[T]] = []
    for request in queue.in_pop_order(now):
        candidates.append(request)
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
        if request not in batch:
            admit(request)
    queue.take(batch)
    for request in candidates[:limit]:
        if request.queued:
            request.passed_over += 1
    return batch
