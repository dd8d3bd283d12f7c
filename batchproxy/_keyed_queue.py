"""`KeyedQueue`: pending requests batched only with requests of their own key.

Each key (`request.key`; None for calls without one) has its own sub-queue, and
every batch comes from one of them: within a key, priority, deadlines, aging and
the length-aware choice work as in a plain `RequestQueue`. Which key goes next:

- The keys with waiting requests form a rotation, in the order their waiting
  began; a key served goes to the back. So keys take turns batch by batch, and a
  key with a batch waiting is served within (keys - 1) batches of the others.
- A full batch does not wait behind a partial one: when the key at the front
  cannot fill a batch and its oldest request is still inside its window
  (`window()` seconds), the first key in the rotation that can fill one goes
  instead, and the front key keeps its place. Once that request has waited its
  window the front key goes first, so a flooding key never starves the others: a
  request waits at most its window plus the batches already running.
- A key whose requests have all left is dropped: memory does not grow with the
  keys ever seen.

Limitation: a deadline orders requests within its key, and makes the scheduler
send a batch early, but does not move its key ahead in the rotation.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import TypeVar

from ._queue import Composite, Queue, Request, RequestQueue

__all__ = ["KeyedQueue"]

T = TypeVar("T")

_NOBODY: Hashable = object()  # no key: every queued request turned out to be dead


class KeyedQueue(Composite[T]):
    """One sub-queue per key, served in rotation; the `Queue` interface."""

    __slots__ = ("_clock", "_new", "_subs", "_window", "fair", "live", "live_cost")

    def __init__(
        self,
        clock: Callable[[], float],
        window: Callable[[], float],
        aging: float | None = None,
        new: Callable[[float | None], Queue[T]] = RequestQueue,
    ) -> None:
        # the rotation is this dict's order: front first; a served key is re-inserted
        self._subs: dict[Hashable, Queue[T]] = {}
        self._clock = clock  # the loop's time
        self._window = window  # seconds a key's oldest request may be overtaken by full batches
        self._aging = aging
        self._new = new  # a sub-queue, given the aging
        self.fair = False  # its sub-queues are `FairQueue`s (`_placement`)
        self.live = 0
        self.live_cost = 0

    @classmethod
    def around(
        cls,
        queue: Queue[T],
        clock: Callable[[], float],
        window: Callable[[], float],
        new: Callable[[float | None], Queue[T]] = RequestQueue,
    ) -> KeyedQueue[T]:
        """A keyed queue whose key None holds `queue` (the requests queued so far)."""
        keyed = cls(clock, window, queue.aging, new)
        if queue.live:
            keyed._subs[None] = queue
            keyed.live, keyed.live_cost = queue.live, queue.live_cost
        return keyed

    def waiting_per_key(self) -> dict[Hashable, int]:
        """Requests waiting, per key, in rotation order."""
        return {key: sub.live for key, sub in self._subs.items()}

    # -- the Queue interface ---------------------------------------------------------

    def push(self, request: Request[T]) -> None:
        sub = self._subs.get(request.key)
        if sub is None:  # its waiting begins: it joins the back of the rotation
            sub = self._subs[request.key] = self._new(self._aging)
        sub.push(request)
        self.live += 1
        self.live_cost += request.cost

    def discard(self, request: Request[T]) -> bool:
        sub = self._subs.get(request.key)
        if sub is None:
            return False
        live, cost = sub.live, sub.live_cost
        left = sub.discard(request)
        self._settle(request.key, sub, live, cost)
        return left

    def pop_batch(self, limit: int, now: float = 0.0) -> list[Request[T]]:
        return self._pop(limit, None, lambda sub: sub.pop_batch(limit, now))

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
        return self._pop(
            limit,
            budget,
            lambda sub: sub.pop_similar(
                limit, budget, window, now=now, group=group, max_passes=max_passes
            ),
        )

    def full_reason(self, limit: int, budget: int | None) -> str | None:
        """Why a batch may leave by size alone: one key can fill it."""
        for sub in self._subs.values():
            why = sub.full_reason(limit, budget)
            if why is not None:
                return why
        return None

    def next_live(self, limit: int, budget: int | None) -> int:
        """A batch takes from one key: the live requests of the key that goes next."""
        if not self.live:
            return 0
        key = self._next_key(limit, budget)
        return 0 if key is _NOBODY else self._subs[key].live

    def count_ahead(self, probe: Request[T]) -> int:
        """Those ahead in every key (taking turns, the other keys' batches come in
        between): an estimate, for `shed_late`."""
        return sum(sub.count_ahead(probe) for sub in self._subs.values())

    def in_pop_order(self, now: float) -> Iterator[Request[T]]:
        """Each key's requests in its own order, the keys in rotation order (batches
        come from one key: this is the order of the keys' turns, not of one batch)."""
        for sub in list(self._subs.values()):
            yield from sub.in_pop_order(now)

    def take(self, requests: list[Request[T]]) -> None:
        by_key: dict[Hashable, list[Request[T]]] = {}
        for request in requests:
            by_key.setdefault(request.key, []).append(request)
        for key, group in by_key.items():
            sub = self._subs[key]
            live, cost = sub.live, sub.live_cost
            sub.take(group)
            self._settle(key, sub, live, cost)

    def nest(self, wrap: Callable[[Queue[T]], Queue[T]]) -> None:
        """Every key's sub-queue, and each new one, wrapped by `wrap` (a `FairQueue`
        around it, once calls name tenants: `_placement`)."""
        self._subs = {key: wrap(sub) for key, sub in self._subs.items()}
        new = self._new
        self._new = lambda aging: wrap(new(aging))

    def subqueues(self) -> list[Queue[T]]:
        """The keys' sub-queues, in rotation order."""
        return list(self._subs.values())

    def peek(self, now: float = 0.0) -> Request[T] | None:
        for sub in self._subs.values():
            request = sub.peek(now)
            if request is not None:
                return request
        return None

    def earliest_deadline(self) -> float:
        return min((sub.earliest_deadline() for sub in self._subs.values()), default=math.inf)

    def oldest_enqueued_at(self) -> float | None:
        arrivals = [self._oldest(key, sub) for key, sub in list(self._subs.items())]
        return min((arrived for arrived in arrivals if arrived is not None), default=None)

    def drain(self) -> list[Request[T]]:
        subs: Iterable[Queue[T]] = self._subs.values()
        drained = [request for sub in subs for request in sub.drain()]
        self._subs = {}
        self.live = self.live_cost = 0
        return drained

    # -- internals ----------------------------------------------------------------------

    def _pop(
        self,
        limit: int,
        budget: int | None,
        take: Callable[[Queue[T]], list[Request[T]]],
    ) -> list[Request[T]]:
        """`take` a batch from the key that goes next; it goes to the back of the rotation."""
        while self.live:
            key = self._next_key(limit, budget)
            if key is _NOBODY:
                break
            sub = self._subs[key]
            live, cost = sub.live, sub.live_cost
            batch = take(sub)
            self._settle(key, sub, live, cost)
            if key in self._subs:
                del self._subs[key]
                self._subs[key] = sub
            if batch:
                return batch
            self._oldest(key, sub)  # its callers all left: retire them
        return []  # every queued request turned out to be dead

    def _next_key(self, limit: int, budget: int | None) -> Hashable:
        """The key whose batch goes next (see the module docstring); None: every queued
        request turned out to be dead (`_NOBODY`)."""
        while True:
            front, sub = next(iter(self._subs.items()))
            if sub.full_reason(limit, budget) is not None:
                return front
            oldest = self._oldest(front, sub)
            if oldest is not None:
                break
            if not self._subs:  # every caller of every key left
                return _NOBODY
        if self._clock() - oldest >= self._window():
            return front  # its oldest request has waited its window: it goes first
        for key, other in self._subs.items():
            if other.full_reason(limit, budget) is not None:
                return key
        return front

    def _oldest(self, key: Hashable, sub: Queue[T]) -> float | None:
        """When `key`'s oldest live request arrived (retiring those whose caller left)."""
        live, cost = sub.live, sub.live_cost
        arrived = sub.oldest_enqueued_at()
        self._settle(key, sub, live, cost)
        return arrived

    def _settle(self, key: Hashable, sub: Queue[T], live: int, cost: int) -> None:
        """Follow `sub`'s change since it held `live` requests of `cost`; drop it empty."""
        self.live += sub.live - live
        self.live_cost += sub.live_cost - cost
        if not sub.live:
            self._subs.pop(key, None)
