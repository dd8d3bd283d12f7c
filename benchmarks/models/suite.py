"""The benchmark suite: batchproxy beside its peers, side by side in one run.

Run: `python -m benchmarks.models.suite` (`--quick` for a smoke run). Writes Markdown,
JSON and a PNG to `benchmarks/results/suite.*`.

Every workload runs through each batcher that is installed, one after another
in the same process, with the same batch size and delay window:

- batchproxy (`@batchproxy.batch`),
- `batched` (`batched.aio.dynamically`), if installed (the `bench` extra),
- Ray Serve's `ray.serve.batch`, if installed (the `bench-ray` extra: Ray is
  large, so it is not part of the dev install). It is run in-process, outside a
  Serve replica: its queue asks the replica for a setting only to print a
  warning, and that one check is skipped; the batching measured is Ray's own.
  (Through a deployment it would measure Ray's RPC and HTTP path instead.)

Workloads:

1. Overhead: an identity model, 1,000 concurrent callers, batch 64: CPU
   microseconds per request added over callers awaiting the model directly.
2. Idle latency: a lone request on an idle batcher (delay window 5 ms), after a
   quiet spell: added latency p50/p99 over a direct await.
3. Simulated accelerator: a model that takes `10 ms + 0.2 ms x n` for a batch of
   n; 150 closed-loop callers; throughput as a share of the ideal (every batch
   full, the model never idle).
4. Real model: all-MiniLM-L6-v2 (offline), 150 concurrent callers embedding
   sentences of 8-60 words; the regular way (one sentence per forward pass on the
   model thread) against each batcher wrapping the same batch function on the
   same model thread, plus batchproxy's length-aware `TensorProxy`.

Numbers are ratios against a baseline measured in the same run: the machine is
shared and noisy, the ratios are what carries over.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.util
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import batchproxy
from benchmarks._harness.drain import drain
from benchmarks._harness.report import arguments, environment, headline, no_targets, write_report

BatchFn = Callable[[list[Any]], Awaitable[list[Any]]]
DELAY_MS = 5.0


@dataclass
class Batcher:
    """One batcher wrapping one batch function: awaited per item, closed at the end."""

    name: str
    call: Callable[[Any], Awaitable[Any]]
    close: Callable[[], Awaitable[None]]


def with_batchproxy(fn: BatchFn, batch_size: int) -> Batcher:
    batched_fn = batchproxy.batch(batch_size=batch_size, max_delay_ms=DELAY_MS)(fn)
    return Batcher("batchproxy", batched_fn, batched_fn.aclose)


def with_batched(fn: BatchFn, batch_size: int) -> Batcher:
    import batched

    processor = batched.aio.dynamically(batch_size=batch_size, timeout_ms=DELAY_MS)(fn)

    async def close() -> None:  # it keeps a collector task running; stop it
        task = getattr(processor, "_task", None)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    return Batcher("batched", processor, close)


def with_ray(fn: BatchFn, batch_size: int) -> Batcher:
    from ray.serve import batching

    # `serve.batch` checks, for a warning, a setting of the Serve replica it expects
    # to run in; outside one that check fails. Skip only that check: the queue,
    # collector and timing measured are Ray's own batching code.
    batching._BatchQueue._warn_if_max_batch_size_exceeds_max_ongoing_requests = (  # type: ignore[method-assign]
        lambda self: None
    )
    from ray import serve

    wrapped = serve.batch(max_batch_size=batch_size, batch_wait_timeout_s=DELAY_MS / 1e3)(fn)

    async def close() -> None:
        pass

    return Batcher("ray.serve.batch", wrapped, close)


def peers() -> list[Callable[[BatchFn, int], Batcher]]:
    found = [with_batchproxy]
    if importlib.util.find_spec("batched"):
        found.append(with_batched)
    if importlib.util.find_spec("ray") and _importable("ray.serve.batching"):
        found.append(with_ray)
    return found


def _importable(module: str) -> bool:
    """Whether `module` imports: Ray without its `serve` extra has `ray.serve`, which
    raises on import (it needs grpc)."""
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


# -- 1. overhead -----------------------------------------------------------------


async def identity(items: list[Any]) -> list[Any]:
    return items


async def cpu_per_request(call: Callable[[Any], Awaitable[Any]], rounds: int) -> float:
    """CPU microseconds per request, 1,000 concurrent callers a round."""
    start = time.process_time()
    for _ in range(rounds):
        await asyncio.gather(*(call(i) for i in range(1000)))
    return (time.process_time() - start) / (rounds * 1000) * 1e6


async def direct_identity(item: Any) -> Any:
    return (await identity([item]))[0]


async def overhead(make: Callable[[BatchFn, int], Batcher], rounds: int, reps: int) -> float:
    batcher = make(identity, 64)
    try:
        await cpu_per_request(batcher.call, 2)  # warm-up
        added = []
        for _ in range(reps):  # interleaved with the baseline: the same noise for both
            base = await cpu_per_request(direct_identity, rounds)
            added.append(await cpu_per_request(batcher.call, rounds) - base)
        return statistics.median(added)
    finally:
        await batcher.close()


# -- 2. idle latency ---------------------------------------------------------------


async def idle_latency(make: Callable[[BatchFn, int], Batcher], calls: int) -> dict[str, float]:
    batcher = make(identity, 64)
    added: list[float] = []
    try:
        for i in range(calls + 20):
            await asyncio.sleep(0.006)  # quiet: longer than the delay window
            start = time.perf_counter()
            await batcher.call(i)
            proxied = time.perf_counter() - start
            start = time.perf_counter()
            await direct_identity(i)
            direct = time.perf_counter() - start
            if i >= 20:
                added.append((proxied - direct) * 1e3)
    finally:
        await batcher.close()
    added.sort()
    return {"p50_ms": added[len(added) // 2], "p99_ms": added[int(len(added) * 0.99) - 1]}


# -- 3. simulated accelerator -------------------------------------------------------

A_S, B_S, SIM_BATCH = 0.010, 0.0002, 64
CALLERS = 150  # closed-loop callers, here and on the real model


async def accelerator(items: list[Any]) -> list[Any]:
    await asyncio.sleep(A_S + B_S * len(items))
    return items


async def accelerator_share(make: Callable[[BatchFn, int], Batcher], each: int) -> float:
    """Throughput as a share of the ideal with CALLERS closed-loop callers making `each`
    calls apiece (in all: each takes the next call as soon as answered)."""
    batcher = make(accelerator, SIM_BATCH)
    try:
        await drain(batcher.call, range(CALLERS * 2), CALLERS)  # warm-up
        run = await drain(batcher.call, range(CALLERS * each), CALLERS)
    finally:
        await batcher.close()
    ideal = SIM_BATCH / (A_S + B_S * SIM_BATCH)
    return CALLERS * each / run.seconds / ideal


# -- 4. real model --------------------------------------------------------------------


async def real_model(sentences: list[str], makes: list[Any]) -> dict[str, dict[str, float]]:
    import numpy as np
    import torch
    from minilm import MiniLMEmbedder, load_minilm, mean_pool

    tokenizer, model = load_minilm()
    model_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="model")

    def forward(texts: list[str]) -> list[Any]:
        tokens = tokenizer(
            texts, padding=True, truncation=True, max_length=256, return_tensors="pt"
        )
        with torch.inference_mode():
            out = model(**tokens).last_hidden_state
        pooled = torch.nn.functional.normalize(mean_pool(out, tokens["attention_mask"]), dim=-1)
        return list(pooled.numpy())

    async def on_model_thread(texts: list[str]) -> list[Any]:
        return await asyncio.get_running_loop().run_in_executor(model_thread, forward, texts)

    async def regular(text: str) -> Any:
        return (await on_model_thread([text]))[0]

    reference = {s: forward([s])[0] for s in sentences[:20]}

    async def drive(name: str, call: Callable[[str], Awaitable[Any]]) -> dict[str, float]:
        await asyncio.gather(*(call(s) for s in sentences[:32]))  # warm-up
        run = await drain(call, sentences, CALLERS)
        worst = max(
            float(np.abs(np.asarray(vector) - reference[text]).max())
            for text, vector in zip(sentences, run.results, strict=True)
            if text in reference
        )
        latencies = sorted(run.latencies)
        print(f"  real model, {name}: {run.seconds:.2f} s", file=sys.stderr)
        return {
            "wall_s": run.seconds,
            "throughput": len(sentences) / run.seconds,
            "p50_ms": latencies[len(latencies) // 2] * 1e3,
            "p99_ms": latencies[int(len(latencies) * 0.99) - 1] * 1e3,
            "max_abs_diff": worst,
        }

    results = {"regular": await drive("regular", regular)}
    for make in makes:
        batcher = make(on_model_thread, 32)
        try:
            results[batcher.name] = await drive(batcher.name, batcher.call)
        finally:
            await batcher.close()
    async with MiniLMEmbedder(tokenizer, model, batch_size=32, offload=True) as embedder:
        from minilm import embed

        results["batchproxy TensorProxy, length-aware"] = await drive(
            "batchproxy TensorProxy", lambda text: embed(embedder, text)
        )
    model_thread.shutdown()
    return results


# -- the run --------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    overhead_rounds: int
    overhead_repetitions: int
    idle_calls: int
    accelerator_calls_per_caller: int
    sentences: int


FULL = Config(10, 7, 500, 20, 300)
QUICK = Config(3, 3, 100, 4, 90)


async def run(config: Config) -> dict[str, Any]:
    makes = peers()
    results: dict[str, Any] = {"overhead_us": {}, "idle": {}, "accelerator_share": {}}
    for make in makes:
        name = make(identity, 1).name
        print(f"{name}: overhead, idle latency, simulated accelerator", file=sys.stderr)
        results["overhead_us"][name] = await overhead(
            make, config.overhead_rounds, config.overhead_repetitions
        )
        results["idle"][name] = await idle_latency(make, config.idle_calls)
        results["accelerator_share"][name] = await accelerator_share(
            make, config.accelerator_calls_per_caller
        )
    from sample_text import make_sentences

    results["real_model"] = await real_model(make_sentences(config.sentences), makes)
    return results


def markdown(results: dict[str, Any]) -> str:
    names = list(results["overhead_us"])
    lines = [
        "| workload | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
        "| added CPU per request (µs), 1,000 callers, identity model | "
        + " | ".join(f"{results['overhead_us'][n]:.2f}" for n in names)
        + " |",
        "| idle lone request, added latency p50 (ms) | "
        + " | ".join(f"{results['idle'][n]['p50_ms']:.3f}" for n in names)
        + " |",
        "| idle lone request, added latency p99 (ms) | "
        + " | ".join(f"{results['idle'][n]['p99_ms']:.3f}" for n in names)
        + " |",
        "| simulated accelerator, % of ideal throughput | "
        + " | ".join(f"{100 * results['accelerator_share'][n]:.1f}%" for n in names)
        + " |",
    ]
    real = results["real_model"]
    base = real["regular"]["wall_s"]
    lines += [
        "",
        "| all-MiniLM-L6-v2, 150 concurrent callers | wall time | speedup vs regular "
        "| p50 | p99 | max abs diff vs single |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in real.items():
        lines.append(
            f"| {name} | {r['wall_s']:.2f} s | {base / r['wall_s']:.2f}x | {r['p50_ms']:.0f} ms "
            f"| {r['p99_ms']:.0f} ms | {r['max_abs_diff']:.1e} |"
        )
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["overhead_us"])
    fig, axes = plt.subplots(1, 4, figsize=(16, 4))
    panels = [
        ("added CPU µs / request (lower is better)", [results["overhead_us"][n] for n in names]),
        ("idle added latency p50, ms (lower)", [results["idle"][n]["p50_ms"] for n in names]),
        (
            "% of ideal, simulated accelerator (higher)",
            [100 * results["accelerator_share"][n] for n in names],
        ),
    ]
    for ax, (title, values) in zip(axes, panels, strict=False):
        ax.bar(names, values, color=["tab:blue", "tab:orange", "tab:green"][: len(names)])
        ax.set_title(title, fontsize=9)
        ax.tick_params(axis="x", labelsize=8)
    real = results["real_model"]
    base = real["regular"]["wall_s"]
    labels = [
        n.replace("batchproxy TensorProxy, length-aware", "batchproxy\nlength-aware") for n in real
    ]
    axes[3].bar(labels, [base / r["wall_s"] for r in real.values()], color="tab:purple")
    axes[3].set_title("MiniLM speedup vs regular, 150 callers (higher)", fontsize=9)
    axes[3].tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: Sequence[str] | None = None) -> int:
    cli = arguments("suite", (__doc__ or "").splitlines()[0], argv)
    config = QUICK if cli.quick else FULL
    results = asyncio.run(run(config))
    env = environment(peers=[make(identity, 1).name for make in peers()])
    text = markdown(results)
    print(headline("suite", env, quick=cli.quick) + "\n")
    print(text)
    cli.output.parent.mkdir(parents=True, exist_ok=True)
    cli.output.with_suffix(".md").write_text(text + "\n")
    plot(results, cli.output.with_suffix(".png"))
    write_report(
        cli.output,
        env,
        quick=cli.quick,
        config={
            **asdict(config),
            "delay_ms": DELAY_MS,
            "callers": CALLERS,
            "accelerator_batch_size": SIM_BATCH,
            "accelerator_seconds": [A_S, B_S],
        },
        targets=no_targets("a side-by-side comparison with the peers: ratios, no pass mark"),
        results=results,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
