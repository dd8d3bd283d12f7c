"""The shape of a binding's queue: it follows the tenants and batch keys calls name.

A proxy starts with a plain `RequestQueue`, and pays nothing for tenants or keys
until a call names one. Then, for good (what is queued keeps its place):

- the first call that names a tenant makes the queue share fairly: a `FairQueue`
  whose tenant None holds what was queued;
- the first call with a batch key makes it a `KeyedQueue` whose key None holds
  what was queued;
- with both, the keyed queue is on top (a batch has one key) and each key's
  sub-queue is a fair queue (its batches are shared between the tenants waiting
  in that key): a fair queue that meets its first key becomes key None's, and a
  keyed queue that meets its first tenant has each sub-queue, and each new one,
  wrapped in a fair queue.

This module is the only code that changes the shape, and answers the questions
about tenants whatever the shape (`queued_by`, `by_tenant`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, TypeVar

from .fair_queue import FairQueue, Weight
from .keyed_queue import KeyedQueue
from .queue import Queue, RequestQueue
from .scheduler import Scheduler

__all__ = ["by_tenant", "place", "queued_by"]

T = TypeVar("T")


def place(
    scheduler: Scheduler[Any],
    *,
    tenant: bool,
    key: bool,
    weight: Weight,
    clock: Callable[[], float],
    window: Callable[[], float],
) -> None:
    """A call names a tenant (`tenant`) and/or has a batch key (`key`): make
    `scheduler`'s queue share fairly and/or batch by key, if it does not yet."""
    queue = scheduler.queue
    if key and not isinstance(queue, KeyedQueue):
        fair = isinstance(queue, FairQueue)
        sub: Callable[[float | None], Queue[Any]] = (
            (lambda aging: FairQueue(aging, weight=weight)) if fair else RequestQueue
        )
        queue = scheduler.queue = KeyedQueue.around(queue, clock, window, sub)
        queue.fair = fair
    if not tenant:
        return
    if isinstance(queue, KeyedQueue):
        if not queue.fair:
            queue.nest(lambda sub: _fair(sub, weight))
            queue.fair = True
    elif not isinstance(queue, FairQueue):
        scheduler.queue = FairQueue.around(queue, weight)


def _fair(queue: Queue[T], weight: Weight) -> Queue[T]:
    return queue if isinstance(queue, FairQueue) else FairQueue.around(queue, weight)


def queued_by(queue: Queue[Any], tenant: Hashable | None) -> int:
    """Live requests of `tenant` (before any call named a tenant, all are None's)."""
    if isinstance(queue, FairQueue):
        return queue.queued(tenant)
    if isinstance(queue, KeyedQueue):
        return sum(queued_by(sub, tenant) for sub in queue.subqueues())
    return queue.live if tenant is None else 0


def by_tenant(queue: Queue[Any]) -> dict[Hashable | None, int]:
    """Live requests per tenant with any; empty until a call names a tenant."""
    if isinstance(queue, FairQueue):
        return queue.by_tenant()
    if isinstance(queue, KeyedQueue) and queue.fair:
        totals: dict[Hashable | None, int] = {}
        for sub in queue.subqueues():
            for tenant, count in by_tenant(sub).items():
                totals[tenant] = totals.get(tenant, 0) + count
        return totals
    return {}
