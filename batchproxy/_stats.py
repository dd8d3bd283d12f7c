"""Counters, latency windows and listener hooks; `ProxyStats` is the public snapshot.

Memory is bounded: latencies are kept in fixed-size windows of the most recent
samples (percentiles describe recent behaviour, as an operator wants), and the
batch-size histogram has at most `batch_size` keys.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from ._cost_model import CostEstimate

__all__ = ["Health", "Listener", "Percentiles", "ProxyStats", "StatsRecorder"]

logger = logging.getLogger("batchproxy")

WINDOW = 4096
"""How many recent samples each latency window keeps."""


@dataclass(frozen=True)
class Percentiles:
    """Latency percentiles in seconds over the most recent `count` samples (0.0 when empty)."""

    count: int
    p50: float
    p90: float
    p99: float
    max: float

    @classmethod
    def of(cls, samples: Sequence[float]) -> Percentiles:
        if not samples:
            return cls(0, 0.0, 0.0, 0.0, 0.0)
        ordered = sorted(samples)
        return cls(
            len(ordered),
            nearest_rank(ordered, 0.50),
            nearest_rank(ordered, 0.90),
            nearest_rank(ordered, 0.99),
            ordered[-1],
        )


def nearest_rank(ordered: Sequence[float], quantile: float) -> float:
    """The nearest-rank `quantile` (in [0, 1]) of sorted, non-empty `ordered`."""
    rank = min(len(ordered) - 1, max(0, math.ceil(quantile * len(ordered)) - 1))
    return ordered[rank]


@dataclass(frozen=True)
class ProxyStats:
    """An immutable snapshot of a proxy's counters and recent latencies.

    Every accepted request ends as exactly one of `succeeded`, `errors`,
    `timed_out` or `cancelled`, or is still `queued` or in a running batch.
    `rejected` counts calls refused with `QueueFull`, `shed` those refused at once
    with `DeadlineExceeded` because they could not finish in time (`shed_late`);
    neither was accepted.
    """

    name: str
    requests: int
    """Calls accepted into the queue."""
    succeeded: int
    errors: int
    """Requests that ended with an error from the model (raised, returned, or a wrong count)."""
    timed_out: int
    cancelled: int
    rejected: int
    batches: int
    """Batches sent to the model."""
    failed_batches: int
    """Batches whose `_inference` raised or returned the wrong number of results."""
    items: int
    """Items sent to the model, summed over batches."""
    queue_depth: int
    in_flight: int
    """Batches running right now."""
    batch_sizes: Mapping[int, int]
    """Histogram: batch size -> number of batches of that size."""
    queue_wait: Percentiles
    model_time: Percentiles
    total_latency: Percentiles
    oom_splits: int = 0
    """Batches that ran out of memory and were retried in halves."""
    batch_cap: int = 0
    """The largest batch the proxy forms now: `batch_size`, or less after running
    out of memory."""
    cost_model: CostEstimate | None = None
    """The fitted model time per batch, `fixed + per_unit x units` (units: items, or
    padded tokens with a `length`); None until a few batches have run."""
    shed: int = 0
    """Calls refused at once because their deadline could not be met (`shed_late`)."""
    padding_waste: float | None = None
    """Padded elements / total elements over all batches, by the proxy's `length`
    (None without one): 0.0 when every batch held items of one length."""
    isolation_splits: int = 0
    """Batches or pieces of them that raised and were re-run in halves
    (`isolate_errors`); each cost two more model calls."""
    timed_out_batches: int = 0
    """Batches the watchdog stopped after `batch_timeout`."""

    @property
    def mean_batch_size(self) -> float:
        return self.items / self.batches if self.batches else 0.0


@dataclass(frozen=True)
class Health:
    """`proxy.health`: whether the model answers in time (see `batch_timeout`)."""

    healthy: bool
    reason: str | None
    """Why not: which batch overran, and the limit."""
    since: float | None
    """When it became unhealthy (`time.time()`), or None."""

    def __bool__(self) -> bool:
        return self.healthy


class Listener:
    """Base class for hooks into a proxy's life; override the methods you need.

    Hooks run on the proxy's event loop and must be quick. What a hook raises is
    logged (logger ``batchproxy``) and otherwise ignored, `CancelledError` and
    `GeneratorExit` included: it never reaches a caller, changes an outcome or
    stops the proxy. A `KeyboardInterrupt` or `SystemExit` still stops the event
    loop, from a callback of its own once the calls being settled have their
    outcomes. Register with `proxy.add_listener(listener)`.
    """

    def request_queued(self, proxy: str, queue_depth: int) -> None:
        """A call was accepted; `queue_depth` includes it."""

    def request_rejected(self, proxy: str, count: int) -> None:
        """`count` requests were refused with `QueueFull` (never accepted)."""

    def request_shed(self, proxy: str) -> None:
        """A call was refused at once: it was predicted to miss its deadline."""

    def batch_started(self, proxy: str, size: int, queue_waits: Sequence[float]) -> None:
        """A batch of `size` items goes to the model; seconds each waited in the queue."""

    def batch_finished(
        self, proxy: str, size: int, model_seconds: float, error: BaseException | None
    ) -> None:
        """The model returned (or raised `error`) after `model_seconds`."""

    def request_finished(self, proxy: str, outcome: str, seconds: float) -> None:
        """A call ended: `outcome` is succeeded, error, timed_out or cancelled.

        Called once per call, when the proxy settles it. A caller cancelled in the
        instant after that, before it resumed, sees `CancelledError`: `stats` then
        counts the call as cancelled, but this hook is not called again.
        """

    def error(self, proxy: str, error: BaseException, size: int) -> None:
        """A batch of `size` failed as a whole with `error`."""


class StatsRecorder:
    """The mutable side, owned by one proxy and touched only on its event loop."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.requests = 0
        self.succeeded = 0
        self.errors = 0
        self.timed_out = 0
        self.cancelled = 0
        self.rejected = 0
        self.shed = 0
        self.batches = 0
        self.failed_batches = 0
        self.items = 0
        self.batch_sizes: dict[int, int] = {}
        self.queue_wait: deque[float] = deque(maxlen=WINDOW)
        self.model_time: deque[float] = deque(maxlen=WINDOW)
        self.total_latency: deque[float] = deque(maxlen=WINDOW)
        self.oom_splits = 0
        self.isolation_splits = 0
        self.timed_out_batches = 0
        self.real_elements = 0
        self.padded_elements = 0
        self.tracks_padding = False
        self.listeners: list[Listener] = []

    def record_padding(self, real: int, padded: int) -> None:
        """One batch: `real` elements of data in a padded batch of `padded` elements."""
        self.tracks_padding = True
        self.real_elements += real
        self.padded_elements += padded

    def snapshot(
        self, queue_depth: int, in_flight: int, batch_cap: int, cost_model: CostEstimate | None
    ) -> ProxyStats:
        return ProxyStats(
            name=self.name,
            requests=self.requests,
            succeeded=self.succeeded,
            errors=self.errors,
            timed_out=self.timed_out,
            cancelled=self.cancelled,
            rejected=self.rejected,
            batches=self.batches,
            failed_batches=self.failed_batches,
            items=self.items,
            queue_depth=queue_depth,
            in_flight=in_flight,
            batch_sizes=MappingProxyType(dict(sorted(self.batch_sizes.items()))),
            queue_wait=Percentiles.of(self.queue_wait),
            model_time=Percentiles.of(self.model_time),
            total_latency=Percentiles.of(self.total_latency),
            oom_splits=self.oom_splits,
            batch_cap=batch_cap,
            cost_model=cost_model,
            shed=self.shed,
            padding_waste=self._padding_waste(),
            isolation_splits=self.isolation_splits,
            timed_out_batches=self.timed_out_batches,
        )

    def _padding_waste(self) -> float | None:
        if not self.tracks_padding:
            return None
        padded = self.padded_elements
        return (padded - self.real_elements) / padded if padded else 0.0

    def notify(self, hook: str, *args: object) -> None:
        """Call `hook` on every listener; whatever they raise never reaches the caller.

        Hooks run in the middle of settling calls, so nothing they raise may cut that
        short: an `Exception`, a `CancelledError` or a `GeneratorExit` is logged and
        dropped (none of them is the proxy's own cancellation or closing); a
        `KeyboardInterrupt` or `SystemExit` is logged and raised again from a callback
        of its own on the event loop, once the settling is done.
        """
        for listener in self.listeners:
            try:
                getattr(listener, hook)(self.name, *args)
            except (KeyboardInterrupt, SystemExit) as exc:
                logger.error("batchproxy listener %r raised %r in %s", listener, exc, hook)
                _raise_soon(exc)
            except BaseException:
                logger.exception("batchproxy listener %r failed in %s", listener, hook)


def _raise_soon(exc: BaseException) -> None:
    """Raise `exc` from a callback of its own on the running loop (it leaves the loop,
    as a `KeyboardInterrupt` in any callback does), or at once with no loop running."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        raise exc from None

    def reraise() -> None:
        raise exc

    loop.call_soon(reraise)
