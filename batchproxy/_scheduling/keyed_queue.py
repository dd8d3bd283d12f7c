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

Cost: the rotation is an `OrderedDict` (its front and a move to the back are
O(1)), and three heaps kept between batches answer "which is the first key in
the rotation that fills a batch", "the oldest arrival" and "the earliest
deadline" in O(log n) in the keys waiting, asking only the sub-queues that
changed. Their entries are checked when they reach the top (a key's recorded
value is never above its true one, so a checked top is the true minimum), and
the heaps are rebuilt once stale entries outnumber the keys. A change of the
batch limit asks only the keys whose answer can change: a key is full when as
many requests as the limit wait in it, or their cost reaches the budget
(`queue.full_reason`), so a higher limit makes no key full (one that stops being
full is dropped when it reaches the top of the heap), and a lower one only the
keys with as many waiting as it and fewer than the old one, found by their count
of requests waiting: `_by_band` files each key under the bit length of its count
(a key moves when its count crosses a power of two, not at every request; a key
with one request, the most common, is never filed: a limit of 1 makes every key
full, and asks every key). A tighter token
budget (never, in a proxy: it is fixed at construction) asks every key. When
the last key leaves, the heaps are emptied and a rotation that held 1,024 keys
or more frees the table it grew to: a drained queue keeps no key and no
peak-sized table.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar

from .queue import Composite, Queue, Request, RequestQueue
from .sizes import Cut, cut_limit

__all__ = ["KeyedQueue"]

T = TypeVar("T")

_NOBODY: Hashable = object()  # no key: every queued request turned out to be dead
_COMPACT_MIN_STALE = 64
_SHRINK_MIN_PEAK = 1024  # an emptied rotation that held this many keys frees its table

_Entry = tuple[float, int, Hashable]  # (value, unique, key): a heap entry


class _Key(Generic[T]):
    """One waiting key: its sub-queue, its place in the rotation (`turn`, larger is
    later), and what the heaps hold for it: the turn of its entry among the full keys
    (-1: none), its recorded oldest arrival and earliest deadline (inf: none); and
    `band`, where `_by_band` files it (0: not filed)."""

    __slots__ = ("arrival", "band", "deadline", "full", "sub", "turn")

    def __init__(self, sub: Queue[T], turn: int) -> None:
        self.sub = sub
        self.turn = turn
        self.full = -1
        self.arrival = math.inf
        self.deadline = math.inf
        self.band = 0


class KeyedQueue(Composite[T]):
    """One sub-queue per key, served in rotation; the `Queue` interface."""

    __slots__ = (
        "_arrivals",
        "_by_band",
        "_clock",
        "_deadlines",
        "_full",
        "_limits",
        "_new",
        "_peak",
        "_subs",
        "_unique",
        "_window",
        "fair",
        "live",
        "live_cost",
    )

    def __init__(
        self,
        clock: Callable[[], float],
        window: Callable[[], float],
        aging: float | None = None,
        new: Callable[[float | None], Queue[T]] = RequestQueue,
    ) -> None:
        # the rotation is this dict's order: front first; a served key moves to the end
        self._subs: OrderedDict[Hashable, _Key[T]] = OrderedDict()
        self._clock = clock  # the loop's time
        self._window = window  # seconds a key's oldest request may be overtaken by full batches
        self._aging = aging
        self._new = new  # a sub-queue, given the aging
        self._unique = itertools.count()  # turns and tie-breaks: keys are never compared
        self._full: list[tuple[int, Hashable]] = []  # (turn, key) of the keys that fill one
        self._limits: tuple[int, int | None] | None = None  # what `_full` is full for
        # the waiting keys by the bit length of their count of live requests (2 and up):
        # where to look for those a lower limit makes full
        self._by_band: dict[int, set[Hashable]] = {}
        self._arrivals: list[_Entry] = []  # (oldest arrival, unique, key)
        self._deadlines: list[_Entry] = []  # (earliest deadline, unique, key)
        self._peak = 0  # the most keys waiting at once since the rotation last emptied
        self.fair = False  # its sub-queues are `FairQueue`s (`_scheduling.placement`)
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
            record = keyed._subs[None] = _Key(queue, next(keyed._unique))
            keyed._file(None, record)
            keyed._note(None, record, queue.oldest_enqueued_at(), queue.earliest_deadline())
            keyed.live, keyed.live_cost = queue.live, queue.live_cost
        return keyed

    def waiting_per_key(self) -> dict[Hashable, int]:
        """Requests waiting, per key, in rotation order."""
        return {key: record.sub.live for key, record in self._subs.items()}

    # -- the Queue interface ---------------------------------------------------------

    def push(self, request: Request[T]) -> None:
        key = request.key
        record = self._subs.get(key)
        if record is None:  # its waiting begins: it joins the back of the rotation
            subs = self._subs
            record = subs[key] = _Key(self._new(self._aging), next(self._unique))
            self._peak = max(self._peak, len(subs))
        record.sub.push(request)
        self.live += 1
        self.live_cost += request.cost
        live = record.sub.live
        if (live.bit_length() if live > 1 else 0) != record.band:  # (`_file`'s test, inline)
            self._file(key, record)
        self._note(key, record, request.enqueued_at, request.deadline)
        self._check_full(key, record)

    def discard(self, request: Request[T]) -> bool:
        record = self._subs.get(request.key)
        if record is None:
            return False
        sub = record.sub
        live, cost = sub.live, sub.live_cost
        left = sub.discard(request)
        self._settle(request.key, record, live, cost)
        return left

    def pop_batch(
        self, limit: int, now: float = 0.0, *, cut: Cut | None = None
    ) -> list[Request[T]]:
        return self._pop(limit, None, cut, lambda sub, size: sub.pop_batch(size, now))

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
        return self._pop(
            limit,
            budget,
            cut,
            lambda sub, size: sub.pop_similar(
                size, budget, window, now=now, group=group, max_passes=max_passes
            ),
        )

    def full_reason(self, limit: int, budget: int | None) -> str | None:
        """Why a batch may leave by size alone: one key can fill it."""
        key = self._first_full(limit, budget)
        return None if key is _NOBODY else self._subs[key].sub.full_reason(limit, budget)

    def next_live(self, limit: int, budget: int | None) -> int:
        """A batch takes from one key: the live requests of the key that goes next."""
        if not self.live:
            return 0
        key = self._next_key(limit, budget)
        return 0 if key is _NOBODY else self._subs[key].sub.live

    def count_ahead(self, probe: Request[T]) -> int:
        """Those ahead in every key (taking turns, the other keys' batches come in
        between): an estimate, for `shed_late`."""
        return sum(record.sub.count_ahead(probe) for record in self._subs.values())

    def in_pop_order(self, now: float) -> Iterator[Request[T]]:
        """Each key's requests in its own order, the keys in rotation order (batches
        come from one key: this is the order of the keys' turns, not of one batch)."""
        for record in list(self._subs.values()):
            yield from record.sub.in_pop_order(now)

    def take(self, requests: list[Request[T]]) -> None:
        by_key: dict[Hashable, list[Request[T]]] = {}
        for request in requests:
            by_key.setdefault(request.key, []).append(request)
        for key, group in by_key.items():
            record = self._subs[key]
            sub = record.sub
            live, cost = sub.live, sub.live_cost
            sub.take(group)
            self._settle(key, record, live, cost)

    def nest(self, wrap: Callable[[Queue[T]], Queue[T]]) -> None:
        """Every key's sub-queue, and each new one, wrapped by `wrap` (a `FairQueue`
        around it, once calls name tenants: `_scheduling.placement`)."""
        for record in self._subs.values():
            record.sub = wrap(record.sub)
        new = self._new
        self._new = lambda aging: wrap(new(aging))

    def subqueues(self) -> list[Queue[T]]:
        """The keys' sub-queues, in rotation order."""
        return [record.sub for record in self._subs.values()]

    def peek(self, now: float = 0.0) -> Request[T] | None:
        for record in self._subs.values():
            request = record.sub.peek(now)
            if request is not None:
                return request
        return None

    def earliest_deadline(self) -> float:
        heap, subs = self._deadlines, self._subs
        while heap:
            deadline, _, key = heap[0]
            record = subs.get(key)
            if record is None or record.deadline != deadline:
                heapq.heappop(heap)  # stale
                continue
            actual = record.sub.earliest_deadline()
            if actual == deadline:
                return deadline
            record.deadline = actual  # its earliest left: the entry follows
            if actual == math.inf:
                heapq.heappop(heap)
            else:
                heapq.heapreplace(heap, (actual, next(self._unique), key))
        return math.inf

    def oldest_enqueued_at(self) -> float | None:
        heap, subs = self._arrivals, self._subs
        while heap:
            arrival, _, key = heap[0]
            record = subs.get(key)
            if record is None or record.arrival != arrival:
                heapq.heappop(heap)  # stale
                continue
            actual = self._oldest(key, record)
            if actual == arrival:
                return arrival
            if actual is None:  # every caller of that key left: it was dropped, and its
                continue  # entry is stale (or gone: dropping it may have rebuilt the heap)
            record.arrival = actual  # its oldest left: the entry follows
            heapq.heapreplace(heap, (actual, next(self._unique), key))
        return None

    def drain(self) -> list[Request[T]]:
        drained = [request for record in self._subs.values() for request in record.sub.drain()]
        self._subs = OrderedDict()
        self._by_band.clear()
        self._peak = 0
        self._full.clear()
        self._arrivals.clear()
        self._deadlines.clear()
        self.live = self.live_cost = 0
        return drained

    # -- internals ----------------------------------------------------------------------

    def _pop(
        self,
        limit: int,
        budget: int | None,
        cut: Cut | None,
        take: Callable[[Queue[T], int], list[Request[T]]],
    ) -> list[Request[T]]:
        """`take` a batch (of a size) from the key that goes next for `limit` and
        `budget`; it goes to the back of the rotation. With `cut`, the size is the one
        allowed for that key's own requests: the key chosen is the key sized for."""
        while self.live:
            key = self._next_key(limit, budget)
            if key is _NOBODY:
                break
            record = self._subs[key]
            sub = record.sub
            live, cost = sub.live, sub.live_cost
            batch = take(sub, cut_limit(limit, live, cut))
            if key in self._subs:
                self._subs.move_to_end(key)
                record.turn = next(self._unique)
            self._settle(key, record, live, cost)
            if batch:
                return batch
            self._oldest(key, record)  # its callers all left: retire them
        return []  # every queued request turned out to be dead

    def _next_key(self, limit: int, budget: int | None) -> Hashable:
        """The key whose batch goes next (see the module docstring); None: every queued
        request turned out to be dead (`_NOBODY`)."""
        while True:
            if not self._subs:  # every caller of every key left
                return _NOBODY
            front, record = next(iter(self._subs.items()))
            if record.sub.full_reason(limit, budget) is not None:
                return front
            oldest = self._oldest(front, record)
            if oldest is not None:
                break
        if self._clock() - oldest >= self._window():
            return front  # its oldest request has waited its window: it goes first
        full = self._first_full(limit, budget)
        return front if full is _NOBODY else full

    def _first_full(self, limit: int, budget: int | None) -> Hashable:
        """The first key in the rotation that fills a batch of `limit` (or `budget`);
        `_NOBODY`: none does."""
        if self._limits != (limit, budget):
            self._relimit(limit, budget)
        heap, subs = self._full, self._subs
        while heap:
            turn, key = heap[0]
            record = subs.get(key)
            if record is not None and record.full == turn == record.turn:
                if record.sub.full_reason(limit, budget) is not None:
                    return key
                record.full = -1  # no longer full: asked again when it changes
            heapq.heappop(heap)
        return _NOBODY

    def _relimit(self, limit: int, budget: int | None) -> None:
        """The full keys are wanted for other limits: ask the keys that may have become
        full (see the module docstring). Those that stopped being full stay in the heap
        until they reach its top, where `_first_full` checks them."""
        old, self._limits = self._limits, (limit, budget)
        if (
            old is None
            or (budget is not None and (old[1] is None or budget < old[1]))
            or (limit < 2 <= old[0])  # every key fills a batch of 1: each must be asked
        ):
            asked = list(self._subs.items())  # the first limits, or a tighter budget
        elif limit < old[0]:  # those with limit to old limit - 1 waiting (limit >= 2)
            by_band, subs, top = self._by_band, self._subs, old[0]
            bands = range(limit.bit_length(), (top - 1).bit_length() + 1)
            filed = [(key, subs[key]) for band in bands for key in by_band.get(band, ())]
            asked = [(key, record) for key, record in filed if limit <= record.sub.live < top]
        else:
            return  # no key became full
        for key, record in asked:
            self._check_full(key, record)

    def _file(self, key: Hashable, record: _Key[T]) -> None:
        """After `record`'s count of live requests changed band: file it in `_by_band`
        under the bit length of its count (under none below 2, or with no request)."""
        live, filed = record.sub.live, record.band
        band = live.bit_length() if live > 1 else 0
        if band == filed:
            return
        by_band = self._by_band
        if filed:
            left = by_band[filed]
            left.discard(key)
            if not left:
                del by_band[filed]
        if band:
            joined = by_band.get(band)
            if joined is None:
                by_band[band] = {key}
            else:
                joined.add(key)
        record.band = band

    def _check_full(self, key: Hashable, record: _Key[T]) -> None:
        """After `record` changed: among the full keys if it fills a batch now."""
        limits = self._limits
        if (
            limits is not None
            and record.full != record.turn
            and record.sub.full_reason(*limits) is not None
        ):
            record.full = record.turn
            heapq.heappush(self._full, (record.turn, key))

    def _note(self, key: Hashable, record: _Key[T], arrival: float | None, deadline: float) -> None:
        """An earlier arrival or deadline of `key` than the heaps hold for it."""
        if arrival is not None and arrival < record.arrival:
            record.arrival = arrival
            heapq.heappush(self._arrivals, (arrival, next(self._unique), key))
        if deadline < record.deadline:
            record.deadline = deadline
            heapq.heappush(self._deadlines, (deadline, next(self._unique), key))

    def _oldest(self, key: Hashable, record: _Key[T]) -> float | None:
        """When `key`'s oldest live request arrived (retiring those whose caller left)."""
        sub = record.sub
        live, cost = sub.live, sub.live_cost
        arrived = sub.oldest_enqueued_at()
        self._settle(key, record, live, cost)
        return arrived

    def _settle(self, key: Hashable, record: _Key[T], live: int, cost: int) -> None:
        """Follow `record`'s change since it held `live` requests of `cost`; drop it empty."""
        sub = record.sub
        self.live += sub.live - live
        self.live_cost += sub.live_cost - cost
        live = sub.live
        if (live.bit_length() if live > 1 else 0) != record.band:  # (`_file`'s test, inline)
            self._file(key, record)
        if not sub.live:
            subs = self._subs
            if subs.get(key) is record:
                del subs[key]
            if subs:
                self._compact()
            else:
                self._emptied()
        else:
            self._check_full(key, record)

    def _emptied(self) -> None:
        """No key waits: every heap entry is stale (each holds its key), and a rotation
        that held many keys keeps the table it grew to (a dict does not shrink when its
        keys are deleted): both go. Cleared in place: callers hold the heaps."""
        self._full.clear()
        self._arrivals.clear()
        self._deadlines.clear()
        self._by_band.clear()  # (empty already: each key left its band as it left)
        if self._peak >= _SHRINK_MIN_PEAK:
            self._subs.clear()  # an empty dict's clear() frees its table
        self._peak = 0

    def _compact(self) -> None:
        """Rebuild the heaps from the keys waiting once stale entries outnumber them."""
        subs = self._subs
        most = 2 * len(subs) + _COMPACT_MIN_STALE
        if len(self._full) > most:
            self._full[:] = [(r.turn, k) for k, r in subs.items() if r.full == r.turn]
            heapq.heapify(self._full)
        if len(self._arrivals) > most:
            self._arrivals[:] = [
                (r.arrival, next(self._unique), k) for k, r in subs.items() if r.arrival < math.inf
            ]
            heapq.heapify(self._arrivals)
        if len(self._deadlines) > most:
            self._deadlines[:] = [
                (r.deadline, next(self._unique), k)
                for k, r in subs.items()
                if r.deadline < math.inf
            ]
            heapq.heapify(self._deadlines)
