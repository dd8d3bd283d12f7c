"""Token generation: no batching, static batching and continuous batching, in the same run.

Run: `python -m benchmarks.models.generation` (or `make bench-generation`); `--quick` for a
smoke run. Prints Markdown tables and writes the numbers as JSON to
`benchmarks/results/`. Needs torch and transformers; nothing is downloaded (the
model is `examples/generate.py`'s GPT-2 with random weights, byte-level tokens).

The workload: 64 prompts of 4 to 48 bytes, made with `random.Random(0)`, asking for
varied numbers of new tokens: 62 want 4 to 32, and 2 (the first and the 33rd) want
320 to 400, as in a chat service where most answers are short and a few are long.
32 client coroutines each take the next prompt from the shared list, stream its
tokens to the end, then take the next, until all 64 are done. EOS is disabled (no
token ends a stream early), so every side generates exactly the same tokens.

The model: GPT-2, 12 layers, n_embd 128, 4 heads, float32. At this size a decode
step's cost is mostly fixed per step (per layer, as kernel launches and weight reads
are on an accelerator) and grows much slower than the batch: the run first measures
a decode step for 1 and for 32 sequences and prints both. Three sides, all on one
`WorkerThread` (as they would share one device; and torch keeps a CPU thread pool
per calling thread, whose idle pools slow a busy one down: everything torch does
here, the model's construction included, runs on that one thread):

- no batching: `Gpt2Generator(batch_size=1)`: one sequence at a time;
- static: `StaticGenerator(batch_size=32)`: a batch runs until its longest sequence
  ends (finished rows are pruned as they go); new requests wait for the whole batch;
- continuous: `Gpt2Generator(batch_size=32)`: every step advances all active
  sequences by one token; a request joins at the next step, leaves when it ends.

Each side is warmed up first. Static and continuous then run `repetitions` times,
taking turns (who goes first alternates); no batching runs once (it is the slow
one). Reported per side: generated tokens/s (all its tokens over all its seconds),
time to first token (from the request to its first token, p50 and p99 pooled over
repetitions), the time per request, and how many streams equal the no-batching ones
(the unbatched reference, token for token). Targets (printed next to the numbers,
not asserted): continuous >= 1.5x static tokens/s, and a lower p99 time to first
token. The ratio depends on the workload: the more the answer lengths vary, the
longer static batches keep their slots for a few long answers.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from generate import Engine, Gpt2Generator, Prompt, StaticGenerator, build_model
from transformers import GPT2LMHeadModel

from batchproxy import Proxy, WorkerThread
from benchmarks._harness.drain import drain
from benchmarks._harness.report import arguments, environment, headline, write_report

TARGET_RATIO = 1.5  # continuous tokens/s over static tokens/s
NO_EOS = -1  # no token id is -1: every stream runs to its max_new_tokens


@dataclass(frozen=True)
class Config:
    prompts: int
    concurrency: int
    batch_size: int
    repetitions: int
    n_layer: int
    n_embd: int
    n_head: int
    short_tokens: tuple[int, int]
    long_tokens: tuple[int, int]
    long_every: int
    prompt_bytes: tuple[int, int]


FULL = Config(
    prompts=64,
    concurrency=32,
    batch_size=32,
    repetitions=4,
    n_layer=12,
    n_embd=128,
    n_head=4,
    short_tokens=(4, 32),
    long_tokens=(320, 400),
    long_every=32,
    prompt_bytes=(4, 48),
)
QUICK = Config(
    prompts=16,
    concurrency=8,
    batch_size=8,
    repetitions=1,
    n_layer=2,
    n_embd=128,
    n_head=4,
    short_tokens=(4, 16),
    long_tokens=(48, 64),
    long_every=8,
    prompt_bytes=(4, 24),
)


def step_cost(model: GPT2LMHeadModel, rows: int, steps: int = 20) -> float:
    """Seconds per decode step for `rows` sequences of 48-token prompts (median), the
    next tokens' argmax included (as a generator's step does; on an accelerator, it
    waits for the step to finish)."""
    engine = Engine(model)
    kv, logits = engine.prefill([[65 + row % 26] * 48 for row in range(rows)])
    tokens = logits.argmax(-1).tolist()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        kv, logits = engine.decode(kv, tokens)
        tokens = logits.argmax(-1).tolist()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def workload(config: Config, seed: int = 0) -> list[Prompt]:
    """The prompts: random bytes of random lengths, mostly short answers, a few long."""
    rng = random.Random(seed)
    prompts = []
    for index in range(config.prompts):
        ids = tuple(rng.randrange(32, 127) for _ in range(rng.randint(*config.prompt_bytes)))
        low, high = config.long_tokens if index % config.long_every == 0 else config.short_tokens
        prompts.append(Prompt(ids, rng.randint(low, high)))
    return prompts


@dataclass
class Run:
    """One pass of the workload through one proxy."""

    seconds: float
    tokens: int
    ttft: list[float]  # seconds from the request to its first token, per request
    latency: list[float]  # seconds from the request to its last token, per request
    streams: list[list[int]]


async def run(proxy: Proxy[Prompt, int], prompts: Sequence[Prompt], concurrency: int) -> Run:
    """`concurrency` clients pull prompts from the shared list and stream each to the end."""
    ttft = [0.0] * len(prompts)

    async def stream(index: int) -> list[int]:
        asked = time.perf_counter()
        tokens: list[int] = []
        async for token in proxy.stream(prompts[index]):
            if not tokens:
                ttft[index] = time.perf_counter() - asked
            tokens.append(token)
        return tokens

    done = await drain(stream, range(len(prompts)), concurrency)
    return Run(done.seconds, sum(map(len, done.results)), ttft, done.latencies, done.results)


def make_proxy(
    side: str, model: GPT2LMHeadModel, config: Config, worker: WorkerThread
) -> Proxy[Prompt, int]:
    """The proxy for one side of the comparison, running its steps on `worker`."""
    if side == "no batching":
        return Gpt2Generator(model, batch_size=1, eos=NO_EOS, offload=worker)
    if side == "static":
        return StaticGenerator(model, batch_size=config.batch_size, eos=NO_EOS, offload=worker)
    return Gpt2Generator(model, batch_size=config.batch_size, eos=NO_EOS, offload=worker)


async def measure(
    config: Config, prompts: Sequence[Prompt]
) -> tuple[dict[str, list[Run]], tuple[float, float]]:
    """Build the model and time a decode step for 1 and for `batch_size` sequences; then
    warm every side up and run: no batching once, static and continuous in turns.

    All of it on one `WorkerThread`, as the sides would share one device: torch keeps
    a CPU thread pool per calling thread, and the idle pools of other threads slow
    the busy one down (2-3x on 2 cores)."""
    sides = ["no batching", "static", "continuous"]
    runs: dict[str, list[Run]] = {side: [] for side in sides}
    warmup = [Prompt(prompt.ids, 4) for prompt in prompts[: config.concurrency]]
    async with WorkerThread(name="generation-model") as worker:

        def prepare(_: object) -> tuple[GPT2LMHeadModel, tuple[float, float]]:
            model = build_model(n_layer=config.n_layer, n_embd=config.n_embd, n_head=config.n_head)
            return model, (step_cost(model, 1), step_cost(model, config.batch_size))

        model, costs = await worker.run(prepare, [])
        single, full = costs
        print(
            f"decode step: {single * 1e3:.1f} ms for 1 sequence, {full * 1e3:.1f} ms for "
            f"{config.batch_size} ({full / single:.1f}x the time, {config.batch_size}x the tokens)",
            flush=True,
        )
        proxies = {side: make_proxy(side, model, config, worker) for side in sides}
        try:
            for side, proxy in proxies.items():
                await run(proxy, warmup, config.concurrency)
                print(f"warmed up: {side}", flush=True)
            order = ["no batching"]
            for repetition in range(config.repetitions):  # take turns, who goes first alternates
                order += ["static", "continuous"][:: 1 if repetition % 2 == 0 else -1]
            for side in order:
                result = await run(proxies[side], prompts, config.concurrency)
                runs[side].append(result)
                rate = result.tokens / result.seconds
                print(f"{side}: {result.seconds:.2f} s, {rate:.0f} tokens/s", flush=True)
        finally:
            for proxy in proxies.values():
                await proxy.aclose()
    return runs, costs


def summary(
    side: str, runs: Sequence[Run], reference: Sequence[list[int] | None]
) -> dict[str, Any]:
    """One side's numbers, pooled over its runs; its streams are compared with
    `reference`'s (one per prompt; `None`: that prompt has none, not compared)."""
    seconds = sum(r.seconds for r in runs)
    tokens = sum(r.tokens for r in runs)
    ttft = sorted(t for r in runs for t in r.ttft)
    latency = sorted(t for r in runs for t in r.latency)
    pairs = [
        (s, want)
        for r in runs
        for s, want in zip(r.streams, reference, strict=True)
        if want is not None
    ]
    return {
        "side": side,
        "runs": len(runs),
        "run_seconds": [r.seconds for r in runs],
        "requests": sum(len(r.streams) for r in runs),
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "ttft_p50_ms": percentile(ttft, 0.50) * 1e3,
        "ttft_p99_ms": percentile(ttft, 0.99) * 1e3,
        "latency_p50_ms": percentile(latency, 0.50) * 1e3,
        "latency_p99_ms": percentile(latency, 0.99) * 1e3,
        "streams_compared": len(pairs),
        "streams_equal_reference": sum(s == want for s, want in pairs),
    }


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The nearest-rank percentile of already sorted values."""
    return sorted_values[min(len(sorted_values) - 1, max(0, round(q * len(sorted_values)) - 1))]


def table(summaries: Sequence[dict[str, Any]]) -> str:
    """The Markdown table of the sides."""
    lines = [
        "| side | requests | tokens | seconds | tokens/s | TTFT p50 (ms) | TTFT p99 (ms) "
        "| request p50 (ms) | request p99 (ms) | streams = reference |",
        "|:--|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for s in summaries:
        lines.append(
            f"| {s['side']} | {s['requests']} | {s['tokens']} | {s['seconds']:.2f} "
            f"| {s['tokens_per_s']:.0f} | {s['ttft_p50_ms']:.0f} | {s['ttft_p99_ms']:.0f} "
            f"| {s['latency_p50_ms']:.0f} | {s['latency_p99_ms']:.0f} "
            f"| {s['streams_equal_reference']}/{s['streams_compared']} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    cli = arguments("generation", __doc__, argv)
    config = QUICK if cli.quick else FULL
    import transformers

    env = environment(
        torch=torch.__version__,
        torch_threads=torch.get_num_threads(),
        transformers=transformers.__version__,
    )
    print(headline("generation: no batching, static and continuous batching", env, quick=cli.quick))
    print()
    prompts = workload(config)
    runs, (single, full) = asyncio.run(measure(config, prompts))
    reference = runs["no batching"][0].streams
    summaries = [summary(side, side_runs, reference) for side, side_runs in runs.items()]
    by_side = {s["side"]: s for s in summaries}
    ratio = by_side["continuous"]["tokens_per_s"] / by_side["static"]["tokens_per_s"]
    versus_none = by_side["continuous"]["tokens_per_s"] / by_side["no batching"]["tokens_per_s"]
    ttft_ratio = by_side["static"]["ttft_p99_ms"] / by_side["continuous"]["ttft_p99_ms"]
    print()
    print(table(summaries))
    print()
    print(
        f"continuous / static tokens/s: {ratio:.2f}x (target >= {TARGET_RATIO}x); "
        f"continuous / no batching: {versus_none:.2f}x"
    )
    print(
        f"p99 time to first token: static {by_side['static']['ttft_p99_ms']:.0f} ms, "
        f"continuous {by_side['continuous']['ttft_p99_ms']:.0f} ms ({ttft_ratio:.1f}x lower; "
        "target: lower)"
    )
    tokens = [p.max_new_tokens for p in prompts]
    write_report(
        cli.output,
        env,
        quick=cli.quick,
        config=asdict(config),
        targets={"continuous_over_static_tokens_per_s": TARGET_RATIO},
        results={
            "workload": {
                "new_tokens": sum(tokens),
                "new_tokens_median": statistics.median(tokens),
                "new_tokens_max": max(tokens),
                "prompt_tokens": sum(len(p.ids) for p in prompts),
            },
            "decode_step_ms": {"1": single * 1e3, str(config.batch_size): full * 1e3},
            "continuous_over_static_tokens_per_s": ratio,
            "continuous_over_no_batching_tokens_per_s": versus_none,
            "static_over_continuous_ttft_p99": ttft_ratio,
            "sides": summaries,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
