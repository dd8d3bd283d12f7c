"""Prometheus metrics for batchproxy proxies (the ``prometheus`` extra).

```python
from batchproxy.integrations.prometheus import CONTENT_TYPE, PrometheusMetrics, render

metrics = PrometheusMetrics()          # the default registry, namespace "batchproxy"
metrics.instrument(embedder)           # any number of proxies, labelled by proxy name
metrics.instrument_pool(actors)        # a pool of replicas (RayActors): replicas, autoscaling

@app.get("/metrics")                   # FastAPI
async def serve_metrics() -> Response:
    return Response(render(metrics.registry), media_type=CONTENT_TYPE)

async def serve_metrics(request: web.Request) -> web.Response:  # aiohttp
    # headers=, not content_type=: aiohttp refuses a charset in content_type
    return web.Response(body=render(metrics.registry), headers={"Content-Type": CONTENT_TYPE})
```

Serve it from an ``async def`` route, so the gauges read `proxy.stats` on the
event loop that runs the proxies.

Every proxy metric has one label, ``proxy`` (the proxy's `name`); the pool
metrics (`instrument_pool`) have ``pool`` (the pool's `name`) instead, and the
replica gauge ``state`` too. With the default namespace:

| metric | type | what |
|---|---|---|
| `batchproxy_requests_total` | counter | calls accepted into the queue |
| `batchproxy_batches_total` | counter | batches sent to the model |
| `batchproxy_failed_batches_total` | counter | batches that failed as a whole |
| `batchproxy_errors_total` | counter | calls that ended with an error from the model |
| `batchproxy_rejected_total` | counter | calls refused with `QueueFull` |
| `batchproxy_shed_total` | counter | calls refused at once as too late (`shed_late`) |
| `batchproxy_deduplicated_total` | counter | calls that joined an identical call (`dedup`) |
| `batchproxy_cache_hits_total` | counter | calls answered from the result cache (`cache_size`) |
| `batchproxy_timed_out_total` | counter | calls whose deadline passed |
| `batchproxy_cancelled_total` | counter | calls whose caller was cancelled |
| `batchproxy_disconnected_total` | counter | calls cancelled: their HTTP client disconnected |
| `batchproxy_timed_out_batches_total` | counter | batches that overran `batch_timeout` |
| `batchproxy_oom_splits_total` | counter | batches split when out of memory (`oom_backoff`) |
| `batchproxy_isolation_splits_total` | counter | batches split after raising (`isolate_errors`) |
| `batchproxy_queue_wait_seconds` | histogram | per item sent to the model: time queued |
| `batchproxy_model_seconds` | histogram | per batch: time in `_inference` |
| `batchproxy_request_seconds` | histogram | per call, every outcome: queueing to end |
| `batchproxy_batch_size` | histogram | items per batch (buckets 1, 2, 4, ..., 512) |
| `batchproxy_queue_depth` | gauge | requests waiting now |
| `batchproxy_in_flight_batches` | gauge | batches running now |
| `batchproxy_healthy` | gauge | 1; 0 from a `batch_timeout` overrun until a batch returns in time |
| `batchproxy_pool_replicas` | gauge | a pool's replicas by `state`: `target`, `ready`, `pending` |
| `batchproxy_pool_scale_ups_total` | counter | autoscaling decisions that added replicas |
| `batchproxy_pool_scale_downs_total` | counter | autoscaling decisions that removed replicas |

Counters and histograms are fed by `Listener` hooks as things happen; the
gauges read `proxy.stats` and `proxy.health` when scraped. `PrometheusMetrics`
holds proxies only weakly: a proxy that is garbage-collected drops out of the
gauges, while its counters and histograms stay (Prometheus counters never go
backwards). Proxies that share a name share a label: their counts add up and so
do their gauges, except `healthy`, which is 0 if any of them is unhealthy.

The pool series are all read from `pool.stats` when scraped (the scaling
counters from its autoscaler's counts, 0 without one), and pools too are held
weakly: a pool that is garbage-collected drops out of all three. Pools that
share a name add up.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from typing_extensions import override

from .._decorator import Batched
from .._executors.autoscaling import AutoscalerStats
from .._listeners import Listener
from .._proxy import Proxy

__all__ = [
    "BATCH_SIZE_BUCKETS",
    "CONTENT_TYPE",
    "LATENCY_BUCKETS",
    "PrometheusMetrics",
    "ReplicaPool",
    "ReplicaPoolStats",
    "render",
]

LATENCY_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
"""Default buckets (seconds) of the three latency histograms: batching lives in ms."""

BATCH_SIZE_BUCKETS: tuple[float, ...] = tuple(float(2**i) for i in range(10))
"""Buckets of the batch-size histogram: 1, 2, 4, ..., 512."""

CONTENT_TYPE: str = CONTENT_TYPE_LATEST
"""The Content-Type header to send with `render()`'s bytes."""


class ReplicaPoolStats(Protocol):
    """What `instrument_pool` reads from a pool's `stats` at each scrape."""

    @property
    def replicas(self) -> int:
        """The replica count asked for (the target)."""
        ...

    @property
    def ready(self) -> int:
        """Replicas that have started and take batches."""
        ...

    @property
    def pending(self) -> int:
        """Replicas still starting."""
        ...

    @property
    def autoscaler(self) -> AutoscalerStats | None:
        """The autoscaler's counts, or None for a pool without autoscaling."""
        ...


class ReplicaPool(Protocol):
    """A pool of replicas `instrument_pool` takes (`RayActors`, say): a name and stats."""

    @property
    def name(self) -> str: ...

    @property
    def stats(self) -> ReplicaPoolStats: ...


def render(registry: CollectorRegistry | None = None) -> bytes:
    """The registry's metrics (default: prometheus_client's global one) in the text format."""
    return generate_latest(REGISTRY if registry is None else registry)


@dataclass(frozen=True)
class _Children:
    """One proxy label's metric children, looked up once rather than on every hook."""

    requests: Counter
    batches: Counter
    failed_batches: Counter
    errors: Counter
    rejected: Counter
    shed: Counter
    deduplicated: Counter
    cache_hits: Counter
    timed_out: Counter
    cancelled: Counter
    disconnected: Counter
    timed_out_batches: Counter
    oom_splits: Counter
    isolation_splits: Counter
    queue_wait: Histogram
    model_seconds: Histogram
    request_seconds: Histogram
    batch_size: Histogram


class PrometheusMetrics(Listener):
    """Prometheus metrics for any number of proxies, one `proxy` label each.

    Create one per registry (a second one with the same namespace in the same
    registry is refused by prometheus_client as duplicated timeseries) and
    `instrument()` each proxy. It is a `batchproxy.Listener`, so
    `proxy.add_listener(metrics)` also feeds the counters and histograms, but
    only `instrument()` adds the proxy to the gauges.
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        namespace: str = "batchproxy",
        *,
        latency_buckets: Sequence[float] = LATENCY_BUCKETS,
    ) -> None:
        self.registry: CollectorRegistry = REGISTRY if registry is None else registry
        self.namespace = namespace
        self._proxies: weakref.WeakSet[Proxy[Any, Any]] = weakref.WeakSet()
        self._pools: weakref.WeakSet[ReplicaPool] = weakref.WeakSet()
        self._lock = threading.Lock()  # instrument() vs a scrape on another thread
        self._children: dict[str, _Children] = {}

        def counter(name: str, documentation: str) -> Counter:
            return Counter(
                name, documentation, ("proxy",), namespace=namespace, registry=self.registry
            )

        def histogram(name: str, documentation: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(
                name,
                documentation,
                ("proxy",),
                namespace=namespace,
                registry=self.registry,
                buckets=buckets,
            )

        self._requests = counter("requests", "Calls accepted into the queue.")
        self._batches = counter("batches", "Batches sent to the model.")
        self._failed_batches = counter(
            "failed_batches", "Batches whose _inference raised or returned the wrong count."
        )
        self._errors = counter("errors", "Calls that ended with an error from the model.")
        self._rejected = counter("rejected", "Calls refused with QueueFull (never accepted).")
        self._shed = counter(
            "shed", "Calls refused at once: predicted to miss their deadline (shed_late)."
        )
        self._deduplicated = counter(
            "deduplicated", "Calls that joined an identical call in flight (dedup)."
        )
        self._cache_hits = counter("cache_hits", "Calls answered from the result cache.")
        self._timed_out = counter("timed_out", "Calls whose deadline passed.")
        self._cancelled = counter("cancelled", "Calls whose caller was cancelled.")
        self._disconnected = counter(
            "disconnected", "Calls cancelled because their HTTP client disconnected."
        )
        self._timed_out_batches = counter(
            "timed_out_batches", "Batches the watchdog stopped after batch_timeout."
        )
        self._oom_splits = counter(
            "oom_splits", "Batches or pieces out of memory, re-run in chunks (oom_backoff)."
        )
        self._isolation_splits = counter(
            "isolation_splits", "Batches or pieces that raised, re-run in halves (isolate_errors)."
        )
        self._queue_wait = histogram(
            "queue_wait_seconds",
            "Time each item sent to the model waited in the queue.",
            latency_buckets,
        )
        self._model_seconds = histogram(
            "model_seconds", "Time each batch spent in the model.", latency_buckets
        )
        self._request_seconds = histogram(
            "request_seconds",
            "Time from queueing to the end of each call, whatever its outcome.",
            latency_buckets,
        )
        self._batch_size = histogram("batch_size", "Items per batch.", BATCH_SIZE_BUCKETS)
        self.registry.register(_Gauges(self))
        self.registry.register(_PoolSeries(self))

    # -- proxies -------------------------------------------------------------------------

    def instrument(self, proxy: Proxy[Any, Any] | Batched[Any, Any]) -> None:
        """Record `proxy`'s metrics (a `@batch` function: its proxy's). Again is a no-op."""
        target = proxy.proxy if isinstance(proxy, Batched) else proxy
        if not isinstance(target, Proxy):
            raise TypeError(f"instrument takes a batchproxy.Proxy, got {proxy!r}")
        with self._lock:
            if target in self._proxies:
                return
            self._proxies.add(target)
        self._child(target.stats.name)  # its series show 0 before the first call
        target.add_listener(self)

    def uninstrument(self, proxy: Proxy[Any, Any] | Batched[Any, Any]) -> None:
        """Stop recording `proxy` (its counters keep their values); unknown proxies are ignored."""
        target = proxy.proxy if isinstance(proxy, Batched) else proxy
        with self._lock:
            if target not in self._proxies:
                return
            self._proxies.discard(target)
        target.remove_listener(self)

    def _live_proxies(self) -> list[Proxy[Any, Any]]:
        with self._lock:
            return list(self._proxies)

    def _child(self, proxy: str) -> _Children:
        children = self._children.get(proxy)
        if children is None:
            children = _Children(
                requests=self._requests.labels(proxy),
                batches=self._batches.labels(proxy),
                failed_batches=self._failed_batches.labels(proxy),
                errors=self._errors.labels(proxy),
                rejected=self._rejected.labels(proxy),
                shed=self._shed.labels(proxy),
                deduplicated=self._deduplicated.labels(proxy),
                cache_hits=self._cache_hits.labels(proxy),
                timed_out=self._timed_out.labels(proxy),
                cancelled=self._cancelled.labels(proxy),
                disconnected=self._disconnected.labels(proxy),
                timed_out_batches=self._timed_out_batches.labels(proxy),
                oom_splits=self._oom_splits.labels(proxy),
                isolation_splits=self._isolation_splits.labels(proxy),
                queue_wait=self._queue_wait.labels(proxy),
                model_seconds=self._model_seconds.labels(proxy),
                request_seconds=self._request_seconds.labels(proxy),
                batch_size=self._batch_size.labels(proxy),
            )
            self._children[proxy] = children
        return children

    # -- pools ---------------------------------------------------------------------------

    def instrument_pool(self, pool: ReplicaPool) -> None:
        """Export `pool`'s replica counts and scaling decisions, labelled by its name.
        Again is a no-op."""
        if isinstance(pool, (Proxy, Batched)):
            raise TypeError("instrument_pool takes a pool of replicas (for a proxy: instrument())")
        stats = pool.stats
        wanted = ("replicas", "ready", "pending", "autoscaler")
        if not all(hasattr(stats, field) for field in wanted):
            raise TypeError(
                f"instrument_pool takes a pool whose stats have {', '.join(wanted)}; "
                f"got {pool!r} with stats {stats!r}"
            )
        with self._lock:
            self._pools.add(pool)

    def uninstrument_pool(self, pool: ReplicaPool) -> None:
        """Drop `pool`'s series; unknown pools are ignored."""
        with self._lock:
            self._pools.discard(pool)

    def _live_pools(self) -> list[ReplicaPool]:
        with self._lock:
            return list(self._pools)

    # -- listener hooks ------------------------------------------------------------------

    @override
    def request_queued(self, proxy: str, queue_depth: int) -> None:
        self._child(proxy).requests.inc()

    @override
    def request_rejected(self, proxy: str, count: int) -> None:
        self._child(proxy).rejected.inc(count)

    @override
    def request_shed(self, proxy: str) -> None:
        self._child(proxy).shed.inc()

    def request_deduplicated(self, proxy: str, cached: bool) -> None:
        children = self._child(proxy)
        (children.cache_hits if cached else children.deduplicated).inc()

    @override
    def request_disconnected(self, proxy: str) -> None:
        self._child(proxy).disconnected.inc()

    @override
    def batch_started(self, proxy: str, size: int, queue_waits: Sequence[float]) -> None:
        children = self._child(proxy)
        children.batches.inc()
        children.batch_size.observe(size)
        observe = children.queue_wait.observe
        for seconds in queue_waits:
            observe(seconds)

    @override
    def batch_finished(
        self, proxy: str, size: int, model_seconds: float, error: BaseException | None
    ) -> None:
        self._child(proxy).model_seconds.observe(model_seconds)

    @override
    def request_finished(self, proxy: str, outcome: str, seconds: float) -> None:
        children = self._child(proxy)
        children.request_seconds.observe(seconds)
        if outcome == "error":
            children.errors.inc()
        elif outcome == "timed_out":
            children.timed_out.inc()
        elif outcome == "cancelled":
            children.cancelled.inc()

    @override
    def error(self, proxy: str, error: BaseException, size: int) -> None:
        self._child(proxy).failed_batches.inc()

    @override
    def batch_timed_out(self, proxy: str, size: int, timeout: float) -> None:
        self._child(proxy).timed_out_batches.inc()

    @override
    def batch_split(self, proxy: str, size: int, reason: str) -> None:
        children = self._child(proxy)
        (children.oom_splits if reason == "oom" else children.isolation_splits).inc()


def _scraped(metrics: PrometheusMetrics, name: str) -> str:
    """A scrape-time series' full name: the namespace's, as prometheus_client names
    the others (no leading "_" with an empty namespace)."""
    return f"{metrics.namespace}_{name}".lstrip("_")


class _Gauges:
    """A collector reading the instrumented proxies' `stats` and `health` at scrape time.

    It holds the `PrometheusMetrics` weakly too, so nothing keeps it alive but
    its owner (the registry keeps this collector).
    """

    def __init__(self, metrics: PrometheusMetrics) -> None:
        self._metrics = weakref.ref(metrics)
        self._queue_depth = _scraped(metrics, "queue_depth")
        self._in_flight = _scraped(metrics, "in_flight_batches")
        self._healthy = _scraped(metrics, "healthy")

    def _families(self) -> tuple[GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily]:
        return (
            GaugeMetricFamily(self._queue_depth, "Requests waiting now.", labels=("proxy",)),
            GaugeMetricFamily(self._in_flight, "Batches running now.", labels=("proxy",)),
            GaugeMetricFamily(
                self._healthy,
                "1 if the model answers within batch_timeout, 0 after an overrun.",
                labels=("proxy",),
            ),
        )

    def describe(self) -> Iterable[Metric]:
        return self._families()

    def collect(self) -> Iterator[Metric]:
        depth, in_flight, healthy = self._families()
        metrics = self._metrics()
        totals: dict[str, tuple[int, int, bool]] = {}
        for proxy in [] if metrics is None else metrics._live_proxies():
            stats = proxy.stats
            queued, running, ok = totals.get(stats.name, (0, 0, True))
            totals[stats.name] = (
                queued + stats.queue_depth,
                running + stats.in_flight,
                ok and proxy.health.healthy,
            )
        for name, (queued, running, ok) in sorted(totals.items()):
            depth.add_metric((name,), queued)
            in_flight.add_metric((name,), running)
            healthy.add_metric((name,), 1 if ok else 0)
        yield depth
        yield in_flight
        yield healthy


class _PoolSeries:
    """A collector reading the instrumented pools' `stats` at scrape time (it holds the
    `PrometheusMetrics` weakly, as `_Gauges` does)."""

    def __init__(self, metrics: PrometheusMetrics) -> None:
        self._metrics = weakref.ref(metrics)
        self._replicas = _scraped(metrics, "pool_replicas")
        self._ups = _scraped(metrics, "pool_scale_ups")
        self._downs = _scraped(metrics, "pool_scale_downs")

    def _families(self) -> tuple[GaugeMetricFamily, CounterMetricFamily, CounterMetricFamily]:
        return (
            GaugeMetricFamily(
                self._replicas,
                "Replicas of the pool: asked for (target), started (ready), starting (pending).",
                labels=("pool", "state"),
            ),
            CounterMetricFamily(
                self._ups, "Autoscaling decisions that added replicas.", labels=("pool",)
            ),
            CounterMetricFamily(
                self._downs, "Autoscaling decisions that removed replicas.", labels=("pool",)
            ),
        )

    def describe(self) -> Iterable[Metric]:
        return self._families()

    def collect(self) -> Iterator[Metric]:
        replicas, ups, downs = self._families()
        metrics = self._metrics()
        totals: dict[str, list[int]] = {}
        for pool in [] if metrics is None else metrics._live_pools():
            stats = pool.stats
            scaling = stats.autoscaler
            counts = totals.setdefault(pool.name, [0, 0, 0, 0, 0])
            counts[0] += stats.replicas
            counts[1] += stats.ready
            counts[2] += stats.pending
            if scaling is not None:
                counts[3] += scaling.scale_ups
                counts[4] += scaling.scale_downs
        for name, (target, ready, pending, up, down) in sorted(totals.items()):
            replicas.add_metric((name, "target"), target)
            replicas.add_metric((name, "ready"), ready)
            replicas.add_metric((name, "pending"), pending)
            ups.add_metric((name,), up)
            downs.add_metric((name,), down)
        yield replicas
        yield ups
        yield downs
