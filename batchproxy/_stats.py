"""Counters and latency windows; `ProxyStats` is the public snapshot.

Memory is bounded: latencies are kept in fixed-size windows of the most recent
samples (percentiles describe recent behaviour, as an operator wants), and the
batch-size histogram has at most `batch_size` keys.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

__all__ = ["CostEstimate", "Health", "Percentiles", "ProxyStats", "StatsRecorder"]

WINDOW = 4096
"""How many recent samples each latency window keeps."""


@dataclass(frozen=True)
class CostEstimate:
    """The fitted line: a batch of `units` takes about `fixed + per_unit * units` s."""

    fixed: float
    per_unit: float
    unit: str
    """"item", or "token" (padded tokens: batch size x longest item)."""
    samples: int
    """Batches the fit has seen after warm-up."""

    def predict(self, units: float) -> float:
        return self.fixed + self.per_unit * units


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
    """Calls accepted: queued, joined to an identical call in flight (`deduplicated`)
    or answered from the cache (`cache_hits`)."""
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
    max_in_flight: int = 0
    """How many batches may run at once now: `max_concurrent_batches`, or the
    executor's capacity."""
    deduplicated: int = 0
    """Calls that joined an identical call in flight (`dedup`) instead of taking a
    batch slot of their own."""
    cache_hits: int = 0
    """Calls answered from the result cache (`cache_size`), without the model."""
    padded_rows: int = 0
    """Filler rows the model ran to bring batches up to an allowed size
    (`batch_sizes`); they are not counted in `items` or `batch_sizes`."""
    tenant_rejected: int = 0
    """Calls refused with `QueueFull` by `max_queue_size_per_tenant` (also in `rejected`)."""
    disconnected: int = 0
    """Calls cancelled because their HTTP client disconnected (also in `cancelled`): the
    FastAPI and aiohttp helpers cancel a request's calls when its connection is lost."""
    queued_by_tenant: Mapping[Hashable, int] = field(default_factory=lambda: MappingProxyType({}))
    """Requests waiting per tenant, for the tenants with any (empty until a call names
    a tenant; then calls without one are tenant None's)."""

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
        self.deduplicated = 0
        self.cache_hits = 0
        self.padded_rows = 0
        self.tenant_rejected = 0
        self.disconnected = 0
        self.real_elements = 0
        self.padded_elements = 0
        self.tracks_padding = False

    def record_padding(self, real: int, padded: int) -> None:
        """One batch: `real` elements of data in a padded batch of `padded` elements."""
        self.tracks_padding = True
        self.real_elements += real
        self.padded_elements += padded

    def snapshot(
        self,
        queue_depth: int,
        in_flight: int,
        batch_cap: int,
        cost_model: CostEstimate | None,
        max_in_flight: int,
        queued_by_tenant: Mapping[Hashable, int] | None = None,
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
            max_in_flight=max_in_flight,
            deduplicated=self.deduplicated,
            cache_hits=self.cache_hits,
            padded_rows=self.padded_rows,
            tenant_rejected=self.tenant_rejected,
            disconnected=self.disconnected,
            queued_by_tenant=MappingProxyType(dict(queued_by_tenant or {})),
        )

    def _padding_waste(self) -> float | None:
        if not self.tracks_padding:
            return None
        padded = self.padded_elements
        return (padded - self.real_elements) / padded if padded else 0.0
