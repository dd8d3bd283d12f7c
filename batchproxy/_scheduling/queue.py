"""Pending requests: one level per priority, highest level first.

Each priority has two lanes, small calls' and below it bulk calls' (`lanes`:
their interleave, and the bound it gives the bulk calls).

Within a lane, requests with a deadline go earliest deadline first, then those
without one in arrival order (so with one timeout for every call, the order is
FIFO). With `aging` (seconds), priorities are served in order of their oldest
request's arrival time (in either lane) minus `aging` per level of priority, and
a lane whose oldest request has waited `aging` is served oldest first. So a
request is never overtaken by one of Δp levels more that arrived more than Δp x
`aging` after it,
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
per batch key; `_scheduling.placement` nests them) also have; `pick_similar`
(`similar`) forms a length-aware batch from any of them.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Iterator
from typing import Generic, Protocol, TypeVar

from .lanes import BULK_EVERY, Level, across, aged, interleaved, lane_order
from .request import NO_DEADLINE as _NO_DEADLINE
from .request import Request, lane
from .similar import pick_similar
from .sizes import Cut, cut_limit

__all__ = [
    "Composite",
    "Queue",
    "Request",
    "RequestQueue",
    "full_reason",
    "pick_similar",
]

T = TypeVar("T")

_COMPACT_MIN_DEAD = 64
_DEFAULT_ONLY = ((0, False),)  # the serving order when only the default level is in use


class RequestQueue(Generic[T]):
    """Priority levels, each a small and a bulk lane (keyed by `lane`); within a lane,
    earliest deadline first, then FIFO; optional aging."""

    __slots__ = ("_dead", "_levels", "_order", "_seq", "aging", "live", "live_cost")

    def __init__(self, aging: float | None = None) -> None:
        # the default level stays even when empty (it is the common one); others come
        # and go with their requests, so memory does not grow with priorities ever used
        self._levels: dict[int, Level[T]] = {0: Level()}  # by `lane`
        self._order: list[int] = [0]  # negated lanes, ascending: highest priority first
        self._dead = 0
        self._seq = 0
        self.aging = aging  # seconds of waiting per level of priority gained; None: off
        self.live = 0
        self.live_cost = 0  # summed cost of the live requests

    def push(self, request: Request[T]) -> None:
        at = 2 * request.priority - request.bulk  # (`lane`, inline: every request)
        level = self._levels.get(at)
        if level is None:
            level = self._levels[at] = Level()
            bisect.insort(self._order, -at)
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

    def pop_batch(
        self, limit: int, now: float = 0.0, *, cut: Cut | None = None
    ) -> list[Request[T]]:
        """Up to `limit` live requests in pop order (see the module docstring); with
        `cut`, up to the size it allows for the live requests (`cut_limit`).

        Requests whose future is already done (cancelled by their caller a moment
        ago) are dropped here rather than sent to the model.
        """
        limit = cut_limit(limit, self.live, cut)
        batch: list[Request[T]] = []
        default_only = self.aging is None and self._order == [0]
        order = _DEFAULT_ONLY if default_only else self._serving_order(now)
        levels = self._levels
        for at, oldest_first in order:
            if len(batch) >= limit:
                break
            level = levels.get(at)
            if level is None:  # a bulk lane, emptied with its small lane
                continue
            bulk = None if at & 1 else levels.get(at - 1)
            if bulk is not None and bulk.live:
                self._interleave(at, (oldest_first, aged(order, at - 1)), limit, batch)
            else:
                self._take_lane(at, level, limit, oldest_first, batch)
        if self._dead > _COMPACT_MIN_DEAD:  # (`_collect`, inline: once per batch)
            self._collect()  # served out of arrival order: dead entries behind a live head
        return batch

    def _take_lane(
        self, at: int, level: Level[T], limit: int, oldest_first: bool, batch: list[Request[T]]
    ) -> None:
        """Fill `batch` up to `limit` from lane `at` (`level`) in its order; requests whose
        caller left on the way leave too, unsent."""
        before = len(batch)
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
        if at & 1 and len(batch) > before:
            level.passed = 0  # a bulk lane served
        if not fifo and at:
            self._drop_level(-at)

    def _interleave(
        self, at: int, oldest_first: tuple[bool, bool], limit: int, batch: list[Request[T]]
    ) -> None:
        """Fill `batch` up to `limit` from priority `at // 2`'s small lane (`at`) and bulk
        lane (`at - 1`), both waiting: `BULK_EVERY - 1` small places, then a bulk one,
        the count carried over between batches; one lane alone takes the rest.
        `oldest_first`: each lane's (small, bulk), as `_serving_order` says."""
        small, bulk = self._levels[at], self._levels[at - 1]
        while len(batch) < limit:
            if not small.live:
                self._take_lane(at - 1, bulk, limit, oldest_first[1], batch)
                return
            if not bulk.live:
                self._take_lane(at, small, limit, oldest_first[0], batch)
                return
            run = BULK_EVERY - 1 - bulk.passed
            before = len(batch)
            if run > 0:
                self._take_lane(at, small, min(limit, before + run), oldest_first[0], batch)
                bulk.passed += len(batch) - before
            else:
                self._take_lane(at - 1, bulk, before + 1, oldest_first[1], batch)

    def pop_similar(
        self,
        limit: int,
        budget: int | None,
        window: int,
        *,
        now: float = 0.0,
        group: bool = True,
        max_passes: int = 3,
        cut: Cut | None = None,
    ) -> list[Request[T]]:
        """Up to `limit` requests of similar cost, so a padded batch wastes little
        (see `pick_similar`); `cut` as for `pop_batch`."""
        if self.live == 1:  # nothing to compare: the one request goes (as `pick_similar`'s
            return self.pop_batch(1, now)  # first always does), without ranking anyone
        limit = cut_limit(limit, self.live, cut)
        return pick_similar(self, limit, budget, window, now, group, max_passes)

    def take(self, requests: list[Request[T]]) -> None:
        """These live requests, picked from `in_pop_order`, leave the queue as served."""
        served: dict[int, tuple[int, bool]] = {}  # per priority: small places, any bulk
        for request in requests:
            if request.queued:
                self._take_out(request)
                small, bulk = served.get(request.priority, (0, False))
                served[request.priority] = (small + (not request.bulk), bulk or request.bulk)
        for priority, (small, bulk) in served.items():  # the interleave's count follows
            level = self._levels.get(2 * priority - 1)
            if level is not None:
                level.passed = 0 if bulk else min(BULK_EVERY - 1, level.passed + small)
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
        priority, lane and deadline, ignoring aging: every one in a higher priority, and
        in its own lane those whose deadline is no later, with the other lane's
        requests the interleave puts before it."""
        own, deadline = lane(probe), probe.deadline
        sibling = own + 1 if own & 1 else own - 1
        ahead = 0
        for negated in self._order:
            if -negated > own and -negated != sibling:
                ahead += self._levels[-negated].live
        level = self._levels.get(own)
        mine = 0 if level is None else bisect.bisect_right(level.by_deadline, (deadline, math.inf))
        other = self._levels.get(sibling)
        if other is not None and other.live:
            passed = (0 if level is None else level.passed) if own & 1 else other.passed
            ahead += across(bool(own & 1), mine, other.live, passed)
        return ahead + mine

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
        self._levels = {0: Level()}
        self._order = [0]
        self._dead = 0
        self.live = 0
        self.live_cost = 0
        return [r for r in batch if not r.future.done()]

    # -- internals ---------------------------------------------------------------------

    def _serving_order(self, now: float, *, clean: bool = True) -> list[tuple[int, bool]]:
        """Lanes to serve, as (lane, oldest first?), most urgent first, a priority's
        small lane just before its bulk one. With aging, a priority ranks by its oldest
        live request's arrival (in either lane) minus `aging` per level, and a lane
        whose oldest has waited `aging` goes oldest first. `clean`: retire the dead
        heads first (a pop); without, the queue is only read (`in_pop_order`: a
        composite queue counts only the changes of its calls)."""
        aging = self.aging
        if aging is None:
            return [(-negated, False) for negated in self._order]
        if clean:
            self._clean_heads()
        heads: dict[int, float] = {}
        for negated in self._order:
            head = next(
                (r for r in self._levels[-negated].fifo if r.queued and not r.future.done()),
                None,
            )
            if head is not None:
                heads[-negated] = head.enqueued_at
        ranked = []
        for at, arrived in heads.items():
            oldest = min(arrived, heads.get(at + 1 if at & 1 else at - 1, math.inf))
            rank = oldest - ((at + 1) >> 1) * aging  # (`at + 1 >> 1`: its priority)
            ranked.append((rank, -at, now - arrived >= aging))
        ranked.sort()
        return [(-negated, aged) for _, negated, aged in ranked]

    def in_pop_order(self, now: float) -> Iterator[Request[T]]:
        """Live requests whose caller still waits, in the order a pop would take them.
        Reading them changes nothing."""
        order = self._serving_order(now, clean=False)
        levels = self._levels
        paired: set[int] = set()
        for at, oldest_first in order:
            if at in paired:
                continue
            requests = lane_order(levels[at], oldest_first)
            bulk = None if at & 1 else levels.get(at - 1)
            if bulk is not None and bulk.live:
                paired.add(at - 1)
                bulk_order = lane_order(bulk, aged(order, at - 1))
                requests = interleaved(requests, bulk_order, bulk.passed)
            yield from requests

    def _take_out(self, request: Request[T]) -> None:
        """A queued request leaves out of arrival order: a dead entry in its deque."""
        if request.deadline != _NO_DEADLINE:
            self._levels[lane(request)].unlist(request)
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
        self._levels[lane(request)].live -= 1
        self.live -= 1
        self.live_cost -= request.cost

    def _drop_level(self, negated: int) -> None:
        """An emptied lane goes, except the default one (priority 0's small lane)."""
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

    def pop_batch(
        self, limit: int, now: float = 0.0, *, cut: Cut | None = None
    ) -> list[Request[T]]:
        """Up to `limit`; with `cut`, the size it allows for the requests the batch draws
        from (`next_live`): sized from the very requests (key) it takes it from."""
        ...

    def pop_similar(
        self,
        limit: int,
        budget: int | None,
        window: int,
        *,
        now: float = 0.0,
        group: bool = True,
        max_passes: int = 3,
        cut: Cut | None = None,
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
        without a filler waits for the next size by it; a pop with `cut` sizes its
        batch by the same count.)"""
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
