"""The embedding service's model layer, shared by `fastapi_app.py` and `aiohttp_app.py`.

Two ways to embed the same texts with the same all-MiniLM-L6-v2 weights
(`minilm.py`: offline, `torch.inference_mode()`, mean pooling, L2-normalised):

- batched: the apps queue each text on `EmbeddingService.proxy`, a
  `MiniLMEmbedder` (`offload=True`), bounded by `max_queue_size` and a per-call
  `timeout`;
- the regular way: `EmbeddingService.embed_regular` runs one forward pass per
  text on a single model thread, in arrival order, as a naive server does
  (`OneAtATime`: no batching, no queue bound, no deadline).

Requests are parsed and checked here too (`parse_json`, `EmbeddingService.parse`),
and every refusal is a `ServiceError` carrying its HTTP status: bad JSON or empty
text 422, oversized text or too many texts 413. batchproxy's own errors (queue
full, deadline, not loaded yet) are answered by the apps' `batchproxy.integrations`
helper.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from minilm import MiniLMEmbedder, load_model, reference_embedding
from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "MAX_TEXTS",
    "MAX_TEXT_CHARS",
    "EmbeddingService",
    "OneAtATime",
    "ServiceError",
    "parse_json",
    "serve_options",
]

MAX_TEXT_CHARS = 4096
"""Longest text accepted (characters); the model reads at most 256 tokens of it anyway."""
MAX_TEXTS = 64
"""Most texts in one `{"texts": [...]}` request."""


class ServiceError(Exception):
    """A refused request: `status` and `detail` become the HTTP response."""

    def __init__(self, status: int, detail: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.headers = headers or {}


def parse_json(raw: bytes) -> object:
    """The request body as JSON, or a 422 `ServiceError` saying why not."""
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ServiceError(422, f"request body is not valid JSON: {exc}") from None


class OneAtATime:
    """The regular way: one forward pass per text, serialized on one model thread.

    Each text is tokenized and run alone (`run_alone`, by default
    `minilm.reference_embedding`: batch of one, no padding) on a single worker
    thread, in arrival order: what a server that calls the model from its
    handler does. It neither batches nor bounds its queue. `model` may be None
    until the service's `load()`.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        model: Any,
        run_alone: Callable[[PreTrainedTokenizerBase, Any, str], Any] = reference_embedding,
        thread_name: str = "minilm-regular",
    ) -> None:
        self.tokenizer = tokenizer
        self.model = model
        self.run_alone = run_alone  # (tokenizer, model, text) -> the text's result
        self.calls = 0
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=thread_name)

    async def run(self, text: str) -> Any:
        """`run_alone(tokenizer, model, text)` on the model thread, after the earlier texts."""
        if self.model is None:
            raise RuntimeError("the model is not loaded yet")
        loop = asyncio.get_running_loop()
        result = await loop.run_in_executor(
            self._thread, self.run_alone, self.tokenizer, self.model, text
        )
        self.calls += 1
        return result

    async def embed(self, text: str) -> torch.Tensor:
        result: torch.Tensor = await self.run(text)
        return result

    def close(self) -> None:
        self._thread.shutdown(wait=True, cancel_futures=True)


class EmbeddingService:
    """The batched proxy and the regular path over one model.

    `model` None: `await load()` reads the weights (the app's startup, through
    `Serving(load=service.load)`). The app starts and drains `proxy` (with
    `Serving`) and closes `regular` after.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        model: PreTrainedModel | None,
        *,
        batch_size: int = 32,
        max_delay_ms: float = 5.0,
        max_queue_size: int | None = 512,
        timeout: float | None = 10.0,
        max_text_chars: int = MAX_TEXT_CHARS,
        max_texts: int = MAX_TEXTS,
    ) -> None:
        self.proxy = MiniLMEmbedder(
            tokenizer,
            model,
            batch_size,
            max_delay_ms=max_delay_ms,
            max_queue_size=max_queue_size,
            timeout=timeout,
            offload=True,
            name="embed",
        )
        self.regular = OneAtATime(tokenizer, model)
        self.max_text_chars = max_text_chars
        self.max_texts = max_texts

    async def load(self) -> None:
        """Read the weights, off the event loop, unless the constructor was given them."""
        if self.proxy.model is None:
            model = await asyncio.to_thread(load_model)
            self.proxy.model = self.regular.model = model

    def parse(self, body: object) -> tuple[list[str], bool]:
        """`{"text": str}` or `{"texts": [str, ...]}` -> (texts, whether it was one text)."""
        if not isinstance(body, dict) or len(body.keys() & {"text", "texts"}) != 1:
            raise ServiceError(
                422, 'body must be a JSON object with "text": str or "texts": [str, ...]'
            )
        single = "text" in body
        texts = [body["text"]] if single else body["texts"]
        if not isinstance(texts, list) or not texts:
            raise ServiceError(422, '"texts" must be a non-empty list of strings')
        if len(texts) > self.max_texts:
            raise ServiceError(413, f"too many texts: {len(texts)} > {self.max_texts} per request")
        for text in texts:
            if not isinstance(text, str):
                raise ServiceError(422, f"each text must be a string, got {type(text).__name__}")
            if not text.strip():
                raise ServiceError(422, "text must not be empty")
            if len(text) > self.max_text_chars:
                raise ServiceError(
                    413, f"text too long: {len(text)} > {self.max_text_chars} characters"
                )
        return texts, single

    async def embed_regular(self, texts: Sequence[str]) -> list[list[float]]:
        """The regular way: one forward pass per text, one after the other."""
        return [(await self.regular.embed(text)).tolist() for text in texts]


def serve_options(description: str, port: int) -> tuple[str, int, dict[str, Any]]:
    """The apps' command line: (host, port, `create_app` options)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=port)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-queue-size", type=int, default=512)
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds per call")
    args = parser.parse_args()
    options = {
        "batch_size": args.batch_size,
        "max_queue_size": args.max_queue_size,
        "timeout": args.timeout,
    }
    return args.host, args.port, options
