"""OpenTelemetry: a span per batch, linked to its callers' spans, through real FastAPI
requests on a uvicorn server on 127.0.0.1; traced with the SDK's in-memory exporter."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import pytest
from _support import modules_after, on_uvicorn, wait_until
from typing_extensions import override

from batchproxy import Proxy

pytest.importorskip("uvicorn")
fastapi = pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
sdk_trace = pytest.importorskip("opentelemetry.sdk.trace")
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)
from opentelemetry.trace import SpanKind, StatusCode  # noqa: E402

from batchproxy.integrations.otel import instrument  # noqa: E402


class Held(Proxy[int, int]):
    """Doubles; holds its batch until `release` is set; starts a span of its own."""

    def __init__(self, tracer: Any, **options: Any) -> None:
        super().__init__(**options)
        self.tracer = tracer
        self.started = asyncio.Event()
        self.release = asyncio.Event()

    @override
    async def _inference(self, items: list[int]) -> Sequence[int]:
        self.started.set()
        await self.release.wait()
        with self.tracer.start_as_current_span("forward"):
            if -1 in items:
                raise ValueError("the model cannot take -1")
            return [2 * item for item in items]


@asynccontextmanager
async def serve(proxy: Held, tracer: Any) -> AsyncIterator[httpx.AsyncClient]:
    app = fastapi.FastAPI()

    @app.get("/double/{x}")
    async def double(x: int) -> dict[str, Any]:
        with tracer.start_as_current_span("handler", kind=SpanKind.SERVER):
            try:
                return {"y": await proxy.inference(x)}
            except ValueError as exc:
                return {"error": str(exc)}

    async with (
        on_uvicorn(app) as (_, port),
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http,
    ):
        yield http


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def provider(exporter: InMemorySpanExporter) -> Any:
    provider = sdk_trace.TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider


async def one_batch_of(provider: Any, xs: list[int]) -> list[Any]:
    """Through an instrumented proxy behind FastAPI: hold a first call's batch, queue
    `xs` behind it, release; they go as one batch. The answers, the first one's first."""
    tracer = provider.get_tracer("test")
    async with Held(tracer) as proxy:
        instrument(proxy, tracer_provider=provider)
        async with serve(proxy, tracer) as http:
            first = asyncio.create_task(http.get("/double/100"))
            await proxy.started.wait()
            rest = [asyncio.create_task(http.get(f"/double/{x}")) for x in xs]
            await wait_until(lambda: proxy.stats.queue_depth == len(xs))
            # (time passes while they wait: uvloop's clock moves in whole milliseconds,
            # and the last request could be queued, seen and released in one tick,
            # with a queue wait of 0.0)
            await asyncio.sleep(0.01)
            proxy.release.set()
            return [(await r).json() for r in [first, *rest]]


async def test_a_batch_span_links_every_caller_and_parents_the_models_spans(
    provider: Any, exporter: InMemorySpanExporter
) -> None:
    answers = await one_batch_of(provider, [1, 2, 3, 4])
    assert answers == [{"y": 200}, {"y": 2}, {"y": 4}, {"y": 6}, {"y": 8}]
    spans = exporter.get_finished_spans()
    batches = [s for s in spans if s.name == "batchproxy.batch Held"]
    assert sorted(s.attributes["batchproxy.batch.size"] for s in batches) == [1, 4]
    batch = next(s for s in batches if s.attributes["batchproxy.batch.size"] == 4)
    handlers = [s for s in spans if s.name == "handler"]
    callers = [h for h in handlers if h.context.span_id != _first_handler(handlers).span_id]
    # linked to each of its four callers, child of none of them
    assert batch.parent is None
    assert {link.context.span_id for link in batch.links} == {h.context.span_id for h in callers}
    assert {link.context.trace_id for link in batch.links} == {h.context.trace_id for h in callers}
    # each caller's span heard when its batch started
    for handler in handlers:
        (event,) = [e for e in handler.events if e.name == "batchproxy.batch_started"]
        assert event.attributes["batchproxy.proxy"] == "Held"
    # the model's span is the batch span's child
    forwards = [s for s in spans if s.name == "forward"]
    assert batch.context.span_id in {s.parent.span_id for s in forwards if s.parent}
    assert batch.attributes["batchproxy.outcome"] == "ok"
    assert batch.attributes["batchproxy.queue_wait.max_ms"] > 0
    assert batch.attributes["batchproxy.model.duration_ms"] >= 0
    assert batch.status.status_code is StatusCode.UNSET


async def test_a_failed_batch_has_an_error_span(
    provider: Any, exporter: InMemorySpanExporter
) -> None:
    answers = await one_batch_of(provider, [1, -1])
    assert answers[1:] == [{"error": "the model cannot take -1"}] * 2
    failed = [
        s
        for s in exporter.get_finished_spans()
        if s.name == "batchproxy.batch Held" and s.attributes["batchproxy.batch.size"] == 2
    ]
    (span,) = failed
    assert span.attributes["batchproxy.outcome"] == "error"
    assert span.status.status_code is StatusCode.ERROR
    assert [e.name for e in span.events] == ["exception"]


async def test_an_uninstrumented_proxy_keeps_no_contexts(provider: Any) -> None:
    async with Held(provider.get_tracer("test")) as proxy:
        assert not proxy.options.caller_context
        instrument(proxy, tracer_provider=provider)
        assert proxy.options.caller_context


def test_importing_batchproxy_loads_no_opentelemetry() -> None:
    assert "opentelemetry" not in modules_after("import batchproxy")


def _first_handler(handlers: Sequence[Any]) -> Any:
    """The context of the handler span of the first call (it had a batch of its own)."""
    return min(handlers, key=lambda h: h.start_time).context


@pytest.mark.parametrize("cut", ["watchdog", "drain deadline"])
async def test_an_abandoned_batch_span_ends_with_its_task(
    provider: Any, exporter: InMemorySpanExporter, cut: str
) -> None:
    """An abandoned batch is not finished (no `batch_finished`, issue 38): its span ends
    when its task does, `abandoned`."""
    import batchproxy

    tracer = provider.get_tracer("test")
    options: dict[str, Any] = {"batch_timeout": 0.5} if cut == "watchdog" else {}
    proxy = Held(tracer, **options)
    instrument(proxy, tracer_provider=provider)
    call = asyncio.ensure_future(proxy.inference(1))
    await proxy.started.wait()
    if cut == "watchdog":
        with pytest.raises(batchproxy.BatchTimeout):
            await call
        await proxy.aclose()
    else:
        await proxy.aclose(timeout=0.5)
        with pytest.raises(batchproxy.DrainDeadline):
            await call
    await wait_until(lambda: len(exporter.get_finished_spans()) == 1)
    (span,) = exporter.get_finished_spans()
    assert span.attributes["batchproxy.outcome"] == "abandoned"
    assert span.status.status_code is StatusCode.ERROR
