"""Token streaming and continuous batching: a GPT-2 model behind a `GenerationProxy`.

    python examples/generate.py                  # a few concurrent prompts, streamed
    python examples/generate.py --serve --port 8000
    curl -N 127.0.0.1:8000/generate -H 'Content-Type: application/json' \\
         -d '{"prompt": "Hello", "max_new_tokens": 20}'

The model is the GPT-2 architecture (`transformers.GPT2LMHeadModel`) with random
weights from a fixed seed: nothing is downloaded, so its text is gibberish, but
every stream is exactly what the model would generate for that prompt alone
(`greedy_decode`, the unbatched reference), however the requests overlap.

Tokenizer: bytes. A prompt's tokens are the bytes of its UTF-8 text (ids 0-255);
id 256 (`EOS`) ends a sequence. `encode` and `decode` convert.

The engine (`Engine`, `KV`, `GreedyBatch`) keeps one KV cache for all running
sequences, left-padded: row i's real tokens are the last `lengths[i]` columns in
use, and position ids count each row's real tokens while the attention mask hides
the padding. Its buffers keep spare columns that each decode step writes into in
place (`GrowingLayer`, a `DynamicLayer` that does not copy the whole cache every
step). Newcomers are prefilled as a batch of their own, then take the rows that
sequences left (copying their own cache only), or are appended (`KV.concat`, the
narrower cache padded on the left); the cache is rebuilt without free rows and
without the columns that are padding in every row (`KV.select`) when that pays.

- `Gpt2Generator`: continuous batching. Its `_step` (a plain `def`, so it runs on
  the proxy's worker thread) advances every active sequence by one token; new
  requests join at the next step, finished ones leave at once.
- `StaticGenerator`: static batching, for comparison (`benchmarks/models/generation.py`):
  a `Proxy` whose `_inference` generator runs one batch to completion while new
  requests wait.
- `create_app`: a FastAPI service; `POST /generate` `{"prompt": str,
  "max_new_tokens": int}` answers `text/event-stream` (sse-starlette's
  `EventSourceResponse`): one `data: {"token": id, "text": str}` event per token,
  then `event: end` with `data: {"tokens": n, "text": str}` (the texts, end
  included, add up to the decoded continuation: a character split over tokens
  comes with its last byte). A client that disconnects drops its stream, freeing
  its slot; a server shutting down lets running streams end.
"""

from __future__ import annotations

import os

# before transformers (and huggingface_hub) is imported: never reach for the hub
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import asyncio
import codecs
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Generator, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache, GPT2Config, GPT2LMHeadModel
from transformers.cache_utils import DynamicLayer
from typing_extensions import override

from batchproxy import GenerationProxy, Last, Proxy, Step

try:  # the service's packages: the model, the engine and the generators need none of them
    from fastapi import Depends, FastAPI, HTTPException
    from pydantic import BaseModel, Field
    from sse_starlette import EventSourceResponse, ServerSentEvent

    from batchproxy.integrations.fastapi import Serving, install
except ImportError as missing:  # (e.g. on a GPU machine with torch and transformers only)
    _SERVICE_MISSING: ImportError | None = missing
else:
    _SERVICE_MISSING = None

__all__ = [
    "EOS",
    "KV",
    "Engine",
    "Gpt2Generator",
    "GreedyBatch",
    "Prompt",
    "StaticGenerator",
    "build_model",
    "create_app",
    "decode",
    "encode",
    "greedy_decode",
]

EOS = 256
"""The end-of-sequence token; 0-255 are bytes."""
VOCAB_SIZE = 257

Chunk = int | Last[int] | Exception


def encode(text: str) -> tuple[int, ...]:
    """The byte-level tokenizer: one token per UTF-8 byte."""
    return tuple(text.encode())


def decode(tokens: Sequence[int]) -> str:
    """Tokens back to text (EOS dropped; bytes that are not valid UTF-8 become U+FFFD)."""
    return bytes(token for token in tokens if token != EOS).decode(errors="replace")


@dataclass(frozen=True)
class Prompt:
    """One request: the prompt's tokens and how many tokens to generate at most."""

    ids: tuple[int, ...]
    max_new_tokens: int

    def __post_init__(self) -> None:
        if not self.ids:
            raise ValueError("a prompt needs at least one token")
        if not all(0 <= token < VOCAB_SIZE for token in self.ids):
            raise ValueError(f"token ids go from 0 to {VOCAB_SIZE - 1}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

    @classmethod
    def of(cls, text: str, max_new_tokens: int) -> Prompt:
        """A prompt from text."""
        return cls(encode(text), max_new_tokens)


def build_model(
    *,
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_positions: int = 512,
    seed: int = 0,
    initializer_range: float = 0.1,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> GPT2LMHeadModel:
    """A GPT-2 with random weights from `seed` (eval mode, on `device`).

    The weights are drawn on the CPU, then moved, so a seed gives the same model on
    every device.

    The output head is not tied to the input embedding: with tied random weights the
    likeliest next token is nearly always the current one, and every stream would
    repeat its prompt's last byte, whatever the context.
    """
    config = GPT2Config(
        vocab_size=VOCAB_SIZE,
        n_positions=n_positions,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        initializer_range=initializer_range,
        tie_word_embeddings=False,
        bos_token_id=EOS,
        eos_token_id=EOS,
    )
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(config)
    # torch's own `to` and `train`: transformers' overrides (which only add checks for
    # quantized models) carry no type annotations mypy can use
    torch.nn.Module.to(model, device=device, dtype=dtype)
    torch.nn.Module.train(model, False)  # eval mode
    return model


def greedy_decode(
    model: GPT2LMHeadModel, ids: Sequence[int], max_new_tokens: int, *, eos: int = EOS
) -> list[int]:
    """The reference: `ids` alone (a batch of one, no padding), greedy, with the KV cache.

    Stops after `max_new_tokens` tokens or at `eos` (which is included).
    """
    out: list[int] = []
    cache = DynamicCache()
    tokens = torch.tensor([list(ids)], device=model.device)
    with torch.inference_mode():
        while len(out) < max_new_tokens:
            logits = model(input_ids=tokens, past_key_values=cache, use_cache=True).logits
            token = int(logits[0, -1].argmax())
            out.append(token)
            if token == eos:
                break
            tokens = torch.tensor([[token]], device=model.device)
    return out


SPARE = 64
"""Free columns a cache keeps for the tokens to come: decode steps write into them in
place, and a full cache grows by this many more (one copy every SPARE steps)."""


@dataclass(frozen=True)
class KV:
    """A batched, left-padded KV cache with room to grow.

    `buffers[l]` is model layer l's `(keys, values)`, each `[rows, heads, capacity,
    head_dim]`. The first `columns` columns are in use; row i's real tokens are the
    last `lengths[i]` of them, the columns before are padding. A forward pass writes
    the next columns in place, so the `KV` it was given is used up.
    """

    buffers: list[tuple[torch.Tensor, torch.Tensor]]
    lengths: torch.Tensor
    columns: int

    @property
    def rows(self) -> int:
        return int(self.lengths.shape[0])

    def select(self, rows: Sequence[int]) -> KV | None:
        """Keep `rows` (in that order), then drop the columns that are padding in all
        of them; None when no row is left."""
        if not rows:
            return None
        if list(rows) == list(range(self.rows)):
            return self  # nobody left: nothing to prune, no column became all padding
        index = torch.tensor(list(rows), dtype=torch.long)
        lengths = self.lengths[index]
        columns = int(lengths.max())
        start = self.columns - columns  # the spare columns stay spare
        buffers = [(k[index, :, start:], v[index, :, start:]) for k, v in self.buffers]
        return KV(buffers, lengths, columns)

    def concat(self, other: KV) -> KV:
        """`self`'s rows then `other`'s, the narrower cache padded on the left."""
        columns = max(self.columns, other.columns)
        buffers = [
            (
                _stack(keys[:, :, : self.columns], other_keys[:, :, : other.columns], columns),
                _stack(values[:, :, : self.columns], other_values[:, :, : other.columns], columns),
            )
            for (keys, values), (other_keys, other_values) in zip(
                self.buffers, other.buffers, strict=True
            )
        ]
        return KV(buffers, torch.cat([self.lengths, other.lengths]), columns)

    def place(self, other: KV, rows: Sequence[int]) -> None:
        """Write `other`'s rows over `rows` of this cache, in place, right-aligned
        (`other` must be no wider)."""
        assert other.columns <= self.columns
        index = torch.tensor(list(rows), dtype=torch.long)
        pad = self.columns - other.columns
        for mine, theirs in zip(self.buffers, other.buffers, strict=True):
            for buffer, new in zip(mine, theirs, strict=True):
                buffer[index, :, :pad] = 0
                buffer[index, :, pad : self.columns] = new[:, :, : other.columns]
        self.lengths[index] = other.lengths


def _stack(top: torch.Tensor, bottom: torch.Tensor, columns: int) -> torch.Tensor:
    """`top`'s rows then `bottom`'s in a new buffer of `columns + SPARE` columns, each
    right-aligned in the first `columns` (zeros before, the spare ones left unset)."""
    rows = top.shape[0]
    out = top.new_empty((rows + bottom.shape[0], top.shape[1], columns + SPARE, top.shape[3]))
    for part, tensor in ((out[:rows], top), (out[rows:], bottom)):
        pad = columns - tensor.shape[2]
        part[:, :, :pad] = 0  # masked out, but must not be NaN: 0 * NaN is NaN
        part[:, :, pad:columns] = tensor
    return out


class GrowingLayer(DynamicLayer):  # type: ignore[no-untyped-call]  # transformers' __init_subclass__
    """A `DynamicLayer` over buffers with spare columns. `update` writes the new keys
    and values into them in place, where `DynamicLayer.update` concatenates (a copy
    of the layer's whole cache at every step); `keys` and `values` are views of the
    columns in use, which is all the model reads."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, columns: int) -> None:
        # what DynamicLayer.__init__ and lazy_initialization set (typed here)
        self.is_initialized = True
        self.dtype, self.device = keys.dtype, keys.device
        self.buffers = (keys, values)
        self.columns = columns
        self.keys, self.values = keys[:, :, :columns], values[:, :, :columns]

    @override
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        start, end = self.columns, self.columns + key_states.shape[2]
        keys, values = self.buffers
        if end > keys.shape[2]:  # full: a copy with SPARE more columns
            keys, values = _grow(keys, start, end), _grow(values, start, end)
            self.buffers = (keys, values)
        keys[:, :, start:end] = key_states
        values[:, :, start:end] = value_states
        self.columns = end
        self.keys, self.values = keys[:, :, :end], values[:, :, :end]
        return self.keys, self.values


def _grow(buffer: torch.Tensor, used: int, columns: int) -> torch.Tensor:
    """A buffer of `columns + SPARE` columns holding the first `used` of `buffer`."""
    out = buffer.new_empty((*buffer.shape[:2], columns + SPARE, buffer.shape[3]))
    out[:, :, :used] = buffer[:, :, :used]
    return out


def _real(lengths: torch.Tensor, columns: int) -> torch.Tensor:
    """The attention mask, `[rows, columns]`: 1 on the last `lengths[i]` columns of row i."""
    return (torch.arange(columns) >= columns - lengths[:, None]).long()


class Engine:
    """Batched forward passes over a `KV`: prefill newcomers, one decode step for all.

    The cache buffers and the model's inputs are on the model's device; the row
    bookkeeping (`KV.lengths`, row indexes) stays on the CPU, so it costs no device
    round trip.
    """

    def __init__(self, model: GPT2LMHeadModel) -> None:
        self.model = model
        self.device = model.device
        config = model.config
        self.max_positions: int = config.n_positions
        """The most tokens a sequence can hold: its prompt plus its new tokens."""
        self._shape = (config.n_layer, config.n_head, config.n_embd // config.n_head)

    def prefill(self, prompts: Sequence[Sequence[int]]) -> tuple[KV, torch.Tensor]:
        """Run the prompts as one left-padded batch: their cache, and the logits
        `[rows, vocab]` of each prompt's next token."""
        lengths = torch.tensor([len(ids) for ids in prompts])
        columns = int(lengths.max())
        ids = torch.zeros(len(prompts), columns, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, columns - len(prompt) :] = torch.tensor(list(prompt))
        # a token's position is the number of real tokens before it (padding: 0)
        positions = (torch.arange(columns) - (columns - lengths[:, None])).clamp(min=0)
        layers, heads, head_dim = self._shape
        shape = (len(prompts), heads, columns + SPARE, head_dim)
        dtype, device = self.model.dtype, self.device
        # every column up to `columns` gets written (padding included), the rest is spare
        buffers = [
            (
                torch.empty(shape, dtype=dtype, device=device),
                torch.empty(shape, dtype=dtype, device=device),
            )
            for _ in range(layers)
        ]
        empty = KV(buffers, torch.zeros(len(prompts), dtype=torch.long), 0)
        return self._forward(empty, ids, positions, lengths)

    def decode(self, kv: KV, tokens: Sequence[int]) -> tuple[KV, torch.Tensor]:
        """Append one token per row: the grown cache and the next tokens' logits."""
        ids = torch.tensor(list(tokens), dtype=torch.long)[:, None]
        return self._forward(kv, ids, kv.lengths[:, None], kv.lengths + 1)

    def _forward(
        self, kv: KV, ids: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor
    ) -> tuple[KV, torch.Tensor]:
        """Run `ids` (`[rows, new columns]`) after `kv`; `lengths`: the real tokens per
        row afterwards."""
        layers = [GrowingLayer(keys, values, kv.columns) for keys, values in kv.buffers]
        cache = DynamicCache()
        cache.layers.extend(layers)
        columns = kv.columns + ids.shape[1]
        device = self.device
        with torch.inference_mode():
            out = self.model(
                input_ids=ids.to(device, non_blocking=True),
                position_ids=positions.to(device, non_blocking=True),
                attention_mask=_real(lengths, columns).to(device, non_blocking=True),
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
        return KV([layer.buffers for layer in layers], lengths, columns), out.logits[:, -1]


class GreedyBatch:
    """Greedy decoding of a changing set of sequences: the state both generators drive.

    The cache has a row per sequence (`rows[i]` is the row of the i-th, in step order),
    plus free rows, left by sequences that ended. A decode step runs every row (a free
    one computes padding), so a sequence leaving costs no copy, and a newcomer takes a
    free row when its prompt fits in the cache's width (a copy of its own cache only).
    The cache is rebuilt around the live rows (`KV.select`, `KV.concat`: a copy of it
    all) when a newcomer does not fit, when rows stay free for `IDLE_STEPS` steps or
    outnumber the live ones, or when SPARE leading columns are padding in every live
    row. A row's cache holds its prompt and every token it generated but the newest,
    `tokens[row]`, which the next decode step feeds in.

    `reuse_rows=False` rebuilds the cache as soon as a sequence leaves: for static
    batching, where no newcomer will take a free row.
    """

    IDLE_STEPS = 4

    def __init__(self, engine: Engine, *, eos: int = EOS, reuse_rows: bool = True) -> None:
        self.engine = engine
        self.eos = eos
        self.reuse_rows = reuse_rows
        self.kv: KV | None = None
        self.rows: list[int] = []
        self.tokens: list[int] = []
        self.remaining: list[int] = []
        self.idle = 0  # steps in a row with free rows and no newcomer

    def step(self, kept: Sequence[int], joined: Sequence[Prompt]) -> list[Chunk]:
        """Keep the sequences `kept` (positions in the last step's order), advance them
        by one token, add `joined`; one chunk per sequence (kept, then joined): a token,
        `Last` when its sequence ends, or a ValueError for a prompt too long."""
        self.rows = [self.rows[i] for i in kept]
        self.remaining = [self.remaining[i] for i in kept]
        if not self.rows:
            self.kv = None
        if self.kv is not None:
            if self._wasteful(self.kv, len(joined)):
                self._compact(self.kv)
            self._decode(self.kv)
        fits = [len(p.ids) + p.max_new_tokens <= self.engine.max_positions for p in joined]
        if joined:
            # a prompt that does not fit gets a one-token row, freed at the next step
            self._join([p.ids if ok else p.ids[:1] for p, ok in zip(joined, fits, strict=True)])
            self.remaining += [prompt.max_new_tokens for prompt in joined]
        self.remaining = [left - 1 for left in self.remaining]
        chunks: list[Chunk] = []
        for row, left in zip(self.rows, self.remaining, strict=True):
            token = self.tokens[row]
            chunks.append(Last(token) if token == self.eos or left == 0 else token)
        for index, ok in enumerate(fits):
            if not ok:
                chunks[len(kept) + index] = ValueError(
                    f"prompt + max_new_tokens > {self.engine.max_positions} tokens"
                )
        return chunks

    def _wasteful(self, kv: KV, joining: int) -> bool:
        """Whether to rebuild the cache before this step (see the class docstring);
        counts the steps rows stay free with nobody joining."""
        live = len(self.rows)
        free = kv.rows - live - joining  # rows that stay free through this step
        self.idle = self.idle + 1 if free > 0 and not joining else 0
        if kv.columns - int(kv.lengths[self.rows].max()) >= SPARE:
            return True
        if not self.reuse_rows:
            return free > 0
        return free > live or self.idle >= self.IDLE_STEPS

    def _compact(self, kv: KV) -> KV:
        """Rebuild the cache with the live rows only, in step order."""
        compact = kv.select(self.rows)
        assert compact is not None
        self.kv, self.tokens = compact, [self.tokens[row] for row in self.rows]
        self.rows = list(range(len(self.rows)))
        return compact

    def _decode(self, kv: KV) -> None:
        """One token for every row (free rows: a one-column padding row, discarded)."""
        free = sorted(set(range(kv.rows)) - set(self.rows))
        kv.lengths[free] = 0
        self.kv, logits = self.engine.decode(kv, self.tokens)
        self.tokens = logits.argmax(-1).tolist()

    def _join(self, prompts: Sequence[Sequence[int]]) -> None:
        """Prefill `prompts` and give each a row: free rows if they fit, else new ones."""
        new, logits = self.engine.prefill(prompts)
        kv = self.kv
        free = [] if kv is None else sorted(set(range(kv.rows)) - set(self.rows))
        if kv is not None and new.columns <= kv.columns and len(free) >= new.rows:
            rows = free[: new.rows]
            kv.place(new, rows)
        elif kv is None:
            self.kv, self.tokens, rows = new, [0] * new.rows, list(range(new.rows))
        else:
            base = self._compact(kv)
            self.kv = base.concat(new)
            rows = list(range(base.rows, self.kv.rows))
            self.tokens += [0] * new.rows
        for row, token in zip(rows, logits.argmax(-1).tolist(), strict=True):
            self.tokens[row] = token
        self.rows += rows


def _prompt_tokens(prompt: Prompt) -> int:
    """The most KV-cache columns a request can take: its prompt plus its new tokens."""
    return len(prompt.ids) + prompt.max_new_tokens


class Gpt2Generator(GenerationProxy[Prompt, int]):
    """Continuous batching: every step advances all active sequences by one token.

    `batch_size` bounds the active sequences, `max_tokens` the sum of their prompt
    plus `max_new_tokens` (a stand-in for KV-cache memory); `options` go to
    `GenerationProxy`. Requests join at the next step and leave as soon as they end,
    so nobody waits for a whole batch. A prompt plus its `max_new_tokens` must fit in
    `max_positions` tokens (its stream fails with ValueError otherwise). `steps`
    counts the steps run.
    """

    def __init__(
        self,
        model: GPT2LMHeadModel,
        *,
        batch_size: int = 16,
        max_tokens: int | None = None,
        eos: int = EOS,
        **options: Any,
    ) -> None:
        super().__init__(
            batch_size,
            max_batch_tokens=max_tokens,
            length=None if max_tokens is None else _prompt_tokens,
            **options,
        )
        self.batch = GreedyBatch(Engine(model), eos=eos)
        self.max_positions = self.batch.engine.max_positions
        self.steps = 0

    @override
    def _step(self, step: Step[Prompt]) -> list[Chunk]:
        """One token for every active sequence (on the proxy's worker thread)."""
        self.steps += 1
        return self.batch.step(step.kept, [slot.item for slot in step.joined])


class StaticGenerator(Proxy[Prompt, int]):
    """Static batching: a batch runs to completion before the next one starts.

    Rows that end are pruned as they go (so the batch gets cheaper), but new
    requests wait for the whole batch, however long its longest sequence.
    """

    def __init__(self, model: GPT2LMHeadModel, *, eos: int = EOS, **options: Any) -> None:
        super().__init__(**options)
        self.engine = Engine(model)
        self.eos = eos

    @override
    def _inference(self, prompts: list[Prompt]) -> Generator[list[Chunk], list[int], None]:
        batch = GreedyBatch(self.engine, eos=self.eos, reuse_rows=False)
        chunks = batch.step([], prompts)
        while True:
            keep = yield chunks
            if not keep:
                return
            chunks = batch.step(keep, [])


if _SERVICE_MISSING is None:

    class GenerateRequest(BaseModel):
        """The body of `POST /generate`."""

        prompt: str = Field(min_length=1, max_length=1000)
        max_new_tokens: int = Field(default=32, ge=1, le=256)


SHUTDOWN_GRACE = 30.0
"""Seconds a stream may run on once the server shuts down (sse-starlette cancels it then)."""


def sse(data: object, *, event: str | None = None) -> ServerSentEvent:
    """One server-sent event: an optional `event:` line, one `data:` line of JSON."""
    return ServerSentEvent(json.dumps(data), event=event)


async def _events(first: int, stream: AsyncGenerator[int, None]) -> AsyncIterator[ServerSentEvent]:
    """The events: one per token (its id and the text it completes), then `end`.
    Closing this (the client went away) closes the stream."""
    text = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def event(token: int) -> ServerSentEvent:
        return sse({"token": token, "text": "" if token == EOS else text.decode(bytes([token]))})

    count = 1
    async with aclosing(stream):
        yield event(first)
        try:
            async for token in stream:
                count += 1
                yield event(token)
        except Exception as error:  # the model failed mid-stream: say so, then stop
            yield sse({"detail": str(error) or type(error).__name__}, event="error")
            return
    yield sse({"tokens": count, "text": text.decode(b"", final=True)}, event="end")


def create_app(generator: Gpt2Generator | None = None) -> FastAPI:
    """The streaming service around `generator` (default: a `Gpt2Generator` on
    `build_model()`); the app starts it and closes it at shutdown, answers its
    errors (a full queue 503 with `Retry-After`) and serves `/livez` and `/readyz`."""
    if _SERVICE_MISSING is not None:
        raise ImportError(
            f"the service needs fastapi, pydantic and sse-starlette: {_SERVICE_MISSING}"
        ) from _SERVICE_MISSING
    serving = Serving(generator or Gpt2Generator(build_model(), max_queue_size=256))
    app = FastAPI(title="batchproxy generation", lifespan=serving.lifespan)
    install(app, serving)
    ready_generator = Depends(serving.provider(Gpt2Generator))

    @app.post("/generate")
    async def generate(
        body: GenerateRequest, proxy: Gpt2Generator = ready_generator
    ) -> EventSourceResponse:
        """Stream the continuation of `prompt` as server-sent events."""
        prompt = Prompt.of(body.prompt, body.max_new_tokens)
        if len(prompt.ids) + prompt.max_new_tokens > proxy.max_positions:
            raise HTTPException(413, f"prompt + max_new_tokens > {proxy.max_positions} tokens")
        stream = proxy.stream(prompt)
        # wait for the first token before answering, so refusals get a status code
        try:  # (a full queue: the helper answers 503 with Retry-After)
            first = await anext(stream)
        except ValueError as error:  # over the proxy's token budget
            raise HTTPException(413, str(error)) from None
        # streams run to their end when the server stops, as uvicorn lets other requests do
        return EventSourceResponse(_events(first, stream), shutdown_grace_period=SHUTDOWN_GRACE)

    return app


DEMO_PROMPTS = [
    Prompt.of("Once upon a time", 40),
    Prompt.of("Hi", 12),
    Prompt.of("A much longer prompt, so that the batch really has to be padded on the left", 24),
    Prompt.of("Streaming, token by token:", 30),
    Prompt.of("Late", 16),
]


async def demo(model: GPT2LMHeadModel, prompts: Sequence[Prompt] = DEMO_PROMPTS) -> list[list[int]]:
    """Stream `prompts` at once through a `Gpt2Generator` of 3 slots (the others
    queue, then join as slots free up); print when each starts and ends; the streams."""
    streams: list[list[int]] = [[] for _ in prompts]
    start = time.perf_counter()

    def log(index: int, what: str) -> None:
        print(f"{(time.perf_counter() - start) * 1e3:7.1f} ms  #{index} {what}")

    async def consume(proxy: Gpt2Generator, index: int) -> None:
        async with aclosing(proxy.stream(prompts[index])) as tokens:  # closed however it ends
            async for token in tokens:
                if not streams[index]:
                    log(index, f"first token (step {proxy.steps})")
                streams[index].append(token)
        log(index, f"done, {len(streams[index])} tokens (step {proxy.steps})")

    async with Gpt2Generator(model, batch_size=3) as proxy:
        await asyncio.gather(*(consume(proxy, index) for index in range(len(prompts))))
        steps = proxy.steps
    total = sum(map(len, streams))
    print(f"\n{total} tokens in {steps} steps (batch_size=3, {len(prompts)} prompts)\n")
    for index, (prompt, tokens) in enumerate(zip(prompts, streams, strict=True)):
        same = tokens == greedy_decode(model, prompt.ids, prompt.max_new_tokens)
        print(f"#{index} {decode(prompt.ids)!r} -> {decode(tokens)!r}")
        print(f"    {tokens}  (= unbatched greedy_decode: {'yes' if same else 'NO'})")
    return streams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--serve", action="store_true", help="run the SSE service instead")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    if args.serve:
        import uvicorn

        uvicorn.run(create_app(), host=args.host, port=args.port)
    else:
        # float64: no float32 near-ties between the batched and the unbatched argmax
        asyncio.run(demo(build_model(dtype=torch.float64)))


if __name__ == "__main__":
    main()
