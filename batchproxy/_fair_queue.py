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
at the queue's virtual time (the lowest pass of the tenants waiting, or the last
one's): it cannot bank credit while idle, and the others do not owe it for
their past. Fairness is counted in requests, not in their cost.

Fairness comes first: within a tenant, its sub-queue's order applies (priority,
then earliest deadline, then arrival, with aging), so no tenant buys a larger
share with priority or tight deadlines. The sub-queues' `live` and `live_cost`
are summed here, kept by the difference each call into a sub-queue makes.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar

from ._queue import Composite, Queue, Request, RequestQueue, full_reason, pick_similar

__all__ = ["FairQueue", "Weight"]

T = TypeVar("T")

Weight = Callable[[Hashable | None], float]
"""A tenant's weight (finite, > 0), read each time its pass advances."""


def _equal(tenant: Hashable | None) -> float:
    return 1.0


class _Tenant(Generic[T]):
    """One waiting tenant: its queue, its pass, and when it started waiting (ties)."""

    __slots__ = ("pass_", "queue", "since")

    def __init__(self, queue: Queue[T], pass_: float, since: int) -> None:
        self.queue = queue
        self.pass_ = pass_
        self.since = since


class FairQueue(Composite[T]):
    """One sub-queue per tenant; batches filled across tenants by weighted fair queuing."""

    __slots__ = (
        "_factory",
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
        self._vtime = 0.0
        self._started = 0  # tenants that started waiting so far: the tie-break
        self.live = 0
        self.live_cost = 0

    @classmethod
    def around(cls, queue: Queue[T], weight: Weight = _equal) -> FairQueue[T]:
        """A fair queue whose tenant None holds `queue`, with what it holds (requests
        queued before any call named a tenant)."""
        fair: FairQueue[T] = cls(queue.aging, weight=weight)
        if queue.live:
            fair._tenants[None] = _Tenant(queue, 0.0, 0)
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
        waiting = self._tenants.get(request.tenant)
        if waiting is None:
            self._started += 1
            queue = self._factory(self._aging)
            waiting = self._tenants[request.tenant] = _Tenant(queue, self._vtime, self._started)
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
            del self._tenants[key]
        return True

    def pop_batch(self, limit: int, now: float = 0.0) -> list[Request[T]]:
        """Up to `limit` live requests, each tenant's share by weighted fair queuing,
        each share in its tenant's own order."""
        batch: list[Request[T]] = []
        while len(batch) < limit and self._tenants:  # again if some callers had left
            for key, waiting, share in self._shares(limit - len(batch)):
                queue = waiting.queue
                live, cost = queue.live, queue.live_cost
                taken = queue.pop_batch(share, now)
                self._served(key, waiting, live, cost, len(taken))
                batch += taken
        self._move_vtime()
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
        """Requests of similar cost among the first `window` in fair order (`pick_similar`)."""
        return pick_similar(self, limit, budget, window, now, group, max_passes)

    def in_pop_order(self, now: float) -> Iterator[Request[T]]:
        """The tenants' requests merged in the order a pop takes them."""
        heap = [
            (w.pass_, w.since, 1.0 / self.weight(key), w.queue.in_pop_order(now))
            for key, w in self._tenants.items()
        ]
        heapq.heapify(heap)
        while heap:
            pass_, since, stride, requests = heap[0]
            request = next(requests, None)
            if request is None:
                heapq.heappop(heap)
                continue
            yield request
            heapq.heapreplace(heap, (pass_ + stride, since, stride, requests))

    def take(self, requests: list[Request[T]]) -> None:
        by_tenant: dict[Hashable | None, list[Request[T]]] = {}
        for request in requests:
            by_tenant.setdefault(request.tenant, []).append(request)
        for key, group in by_tenant.items():
            waiting = self._tenants[key]
            queue = waiting.queue
            live, cost = queue.live, queue.live_cost
            queue.take(group)
            self._served(key, waiting, live, cost, len(group))
        self._move_vtime()

    def full_reason(self, limit: int, budget: int | None) -> str | None:
        """A batch fills across tenants: full when all of them together fill it."""
        return full_reason(self, limit, budget)

    def next_live(self, limit: int, budget: int | None) -> int:
        """A batch takes from every tenant."""
        return self.live

    def count_ahead(self, probe: Request[T]) -> int:
        """Those ahead of `probe` in its tenant's queue, and from each other tenant the
        requests fair queuing serves before its turn comes."""
        key = probe.tenant
        own = self._tenants.get(key)
        ahead = 0 if own is None else own.queue.count_ahead(probe)
        turn = (self._vtime if own is None else own.pass_) + ahead / self.weight(key)
        for other, waiting in self._tenants.items():
            if other is key or other == key or waiting.pass_ >= turn:
                continue
            before = math.ceil((turn - waiting.pass_) * self.weight(other))
            ahead += min(waiting.queue.live, before)
        return ahead

    def peek(self, now: float = 0.0) -> Request[T] | None:
        return next(self.in_pop_order(now), None)

    def earliest_deadline(self) -> float:
        return min((w.queue.earliest_deadline() for w in self._tenants.values()), default=math.inf)

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
        self.live = self.live_cost = 0
        return drained

    # -- internals ------------------------------------------------------------------------

    def _shares(self, places: int) -> list[tuple[Hashable | None, _Tenant[T], int]]:
        """How many of `places` each tenant gets: one at a time to the lowest pass."""
        tenants = self._tenants
        if len(tenants) == 1:
            ((key, waiting),) = tenants.items()
            return [(key, waiting, min(places, waiting.queue.live))]
        heap = [(w.pass_, w.since, 1.0 / self.weight(key), key) for key, w in tenants.items()]
        heapq.heapify(heap)
        shares: dict[Hashable | None, int] = {}
        while places and heap:
            pass_, since, stride, key = heap[0]
            share = shares.get(key, 0)
            if share >= tenants[key].queue.live:
                heapq.heappop(heap)
                continue
            shares[key] = share + 1
            places -= 1
            heapq.heapreplace(heap, (pass_ + stride, since, stride, key))
        return [(key, tenants[key], share) for key, share in shares.items()]

    def _served(
        self, key: Hashable | None, waiting: _Tenant[T], live: int, cost: int, served: int
    ) -> None:
        """After a call into a tenant's queue (which had `live` requests costing `cost`):
        the totals follow, its pass advances by `served`, and an emptied tenant goes."""
        queue = waiting.queue
        self.live += queue.live - live
        self.live_cost += queue.live_cost - cost
        if served:
            waiting.pass_ += served / self.weight(key)
        if not queue.live:
            del self._tenants[key]

    def _move_vtime(self) -> None:
        """The virtual time: the lowest pass of the tenants waiting (unchanged if none)."""
        if self._tenants:
            self._vtime = min(w.pass_ for w in self._tenants.values())
