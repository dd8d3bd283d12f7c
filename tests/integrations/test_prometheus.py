"""batchproxy.integrations.prometheus: counters, histograms and gauges per proxy label."""

from __future__ import annotations

import asyncio
import gc
import re
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from _support import Recorder, modules_after

import batchproxy
from batchproxy import BatchTimeout, DeadlineExceeded, QueueFull
from batchproxy._executors.autoscaling import Autoscaler, AutoscalerStats, Autoscaling

prometheus_client = pytest.importorskip("prometheus_client")

from prometheus_client import CollectorRegistry  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

import batchproxy.integrations.prometheus  # noqa: E402
from batchproxy.integrations.prometheus import (  # noqa: E402
    CONTENT_TYPE,
    PrometheusMetrics,
    render,
)

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(registry: CollectorRegistry) -> Samples:
    """Render the registry and parse it back: {(sample name, sorted labels): value}."""
    samples: Samples = {}
    for family in text_string_to_metric_families(render(registry).decode()):
        for sample in family.samples:
            samples[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def value(samples: Samples, name: str, proxy: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted({"proxy": proxy, **labels}.items()))))


COUNTERS = (
    *("requests", "batches", "failed_batches", "errors", "rejected", "shed", "timed_out"),
    *("cancelled", "timed_out_batches", "oom_splits", "isolation_splits"),
    *("deduplicated", "cache_hits", "disconnected"),
)


def counts(samples: Samples, proxy: str) -> dict[str, float | None]:
    return {name: value(samples, f"batchproxy_{name}_total", proxy) for name in COUNTERS}


def zero_counts(**nonzero: float) -> dict[str, float | None]:
    zeros: dict[str, float | None] = dict.fromkeys(COUNTERS, 0.0)
    return zeros | nonzero


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def metrics(registry: CollectorRegistry) -> PrometheusMetrics:
    return PrometheusMetrics(registry)


def _slot_or_batch_error(items: list[int]) -> list[Any]:
    if 0 in items:
        raise RuntimeError("batch failed")
    return [ValueError("slot") if item == 2 else item for item in items]


# -- counters and histograms ---------------------------------------------------------------


@pytest.mark.looptime
async def test_successes_batches_and_histograms(
    no_leftovers: None, registry: CollectorRegistry, metrics: PrometheusMetrics
) -> None:
    proxy = Recorder(batch_size=4, delay=0.010, name="a")
    metrics.instrument(proxy)
    await asyncio.wait_for(asyncio.gather(*(proxy.inference(i) for i in range(10))), 10)
    assert [len(batch) for batch in proxy.batches] == [4, 4, 2]
    samples = scrape(registry)
    assert counts(samples, "a") == zero_counts(requests=10.0, batches=3.0)

    # batches of 4, 4, 2 one after another, 0.010 s of model time each
    assert value(samples, "batchproxy_model_seconds_count", "a") == 3
    assert value(samples, "batchproxy_model_seconds_sum", "a") == pytest.approx(0.030)
    assert value(samples, "batchproxy_model_seconds_bucket", "a", le="0.005") == 0
    assert value(samples, "batchproxy_model_seconds_bucket", "a", le="0.01") == 3
    assert value(samples, "batchproxy_queue_wait_seconds_count", "a") == 10
    waited = 4 * 0.0 + 4 * 0.010 + 2 * 0.020
    assert value(samples, "batchproxy_queue_wait_seconds_sum", "a") == pytest.approx(waited)
    assert value(samples, "batchproxy_request_seconds_count", "a") == 10
    took = 4 * 0.010 + 4 * 0.020 + 2 * 0.030
    assert value(samples, "batchproxy_request_seconds_sum", "a") == pytest.approx(took)

    assert value(samples, "batchproxy_batch_size_count", "a") == 3
    assert value(samples, "batchproxy_batch_size_sum", "a") == 10
    buckets = {
        le: value(samples, "batchproxy_batch_size_bucket", "a", le=le)
        for le in ("1.0", "2.0", "4.0", "8.0", "512.0", "+Inf")
    }
    assert buckets == {"1.0": 0, "2.0": 1, "4.0": 3, "8.0": 3, "512.0": 3, "+Inf": 3}
    assert ("batchproxy_batch_size_bucket", (("le", "1024.0"), ("proxy", "a"))) not in samples
    await proxy.aclose()


@pytest.mark.looptime
async def test_errors_from_a_slot_and_from_a_raising_batch(
    no_leftovers: None, registry: CollectorRegistry, metrics: PrometheusMetrics
) -> None:
    proxy = Recorder(respond=_slot_or_batch_error, delay=0.010, batch_size=3, name="err")
    metrics.instrument(proxy)
    results = await asyncio.wait_for(
        asyncio.gather(*(proxy.inference(i) for i in (1, 2, 3)), return_exceptions=True), 10
    )
    assert [type(result).__name__ for result in results] == ["int", "ValueError", "int"]
    with pytest.raises(RuntimeError, match="batch failed"):
        await asyncio.wait_for(asyncio.gather(proxy.inference(0), proxy.inference(5)), 10)
    await asyncio.sleep(0.1)  # let the second caller of the failed batch end too

    samples = scrape(registry)
    assert counts(samples, "err") == zero_counts(
        requests=5.0, batches=2.0, failed_batches=1.0, errors=3.0
    )
    assert proxy.stats.errors == 3
    assert value(samples, "batchproxy_model_seconds_count", "err") == 2  # failed batches too
    assert value(samples, "batchproxy_request_seconds_count", "err") == 5
    await proxy.aclose()


@pytest.mark.looptime
async def test_rejected_timed_out_and_cancelled(
    no_leftovers: None, registry: CollectorRegistry, metrics: PrometheusMetrics
) -> None:
    proxy = Recorder(batch_size=1, delay=1.0, max_queue_size=2, name="busy")
    metrics.instrument(proxy)
    running = asyncio.create_task(proxy.inference(0))
    await asyncio.sleep(0.1)  # 0 is in the model; the queue is empty
    expiring = asyncio.create_task(proxy.inference(1, timeout=0.25))
    withdrawn = asyncio.create_task(proxy.inference(2))
    await asyncio.sleep(0)
    for item in (3, 4):
        with pytest.raises(QueueFull):
            await proxy.inference(item)
    await asyncio.sleep(0.05)
    withdrawn.cancel()
    with pytest.raises(DeadlineExceeded):
        await asyncio.wait_for(expiring, 10)
    await asyncio.wait_for(running, 10)

    samples = scrape(registry)
    assert counts(samples, "busy") == zero_counts(
        requests=3.0, batches=1.0, rejected=2.0, timed_out=1.0, cancelled=1.0
    )
    # every call that ended, whatever its outcome: 1.0 s answered, 0.25 timed out, 0.05 cancelled
    assert value(samples, "batchproxy_request_seconds_count", "busy") == 3
    assert value(samples, "batchproxy_request_seconds_sum", "busy") == pytest.approx(1.3)
    await proxy.aclose()


@pytest.mark.looptime
async def test_shed_calls_are_counted(
    registry: CollectorRegistry, metrics: PrometheusMetrics
) -> None:
    async with Recorder(batch_size=1, delay=0.01, shed_late=True, name="late") as proxy:
        metrics.instrument(proxy)
        for i in range(8):  # the cost model learns 10 ms per batch
            await proxy.inference(i)
        backlog = [asyncio.create_task(proxy.inference(i, priority=1)) for i in range(20)]
        await asyncio.sleep(0)
        with pytest.raises(DeadlineExceeded):
            await proxy.inference("late", timeout=0.05)
        await asyncio.gather(*backlog)
    assert counts(scrape(registry), "late") == zero_counts(requests=28.0, batches=28.0, shed=1.0)


@pytest.mark.looptime
async def test_deduplicated_calls_and_cache_hits_are_counted(
    registry: CollectorRegistry, metrics: PrometheusMetrics
) -> None:
    async with Recorder(
        batch_size=8, delay=1.0, dedup=batchproxy.Dedup(cache_size=8), name="d"
    ) as proxy:
        metrics.instrument(proxy)
        await asyncio.gather(*(proxy.inference(x) for x in "aaab"))  # two joined "a"
        await proxy.inference("a")  # from the cache
    expected = zero_counts(requests=5.0, batches=1.0, deduplicated=2.0, cache_hits=1.0)
    assert counts(scrape(registry), "d") == expected


@pytest.mark.looptime
async def test_watchdog_overruns_are_counted(
    registry: CollectorRegistry, metrics: PrometheusMetrics
) -> None:
    async with Recorder(delay=3.0, batch_timeout=2.0, name="slow") as proxy:
        metrics.instrument(proxy)
        with pytest.raises(BatchTimeout):
            await proxy.inference(1)
        proxy.delay = 0.0
        assert await proxy.inference(2) == ("out", 2)
        assert proxy.stats.timed_out_batches == 1
    assert counts(scrape(registry), "slow") == zero_counts(
        requests=2.0, batches=2.0, failed_batches=1.0, errors=1.0, timed_out_batches=1.0
    )


def fits(limit: int) -> Any:
    """A model whose memory holds `limit` items: more raises MemoryError."""

    def respond(items: list[Any]) -> list[Any]:
        if len(items) > limit:
            raise MemoryError
        return [("out", item) for item in items]

    return respond


def poisoned(bad: int) -> Any:
    """A model that raises for a whole batch holding `bad`."""

    def respond(items: list[Any]) -> list[Any]:
        if bad in items:
            raise ValueError(f"cannot take {bad}")
        return [("out", item) for item in items]

    return respond


async def burst(proxy: Recorder, n: int) -> list[Any]:
    calls = (proxy.inference(i) for i in range(n))
    return list(await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 10))


@pytest.mark.looptime
async def test_out_of_memory_splits_are_counted(
    registry: CollectorRegistry, metrics: PrometheusMetrics
) -> None:
    async with Recorder(fits(4), oom_backoff=True, batch_size=16, name="oom") as proxy:
        metrics.instrument(proxy)
        assert await burst(proxy, 16) == [("out", i) for i in range(16)]
        # 16 and 8 ran out of memory; then chunks of the learned cap, 4
        assert [len(batch) for batch in proxy.batches] == [16, 8, 4, 4, 4, 4]
        assert proxy.stats.oom_splits == 2
    assert counts(scrape(registry), "oom") == zero_counts(
        requests=16.0, batches=1.0, oom_splits=2.0
    )


@pytest.mark.looptime
async def test_isolation_reruns_are_counted(
    registry: CollectorRegistry, metrics: PrometheusMetrics
) -> None:
    async with Recorder(poisoned(5), isolate_errors=True, batch_size=16, name="iso") as proxy:
        metrics.instrument(proxy)
        answers = await burst(proxy, 16)
        assert [type(answer).__name__ for answer in answers].count("ValueError") == 1
        assert proxy.stats.isolation_splits == 4  # 16 -> 8 -> 4 -> 2 -> 1
    assert counts(scrape(registry), "iso") == zero_counts(
        requests=16.0, batches=1.0, errors=1.0, isolation_splits=4.0
    )


# -- gauges --------------------------------------------------------------------------------


@pytest.mark.looptime
async def test_the_health_gauge_drops_on_an_overrun_and_recovers(
    registry: CollectorRegistry, metrics: PrometheusMetrics
) -> None:
    async with (
        Recorder(delay=3.0, batch_timeout=2.0, name="h") as proxy,
        Recorder(name="h") as twin,  # shares the label: the gauge is 0 if either is unhealthy
    ):
        metrics.instrument(proxy)
        metrics.instrument(twin)
        assert value(scrape(registry), "batchproxy_healthy", "h") == 1
        with pytest.raises(BatchTimeout):
            await proxy.inference(1)
        assert not proxy.healthy
        assert value(scrape(registry), "batchproxy_healthy", "h") == 0
        proxy.delay = 0.0
        assert await proxy.inference(2) == ("out", 2)  # a batch in time: healthy again
        assert value(scrape(registry), "batchproxy_healthy", "h") == 1


@pytest.mark.looptime
async def test_queue_depth_and_in_flight_gauges_while_the_model_is_busy(
    no_leftovers: None, registry: CollectorRegistry, metrics: PrometheusMetrics
) -> None:
    proxy = Recorder(batch_size=2, delay=1.0, name="q")
    metrics.instrument(proxy)
    samples = scrape(registry)
    assert value(samples, "batchproxy_queue_depth", "q") == 0
    assert value(samples, "batchproxy_in_flight_batches", "q") == 0

    first = asyncio.create_task(proxy.inference(0))
    await asyncio.sleep(0.1)
    waiting = [asyncio.create_task(proxy.inference(i)) for i in (1, 2, 3)]
    await asyncio.sleep(0.1)
    samples = scrape(registry)
    assert value(samples, "batchproxy_queue_depth", "q") == 3
    assert value(samples, "batchproxy_in_flight_batches", "q") == 1

    await asyncio.wait_for(asyncio.gather(first, *waiting), 10)
    samples = scrape(registry)
    assert value(samples, "batchproxy_queue_depth", "q") == 0
    assert value(samples, "batchproxy_in_flight_batches", "q") == 0
    assert value(samples, "batchproxy_batches_total", "q") == 3
    await proxy.aclose()


@pytest.mark.looptime
async def test_proxies_sharing_a_name_share_one_gauge_sample(
    no_leftovers: None, registry: CollectorRegistry, metrics: PrometheusMetrics
) -> None:
    proxies = [Recorder(batch_size=1, delay=1.0, name="same") for _ in range(2)]
    for proxy in proxies:
        metrics.instrument(proxy)
    calls = [asyncio.create_task(proxy.inference(i)) for proxy in proxies for i in range(3)]
    await asyncio.sleep(0.1)
    samples = scrape(registry)
    assert value(samples, "batchproxy_queue_depth", "same") == 4
    assert value(samples, "batchproxy_in_flight_batches", "same") == 2
    assert value(samples, "batchproxy_requests_total", "same") == 6
    await asyncio.wait_for(asyncio.gather(*calls), 10)
    for proxy in proxies:
        await proxy.aclose()


# -- pools of replicas ----------------------------------------------------------------------


@dataclass(frozen=True)
class FakePoolStats:
    replicas: int
    ready: int
    pending: int
    autoscaler: AutoscalerStats | None


class FakePool:
    """What `instrument_pool` takes: a name and `stats` (as `RayActors` has them)."""

    def __init__(self, name: str, replicas: int = 1, ready: int = 1) -> None:
        self.name = name
        self.current = FakePoolStats(replicas, ready, replicas - ready, None)

    @property
    def stats(self) -> FakePoolStats:
        return self.current


def pool_series(samples: Samples, pool: str) -> dict[str, float | None]:
    """The pool's five samples, by a short name."""

    def get(name: str, **labels: str) -> float | None:
        return samples.get((name, tuple(sorted({"pool": pool, **labels}.items()))))

    return {
        **{state: get("batchproxy_pool_replicas", state=state) for state in STATES},
        "ups": get("batchproxy_pool_scale_ups_total"),
        "downs": get("batchproxy_pool_scale_downs_total"),
    }


STATES = ("target", "ready", "pending")


def test_a_pool_s_replicas_and_scaling_counts_are_read_at_scrape_time(
    registry: CollectorRegistry, metrics: PrometheusMetrics
) -> None:
    pool = FakePool("embed", replicas=2, ready=2)
    metrics.instrument_pool(pool)
    metrics.instrument_pool(pool)  # again: a no-op
    assert pool_series(scrape(registry), "embed") == {
        "target": 2, "ready": 2, "pending": 0, "ups": 0, "downs": 0,
    }  # fmt: skip
    scaling = AutoscalerStats(scale_ups=3, scale_downs=1, errors=0, last_decision=None, desired=5)
    pool.current = FakePoolStats(replicas=5, ready=3, pending=2, autoscaler=scaling)
    assert pool_series(scrape(registry), "embed") == {
        "target": 5, "ready": 3, "pending": 2, "ups": 3, "downs": 1,
    }  # fmt: skip
    text = render(registry).decode()
    assert "# TYPE batchproxy_pool_replicas gauge" in text
    assert "# TYPE batchproxy_pool_scale_ups_total counter" in text
    assert "# TYPE batchproxy_pool_scale_downs_total counter" in text
    metrics.uninstrument_pool(pool)
    metrics.uninstrument_pool(pool)  # again: ignored
    assert pool_series(scrape(registry), "embed") == dict.fromkeys((*STATES, "ups", "downs"))


def test_pools_sharing_a_name_add_up_and_are_held_weakly(
    registry: CollectorRegistry, metrics: PrometheusMetrics
) -> None:
    pools = [FakePool("same", replicas=2, ready=1), FakePool("same", replicas=3, ready=3)]
    for pool in pools:
        metrics.instrument_pool(pool)
    metrics.instrument_pool(FakePool("other"))  # dropped at once: never scraped
    gc.collect()
    samples = scrape(registry)
    assert pool_series(samples, "same") == {
        "target": 5, "ready": 4, "pending": 1, "ups": 0, "downs": 0,
    }  # fmt: skip
    assert pool_series(samples, "other")["target"] is None
    ref = weakref.ref(pools[0])
    del pools[0]
    gc.collect()
    assert ref() is None
    assert pool_series(scrape(registry), "same")["target"] == 3


def test_pool_series_take_the_namespace(registry: CollectorRegistry) -> None:
    metrics = PrometheusMetrics(registry, namespace="svc")
    pool = FakePool("p")
    metrics.instrument_pool(pool)
    samples = scrape(registry)
    assert samples[("svc_pool_replicas", (("pool", "p"), ("state", "target")))] == 1
    assert samples[("svc_pool_scale_ups_total", (("pool", "p"),))] == 0


def test_instrument_pool_refuses_a_proxy_and_a_pool_without_those_stats(
    metrics: PrometheusMetrics,
) -> None:
    with pytest.raises(TypeError, match=r"for a proxy: instrument\(\)"):
        metrics.instrument_pool(Recorder(name="p"))  # type: ignore[arg-type]

    class Bare:
        name = "bare"
        stats = "nothing"

    with pytest.raises(TypeError, match="stats have replicas, ready, pending, autoscaler"):
        metrics.instrument_pool(Bare())  # type: ignore[arg-type]


class AutoscaledPool:
    """A `Scalable` with the stats `instrument_pool` reads, its load set by the test."""

    def __init__(self, settings: Autoscaling) -> None:
        self.name = "auto"
        self.load = 0.0
        self.replicas = 1
        self.autoscaler = Autoscaler(self, settings)

    @property
    def num_replicas(self) -> int:
        return self.replicas

    def autoscale_load(self) -> float:
        return self.load

    def autoscale_to(self, n: int) -> None:
        self.replicas = n

    @property
    def stats(self) -> FakePoolStats:
        return FakePoolStats(self.replicas, self.replicas, 0, self.autoscaler.stats)


@pytest.mark.looptime
async def test_an_autoscaled_pool_s_decisions_are_counted(
    no_leftovers: None, registry: CollectorRegistry, metrics: PrometheusMetrics
) -> None:
    pool = AutoscaledPool(Autoscaling(max_replicas=4, upscale_delay=5, downscale_delay=20))
    metrics.instrument_pool(pool)
    pool.autoscaler.start()
    pool.load = 3.5
    await asyncio.sleep(10.5)
    assert pool_series(scrape(registry), "auto") == {
        "target": 4, "ready": 4, "pending": 0, "ups": 1, "downs": 0,
    }  # fmt: skip
    pool.load = 0.0
    await asyncio.sleep(30.0)
    assert pool_series(scrape(registry), "auto") == {
        "target": 1, "ready": 1, "pending": 0, "ups": 1, "downs": 1,
    }  # fmt: skip
    await pool.autoscaler.aclose()


# -- several proxies, twice, garbage collection --------------------------------------------


@pytest.mark.looptime
async def test_two_proxies_in_one_registry_have_their_own_labels(
    no_leftovers: None, registry: CollectorRegistry, metrics: PrometheusMetrics
) -> None:
    small = Recorder(batch_size=2, delay=0.010, name="small")
    large = Recorder(batch_size=8, delay=0.020, name="large")
    metrics.instrument(small)
    metrics.instrument(large)
    await asyncio.wait_for(
        asyncio.gather(
            *(small.inference(i) for i in range(4)), *(large.inference(i) for i in range(8))
        ),
        10,
    )
    samples = scrape(registry)
    assert counts(samples, "small") == zero_counts(requests=4.0, batches=2.0)
    assert counts(samples, "large") == zero_counts(requests=8.0, batches=1.0)
    assert value(samples, "batchproxy_model_seconds_sum", "small") == pytest.approx(0.020)
    assert value(samples, "batchproxy_model_seconds_sum", "large") == pytest.approx(0.020)
    assert value(samples, "batchproxy_batch_size_sum", "large") == 8
    for name in ("small", "large"):
        assert value(samples, "batchproxy_queue_depth", name) == 0
    await small.aclose()
    await large.aclose()


@pytest.mark.looptime
async def test_instrumenting_twice_does_not_double_count(
    no_leftovers: None, registry: CollectorRegistry, metrics: PrometheusMetrics
) -> None:
    proxy = Recorder(batch_size=4, name="twice")
    metrics.instrument(proxy)
    metrics.instrument(proxy)
    await asyncio.wait_for(asyncio.gather(*(proxy.inference(i) for i in range(4))), 10)
    samples = scrape(registry)
    assert counts(samples, "twice") == zero_counts(requests=4.0, batches=1.0)
    assert value(samples, "batchproxy_request_seconds_count", "twice") == 4

    metrics.uninstrument(proxy)
    metrics.uninstrument(proxy)  # again: a no-op
    await asyncio.wait_for(proxy.inference(9), 10)
    samples = scrape(registry)
    assert value(samples, "batchproxy_requests_total", "twice") == 4  # kept, no longer fed
    assert value(samples, "batchproxy_queue_depth", "twice") is None
    await proxy.aclose()


async def test_a_proxy_is_held_only_weakly(
    registry: CollectorRegistry, metrics: PrometheusMetrics
) -> None:
    proxy = Recorder(name="gone")
    metrics.instrument(proxy)
    assert await asyncio.wait_for(proxy.inference(1), 10) == ("out", 1)
    await proxy.aclose()
    assert value(scrape(registry), "batchproxy_queue_depth", "gone") == 0
    ref = weakref.ref(proxy)
    del proxy
    gc.collect()
    assert ref() is None
    samples = scrape(registry)
    assert value(samples, "batchproxy_queue_depth", "gone") is None
    assert value(samples, "batchproxy_requests_total", "gone") == 1


async def test_a_batch_function_and_a_namespace(registry: CollectorRegistry) -> None:
    metrics = PrometheusMetrics(registry, namespace="svc")

    @batchproxy.batch(batch_size=8, name="double")
    async def double(items: list[int]) -> list[int]:
        return [2 * item for item in items]

    metrics.instrument(double)
    assert await asyncio.wait_for(double.inference_many([1, 2, 3]), 10) == [2, 4, 6]
    samples = scrape(registry)
    assert value(samples, "svc_requests_total", "double") == 3
    assert value(samples, "svc_queue_depth", "double") == 0
    assert not any(name.startswith("batchproxy_") for name, _ in samples)
    await double.aclose()


def test_one_metrics_object_per_registry_and_namespace(
    registry: CollectorRegistry, metrics: PrometheusMetrics
) -> None:
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        PrometheusMetrics(registry)
    PrometheusMetrics(registry, namespace="other")  # another namespace is fine


def test_instrument_refuses_what_is_not_a_proxy(metrics: PrometheusMetrics) -> None:
    with pytest.raises(TypeError, match=r"batchproxy\.Proxy"):
        metrics.instrument(object())  # type: ignore[arg-type]


def test_render_and_content_type(registry: CollectorRegistry, metrics: PrometheusMetrics) -> None:
    assert CONTENT_TYPE.startswith("text/plain")
    text = render(registry).decode()
    assert "# TYPE batchproxy_requests_total counter" in text
    assert "# TYPE batchproxy_queue_depth gauge" in text
    assert "# TYPE batchproxy_healthy gauge" in text


def metric_table(text: str) -> dict[str, str]:
    """The metric table in `text`: {metric: "type | what"}."""
    rows = re.findall(r"^\| `(batchproxy_\w+)` \| (.+) \|$", text, re.MULTILINE)
    return dict(rows)


def test_the_metric_tables_list_every_series(
    registry: CollectorRegistry, metrics: PrometheusMetrics
) -> None:
    metrics.instrument(Recorder(name="t"))
    families = {
        family.name + ("_total" if family.type == "counter" else ""): family.type
        for family in registry.collect()
    }
    docstring = metric_table(batchproxy.integrations.prometheus.__doc__ or "")
    assert {name: row.split(" | ")[0] for name, row in docstring.items()} == families
    guide = (Path(__file__).parents[2] / "docs" / "observability.md").read_text(encoding="utf-8")
    assert metric_table(guide) == docstring


def test_import_batchproxy_does_not_import_prometheus_client() -> None:
    assert "prometheus_client" not in modules_after("import batchproxy, batchproxy.integrations")
    assert "prometheus_client" in modules_after("import batchproxy.integrations.prometheus")
