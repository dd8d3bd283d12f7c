"""GPU section: GPT-2 generation, no batching against continuous batching, tokens/s.

`run(args)` (args: `.device` "cpu" or "cuda", `.quick`, `.dtype`, `.out`) measures
`examples/generate.py`'s `Gpt2Generator` on `args.device`: GPT-2 small (12 layers,
n_embd 768, 12 heads, random weights, the byte-level vocabulary; `--quick`: the
2-layer model of `benchmarks/models/generation.py --quick`), its KV cache and step tensors
on the device, in `args.dtype`. The workload and the measurement are
`benchmarks/models/generation.py`'s (`workload`, `run`, `summary`, `make_proxy`,
`step_cost`), sized here: 128 prompts, 64 clients, `batch_size=64`.

- no batching: `Gpt2Generator(batch_size=1)`, on the first `reference` prompts only
  (it is the slow side), once;
- continuous: `Gpt2Generator(batch_size=64)`, on all the prompts, `repetitions` times.

Reported: tokens/s per side, time to first token (p50, p99; no batching's is under
its own, smaller load), the ratio (target: continuous >= 4x no batching), and how
many continuous streams equal the unbatched ones token for token (the prompts no
batching ran). In float32 every stream should (a mismatch is reported as an error
in the result, not raised); in float16 and bfloat16 the batched and unbatched
arithmetic round differently, so only the match fraction is reported.

    python -m benchmarks.gpu._generation --device cpu --quick   # a test run
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from generate import Prompt, build_model
from transformers import GPT2LMHeadModel

from batchproxy import Proxy
from benchmarks.gpu._common import DTYPES, no_cudnn_attention, pyplot, run_alone, worker_thread
from benchmarks.models import generation as gen

TARGET = 4.0  # continuous tokens/s over no batching tokens/s


@dataclass(frozen=True)
class Sizes:
    """The section's sizes: the workload (`benchmarks/models/generation.py`'s `Config`), how
    many prompts no batching runs, and the model's positions."""

    config: gen.Config
    reference: int
    n_positions: int


FULL = Sizes(
    gen.Config(
        prompts=128,
        concurrency=64,
        batch_size=64,
        repetitions=2,
        n_layer=12,
        n_embd=768,
        n_head=12,
        short_tokens=(16, 64),
        long_tokens=(128, 192),
        long_every=32,
        prompt_bytes=(4, 48),
    ),
    reference=16,
    n_positions=1024,
)
QUICK = Sizes(
    replace(gen.QUICK, prompts=12, concurrency=12, batch_size=12, long_tokens=(24, 32)),
    reference=6,
    n_positions=512,
)


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


async def measure(
    args: argparse.Namespace, sizes: Sizes, prompts: Sequence[Prompt]
) -> tuple[dict[str, list[gen.Run]], dict[str, float], float]:
    """Build the model on the worker thread, time a decode step for 1 and for
    `batch_size` rows, warm both sides up, then run no batching once on the first
    `sizes.reference` prompts and continuous `repetitions` times on all of them.
    Returns the runs, the step times, and the seconds the model took to build."""
    config = sizes.config
    dtype = DTYPES[args.dtype]
    runs: dict[str, list[gen.Run]] = {"no batching": [], "continuous": []}
    async with worker_thread("gpu-generation", args.device) as worker:

        def prepare(_: object) -> tuple[GPT2LMHeadModel, dict[str, float], float]:
            start = time.perf_counter()
            model = build_model(
                n_layer=config.n_layer,
                n_embd=config.n_embd,
                n_head=config.n_head,
                n_positions=sizes.n_positions,
                dtype=dtype,
                device=args.device,
            )
            synchronize(args.device)
            built = time.perf_counter() - start
            gen.step_cost(model, 1, steps=3)  # kernels, allocator, cuBLAS handles
            costs = {str(rows): gen.step_cost(model, rows) * 1e3 for rows in (1, config.batch_size)}
            return model, costs, built

        model, costs, built = await worker.run(prepare, [])
        single, full = costs["1"], costs[str(config.batch_size)]
        print(
            f"  model built in {built:.1f} s; decode step: {single:.1f} ms for 1 sequence, "
            f"{full:.1f} ms for {config.batch_size} ({full / single:.1f}x the time, "
            f"{config.batch_size}x the tokens)",
            flush=True,
        )
        proxies: dict[str, Proxy[Prompt, int]] = {
            side: gen.make_proxy(side, model, config, worker) for side in runs
        }
        subset = prompts[: sizes.reference]
        try:
            warmup = [Prompt(p.ids, 4) for p in prompts[: config.concurrency]]
            await gen.run(proxies["no batching"], warmup[:4], 4)
            await gen.run(proxies["continuous"], warmup, config.concurrency)
            print("  warmed up", flush=True)
            result = await gen.run(
                proxies["no batching"], subset, min(config.concurrency, len(subset))
            )
            runs["no batching"].append(result)
            print(
                f"  no batching ({len(subset)} prompts): {result.seconds:.2f} s, "
                f"{result.tokens / result.seconds:.0f} tokens/s",
                flush=True,
            )
            for _ in range(config.repetitions):
                result = await gen.run(proxies["continuous"], prompts, config.concurrency)
                runs["continuous"].append(result)
                print(
                    f"  continuous ({len(prompts)} prompts): {result.seconds:.2f} s, "
                    f"{result.tokens / result.seconds:.0f} tokens/s",
                    flush=True,
                )
        finally:
            for proxy in proxies.values():
                await proxy.aclose()
    return runs, costs, built


def divergences(runs: Sequence[gen.Run], reference: Sequence[list[int]]) -> list[int]:
    """For each compared stream that differs from its reference: the index of the first
    token that differs (late ones point at near-ties in the arithmetic, not a bug)."""
    out = []
    for result in runs:
        for stream, want in zip(result.streams, reference, strict=False):
            if stream != want:
                out.append(
                    next(
                        (i for i, (a, b) in enumerate(zip(stream, want, strict=False)) if a != b),
                        min(len(stream), len(want)),
                    )
                )
    return out


def plot(out: Path, summaries: Sequence[dict[str, Any]], title: str) -> str | None:
    """Tokens/s and TTFT p50/p99 per side, as a PNG in `out`; None without matplotlib."""
    plt = pyplot()
    if plt is None:
        return None
    out.mkdir(parents=True, exist_ok=True)
    path = out / "gpu_generation.png"
    sides = [s["side"] for s in summaries]
    figure, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    left.bar(sides, [s["tokens_per_s"] for s in summaries], color=["#999999", "#1f77b4"])
    left.set_ylabel("tokens/s")
    left.set_title("throughput")
    x = range(len(sides))
    right.bar([i - 0.2 for i in x], [s["ttft_p50_ms"] for s in summaries], 0.4, label="p50")
    right.bar([i + 0.2 for i in x], [s["ttft_p99_ms"] for s in summaries], 0.4, label="p99")
    right.set_xticks(list(x), sides)
    right.set_yscale("log")
    right.set_ylabel("ms")
    right.set_title("time to first token")
    right.legend()
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return str(path)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The section: measure, print a Markdown table, return the numbers."""
    sizes = QUICK if args.quick else FULL
    config = sizes.config
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    model_name = f"GPT-2, {config.n_layer} layers, n_embd {config.n_embd}, {config.n_head} heads"
    print(
        f"## generation: no batching vs continuous batching ({model_name}, {args.dtype}, "
        f"{device_name})",
        flush=True,
    )
    start = time.perf_counter()
    prompts = gen.workload(config)
    with no_cudnn_attention(args.device):
        runs, costs, built = asyncio.run(measure(args, sizes, prompts))
    reference: list[list[int] | None] = [*runs["no batching"][0].streams]
    reference += [None] * (len(prompts) - len(reference))
    summaries = [
        gen.summary(side, side_runs, reference[: len(side_runs[0].streams)])
        for side, side_runs in runs.items()
    ]
    by_side = {s["side"]: s for s in summaries}
    ratio = by_side["continuous"]["tokens_per_s"] / by_side["no batching"]["tokens_per_s"]
    continuous = by_side["continuous"]
    compared, equal = continuous["streams_compared"], continuous["streams_equal_reference"]
    exact = args.dtype == "float32"
    first_differences = divergences(runs["continuous"], runs["no batching"][0].streams)
    print()
    print(gen.table(summaries))
    print()
    print(
        f"continuous / no batching tokens/s: {ratio:.1f}x (target >= {TARGET:.0f}x: "
        f"{'met' if ratio >= TARGET else 'NOT met'})"
    )
    print(
        f"continuous streams equal to the unbatched ones: {equal}/{compared}"
        + (
            " (float32: all expected)"
            if exact
            else f" ({args.dtype}: rounding differs with the batch; reported, not required)"
        )
        + (f"; first differing token at {sorted(first_differences)}" if first_differences else "")
    )
    error = None
    if exact and equal != compared:
        error = f"float32 streams differ from the unbatched ones: {equal}/{compared} equal"
        print(f"ERROR: {error}")
    tokens = [p.max_new_tokens for p in prompts]
    result: dict[str, Any] = {
        "section": "generation",
        "device": device_name,
        "dtype": args.dtype,
        "quick": args.quick,
        "model": model_name,
        "config": asdict(config),
        "reference_prompts": sizes.reference,
        "workload": {
            "new_tokens": sum(tokens),
            "new_tokens_median": statistics.median(tokens),
            "new_tokens_max": max(tokens),
            "prompt_tokens": sum(len(p.ids) for p in prompts),
        },
        "model_build_s": built,
        "decode_step_ms": costs,
        "target_continuous_over_no_batching": TARGET,
        "continuous_over_no_batching_tokens_per_s": ratio,
        "target_met": ratio >= TARGET,
        "streams_compared": compared,
        "streams_equal": equal,
        "match_fraction": equal / compared if compared else None,
        "match_expected": exact,
        "first_differing_token": sorted(first_differences),
        "error": error,
        "cudnn_attention": False if args.device == "cuda" else None,
        "sides": summaries,
    }
    result["plot"] = plot(args.out, summaries, f"{model_name}, {args.dtype}, {device_name}")
    result["seconds"] = time.perf_counter() - start
    print(f"(section took {result['seconds']:.1f} s)", flush=True)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """For testing the section alone."""
    return run_alone(run, "gpu_generation", __doc__.splitlines()[0] if __doc__ else None, argv)


if __name__ == "__main__":
    sys.exit(main())
