"""`Settlement`: the only code that resolves, fails or cancels a caller's future.

The invariant: every accepted request is settled exactly once, here. Each method
settles only futures that are not done yet (a caller may have left, its deadline
fired, the watchdog or a shutdown got there first: whoever comes first settles,
the others find the future done and do nothing), counts each outcome once in the
proxy's stats, and tells the listeners (`Listeners`, whose hooks cannot raise
into the settling).

The outcomes, and who reaches them:

- `deliver`: result i of a batch to caller i (an `Exception` in slot i fails
  caller i alone);
- `fail`: the batch failed as a whole, the proxy refused a queued call as it
  closed, a stream overflowed, the loop ended;
- `answer_cached`: a call answered from the result cache (`dedup`);
- `expire`: the call's deadline passed (`DeadlineExceeded`);
- `withdraw`: the caller left (a stream's consumer, `inference_many` after a
  failure): its future is cancelled here;
- `count_cancelled`: the caller's task was cancelled, which cancelled its future
  (asyncio did that; this counts it);
- `recount_as_cancelled`: an outcome was set, but the caller was cancelled
  before it could take it: it saw `CancelledError`, and counts as cancelled.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from typing import Any

from ._dedup import Deduplicator
from ._errors import DeadlineExceeded, InferenceError
from ._listeners import Listeners
from ._scheduling.queue import Request
from ._stats import StatsRecorder

__all__ = ["Settlement", "caller_error"]


class Settlement:
    """Settles one proxy's requests: their futures, its stats and its listeners."""

    __slots__ = ("dedup", "listeners", "name", "stats")

    def __init__(self, name: str, stats: StatsRecorder, listeners: Listeners) -> None:
        self.name = name
        self.stats = stats
        self.listeners = listeners
        # with `dedup`: a shared slot's outcome goes to each of its callers (`_dedup`)
        self.dedup: Deduplicator[Any] | None = None

    def deliver(self, requests: Sequence[Request[Any]], results: Sequence[Any], now: float) -> None:
        """Result i to caller i (as many of each; an `Exception` fails its caller alone)."""
        if self.dedup is not None:  # a shared slot's result goes to each of its callers
            requests, results = self.dedup.callers_of(requests, results, now)
        stats, listeners = self.stats, self.listeners.on
        latency = stats.total_latency
        succeeded = errors = 0
        for request, result in zip(requests, results, strict=True):
            future = request.future
            if future.done():
                continue
            if isinstance(result, BaseException):
                future.set_exception(caller_error(self.name, result))
                errors += 1
                if listeners:
                    self._finished("error", request)
            else:
                future.set_result(result)
                succeeded += 1
                if listeners:
                    self._finished("succeeded", request)
            latency.append(now - request.enqueued_at)
        stats.succeeded += succeeded
        stats.errors += errors

    def fail(self, requests: Iterable[Request[Any]], error: BaseException) -> None:
        """Every one of `requests` still waiting gets `error`."""
        if self.dedup is not None:  # a shared slot's callers each get it
            requests, _ = self.dedup.callers_of(list(requests), None, 0.0)
        for request in requests:
            if not request.future.done():
                request.future.set_exception(error)
                self.stats.errors += 1
                if self.listeners.on:
                    self._finished("error", request)

    def expire(self, request: Request[Any], error: DeadlineExceeded) -> bool:
        """The deadline passed: whether that settled the call (False: it had ended)."""
        if request.future.done():
            return False
        request.future.set_exception(error)
        self.stats.timed_out += 1
        if self.listeners.on:
            self._finished("timed_out", request)
        return True

    def end_streams(self, requests: Iterable[Request[Any]], now: float) -> None:
        """The streams still open among `requests` end, successfully."""
        stats = self.stats
        for request in requests:
            if not request.future.done():
                request.future.set_result(None)
                stats.succeeded += 1
                stats.total_latency.append(now - request.enqueued_at)
                if self.listeners.on:
                    self._finished("succeeded", request)

    def answer_cached(self, request: Request[Any], result: Any) -> None:
        """A call answered from the result cache (`dedup`), without reaching the queue."""
        request.future.set_result(result)
        stats = self.stats
        stats.cache_hits += 1
        stats.succeeded += 1
        stats.total_latency.append(0.0)
        if self.listeners.on:
            self.listeners.request_deduplicated(True)
            self._finished("succeeded", request)

    def withdraw(self, request: Request[Any]) -> bool:
        """Its caller left: cancel the call if it still waits; whether it did."""
        if request.future.done():
            return False
        request.future.cancel()
        self.count_cancelled(request)
        return True

    def count_cancelled(self, request: Request[Any]) -> None:
        """The call's future was cancelled (its caller left): count it."""
        self.stats.cancelled += 1
        if self.listeners.on:
            self._finished("cancelled", request)

    def recount_as_cancelled(self, future: asyncio.Future[Any]) -> None:
        """Count a settled call as cancelled instead: its caller was cancelled before it
        could take the outcome. (`request_finished` reported the outcome already.)"""
        stats = self.stats
        error = future.exception()
        if error is None:
            stats.succeeded -= 1
        elif isinstance(error, DeadlineExceeded) and error.proxy == self.name:
            stats.timed_out -= 1
        else:
            stats.errors -= 1
        stats.cancelled += 1

    def _finished(self, outcome: str, request: Request[Any]) -> None:
        seconds = request.future.get_loop().time() - request.enqueued_at
        self.listeners.request_finished(outcome, seconds)


def caller_error(proxy: str, error: BaseException) -> Exception:
    """How an error from the model reaches its callers: an `Exception` as it is, but a
    `StopIteration` (a future refuses it) in a `RuntimeError`, as Python does when one
    escapes a coroutine, and any other `BaseException` in `InferenceError`."""
    if isinstance(error, StopIteration):
        wrapped = RuntimeError(f"{proxy}._inference gave a StopIteration as a result: {error!r}")
        wrapped.__cause__ = error
        return wrapped
    return error if isinstance(error, Exception) else InferenceError(proxy, error)
