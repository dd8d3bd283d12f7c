"""A BERT text classifier on FastAPI: batched through a `TensorProxy`, or the regular way.

    python examples/bert_app.py --model bert-base --device cuda --port 8000
    python examples/bert_app.py --model bert-tiny --device cpu      # a 2-layer toy, any machine

The model is `BertForSequenceClassification` with two labels and random weights
(`torch.manual_seed(0)`; `bert_classifier.build_model`): `bert-base` (12 layers,
hidden 768), `bert-large` (24 layers, hidden 1024) or `bert-tiny` (2 layers, hidden
128), in `--dtype` float32, float16 or bfloat16 on `--device`. Nothing is downloaded:
the tokenizer is the all-MiniLM-L6-v2 package's BERT WordPiece one (`minilm.py`; or
the folder `$BATCHPROXY_TOKENIZER_DIR`). The weights are built at startup, in the
background: `/readyz` is 503 until then.

Routes:

- `POST /classify` `{"text": str}` -> `{"label": int, "probability": float}` (the
  probability of that label): the handler tokenizes, and the proxy pads each batch
  (up to `batch_size` texts) and runs one forward pass for it. On a CUDA device the
  proxy's worker thread is bound to the device (`WorkerThread(device=...)`), the
  padded batch is copied there pinned and non-blocking, the probabilities come back
  to the CPU once per batch. With `--overlap` (on a CPU too) the next batch's
  collate and copy overlap the current batch's compute (off by default: see
  docs/scaling-out.md, "On a GPU").
- `POST /classify/regular`: the same body and answer, the regular way: one forward
  pass per request on one model thread, no batching.
- `POST /constant`: the same body, a constant answer; the model is not touched (what
  the HTTP stack alone costs).
- `GET /livez`, `GET /readyz` (`batchproxy.integrations.fastapi`), `GET /metrics`
  (Prometheus text, with the batch-size histogram).

An empty or blank text is answered 422.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from bert_classifier import build_model
from embeddings import OneAtATime
from fastapi import Depends, FastAPI, Response
from minilm import MiniLMEmbedder, load_tokenizer, tokenize
from prometheus_client import CollectorRegistry
from pydantic import BaseModel, Field, field_validator
from transformers import PreTrainedTokenizerBase
from typing_extensions import override

from batchproxy import WorkerThread
from batchproxy.integrations.fastapi import Serving, install
from batchproxy.integrations.prometheus import CONTENT_TYPE, PrometheusMetrics, render
from batchproxy.tensors import Collated

__all__ = [
    "MODELS",
    "BertClassifier",
    "Classification",
    "ClassifyRequest",
    "classify_alone",
    "create_app",
    "load_bert",
    "probabilities",
]

MODELS: dict[str, dict[str, int]] = {
    "bert-tiny": {
        "layers": 2,
        "hidden_size": 128,
        "num_attention_heads": 2,
        "intermediate_size": 256,
    },
    "bert-base": {"layers": 12},  # BertConfig()'s defaults
    "bert-large": {
        "layers": 24,
        "hidden_size": 1024,
        "num_attention_heads": 16,
        "intermediate_size": 4096,
    },
}
"""The `BertConfig` of each model name (`layers`: `num_hidden_layers`)."""
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
MAX_TEXT_CHARS = 4096


def load_bert(
    name: str, device: str = "cpu", dtype: str = "float32", tokenizer: Any = None
) -> torch.nn.Module:
    """The classifier `name` (random weights, seed 0), built on `device` in `dtype`, eval."""
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer()
    with torch.device(device):  # built where it runs: no big copy from the CPU
        model = build_model(tokenizer, **MODELS[name])
    return model.to(dtype=DTYPES[dtype]).eval()


def probabilities(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """(n, L) token ids and mask -> (n, 2) float32 softmax probabilities of the labels."""
    with torch.inference_mode():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        return torch.softmax(logits.float(), dim=-1)


def classify_alone(tokenizer: PreTrainedTokenizerBase, model: torch.nn.Module, text: str) -> Any:
    """The text run alone, unpadded, no proxy: its (2,) probabilities, on the CPU."""
    device = next(model.parameters()).device
    item = tokenize(tokenizer, text)
    ids = item["input_ids"].unsqueeze(0).to(device)
    mask = item["attention_mask"].unsqueeze(0).to(device)
    return probabilities(model, ids, mask)[0].cpu()


class BertClassifier(MiniLMEmbedder):
    """Token-id dicts in (`tokenize(text)`), each caller's (2,) probabilities out.

    The tokenizing and padding are `MiniLMEmbedder`'s; the forward pass is the
    classifier's. Options go to `TensorProxy` (`device`, `output_device`, `offload`...).
    """

    @override
    def _forward(self, batch: Collated, /) -> torch.Tensor:
        if self.model is None:
            raise RuntimeError(f"{self.name}: the model is not loaded yet")
        data = batch.data
        return probabilities(self.model, data["input_ids"], data["attention_mask"])


def gpu_options(device: str, overlap: bool, name: str = "bert") -> dict[str, Any]:
    """The proxy's placement: on CUDA, inputs to the device and outputs back to the CPU, on
    a worker thread bound to the device; elsewhere, a worker thread of its own. With
    `overlap`, the thread pipelines the proxy's stages (collate and copy of the next batch
    on a second thread while this one computes)."""
    if not device.startswith("cuda"):
        return {"offload": WorkerThread(name, overlap=overlap)}
    return {
        "device": device,
        "output_device": "cpu",
        "offload": WorkerThread(name, device=device, overlap=overlap),
    }


class ClassifyRequest(BaseModel):
    text: str = Field(min_length=1, max_length=MAX_TEXT_CHARS, examples=["A sentence."])

    @field_validator("text")
    @classmethod
    def not_blank(cls, text: str) -> str:
        if not text.strip():
            raise ValueError("text must not be blank")
        return text


class Classification(BaseModel):
    label: int = Field(description="the label with the higher probability: 0 or 1")
    probability: float = Field(description="that label's softmax probability")


def answer(probs: torch.Tensor) -> Classification:
    label = int(probs.argmax())
    return Classification(label=label, probability=float(probs[label]))


def create_app(
    model_name: str = "bert-base",
    device: str = "cpu",
    dtype: str = "float32",
    batch_size: int = 64,
    *,
    overlap: bool = False,
    max_delay_ms: float = 2.0,
    max_queue_size: int | None = 4096,
    timeout: float | None = 60.0,
    model: torch.nn.Module | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> FastAPI:
    """The service. `model` given: used as is; else `load_bert(model_name, device, dtype)`
    at startup, in the background. `app.state.proxy`, `.regular`, `.serving`: its parts."""
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer()
    placement = gpu_options(device, overlap)
    proxy = BertClassifier(
        tokenizer,
        None,
        batch_size,
        max_delay_ms=max_delay_ms,
        max_queue_size=max_queue_size,
        timeout=timeout,
        pad_to_multiple_of=8,
        name="classify",
        **placement,
    )
    regular = OneAtATime(tokenizer, None, classify_alone, thread_name="bert-regular")

    async def load() -> None:
        loaded = model
        if loaded is None:
            loaded = await asyncio.to_thread(load_bert, model_name, device, dtype, tokenizer)
        proxy.model = regular.model = loaded

    serving = Serving(proxy, executors=[placement["offload"]], load=load)
    metrics = PrometheusMetrics(CollectorRegistry())  # a registry of this app's own
    metrics.instrument(proxy)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            async with serving.running():  # load in the background; drain at shutdown
                yield
        finally:
            regular.close()

    app = FastAPI(title=f"batchproxy {model_name} classifier", lifespan=lifespan)
    app.state.proxy, app.state.regular, app.state.serving = proxy, regular, serving
    install(app, serving)

    @app.post("/classify")
    async def classify(
        body: ClassifyRequest,
        classifier: BertClassifier = Depends(serving.provider(BertClassifier)),  # noqa: B008
    ) -> Classification:
        """Batched: the text is one request on the proxy, padded into a batch."""
        return answer(await classifier.inference(classifier.tokenize(body.text)))

    ready = Depends(serving.provider(BertClassifier))  # 503 while loading, as the batched route

    @app.post("/classify/regular", dependencies=[ready])
    async def classify_regular(body: ClassifyRequest) -> Classification:
        """The regular way: one forward pass for this text alone."""
        return answer(await regular.run(body.text))

    @app.post("/constant")
    async def constant(body: ClassifyRequest) -> Classification:
        """The HTTP floor: the same body and answer shape, the model untouched."""
        return Classification(label=0, probability=0.5)

    @app.get("/metrics")
    async def serve_metrics() -> Response:
        return Response(render(metrics.registry), headers={"Content-Type": CONTENT_TYPE})

    return app


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model", choices=sorted(MODELS), default="bert-base")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument(
        "--overlap",
        action="store_true",
        help="stage the next batch (collate, copy) while one computes: two batches in flight",
    )
    args = parser.parse_args()
    app = create_app(args.model, args.device, args.dtype, args.batch_size, overlap=args.overlap)
    uvicorn.run(app, host=args.host, port=args.port)


if __name__ == "__main__":
    main()
