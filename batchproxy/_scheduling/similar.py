"""`pick_similar`: a length-aware batch, from any queue: up to `limit` requests of
similar cost among the first in its pop order, so a padded batch wastes little."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol, TypeVar

from .request import Request, lane

__all__ = ["pick_similar"]

T = TypeVar("T")


class _Readable(Protocol[T]):
    """What `pick_similar` uses of a queue (every `queue.Queue` has it)."""

    def in_pop_order(self, now: float) -> Iterator[Request[T]]: ...

    def take(self, requests: list[Request[T]]) -> None: ...


def pick_similar(
    queue: _Readable[T],
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
    to the first (higher priority first, small calls before bulk ones), or, with
    `group=False`, the rest in pop order. With a `budget`, the padded size
    (members x largest cost) stays within it. Whoever is among the `limit` first
    in pop order (the batch a plain pop would send) and left out is passed over
    once more, so nobody waits more than `max_passes` batches longer than in that
    order.
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
        rest = sorted(rest, key=lambda r: (-lane(r), abs(r.cost - anchor.cost)))
    for request in rest:
        if request not in batch:
            admit(request)
    queue.take(batch)
    for request in candidates[:limit]:
        if request.queued:
            request.passed_over += 1
    return batch
