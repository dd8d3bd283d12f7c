"""Fair sharing between tenants: one queue per tenant, batches filled across them by
weighted fair queuing.

Each call may name its tenant (`tenant=`); calls without one are tenant None. The
`FairQueue` holds one sub-queue per tenant with requests waiting (made by its
`factory`, a `RequestQueue` by default), so memory grows with the tenants waiting,
not with those ever seen. It has the interface of every queue (`Queue`), so the
scheduler, intake and generation use it as they use a `RequestQueue`.

Who goes next is stride scheduling. Each waiting tenant has a pass (a virtual
time); a batch is filled one request at a time from the tenant with the lowest
pass (on a tie, the one waiting longest), and taking a request advances that
tenant's pass by 1 / its weight. So while tenants stay backlogged, each gets
batch places in proportion to its weight, and one alone gets them all (nothing
is held back for tenants that send nothing). A tenant that starts waiting starts
at the queue's virtual time (the lowest pass of the tenants waiting when it
arrives, or the last one's): it cannot bank credit while idle, and the others do
not owe it for their past. Fairness is counted in requests, not in their cost.

Passes are exact: integers in units of 2**-_SCALE, and a tenant's step is its
weight's reciprocal to 53 bits (`stride`), for every positive float weight. A
float pass lost the steps of weight-1 tenants once a weight of 1e-300 had moved
the virtual time to 1e300; an integer loses nothing at any size.

The waiting tenants are in a heap by (pass, since) kept between batches, so a
place costs one heap step (O(log n) in the tenants waiting), not a heap built
over all of them per batch. A tenant's heap entry is valid while it is the
tuple its `_Tenant` holds (`entry`); others are stale, skipped at the top and
dropped when they outnumber the valid ones.

Fairness comes first: within a tenant, its sub-queue's order applies (priority,
then earliest deadline, then arrival, with aging), so no tenant buys a larger
share with priority or tight deadlines. The sub-queues' `live` and `live_cost`
are summed here, kept by the difference each call into a sub-queue makes.
"""

from __future__ import annotations

import functools
import heapq
import itertools
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar

from .queue import Composite, Queue, Request, RequestQueue, full_reason, pick_similar
from .sizes import Cut, cut_limit

__all__ = ["FairQueue", "Weight", "stride"]

T = TypeVar("T")

Weight = Callable[[Hashable | None], float]
"""A tenant's weight (finite, > 0), read each time its pass advances."""

_SCALE = 1077
"""Passes count units of 2**-_SCALE: the step of the largest float weight (just
under 2**1024) still has 53 significant bits, as a float has."""

_COMPACT_MIN_STALE = 64

_Entry = tuple[int, int, Hashable | None]  # (pass, since, tenant): a heap entry


def _equal(tenant: Hashable | None) -> float:
    return 1.0


@functools.lru_cache(maxsize=1024)
def stride(weight: float) -> int:
    """The pass step of a tenant of `weight` (finite, > 0): 1 / weight in units of
    2**-_SCALE, rounded down (at least 1)."""
    numerator, denominator = weight.as_integer_ratio()
    return max(1, (denominator << _SCALE) // numerator)


class _Tenant(Generic[T]):
    """One waiting tenant: its queue, its pass, when it started waiting (ties), and
    its valid heap entry (None while out of the heap)."""

    __slots__ = ("entry", "pass_", "queue", "since")

    def __init__(self, queue: Queue[T], pass_: int, since: int) -> None:
        self.queue = queue
        self.pass_ = pass_
        self.since = since
        self.entry: _Entry | None = None


class FairQueue(Composite[T]):
    """One sub-queue per tenant; batches filled across tenants by weighted fair queuing."""

    __slots__ = (
        "_factory",
        "_heap",
        "_started",
        "_tenants",
        "_vtime",
        "live",
        "live_cost",
        "weight",
    )

    def __init__(
        self,
        aging: float | None = None,
        *,
        weight: Weight = _equal,
        factory: Callable[[float | None], Queue[T]] = RequestQueue,
    ) -> None:
        self._aging = aging
        self._factory = factory  # a tenant's sub-queue, given `aging`
        self.weight = weight
        self._tenants: dict[Hashable | None, _Tenant[T]] = {}  # those with requests waiting
        self._heap: list[_Entry] = []  # the waiting tenants by (pass, since); stale entries
        self._vtime = 0  # the lowest pass when last looked at (`_virtual_time`)
        self._started = 0  # tenants that started waiting so far: the tie-break
        self.live = 0
        self.live_cost = 0

    @classmethod
    def around(cls, queue: Queue[T], weight: Weight = _equal) -> FairQueue[T]:
        """A fair queue whose tenant None holds `queue`, with what it holds (requests
        queued before any call named a tenant)."""
        fair: FairQueue[T] = cls(queue.aging, weight=weight)
        if queue.live:
            waiting = fair._tenants[None] = _Tenant(queue, 0, 0)
            fair._enlist(None, waiting)
            fair.live, fair.live_cost = queue.live, queue.live_cost
        return fair

    def subqueues(self) -> list[Queue[T]]:
        return [tenant.queue for tenant in self._tenants.values()]

    def queued(self, tenant: Hashable | None) -> int:
        """Live requests of `tenant`."""
        waiting = self._tenants.get(tenant)
        return 0 if waiting is None else waiting.queue.live

    def by_tenant(self) -> dict[Hashable | None, int]:
        """Live requests per tenant with any."""
        return {key: t.queue.live for key, t in self._tenants.items() if t.queue.live}

    # -- the queue interface --------------------------------------------------------------

    def push(self, request: Request[T]) -> None:
        key = request.tenant
        waiting = self._tenants.get(key)
        if waiting is None:
            self._started += 1
            queue = self._factory(self._aging)
            waiting = _Tenant(queue, self._virtual_time(), self._started)
            self._tenants[key] = waiting
            self._enlist(key, waiting)
        waiting.queue.push(request)
        self.live += 1
        self.live_cost += request.cost

    def discard(self, request: Request[T]) -> bool:
        key = request.tenant
        waiting = self._tenants.get(key)
        if waiting is None or not waiting.queue.discard(request):
            return False
        self.live -= 1
        self.live_cost -= request.cost
        if not waiting.queue.live:
            self._leave(key, waiting)
        return True

    def pop_batch(
        self, limit: int, now: float = 0.0, *, cut: Cut | None = None
    ) -> list[Request[T]]:
        """Up to `limit` live requests (`cut`: see `Queue.pop_batch`), each tenant's share
        by weighted fair queuing, each share in its tenant's own order."""
        limit = cut_limit(limit, self.live, cut)
        batch: list[Request[T]] = []
        while len(batch) < limit and self._tenants:  # again if some callers had left
            for key, (waiting, share, step) in self._shares(limit - len(batch)).items():
                queue = waiting.queue
                live, cost = queue.live, queue.live_cost
                taken = queue.pop_batch(share, now)
                # its pass moved `share` steps; those its departed callers left go back
                self._served(key, waiting, live, cost, (len(taken) - share) * step)
                batch += taken
        self._virtual_time()
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
        cut: Cut | None = None,
    ) -> list[Request[T]]:
        """Requests of similar cost among the first `window` in fair order (`pick_similar`)."""
        limit = cut_limit(limit, self.live, cut)
        return pick_similar(self, limit, budget, window, now, group, max_passes)

    def in_pop_order(self, now: float) -> Iterator[Request[T]]:
        """The tenants' requests merged in the order a pop takes them. The heap is read
        from its root down, as far as the caller reads: O(log n) per request."""
        heap, tenants, weight = self._heap, self._tenants, self.weight
        unique = itertools.count()  # (never compare iterators)
        # (pass, since, unique, heap index or -1, the tenant's requests, its step)
        frontier: list[tuple[int, int, int, int, Iterator[Request[T]] | None, int]] = []

        def reach(node: int) -> None:
            if node < len(heap):
                pass_, since, _ = heap[node]
                heapq.heappush(frontier, (pass_, since, next(unique), node, None, 0))

        reach(0)
        while frontier:
            pass_, since, _, node, requests, step = frontier[0]
            if requests is None:  # a heap entry: its children next, and its tenant
                heapq.heappop(frontier)
                reach(2 * node + 1)
                reach(2 * node + 2)
                entry = heap[node]
                waiting = tenants.get(entry[2])
                if waiting is not None and waiting.entry is entry:
                    requests = waiting.queue.in_pop_order(now)
                    step = stride(weight(entry[2]))
                    heapq.heappush(frontier, (pass_, since, next(unique), -1, requests, step))
                continue
            request = next(requests, None)
            if request is None:
                heapq.heappop(frontier)
                continue
            yield request
            heapq.heapreplace(frontier, (pass_ + step, since, next(unique), -1, requests, step))

    def take(self, requests: list[Request[T]]) -> None:
        by_tenant: dict[Hashable | None, list[Request[T]]] = {}
        for request in requests:
            by_tenant.setdefault(request.tenant, []).append(request)
        for key, group in by_tenant.items():
            waiting = self._tenants[key]
            queue = waiting.queue
            live, cost = queue.live, queue.live_cost
            queue.take(group)
            self._served(key, waiting, live, cost, len(group) * stride(self.weight(key)))
        self._virtual_time()

    def full_reason(self, limit: int, budget: int | None) -> str | None:
        """A batch fills across tenants: full when all of them together fill it."""
        return full_reason(self, limit, budget)

    def next_live(self, limit: int, budget: int | None) -> int:
        """A batch takes from every tenant."""
        return self.live

    def count_ahead(self, probe: Request[T]) -> int:
        """Those ahead of `probe` in its tenant's queue, and from each other tenant the
        requests fair queuing serves before its turn comes. Reads only the heap entries
        below its turn."""
        key = probe.tenant
        own = self._tenants.get(key)
        ahead = 0 if own is None else own.queue.count_ahead(probe)
        turn = (self._virtual_time() if own is None else own.pass_) + ahead * stride(
            self.weight(key)
        )
        heap, nodes = self._heap, [0]
        while nodes:
            node = nodes.pop()
            if node >= len(heap) or heap[node][0] >= turn:
                continue  # (every entry below it has as high a pass)
            nodes += (2 * node + 1, 2 * node + 2)
            pass_, _, other = entry = heap[node]
            waiting = self._tenants.get(other)
            if waiting is None or waiting.entry is not entry or waiting is own:
                continue
            before = -((pass_ - turn) // stride(self.weight(other)))  # ceil of the steps
            ahead += min(waiting.queue.live, before)
        return ahead

    def peek(self, now: float = 0.0) -> Request[T] | None:
        return next(self.in_pop_order(now), None)

    def earliest_deadline(self) -> float:
        return min(
            (w.queue.earliest_deadline() for w in self._tenants.values()), default=float("inf")
        )

    def oldest_enqueued_at(self) -> float | None:
        oldest: float | None = None
        for key, waiting in list(self._tenants.items()):
            queue = waiting.queue
            live, cost = queue.live, queue.live_cost
            arrived = queue.oldest_enqueued_at()  # it may retire requests whose caller left
            self._served(key, waiting, live, cost, 0)
            if arrived is not None and (oldest is None or arrived < oldest):
                oldest = arrived
        return oldest

    def drain(self) -> list[Request[T]]:
        drained = [r for waiting in self._tenants.values() for r in waiting.queue.drain()]
        self._tenants.clear()
        self._heap.clear()
        self.live = self.live_cost = 0
        return drained

    # -- internals ------------------------------------------------------------------------

    def _shares(self, places: int) -> dict[Hashable | None, tuple[_Tenant[T], int, int]]:
        """How many of `places` each tenant gets, one at a time to the lowest pass: the
        passes advance as the places are given (by one heap step each). For each
        tenant served: it, its share and its step."""
        heap, tenants = self._heap, self._tenants
        shares: dict[Hashable | None, tuple[_Tenant[T], int, int]] = {}
        while places:
            entry = self._top()
            if entry is None:
                break
            key = entry[2]
            waiting = tenants[key]
            _, share, step = shares.get(key) or (waiting, 0, stride(self.weight(key)))
            more = waiting.queue.live - share
            if len(heap) > 1:
                more = 1  # one place, then whoever is lowest
            more = min(more, places)
            share += more
            places -= more
            waiting.pass_ += more * step
            shares[key] = (waiting, share, step)
            if share >= waiting.queue.live:  # all it has: out of the heap
                heapq.heappop(heap)
                waiting.entry = None
            else:
                waiting.entry = new = (waiting.pass_, waiting.since, key)
                heapq.heapreplace(heap, new)
        return shares

    def _served(
        self, key: Hashable | None, waiting: _Tenant[T], live: int, cost: int, advance: int
    ) -> None:
        """After a call into a tenant's queue (which had `live` requests costing `cost`):
        the totals follow, its pass moves by `advance`, and an emptied tenant goes."""
        queue = waiting.queue
        self.live += queue.live - live
        self.live_cost += queue.live_cost - cost
        waiting.pass_ += advance
        if not queue.live:
            self._leave(key, waiting)
        elif waiting.entry is None or waiting.entry[0] != waiting.pass_:
            self._enlist(key, waiting)

    def _enlist(self, key: Hashable | None, waiting: _Tenant[T]) -> None:
        """A heap entry for `waiting` at its pass (an older one goes stale)."""
        waiting.entry = entry = (waiting.pass_, waiting.since, key)
        heapq.heappush(self._heap, entry)
        self._compact()

    def _leave(self, key: Hashable | None, waiting: _Tenant[T]) -> None:
        """An emptied tenant is dropped (its heap entry goes stale)."""
        del self._tenants[key]
        waiting.entry = None
        self._compact()

    def _top(self) -> _Entry | None:
        """The valid entry of the lowest pass (stale ones above it dropped)."""
        heap, tenants = self._heap, self._tenants
        while heap:
            entry = heap[0]
            waiting = tenants.get(entry[2])
            if waiting is not None and waiting.entry is entry:
                return entry
            heapq.heappop(heap)
        return None

    def _compact(self) -> None:
        """Rebuild the heap from the valid entries once the stale ones outnumber them."""
        heap, tenants = self._heap, self._tenants
        if len(heap) > 2 * len(tenants) + _COMPACT_MIN_STALE:
            heap[:] = [w.entry for w in tenants.values() if w.entry is not None]
            heapq.heapify(heap)

    def _virtual_time(self) -> int:
        """The virtual time: the lowest pass of the tenants waiting, or, with none, the
        last one seen."""
        entry = self._top()
        if entry is not None:
            self._vtime = entry[0]
        return self._vtime
