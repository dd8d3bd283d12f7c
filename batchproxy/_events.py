"""`Events`: what happens to a proxy, counted in its stats and told to its listeners
in one step.

Each method is one event: it counts it (`StatsRecorder`) and tells the listeners
(`Listeners`) once. The intake tells of calls queued, refused, shed or joined to an
identical call; the runs of batches started, ended, failed, overrun, split or
padded; the settlement of each call's outcome. A proxy with no listener pays one
attribute test per event (`if listeners.on:`), here.

Invariant: the counters of `stats` are written here only; `stats` is read for
snapshots, and listeners are added and removed by the proxy.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Protocol

from ._client import client_gone
from ._listeners import Listeners
from ._stats import StatsRecorder

__all__ = ["Events"]


class _Call(Protocol):
    """A request, as an event tells of it."""

    future: asyncio.Future[Any]
    enqueued_at: float


class Events:
    """Counts one proxy's events and tells its listeners of each, once."""

    __slots__ = ("listeners", "stats")

    def __init__(self, stats: StatsRecorder, listeners: Listeners) -> None:
        self.stats = stats
        self.listeners = listeners

    # -- calls coming in (the intake) -----------------------------------------------------

    def request_queued(self, queue_depth: int) -> None:
        """A call was accepted; `queue_depth` counts it."""
        self.stats.requests += 1
        if self.listeners.on:
            self.listeners.request_queued(queue_depth)

    def request_joined(self) -> None:
        """An accepted call joined an identical call in flight (`dedup`)."""
        self.stats.deduplicated += 1
        if self.listeners.on:
            self.listeners.request_deduplicated(False)

    def requests_rejected(self, count: int, *, per_tenant: bool = False) -> None:
        """`count` calls were refused with `QueueFull` (`per_tenant`: by their tenant's
        share of the queue)."""
        stats = self.stats
        if per_tenant:
            stats.tenant_rejected += count
        stats.rejected += count
        if self.listeners.on:
            self.listeners.request_rejected(count)

    def request_shed(self) -> None:
        """A call was refused at once: it would miss its deadline (`shed_late`)."""
        self.stats.shed += 1
        if self.listeners.on:
            self.listeners.request_shed()

    # -- batches (the runs) ---------------------------------------------------------------

    def batch_started(self, size: int, queue_waits: Sequence[float]) -> None:
        """A batch (or a step) of `size` goes to the model; `queue_waits`: seconds each of
        its newcomers waited in the queue."""
        stats = self.stats
        stats.batches += 1
        stats.items += size
        stats.batch_sizes[size] = stats.batch_sizes.get(size, 0) + 1
        stats.queue_wait.extend(queue_waits)
        if self.listeners.on:
            self.listeners.batch_started(size, queue_waits)

    def batch_padded(self, real: int, padded: int) -> None:
        """The batch that starts holds `real` elements of data, padded to `padded`."""
        self.stats.record_padding(real, padded)

    def rows_padded(self, rows: int) -> None:
        """A model call was padded with `rows` filler rows up to an allowed size."""
        self.stats.padded_rows += rows

    def batch_finished(self, size: int, seconds: float, error: BaseException | None) -> None:
        """A model call (a batch or a step) of `size` returned, or raised `error`, after
        `seconds`."""
        self.stats.model_time.append(seconds)
        if self.listeners.on:
            self.listeners.batch_finished(size, seconds, error)

    def batch_failed(self, error: BaseException, size: int) -> None:
        """A batch of `size` failed as a whole with `error`."""
        self.stats.failed_batches += 1
        if self.listeners.on:
            self.listeners.error(error, size)

    def batch_timed_out(self, size: int, timeout: float) -> None:
        """A batch of `size` ran past `batch_timeout` (`timeout` s): the watchdog stopped it."""
        self.stats.timed_out_batches += 1
        if self.listeners.on:
            self.listeners.batch_timed_out(size, timeout)

    def batch_split(self, size: int, reason: str) -> None:
        """A model call on `size` items raised and is re-run in pieces: `reason` is "oom"
        (`oom_backoff`) or "isolation" (`isolate_errors`)."""
        if reason == "oom":
            self.stats.oom_splits += 1
        else:
            self.stats.isolation_splits += 1
        if self.listeners.on:
            self.listeners.batch_split(size, reason)

    # -- outcomes (the settlement) --------------------------------------------------------

    def delivered(self, succeeded: int, errors: int, latencies: Sequence[float]) -> None:
        """A batch's results were handed out: `succeeded` calls got theirs, `errors` an
        error of their own; `latencies`: seconds each took. The listeners were told of
        each as it was settled (`finished`): a batch counts in one step, not per call."""
        stats = self.stats
        stats.succeeded += succeeded
        stats.errors += errors
        stats.total_latency.extend(latencies)

    def failed(self, call: _Call) -> None:
        """A call got an error that is not its own result (its batch's, a refusal)."""
        self.stats.errors += 1
        if self.listeners.on:
            self.finished("error", call)

    def timed_out(self, call: _Call) -> None:
        """A call's deadline passed before its answer."""
        self.stats.timed_out += 1
        if self.listeners.on:
            self.finished("timed_out", call)

    def stream_ended(self, call: _Call, now: float) -> None:
        """A stream ended well."""
        stats = self.stats
        stats.succeeded += 1
        stats.total_latency.append(now - call.enqueued_at)
        if self.listeners.on:
            self.finished("succeeded", call)

    def answered_from_cache(self, call: _Call) -> None:
        """A call was answered from the result cache (`dedup`), at once."""
        stats = self.stats
        stats.cache_hits += 1
        stats.succeeded += 1
        stats.total_latency.append(0.0)
        if self.listeners.on:
            self.listeners.request_deduplicated(True)
            self.finished("succeeded", call)

    def cancelled(self, call: _Call) -> None:
        """A call's caller left before its answer; `disconnected` too when it left because
        its HTTP client disconnected (`_client`: read here, on cancellation only)."""
        stats = self.stats
        stats.cancelled += 1
        gone = client_gone()
        if gone:
            stats.disconnected += 1
        if self.listeners.on:
            if gone:
                self.listeners.request_disconnected()
            self.finished("cancelled", call)

    def recounted_as_cancelled(self, outcome: str) -> None:
        """A call counted with `outcome` ("succeeded", "timed_out" or "error") counts as
        cancelled instead: its caller was cancelled before it took the outcome. The
        listeners heard of the outcome, and hear nothing more."""
        stats = self.stats
        if outcome == "succeeded":
            stats.succeeded -= 1
        elif outcome == "timed_out":
            stats.timed_out -= 1
        else:
            stats.errors -= 1
        stats.cancelled += 1
        if client_gone():
            stats.disconnected += 1

    def finished(self, outcome: str, call: _Call) -> None:
        """Tell the listeners a call ended with `outcome` (counted by the caller of this:
        `delivered`, or the methods above). Only when `listeners.on`."""
        seconds = call.future.get_loop().time() - call.enqueued_at
        self.listeners.request_finished(outcome, seconds)
