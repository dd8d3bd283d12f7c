"""examples/bert_app.py under uvicorn on loopback: batched answers equal the regular ones."""

from __future__ import annotations

import asyncio
from types import ModuleType
from typing import Any

import httpx
import pytest
from _support import load_example, on_uvicorn

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("fastapi")

TEXTS = [
    "Short one.",
    "A somewhat longer sentence, so that the short one is padded in its batch.",
    "The delivery was quick and the battery lasts all day.",
    "Batching must not change any answer by more than a rounding error.",
] * 4


@pytest.fixture(scope="module")
def bert_app() -> ModuleType:
    return load_example("bert_app")


async def ready(http: httpx.AsyncClient) -> None:
    for _ in range(600):  # the model is built in the background
        if (await http.get("/readyz")).status_code == 200:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the app was not ready in 30 s")


def class_one(answer: dict[str, Any]) -> float:
    probability = float(answer["probability"])
    return probability if answer["label"] == 1 else 1.0 - probability


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "one-at-a-time"])
async def test_batched_equals_regular_and_the_other_routes(
    bert_app: ModuleType, overlap: bool
) -> None:
    app = bert_app.create_app("bert-tiny", "cpu", "float32", batch_size=8, overlap=overlap)
    async with (
        on_uvicorn(app) as (_, port),
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http,
    ):
        await ready(http)
        batched = await asyncio.gather(
            *(http.post("/classify", json={"text": text}) for text in TEXTS)
        )
        regular = [await http.post("/classify/regular", json={"text": t}) for t in TEXTS]
        for got, want in zip(batched, regular, strict=True):
            assert got.status_code == want.status_code == 200, (got.text, want.text)
            assert 0.5 <= got.json()["probability"] <= 1.0
            assert class_one(got.json()) == pytest.approx(class_one(want.json()), abs=1e-4)
        stats = app.state.proxy.stats
        assert stats.items == len(TEXTS)
        assert stats.batches < len(TEXTS)  # they were batched
        assert app.state.regular.calls == len(TEXTS)

        constant = await http.post("/constant", json={"text": "anything"})
        assert constant.status_code == 200
        assert constant.json() == {"label": 0, "probability": 0.5}
        assert app.state.proxy.stats.items == len(TEXTS)  # the model was not touched

        for path in ("/classify", "/classify/regular", "/constant"):
            for body in ({"text": ""}, {"text": "   "}, {}):
                assert (await http.post(path, json=body)).status_code == 422, (path, body)

        metrics = (await http.get("/metrics")).text
        assert "batch_size_count" in metrics
