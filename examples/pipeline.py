"""Three proxies composed in one event loop: tokenize -> embed -> score, each batching on its own.

Run it with `python examples/pipeline.py` (`--requests N` for another load).

A small semantic-search service: each request is a sentence, and its answer is
how relevant that sentence is to a fixed query (the cosine similarity of their
all-MiniLM-L6-v2 embeddings). A request goes through three stages with three
awaits, and each stage is its own proxy with its own queue, batch size and
batches:

1. `Tokenizer` (`Proxy[str, dict]`): a plain `def _inference` on its private
   worker thread, one call of the fast (Rust) tokenizer per batch of texts;
   each caller gets its own unpadded `input_ids` and `attention_mask`.
2. `MiniLMEmbedder` (the `TensorProxy` from `examples/minilm.py`): pads a batch
   of token dicts, runs the model once, mean-pools: one (384,) vector each.
3. `Scorer` (`Proxy[torch.Tensor, float]`): stacks a batch of embeddings and
   scores them against the query with one matrix product, as a reranking or
   classification head would.

The two model stages share one `WorkerThread` (the "several models on one GPU"
pattern: their batches never run at the same time and never on the event loop),
while tokenizing runs on a thread of its own, overlapping the models. 100
requests start at once; the script prints each stage's batches (each proxy
batches whatever has reached it: a whole wave of texts for the tokenizer, at most
32 for the embedder, and for the scorer the embeddings as each embedder batch
delivers them), the most relevant sentences, and checks every score against the
same sentence run alone, with no proxy and no padding, within 1e-4.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from minilm import (  # sets HF_HUB_OFFLINE=1 before transformers is imported
    MAX_TOKENS,
    MiniLMEmbedder,
    load_minilm,
    reference_embedding,
)
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from typing_extensions import override

from batchproxy import Proxy, ProxyStats, WorkerThread

REQUESTS = 100
TOLERANCE = 1e-4  # max abs difference between a pipeline score and the unbatched one
QUERY = "How do I train a neural network faster on a graphics card?"

Item = dict[str, torch.Tensor]

_SUBJECTS = (
    "The research team",
    "My neighbour",
    "A young engineer",
    "The small bakery downtown",
    "Our football coach",
    "The night-shift nurse",
    "A travelling musician",
    "The startup's data scientist",
    "Grandma",
    "The city council",
)
_ENDINGS = (
    "trained the neural network on a GPU and cut the training time in half.",
    "baked sourdough bread before sunrise.",
    "moved the model to a graphics card and used larger batches to speed up training.",
    "planted tomatoes along the garden fence.",
    "argued about the new parking rules for an hour.",
    "tuned the learning rate of a deep learning model overnight.",
    "played an old folk song on a borrowed guitar.",
    "ran the team through sprints in the rain.",
    "wrote a letter to a friend who lives by the sea.",
    "fixed the bicycle's chain with a spoon and some patience.",
)


def make_texts(count: int) -> list[str]:
    """`count` distinct sentences of different lengths and topics (deterministic)."""
    pairs = len(_SUBJECTS) * len(_ENDINGS)
    if not 1 <= count <= pairs:
        raise ValueError(f"count must be between 1 and {pairs}, got {count}")
    texts = []
    for i in range(count):
        subject = _SUBJECTS[i % len(_SUBJECTS)]
        ending = _ENDINGS[(i + i // len(_SUBJECTS)) % len(_ENDINGS)]
        texts.append(f"{subject} {ending}")
    return texts


class Tokenizer(Proxy[str, Item]):
    """Texts in, each text's own unpadded token ids and mask out (as `minilm.tokenize`)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, batch_size: int = 64) -> None:
        super().__init__(batch_size=batch_size, max_delay_ms=2.0, name="tokenize")
        self.tokenizer = tokenizer

    @override
    def _inference(self, texts: list[str]) -> list[Item]:
        # one call for the whole batch: the fast tokenizer encodes the texts in parallel
        encoded = self.tokenizer(texts, truncation=True, max_length=MAX_TOKENS)
        return [
            {
                "input_ids": torch.tensor(ids, dtype=torch.int64),
                "attention_mask": torch.tensor(mask, dtype=torch.int64),
            }
            for ids, mask in zip(encoded["input_ids"], encoded["attention_mask"], strict=True)
        ]


class Scorer(Proxy[torch.Tensor, float]):
    """Embeddings in, their relevance to the query out (cosine: both are unit vectors)."""

    def __init__(self, query: torch.Tensor, batch_size: int = 64, **options: Any) -> None:
        super().__init__(batch_size=batch_size, name="score", **options)
        self.query = query

    @override
    def _inference(self, embeddings: list[torch.Tensor]) -> list[float]:
        with torch.inference_mode():
            scores: list[float] = (torch.stack(embeddings) @ self.query).tolist()
        return scores


@dataclass(frozen=True)
class PipelineRun:
    """What `main()` computed: each text's score through the pipeline and unbatched."""

    texts: list[str]
    scores: list[float]
    references: list[float]
    stages: dict[str, ProxyStats]
    seconds: float

    @property
    def max_difference(self) -> float:
        return max(abs(s - r) for s, r in zip(self.scores, self.references, strict=True))


async def serve(
    tokenizer: PreTrainedTokenizerBase,
    model: PreTrainedModel,
    query: torch.Tensor,
    texts: Sequence[str],
    *,
    embed_batch_size: int = 32,
) -> tuple[list[float], dict[str, ProxyStats], float]:
    """Every text as its own request, all at once, through the three stages."""
    # the shared "GPU" thread: both model stages run their batches on it, one at a time
    async with (
        WorkerThread(name="models") as models,
        Tokenizer(tokenizer) as tokenize,
        MiniLMEmbedder(
            tokenizer, model, batch_size=embed_batch_size, offload=models, name="embed"
        ) as embed,
        Scorer(query, offload=models) as score,
    ):

        async def request(text: str) -> float:
            tokens = await tokenize.inference(text)
            vector = await embed.inference(tokens)
            return await score.inference(vector)

        started = time.perf_counter()
        scores = await asyncio.gather(*(request(text) for text in texts))
        seconds = time.perf_counter() - started
        stages = {proxy.name: proxy.stats for proxy in (tokenize, embed, score)}
    return list(scores), stages, seconds


def unbatched_score(
    tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel, query: torch.Tensor, text: str
) -> float:
    """The same computation for one text alone: no proxy, no batch, no padding."""
    return float(reference_embedding(tokenizer, model, text) @ query)


def stage_table(stages: dict[str, ProxyStats]) -> list[str]:
    lines = ["stage      requests  batches  mean batch  batch sizes"]
    for name, stats in stages.items():
        counts = " ".join(
            f"{size}x{count}" if count > 1 else str(size)
            for size, count in sorted(stats.batch_sizes.items(), reverse=True)
        )
        lines.append(
            f"{name:<10} {stats.requests:>8} {stats.batches:>8} "
            f"{stats.mean_batch_size:>11.1f}  {counts}"
        )
    return lines


def main(argv: Sequence[str] | None = None) -> PipelineRun:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=REQUESTS, help="concurrent requests")
    parser.add_argument("--embed-batch-size", type=int, default=32)
    args = parser.parse_args(argv)

    tokenizer, model = load_minilm()
    query = reference_embedding(tokenizer, model, QUERY)
    texts = make_texts(args.requests)

    scores, stages, seconds = asyncio.run(
        serve(tokenizer, model, query, texts, embed_batch_size=args.embed_batch_size)
    )
    references = [unbatched_score(tokenizer, model, query, text) for text in texts]
    run = PipelineRun(texts, scores, references, stages, seconds)

    print(f"requests:  {len(texts)} at once, each tokenize -> embed -> score (three awaits)")
    print(f"wall time: {seconds:.2f} s")
    print("\n".join(stage_table(stages)))
    print(f'query:     "{QUERY}"')
    print("most relevant:")
    ranked = sorted(zip(scores, texts, strict=True), reverse=True)
    for value, text in ranked[:3]:
        print(f"  {value:+.3f}  {text}")
    print("least relevant:")
    value, text = ranked[-1]
    print(f"  {value:+.3f}  {text}")
    print(f"max |pipeline - unbatched| score: {run.max_difference:.1e} (tolerance {TOLERANCE:g})")
    if run.max_difference > TOLERANCE:
        raise SystemExit("a pipeline score differs from the unbatched computation")
    return run


if __name__ == "__main__":
    main()
