"""The getting-started guide's `class BERTProxy(Proxy[str, float])`, on a BERT-base classifier.

Run it with `python examples/bert_classifier.py` (`--small` for a 2-layer model).

The model is the BERT-base architecture (12 layers, hidden size 768, 12 heads)
built from `transformers.BertConfig()` as `BertForSequenceClassification` with two
labels and random weights (`torch.manual_seed(0)`): nothing is downloaded, and the
probabilities are those of an untrained model (they carry no meaning and differ
little from text to text), but every one is a real forward pass. The text is
tokenized with the all-MiniLM-L6-v2 package's BERT tokenizer (the uncased
WordPiece vocabulary of BERT-base, loaded offline from the folder
`examples/minilm.py` finds), padded per batch to that batch's longest text.

32 coroutines each ask for one text's probability of class 1 at the same moment;
the proxy groups them into batches of at most 16, runs each batch's forward pass
on its worker thread (`offload=True`, so the event loop stays free), and every
caller gets the softmax probability of its own text. The script then runs each
text alone, unpadded, and checks the batched answers against those.
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
from minilm import load_tokenizer  # sets HF_HUB_OFFLINE=1 before transformers is imported
from transformers import (
    BatchEncoding,
    BertConfig,
    BertForSequenceClassification,
    PreTrainedTokenizerBase,
)
from typing_extensions import override

from batchproxy import Proxy, ProxyStats

TEXTS = 32
BATCH_SIZE = 16
MAX_TOKENS = 128  # truncation; BERT-base reads at most 512 positions
TOLERANCE = 1e-4  # max abs difference between a batched and a single-text probability

_OPENINGS = (
    "Honestly,",
    "After two weeks of use,",
    "My sister bought one and",
    "Compared with the previous model,",
    "For the price,",
    "The delivery was quick and",
    "I was sceptical at first, but",
    "Long story short:",
)
_VERDICTS = (
    "it works.",
    "the battery lasts all day and the screen is bright enough to read outside.",
    "the keyboard feels cheap.",
    "the speakers crackle at high volume and support never answered my emails.",
    "I would buy it again without thinking twice.",
    "the camera struggles in low light, although daylight photos look sharp and natural.",
    "it stopped charging after a month.",
    "setup took five minutes, the app is clear, and it has not crashed once since.",
)


def make_texts(count: int) -> list[str]:
    """`count` distinct short reviews of different lengths (deterministic)."""
    pairs = len(_OPENINGS) * len(_VERDICTS)
    if not 1 <= count <= pairs:
        raise ValueError(f"count must be between 1 and {pairs}, got {count}")
    texts = []
    for i in range(count):
        opening = _OPENINGS[i % len(_OPENINGS)]
        verdict = _VERDICTS[(i + i // len(_OPENINGS)) % len(_VERDICTS)]
        texts.append(f"{opening} {verdict}")
    return texts


def build_model(
    tokenizer: PreTrainedTokenizerBase, *, layers: int = 12, **config_options: Any
) -> BertForSequenceClassification:
    """BERT-base (`BertConfig()` defaults) with `layers` encoder layers and random weights;
    `config_options` change other `BertConfig` fields (`hidden_size=1024`, ...)."""
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(tokenizer),
        num_hidden_layers=layers,
        pad_token_id=tokenizer.pad_token_id,
        **config_options,
    )
    config.num_labels = 2  # classes 0 and 1
    model = BertForSequenceClassification(config)
    model.train(False)  # eval mode (no dropout); the same as model.eval()
    return model


def positive_probability(model: torch.nn.Module, tokens: BatchEncoding) -> torch.Tensor:
    """(n,) softmax probability of class 1 for a tokenized batch."""
    with torch.inference_mode():
        logits = model(**tokens).logits
        return torch.softmax(logits, dim=-1)[:, 1]


def classify_one(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, text: str) -> float:
    """The text run alone, unpadded, no proxy: what its batched result must equal."""
    tokens = tokenizer(text, truncation=True, max_length=MAX_TOKENS, return_tensors="pt")
    return float(positive_probability(model, tokens)[0])


class BERTProxy(Proxy[str, float]):
    """Texts in, the probability of class 1 out, one padded forward pass per batch."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        batch_size: int = BATCH_SIZE,
    ) -> None:
        # offload=True: the forward pass runs on the proxy's worker thread, so the
        # event loop keeps accepting requests and forming the next batch meanwhile
        super().__init__(batch_size=batch_size, max_delay_ms=5.0, offload=True)
        self.model = model
        self.tokenizer = tokenizer
        self.model_calls = 0

    @override
    async def _inference(self, arguments: list[str]) -> list[float]:
        self.model_calls += 1
        tokens = self.tokenizer(
            arguments, padding=True, truncation=True, max_length=MAX_TOKENS, return_tensors="pt"
        )
        probabilities: list[float] = positive_probability(self.model, tokens).tolist()
        return probabilities


@dataclass(frozen=True)
class ClassifierRun:
    """What `main()` computed: batched and single-text probabilities, per text."""

    texts: list[str]
    probabilities: list[float]
    singles: list[float]
    model_calls: int
    stats: ProxyStats
    seconds: float

    @property
    def max_difference(self) -> float:
        return max(abs(b - s) for b, s in zip(self.probabilities, self.singles, strict=True))


async def classify_concurrently(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    texts: Sequence[str],
    batch_size: int,
) -> tuple[list[float], int, ProxyStats, float]:
    """Every text from its own coroutine, all at once, through one `BERTProxy`."""
    async with BERTProxy(model, tokenizer, batch_size=batch_size) as proxy:
        started = time.perf_counter()
        probabilities = await asyncio.gather(*(proxy.inference(text) for text in texts))
        seconds = time.perf_counter() - started
        return list(probabilities), proxy.model_calls, proxy.stats, seconds


def main(argv: Sequence[str] | None = None) -> ClassifierRun:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--small", action="store_true", help="2 encoder layers instead of 12")
    parser.add_argument("--texts", type=int, default=TEXTS, help="concurrent texts (1-64)")
    parser.add_argument("--batch-size", type=int, default=BATCH_SIZE)
    args = parser.parse_args(argv)

    tokenizer = load_tokenizer()
    layers = 2 if args.small else 12
    model = build_model(tokenizer, layers=layers)
    texts = make_texts(args.texts)

    probabilities, calls, stats, seconds = asyncio.run(
        classify_concurrently(model, tokenizer, texts, args.batch_size)
    )
    singles = [classify_one(model, tokenizer, text) for text in texts]
    run = ClassifierRun(texts, probabilities, singles, calls, stats, seconds)

    sizes = ", ".join(f"{count} of {size}" for size, count in sorted(stats.batch_sizes.items()))
    print(f"model:       BERT-base architecture, {layers} layers, random weights (seed 0)")
    print(f"texts:       {len(texts)} concurrent callers, batch_size {args.batch_size}")
    print(f"model calls: {calls} batches ({sizes}) in {seconds:.2f} s")
    print("P(class 1)  text")
    for text, probability in zip(texts, probabilities, strict=True):
        shown = text if len(text) <= 70 else text[:67] + "..."
        print(f"  {probability:.4f}    {shown}")
    print(f"max |batched - single text|: {run.max_difference:.1e} (tolerance {TOLERANCE:g})")
    if run.max_difference > TOLERANCE:
        raise SystemExit("a batched probability differs from the text run alone")
    if not all(0.0 <= p <= 1.0 for p in probabilities):
        raise SystemExit("a probability outside [0, 1]")
    return run


if __name__ == "__main__":
    main()
