"""Identical calls computed once (`dedup=`), with a bounded result cache on top.

With `dedup`, each call has a key: the pair of its batch `key` (None without
one) and `dedup(item)`, or with `dedup=True` the item typed: `(type(item),
item)`, as `functools.lru_cache(typed=True)` keys its arguments, so that `1`,
`1.0` and `True` (equal, and equally hashed) are three calls, which a model may
well answer differently (`repr`, a type check, a tokenizer). As there, the type
is the item's own, not its contents': `(1,)` and `(1.0,)` are one item. A dedup
function's value is taken as it is (the user's function defines identity).
Always the pair, so
that no call's key can equal another's by accident: with the bare item for a call
without a batch key, `inference(("k", "x"))` would be `inference("x", key="k")`.
Identical items for different batch keys (models, adapters, per-batch arguments)
never share. The first call with a key makes a *slot*: a
`SharedSlot`, queued and batched like any request, whose future nobody awaits
(done: nobody needs the slot any more). Every call with that key, the first
included, is a `Caller` of the slot: a request of its own, never queued, with its
own future, deadline timer and cancellation. While the slot is in flight (queued,
or in a batch that has not answered yet) later calls with its key join it, and
its one result, or its error, reaches each of them.

Invariants, each kept by one method:

- `inflight[key]` is the slot of `key` from its first call until it is settled
  (`settled`, called by `Settlement` with its outcome) or its last caller leaves
  (`leave`); then the next call with that key makes a new slot (or, for a result,
  is answered from the cache while it holds the key).
- A queued slot stands at the best place among its callers: the highest
  priority, a small call's lane before a bulk call's, and within it the earliest
  deadline (`join` moves it up by queueing a
  copy and discarding the original; the queue forgets a discarded request, so a
  request object is never queued twice).
- Its last caller gone, a slot's future is cancelled and it leaves the queue:
  it never reaches the model; if its batch is already running, its result is
  dropped (nobody is counted twice: the slot itself is never a call).
- Only results go in the cache, never an `Exception`, stored when the slot is
  settled: a call answered from it skips the queue and the model.

Everything here runs on the proxy's loop; the table is forgotten when the proxy
moves to another loop (its slots belong to the old one).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, Generic, TypeVar

from ._scheduling.queue import Request

__all__ = ["MISSING", "Caller", "Deduplicator", "ResultCache", "SharedSlot"]

T = TypeVar("T")

MISSING: Any = object()
"""What `Deduplicator.cached` returns when nothing is cached for a key."""
_PRUNE_SLACK = 16  # callers that left, kept in a slot's list before it is pruned


class SharedSlot(Request[T]):
    """The request that runs once for every call with its key."""

    __slots__ = ("callers", "dedup_key", "waiting")

    callers: list[Caller[T]]  # every caller still waiting, and some that left (pruned)
    dedup_key: Hashable
    waiting: int  # callers that have not left


class Caller(Request[T]):
    """One call answered by a `SharedSlot` (its `slot`); never queued itself."""

    __slots__ = ("slot",)

    slot: SharedSlot[T]


class ResultCache:
    """The most recent `size` results by key, each for `ttl` seconds (None: no expiry)."""

    __slots__ = ("_entries", "size", "ttl")

    def __init__(self, size: int, ttl: float | None) -> None:
        self.size = size
        self.ttl = ttl
        self._entries: OrderedDict[Hashable, tuple[float, Any]] = OrderedDict()

    def get(self, key: Hashable, now: float) -> Any:
        """The result stored for `key`, or `MISSING` (never stored, evicted, expired)."""
        entry = self._entries.get(key)
        if entry is None:
            return MISSING
        stored, result = entry
        if self.ttl is not None and now - stored >= self.ttl:
            del self._entries[key]
            return MISSING
        self._entries.move_to_end(key)
        return result

    def put(self, key: Hashable, result: Any, now: float) -> None:
        entries = self._entries
        entries[key] = (now, result)
        entries.move_to_end(key)
        if len(entries) > self.size:
            entries.popitem(last=False)


class Deduplicator(Generic[T]):
    """The slots in flight on the proxy's loop, by key, and the result cache."""

    __slots__ = ("_key_of", "_loop", "cache", "inflight", "name")

    def __init__(
        self, name: str, key_of: Callable[[T], Hashable] | None, cache: ResultCache | None
    ) -> None:
        self.name = name
        self._key_of = key_of  # None: the item itself
        self.cache = cache
        self.inflight: dict[Hashable, SharedSlot[T]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def key(self, item: T, batch_key: Hashable | None) -> tuple[Hashable, Hashable]:
        """A call's key, `(batch_key, the item's key)`: the dedup function's value, or
        the item typed (see the module docstring); or a `TypeError` saying how to give
        one."""
        key = item if self._key_of is None else self._key_of(item)
        try:
            hash(key)
        except TypeError:
            how = (
                "pass dedup=<a function of the item returning a hashable key>"
                if self._key_of is None
                else "the dedup function must return a hashable value"
            )
            raise TypeError(
                f"{self.name}: dedup needs a hashable key, got {type(key).__name__}; {how}"
            ) from None
        if self._key_of is None:
            return (batch_key, (type(key), key))
        return (batch_key, key)

    def cached(self, key: Hashable, now: float) -> Any:
        """The cached result for `key`, or `MISSING`."""
        return MISSING if self.cache is None else self.cache.get(key, now)

    def new_slots(
        self, keys: Iterable[Hashable], loop: asyncio.AbstractEventLoop, now: float
    ) -> int:
        """How many new slots calls with `keys` (on `loop`, at `now`) would make: one per
        key neither cached nor in flight (the others add no work)."""
        new: set[Hashable] = set()
        for key in keys:
            if (
                key not in new
                and self.slot_for(key, loop) is None
                and self.cached(key, now) is MISSING
            ):
                new.add(key)
        return len(new)

    def slot_for(self, key: Hashable, loop: asyncio.AbstractEventLoop) -> SharedSlot[T] | None:
        """The slot in flight for `key` on `loop`, if any."""
        if loop is not self._loop:  # the proxy moved: the old loop's slots are its own
            self.inflight.clear()
            self._loop = loop
        return self.inflight.get(key)

    def open(self, key: Hashable, slot: SharedSlot[T], first: Caller[T]) -> None:
        """`slot` is the new slot of `key`, its first caller `first`."""
        slot.dedup_key = key
        slot.callers = [first]
        slot.waiting = 1
        first.slot = slot
        self.inflight[key] = slot

    def join(self, slot: SharedSlot[T], caller: Caller[T]) -> SharedSlot[T] | None:
        """Add `caller` to `slot`; if it deserves a better place in the queue than the
        slot has, the copy to queue in the slot's stead (the caller then discards the
        original), else None."""
        caller.slot = slot
        slot.callers.append(caller)
        slot.waiting += 1
        if not slot.queued or not _ahead(caller, slot):
            return None
        moved: SharedSlot[T] = SharedSlot(
            slot.item,
            slot.future,
            caller.priority,
            slot.enqueued_at,  # its wait so far still counts (window, aging)
            slot.cost,
            # no later than the slot's at the same priority (a small caller may move a
            # bulk slot up with a later deadline of its own: the earlier one stays)
            caller.deadline
            if caller.priority != slot.priority
            else min(caller.deadline, slot.deadline),
        )
        moved.tenant, moved.key, moved.bulk = slot.tenant, slot.key, caller.bulk
        if hasattr(slot, "context"):
            moved.context = slot.context
        moved.dedup_key, moved.callers, moved.waiting = slot.dedup_key, slot.callers, slot.waiting
        for each in moved.callers:
            each.slot = moved
        self.inflight[slot.dedup_key] = moved
        return moved

    def leave(self, caller: Caller[T]) -> SharedSlot[T] | None:
        """`caller` left before its answer (cancelled, expired, withdrawn: called once
        per caller that left). If it was the last one waiting on a slot still in flight,
        the slot is dropped: returned, its future cancelled, for the caller to take out of
        the queue. Else None."""
        slot = caller.slot
        if slot.future.done():
            return None  # settled already: nothing in flight
        slot.waiting -= 1
        if slot.waiting:
            callers = slot.callers
            if len(callers) > 2 * slot.waiting + _PRUNE_SLACK:  # (amortised: a flood of
                callers[:] = [c for c in callers if not c.future.done()]  # leavers stays O(1))
            return None
        slot.future.cancel()  # (not a call's future: nobody is told, nothing counted)
        self._forget(slot)
        return slot

    def settled(
        self, slot: SharedSlot[T], result: Any, now: float, *, cache: bool = True
    ) -> list[Caller[T]]:
        """`slot` has its outcome (`result`, maybe an exception): it is no longer in
        flight; a result goes in the cache (with `cache`). Its callers, for
        `Settlement` to answer."""
        future = slot.future
        if future.done():  # every caller had left
            return []
        future.set_result(None)  # (not a call's future: it marks the slot settled)
        self._forget(slot)
        if cache and self.cache is not None and not isinstance(result, BaseException):
            self.cache.put(slot.dedup_key, result, now)
        return slot.callers

    def callers_of(
        self, requests: Sequence[Request[T]], results: Sequence[Any] | None, now: float
    ) -> tuple[list[Request[T]], list[Any]]:
        """The calls behind settling `requests` (a slot stands for its callers), each
        with its request's result (None when `results` is None: they fail). Each slot
        among them is settled here (`settled`)."""
        calls: list[Request[T]] = []
        answers: list[Any] = []
        for index, request in enumerate(requests):
            result = None if results is None else results[index]
            if type(request) is SharedSlot:
                for caller in self.settled(request, result, now, cache=results is not None):
                    calls.append(caller)
                    answers.append(result)
            else:
                calls.append(request)
                answers.append(result)
        return calls, answers

    def _forget(self, slot: SharedSlot[T]) -> None:
        if self.inflight.get(slot.dedup_key) is slot:
            del self.inflight[slot.dedup_key]


def _ahead(caller: Request[Any], slot: Request[Any]) -> bool:
    """Whether `caller` would be served before `slot` in its own queue order."""
    if caller.priority != slot.priority:
        return caller.priority > slot.priority
    if caller.bulk != slot.bulk:
        return slot.bulk  # a small call's lane is ahead of a bulk call's
    return caller.deadline < slot.deadline
