"""Intake: how a call becomes a queued request, and how one leaves the queue early.

`admit` checks a call (its own model calling the proxy, priority, timeout, cost,
room in the queue, a deadline it cannot meet with `shed_late`), makes its
request (an item of an `inference_many` the scheduler calls bulk is marked so:
the queue ranks it) (a future, the arrival time, a deadline timer if it has a deadline) and
hands it to the scheduler. A request leaves before dispatch when its deadline
passes (`expire`) or its caller leaves (`abandon`, `withdraw`); settling it is
`Settlement`'s, taking it out of the queue is the queue's, and timers are
cancelled here. With `dedup`, a call is answered from the cache or becomes a
caller of the shared slot of its key (`_admit_shared`; the slot, not the caller,
is queued, and leaves the queue with its last caller: `_dedup`). A call pays
only for what it uses: no timer without a deadline, no cost without a `length`,
no listener call without listeners.
"""

from __future__ import annotations

import asyncio
import contextvars
import math
from collections.abc import Callable, Hashable, Iterable
from typing import Any, Generic, TypeVar

from . import _validate
from ._arguments import Arguments, ArgumentsKey, refuse_key
from ._dedup import MISSING, Caller, Deduplicator, ResultCache, SharedSlot
from ._errors import DeadlineExceeded, QueueFull
from ._lifecycle import Lifecycle
from ._loops.binding import Binding
from ._options import Options
from ._runs.batches import current_batch
from ._runs.streams import StreamRequest
from ._scheduling.placement import place, queued_by
from ._scheduling.queue import Request
from ._settle import Settlement

__all__ = ["Intake"]

In = TypeVar("In")


class Intake(Generic[In]):
    """Admits one proxy's calls into the queue of its current binding."""

    def __init__(
        self,
        *,
        name: str,
        options: Options,
        lifecycle: Lifecycle,
        settlement: Settlement,
        cost: Callable[[In], int],
        streams: bool,
        keys: bool = True,
        arguments: Arguments | None = None,
    ) -> None:
        self.name = name
        # the proxy's options now: held here alone (the runner reads them here, and the
        # proxy); written by `Proxy.configure` only, checked whole before it writes them
        self.options = options
        self._lifecycle = lifecycle
        self._settlement = settlement
        self._events = settlement.events  # counts, and tells the listeners
        self._streams = streams
        # an item's cost, by `length` (by default tensors.length with max_batch_tokens);
        # without one, every request costs 1 and nothing is measured
        self._default_length = options.length is None and options.max_batch_tokens is not None
        self._length = options.length
        if self._default_length:
            from .tensors import length as sequence_length

            self._length = sequence_length
        self.measures = self._length is not None
        self._cost = cost if self.measures else None  # the proxy's hook, or none
        self._dedup: Deduplicator[In] | None = None
        dedup = options.dedup
        if dedup is not None:
            if streams:
                raise TypeError(f"{name}: dedup does not apply to a proxy that streams")
            cache = (
                None if dedup.cache_size is None else ResultCache(dedup.cache_size, dedup.cache_ttl)
            )
            self._dedup = settlement.dedup = Deduplicator(name, dedup.key, cache)
        self._key_of = options.key  # an item's batch key (`_runs.keys`), or None
        # the model takes per-batch arguments: they are each call's batch key
        self._arguments = arguments
        self._default_arguments: ArgumentsKey | TypeError | None = None
        if arguments is not None:
            try:
                self._default_arguments = arguments.key((), {})
            except TypeError as exc:  # it has required ones: every call must give them
                self._default_arguments = exc
        self._keys = keys  # False: its run kind cannot batch by key (a generation engine)

    def admit(
        self,
        binding: Binding[In],
        item: In,
        timeout: object,
        priority: object,
        tenant: object = None,
        key: object = None,
        *,
        stream: bool = False,
        identity: tuple[Hashable, Hashable] | None = None,
        cost: int | None = None,
        bulk: bool = False,
    ) -> Request[In]:
        """Queue one call on `binding` (its loop is running this): its request.
        `identity`: with `dedup`, the call's key (`Deduplicator.key`: its batch key
        first), and `cost` its item's, when `admit_many` has made them already;
        `bulk`: an item of a bulk call (`Scheduler.is_bulk`)."""
        if stream is not self._streams:
            raise TypeError(
                f"{self.name} streams its results (its _inference is a generator): "
                f"use `async for chunk in proxy.stream(item)`"
            )
        if current_batch.get() is not None:  # (this test only: every call passes here)
            self.refuse_own_model(binding, "stream" if stream else "inference")
        if type(priority) is not int:
            priority = _validate.priority(priority)
        options = self.options
        seconds = options.timeout if timeout is None else _validate.timeout("timeout", timeout)
        key = self._batch_key(item, key) if identity is None else identity[0]
        if tenant is not None or key is not None:  # before anything is made for the call
            self._place(binding, tenant, key)
        if self._dedup is not None:
            return self._admit_shared(
                binding, item, seconds, priority, tenant, key, identity, cost, bulk
            )
        if cost is None:
            cost = 1 if self._cost is None else self._cost(item)
        loop, scheduler = binding.loop, binding.scheduler
        if (
            not self._lifecycle.open  # (`check_room`, inline: every call passes here)
            or (
                options.max_queue_size is not None
                and scheduler.queue.live >= options.max_queue_size
            )
            or options.max_queue_size_per_tenant is not None
        ):
            self.check_room(binding, 1, tenant)
        now = binding.clock()
        kind = StreamRequest if stream else Request
        if seconds is None:
            request: Request[In] = kind(item, binding.new_future(), priority, now, cost)
        else:
            request = kind(item, binding.new_future(), priority, now, cost, now + seconds)
        if tenant is not None or key is not None:
            request.tenant, request.key = tenant, key
        if bulk:
            request.bulk = True
        if seconds is not None:
            if options.shed_late:
                self._shed_if_late(binding, request, seconds)
            request.deadline_timer = loop.call_at(
                request.deadline, self.expire, binding, request, seconds
            )
        if options.caller_context:
            request.context = contextvars.copy_context()  # the model may read it, not change it
        scheduler.submit(request)
        self._events.request_queued(scheduler.queue.live)
        return request

    def _batch_key(self, item: In, key: object) -> object:
        """A call's batch key: its arguments (a model that takes them), else its `key=`,
        else the `key` option's for its item, else None."""
        if self._arguments is not None:
            return self._arguments_key(item, key)
        if key is None and self._key_of is not None:  # (a per-call key wins)
            return self._key_of(item)
        return key

    def _admit_shared(
        self,
        binding: Binding[In],
        item: In,
        seconds: float | None,
        priority: int,
        tenant: object,
        key: object,
        identity: tuple[Hashable, Hashable] | None,
        cost: int | None,
        bulk: bool,
    ) -> Request[In]:
        """`admit` with `dedup`: answer the call from the cache, or make it a caller of
        the slot in flight for its key (a new slot, queued like any request, if none)."""
        dedup = self._dedup
        assert dedup is not None
        if not self._lifecycle.open:
            raise self._lifecycle.closed_error()
        shared_key = dedup.key(item, key) if identity is None else identity
        now = binding.clock()
        scheduler = binding.scheduler
        cached = dedup.cached(shared_key, now)
        if cached is not MISSING:
            request: Request[In] = Request(item, binding.new_future(), priority, now)
            self._events.request_queued(scheduler.queue.live)
            self._settlement.answer_cached(request, cached)
            return request
        slot = dedup.slot_for(shared_key, binding.loop)
        joins = slot is not None
        deadline = math.inf if seconds is None else now + seconds
        if slot is None:  # the first call with this key: a new slot, checked like any call
            if cost is None:
                cost = 1 if self._cost is None else self._cost(item)
            self.check_room(binding, 1, tenant)
            slot = SharedSlot(item, binding.new_future(), priority, now, cost, deadline)
            slot.tenant, slot.key, slot.bulk = tenant, key, bulk
            if seconds is not None and self.options.shed_late:
                self._shed_if_late(binding, slot, seconds)
        caller: Caller[In] = Caller(item, binding.new_future(), priority, now, 1, deadline)
        caller.queued = False  # the slot is queued, not the caller
        caller.bulk = bulk  # (a small caller moves a bulk slot up: `Deduplicator.join`)
        if seconds is not None:
            caller.deadline_timer = binding.loop.call_at(
                deadline, self.expire, binding, caller, seconds
            )
        if not joins:
            if self.options.caller_context:
                slot.context = contextvars.copy_context()  # the first caller's
            dedup.open(shared_key, slot, caller)
            scheduler.submit(slot)
        else:  # never refused for room nor shed: it adds no work, and is answered no later
            moved = dedup.join(slot, caller)  # than a slot of its own would be
            if moved is not None:
                scheduler.requeue(slot, moved)
        self._events.request_queued(scheduler.queue.live)
        if joins:
            self._events.request_joined()
        return caller

    async def admit_many(
        self,
        binding: Binding[In],
        items: list[In],
        timeout: object,
        priority: object,
        tenant: object,
        key: object,
        *,
        return_exceptions: bool,
    ) -> list[Any]:
        """`inference_many` on `binding`'s loop: queue each item as its own request (all
        of them or none), wait for their outcomes, in item order. Unless
        `return_exceptions`, the first failure is raised as soon as it happens and the
        remaining items are withdrawn. The list needs room for the requests it adds to
        the queue, as `admit` needs it for one: with `dedup`, only for the new slots
        its items make (an item that joins a slot, or is answered from the cache, adds
        none)."""
        tenant = _validate.hashable("tenant", tenant)
        dedup = self._dedup
        identities: list[tuple[Hashable, Hashable]] | None = None
        wanted = len(items)
        if dedup is not None and self._lifecycle.open:
            identities = []
            for item in items:
                batch_key = _validate.hashable("key", self._batch_key(item, key))
                identities.append(dedup.key(item, batch_key))
            wanted = dedup.new_slots(identities, binding.loop, binding.clock())
        self.check_room(binding, wanted, tenant, calls=len(items))
        bulk = binding.scheduler.is_bulk(len(items))  # the scheduler says what is bulk
        # every item measured before any is queued: one that cannot be refuses the list
        # with none of its items counted as calls accepted (then withdrawn)
        costs = [None if self._cost is None else self._cost(item) for item in items]
        requests: list[Request[In]] = []
        try:
            for index, item in enumerate(items):
                identity = None if identities is None else identities[index]
                requests.append(
                    self.admit(
                        binding,
                        item,
                        timeout,
                        priority,
                        tenant,
                        key,
                        identity=identity,
                        cost=costs[index],
                        bulk=bulk,
                    )
                )
        except BaseException:  # an item refused (its length, shed_late) refuses the list:
            self.withdraw(binding, requests)  # those queued before it never reach the model
            raise
        futures = [request.future for request in requests]
        answered = binding.loop.create_future()
        remaining = len(requests)

        def on_done(future: asyncio.Future[Any]) -> None:
            # runs before the next dispatch decision, so withdrawn items are never sent
            nonlocal remaining
            remaining -= 1
            failed = not future.cancelled() and future.exception() is not None
            if failed and not return_exceptions:
                self.withdraw(binding, requests)
            if (remaining == 0 or (failed and not return_exceptions)) and not answered.done():
                answered.set_result(None)

        for future in futures:
            future.add_done_callback(on_done)
        try:
            await answered
            if not return_exceptions:
                for future in futures:  # the first failure, in item order
                    if future.done() and not future.cancelled() and future.exception():
                        future.result()
            return [f.exception() or f.result() for f in futures]
        finally:
            self.withdraw(binding, requests)
            # an error raised here keeps this frame in its traceback, and these lists
            # keep the futures that keep the error: empty them, or each is a cycle
            requests.clear()
            futures.clear()
            del future

    def measure(self, item: In) -> int:
        """An item's cost, by `length`: an int >= 0, or a clear `TypeError`."""
        assert self._length is not None
        try:
            cost = self._length(item)
        except TypeError as exc:
            if not self._default_length:
                raise
            raise TypeError(
                f"{self.name}: max_batch_tokens measures items with batchproxy.tensors.length, "
                f"which says: {exc}; pass length=... to measure these items"
            ) from exc
        if isinstance(cost, bool) or not isinstance(cost, int) or cost < 0:
            raise TypeError(
                f"{self.name}: length(item) must return an int >= 0, got {cost!r} "
                f"for {type(item).__name__}"
            )
        return cost

    def check_room(
        self, binding: Binding[In], wanted: int, tenant: Hashable = None, *, calls: int = 0
    ) -> None:
        """Refuse calls of `tenant` that would add `wanted` requests to the queue, at once:
        the proxy is closed (`ProxyClosed`), or the queue, or the tenant's share of it,
        has no room for them (`QueueFull`, counted as `calls` calls refused: `wanted`
        unless more are refused together). Nothing added needs no room."""
        if not self._lifecycle.open:
            raise self._lifecycle.closed_error()
        if not wanted:
            return
        refused = max(calls, wanted)
        queue = binding.scheduler.queue
        limit = self.options.max_queue_size
        if limit is not None and queue.live + wanted > limit:
            self._events.requests_rejected(refused)
            raise QueueFull(self.name, limit)
        limit = self.options.max_queue_size_per_tenant
        if limit is not None and queued_by(queue, tenant) + wanted > limit:
            self._events.requests_rejected(refused, per_tenant=True)
            raise QueueFull(self.name, limit, tenant=tenant, per_tenant=True)

    def tenant_weight(self, tenant: Hashable) -> float:
        """A tenant's weight now, by `tenant_weights` (default 1)."""
        weights = self.options.tenant_weights
        return 1.0 if weights is None else weights.get(tenant, 1.0)

    def refuse_own_model(self, binding: Binding[In] | None, method: str) -> None:
        """Refuse a call made by this proxy's own model (in one of its batches, on the
        loop or its worker thread): it could only run after the batch waiting for it."""
        if binding is not None and current_batch.get() in binding.batch_tasks:
            raise RuntimeError(
                f"{self.name}.{method}() was called from inside its own model: the model's "
                f"batch would wait for a call that can only run after that batch, a "
                f"deadlock. Call the model's code directly instead"
            )

    def _place(self, binding: Binding[In], tenant: object, key: object) -> None:
        """A call that names a tenant or has a batch key: both must be hashable; from
        now on the binding's queue shares fairly between tenants, batches by key, or
        both (`_scheduling.placement`)."""
        _validate.hashable("tenant", tenant)
        _validate.hashable("key", key)
        if key is not None and not self._keys:
            raise TypeError(f"{self.name}: a GenerationProxy does not batch by key (key=)")
        place(
            binding.scheduler,
            tenant=tenant is not None,
            key=key is not None,
            weight=self.tenant_weight,
            clock=binding.clock,
            window=self._window,
        )

    def _arguments_key(self, item: In, key: object) -> ArgumentsKey:
        """A call's arguments for a model that takes per-batch arguments: from
        `with_args` (its key), else the defaults; its item checked."""
        assert self._arguments is not None
        self._arguments.check_item(item)
        if key is not None:
            refuse_key(self.name, key)
            return key  # type: ignore[return-value]  # (an ArgumentsKey: refuse_key)
        default = self._default_arguments
        if isinstance(default, TypeError):
            raise TypeError(
                f"{self.name}: {default}; give them with proxy.with_args(...).inference(item)"
            )
        assert default is not None
        return default

    def _window(self) -> float:
        """How long a key's oldest request may be overtaken by other keys' full batches."""
        return self.options.max_delay

    def _shed_if_late(self, binding: Binding[In], request: Request[In], seconds: float) -> None:
        """Refuse a call (not queued yet) at once when even the soonest predicted answer
        misses its deadline."""
        expected = binding.scheduler.expected_finish(request)
        deadline = request.deadline
        if expected is not None and expected > deadline:
            self._events.request_shed()
            raise DeadlineExceeded(self.name, seconds, expected - (deadline - seconds))

    def expire(self, binding: Binding[In], request: Request[In], seconds: float) -> None:
        """Deadline timer: fail the call; a queued request leaves without reaching the model."""
        if self._settlement.expire(request, DeadlineExceeded(self.name, seconds)):
            self._dequeue(binding, request)

    def abandon(self, binding: Binding[In], request: Request[In]) -> None:
        """The caller was cancelled (its future with it): a queued request leaves; the
        call counts as cancelled, once."""
        if not request.future.cancelled():
            return
        self._dequeue(binding, request)
        _cancel_timer(request)
        self._settlement.count_cancelled(request)

    def end_stream(
        self, binding: Binding[In], request: Request[In], *, read_to_the_end: bool
    ) -> None:
        """A stream's consumer is done with it: if it left before the end, its call is
        withdrawn (or, ended unread, counted as cancelled); its deadline timer goes."""
        future = request.future
        if not read_to_the_end and future.done() and not future.cancelled():
            self._settlement.recount_as_cancelled(future)  # it ended unread: the consumer left
        self.withdraw(binding, [request])

    def withdraw(self, binding: Binding[In], requests: Iterable[Request[In]]) -> None:
        """The caller leaves: cancel its calls not answered yet (queued ones leave the
        queue, running ones are dropped from their batch); cancel every deadline timer."""
        for request in requests:
            if self._settlement.withdraw(request):
                self._dequeue(binding, request)
            _cancel_timer(request)

    def _dequeue(self, binding: Binding[In], request: Request[In]) -> None:
        """A call left before its answer: its request leaves the queue if it is still
        there; a caller of a shared slot leaves the slot, which leaves the queue with
        its last caller (`_dedup`)."""
        if type(request) is Caller:
            assert self._dedup is not None
            slot = self._dedup.leave(request)
            if slot is None:
                return
            request = slot
        binding.scheduler.queue.discard(request)


def _cancel_timer(request: Request[Any]) -> None:
    timer = request.deadline_timer
    if timer is not None:
        timer.cancel()
        request.deadline_timer = None
