"""`Request`: one call as the scheduler sees it, from intake to its batch (or its leaving
the queue): its item and future, and where it stands (priority, bulk or small call,
deadline, cost, tenant, batch key). The queues (`queue`, `fair_queue`, `keyed_queue`) hold them."""

from __future__ import annotations

import asyncio
import contextvars
import math
from collections.abc import Hashable
from typing import Any, Generic, TypeVar

__all__ = ["NO_DEADLINE", "Request", "lane"]

T = TypeVar("T")

NO_DEADLINE = math.inf
"""A request's deadline when it has none."""


class Request(Generic[T]):
    """One call's item, its future, and where it stands. `context`, a copy of the
    caller's `contextvars` context, is set (by intake) only with `caller_context`."""

    __slots__ = (
        "bulk",
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
        deadline: float = NO_DEADLINE,
    ) -> None:
        self.item = item
        self.future = future
        self.priority = priority
        self.bulk = False  # part of a bulk call (`Scheduler.is_bulk`): set by intake
        self.enqueued_at = enqueued_at
        self.cost = cost
        self.deadline = deadline  # loop time; inf: none
        self.seq = 0  # arrival order, set by the queue
        self.queued = True
        self.passed_over = 0  # times left out of a batch while among the oldest
        self.deadline_timer: asyncio.TimerHandle | None = None
        self.tenant: Hashable | None = None  # whose call (fair sharing); set by intake
        self.key: Hashable | None = None  # batched only with its own key; set by intake


def lane(request: Request[Any]) -> int:
    """The queue level `request` waits in: its priority's small-call lane (2 x priority),
    or just below it, that priority's bulk lane (2 x priority - 1). So levels sort by
    priority first, and within a priority small calls rank above bulk ones."""
    return 2 * request.priority - request.bulk
