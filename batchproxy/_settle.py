"""`Settlement`: the only code that resolves, fails or cancels a caller's future.

The invariant: every accepted request is settled exactly once, here. Each method
settles only futures that are not done yet (a caller may have left, its deadline
fired, the watchdog or a shutdown got there first: whoever comes first settles,
the others find the future done and do nothing), and counts each outcome once in
the proxy's stats and tells the listeners of it through `Events` (whose hooks
cannot raise into the settling).

The outcomes, and who reaches them:

- `deliver`: result i of a batch to caller i (an `Exception` in slot i fails
  caller i alone);
- `fail`: the batch failed as a whole, the proxy refused a queued call as it
  closed, a stream overflowed, the loop ended, the drain's deadline passed;
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
from ._events import Events
from ._scheduling.queue import Request

__all__ = ["Settlement", "caller_error"]


class Settlement:
    """Settles one proxy's requests: their futures; each outcome counted and told once
    (`Events`)."""

    __slots__ = ("dedup", "events", "name")

    def __init__(self, name: str, events: Events) -> None:
        self.name = name
        self.events = events
        # with `dedup`: a shared slot's outcome goes to each of its callers (`_dedup`)
        self.dedup: Deduplicator[Any] | None = None

    def deliver(self, requests: Sequence[Request[Any]], results: Sequence[Any], now: float) -> None:
        """Result i to caller i (as many of each; an `Exception` fails its caller alone)."""
        if self.dedup is not None:  # a shared slot's result goes to each of its callers
            requests, results = self.dedup.callers_of(requests, results, now)
        events = self.events
        tell = events.listeners.on  # (once per batch: each call is told as it is settled,
        latencies: list[float] = []  # and the batch counted in one step)
        errors = 0
        for request, result in zip(requests, results, strict=True):
            future = request.future
            if future.done():
                continue
            if isinstance(result, BaseException):
                future.set_exception(caller_error(self.name, result))
                errors += 1
                if tell:
                    events.finished("error", request)
            else:
                future.set_result(result)
                if tell:
                    events.finished("succeeded", request)
            latencies.append(now - request.enqueued_at)
        events.delivered(len(latencies) - errors, errors, latencies)

    def fail(self, requests: Iterable[Request[Any]], error: BaseException) -> None:
        """Every one of `requests` still waiting gets `error`."""
        if self.dedup is not None:  # a shared slot's callers each get it
            requests, _ = self.dedup.callers_of(list(requests), None, 0.0)
        for request in requests:
            if not request.future.done():
                request.future.set_exception(error)
                self.events.failed(request)

    def expire(self, request: Request[Any], error: DeadlineExceeded) -> bool:
        """The deadline passed: whether that settled the call (False: it had ended)."""
        if request.future.done():
            return False
        request.future.set_exception(error)
        self.events.timed_out(request)
        return True

    def end_streams(self, requests: Iterable[Request[Any]], now: float) -> None:
        """The streams still open among `requests` end, successfully."""
        for request in requests:
            if not request.future.done():
                request.future.set_result(None)
                self.events.stream_ended(request, now)

    def answer_cached(self, request: Request[Any], result: Any) -> None:
        """A call answered from the result cache (`dedup`), without reaching the queue."""
        request.future.set_result(result)
        self.events.answered_from_cache(request)

    def withdraw(self, request: Request[Any]) -> bool:
        """Its caller left: cancel the call if it still waits; whether it did."""
        if request.future.done():
            return False
        request.future.cancel()
        self.count_cancelled(request)
        return True

    def count_cancelled(self, request: Request[Any]) -> None:
        """The call's future was cancelled (its caller left): count it."""
        self.events.cancelled(request)

    def recount_as_cancelled(self, future: asyncio.Future[Any]) -> None:
        """Count a settled call as cancelled instead: its caller was cancelled before it
        could take the outcome. (`request_finished` reported the outcome already.)"""
        error = future.exception()
        if error is None:
            outcome = "succeeded"
        elif isinstance(error, DeadlineExceeded) and error.proxy == self.name:
            outcome = "timed_out"
        else:
            outcome = "error"
        self.events.recounted_as_cancelled(outcome)


def caller_error(proxy: str, error: BaseException) -> Exception:
    """How an error from the model reaches its callers: an `Exception` as it is, but a
    `StopIteration` (a future refuses it) in a `RuntimeError`, as Python does when one
    escapes a coroutine, and any other `BaseException` in `InferenceError`."""
    if isinstance(error, StopIteration):
        wrapped = RuntimeError(f"{proxy}._inference gave a StopIteration as a result: {error!r}")
        wrapped.__cause__ = error
        return wrapped
    return error if isinstance(error, Exception) else InferenceError(proxy, error)
