"""GPU section: a BERT encoder behind a `TensorProxy`, any batch size against preferred
batch sizes with one CUDA graph per size.

`run(args)` (args: `.device` "cpu" or "cuda", `.quick`, `.dtype`, `.out`) serves
`transformers.BertModel(BertConfig())` (BERT-base, random weights, eval, on
`args.device` in `args.dtype`; `--quick`: 2 layers, hidden size 128) through two
`TensorProxy`s on one `WorkerThread`, for the same items (token ids, 8 to 128 long)
and the same load. Each returns an item's `[CLS]` vector, on the CPU.

- any size: eager forward of whatever batch formed, padded to its longest item
  (dynamic shapes, the 2-D attention mask);
- fixed sizes: `batch_sizes=(1, 2, 4, 8, 16, 32, 64)` pads the batch axis, and
  `pad_to_multiple_of=128` the sequence, so only 7 shapes ever reach the model; on
  CUDA each is captured once as a CUDA graph (static input and output buffers,
  warmed up on a side stream first, as torch's documentation says) and a batch is
  copied into the static inputs, replayed, and read back. The mask goes in as a 4-D
  additive float mask computed inside the graph (so transformers' own mask code,
  which may ask the device whether anything is padded, never runs); when capture
  fails, the next recipe is tried (eager attention; then the 2-D mask), and when all
  fail, the errors are recorded and the fixed-size side runs eagerly. On the CPU
  there are no graphs (`graphs: false`): the fixed-size side runs eagerly.

Capture and replay run on the worker thread, the one `_forward` runs on, on its
current stream: all sizes are captured in a call on that thread before the clock
starts (and a size still missing would be captured by its first batch).

Measured per side: a lone request's latency (p50, p99 over `lone` sequential calls)
and the throughput of 150 concurrent coroutines, each sending `per_client` requests
in turn (items/s, the best run); the two sides take turns, `repetitions` times. Also
reported: the largest difference between the two sides' outputs for the same items.

    python -m benchmarks.gpu._graphs --device cpu --quick   # a test run
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import BertConfig, BertModel
from typing_extensions import override

import batchproxy
from batchproxy import TensorProxy
from batchproxy.tensors import Collated
from benchmarks.gpu._common import DTYPES, no_cudnn_attention, pyplot, run_alone, worker_thread

SIZES = (1, 2, 4, 8, 16, 32, 64)
LENGTH = 128  # the longest item, and the fixed sequence length of the graphs
CLIENTS = 150
RECIPES = (("sdpa", "4d"), ("eager", "4d"), ("sdpa", "2d"))
"""Capture attempts in order: (attention implementation, mask form)."""


@dataclass(frozen=True)
class Config:
    layers: int
    hidden: int
    heads: int
    lone: int  # sequential calls for the lone-request latency
    per_client: int  # requests each of the CLIENTS coroutines sends in turn
    repetitions: int
    min_length: int


FULL = Config(layers=12, hidden=768, heads=12, lone=50, per_client=16, repetitions=2, min_length=8)
QUICK = Config(layers=2, hidden=128, heads=2, lone=20, per_client=1, repetitions=1, min_length=8)

Encode = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def build_model(config: Config, device: str, dtype: torch.dtype) -> BertModel:
    """BERT with random weights from a fixed seed (eval mode, on `device`)."""
    bert = BertConfig()  # BERT-base
    if config.layers != bert.num_hidden_layers or config.hidden != bert.hidden_size:
        bert = BertConfig(
            num_hidden_layers=config.layers,
            hidden_size=config.hidden,
            num_attention_heads=config.heads,
            intermediate_size=4 * config.hidden,
        )
    torch.manual_seed(0)
    model = BertModel(bert)
    torch.nn.Module.to(model, device=device, dtype=dtype)
    torch.nn.Module.train(model, False)
    return model


def encode_2d(model: BertModel) -> Encode:
    """`[CLS]` vectors, the boolean mask as transformers takes it (`[rows, length]`)."""

    def encode(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = model(input_ids=ids, attention_mask=mask).last_hidden_state[:, 0]
        return out

    return encode


def encode_4d(model: BertModel) -> Encode:
    """`[CLS]` vectors, the mask made here into the 4-D additive float mask
    (`[rows, 1, 1, length]`: 0 where a token is real, the dtype's minimum on padding),
    which transformers passes to attention as it is."""
    dtype = model.dtype

    def encode(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        bias = (~mask)[:, None, None, :].to(dtype) * torch.finfo(dtype).min
        out: torch.Tensor = model(input_ids=ids, attention_mask=bias).last_hidden_state[:, 0]
        return out

    return encode


def set_attention(model: BertModel, implementation: str) -> None:
    model.set_attn_implementation(implementation)


class Graphs:
    """One CUDA graph per batch size over `encode`, all of `LENGTH` tokens.

    `capture(size)` and `__call__` must run on the thread that runs `_forward`: the
    graphs replay on its current stream. `__call__` copies the batch into the static
    input buffers (padded to LENGTH), replays, and returns the static output buffer itself: the next
    replay overwrites it, so the caller must copy it out before then, on the same
    stream (as `TensorProxy(output_device="cpu")` does right after `_forward`).
    """

    def __init__(self, encode: Encode, device: torch.device) -> None:
        self.encode = encode
        self.device = device
        self.graphs: dict[
            int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, torch.Tensor]
        ] = {}

    def capture(self, size: int) -> None:
        ids = torch.zeros(size, LENGTH, dtype=torch.long, device=self.device)
        mask = torch.ones(size, LENGTH, dtype=torch.bool, device=self.device)
        current = torch.cuda.current_stream(self.device)
        with torch.inference_mode():
            side = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
            side.wait_stream(current)
            with torch.cuda.stream(side):  # warm-up: lazy initialisations, autotuning
                for _ in range(3):
                    self.encode(ids, mask)
            current.wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # capture on the thread's own stream where it has one (not the legacy
            # default stream, which cannot capture); else on torch's side stream
            legacy = current == torch.cuda.default_stream(self.device)
            with torch.cuda.graph(
                graph, stream=None if legacy else current, capture_error_mode="thread_local"
            ):
                out = self.encode(ids, mask)
        self.graphs[size] = (graph, ids, mask, out)

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        size = ids.shape[0]
        if size not in self.graphs:
            self.capture(size)
        graph, static_ids, static_mask, out = self.graphs[size]
        # a batch whose items are all as long is not padded: shorter than LENGTH
        length = ids.shape[1]
        static_ids[:, :length].copy_(ids, non_blocking=True)
        static_mask[:, :length].copy_(mask, non_blocking=True)
        if length < LENGTH:
            static_ids[:, length:] = 0
            static_mask[:, length:] = False
        graph.replay()
        return out


def prepare_graphs(model: BertModel, device: str) -> tuple[Graphs | None, str, list[str]]:
    """Capture every size with the first recipe that works; (graphs, recipe, errors of
    the recipes that failed). No graphs (None) on the CPU or when every recipe failed."""
    errors: list[str] = []
    if device != "cuda":
        return None, "", errors
    for implementation, mask in RECIPES:
        try:
            set_attention(model, implementation)
            encode = encode_4d(model) if mask == "4d" else encode_2d(model)
            graphs = Graphs(encode, torch.device("cuda", torch.cuda.current_device()))
            for size in SIZES:
                graphs.capture(size)
            # a replay equals the eager forward (same shapes, same kernels)
            ids = torch.randint(1000, 30000, (4, LENGTH), device=graphs.device)
            mask_ = torch.ones(4, LENGTH, dtype=torch.bool, device=graphs.device)
            mask_[1:, 64:] = False
            with torch.inference_mode():
                eager = encode(ids, mask_).float().cpu()
            difference = float((graphs(ids, mask_).float().cpu() - eager).abs().max())
            print(
                f"  captured {len(SIZES)} graphs ({implementation} attention, {mask} mask); "
                f"replay vs eager: max |difference| {difference:.2e}",
                flush=True,
            )
            return graphs, f"{implementation} attention, {mask} mask", errors
        except Exception as error:
            message = f"{implementation}/{mask}: {type(error).__name__}: {error}"
            errors.append(message)
            print(f"  capture failed: {message}", flush=True)
            traceback.print_exc(limit=3)
            try:
                torch.cuda.synchronize()
            except Exception as sync_error:  # a broken capture may leave an error behind
                errors.append(f"after {implementation}/{mask}: {sync_error}")
    set_attention(model, "sdpa")
    return None, "", errors


class Encoder(TensorProxy[torch.Tensor, torch.Tensor]):
    """`[CLS]` vectors of token-id items: `encode` on each batch, or `graphs` when set.

    The outputs go to the CPU (`output_device`, a copy started on the model's stream
    right after `_forward`, before the next replay can overwrite a graph's output).
    """

    def __init__(
        self, encode: Encode, graphs: Graphs | None = None, *, fixed: bool, **options: Any
    ) -> None:
        if fixed:
            options.update(batch_sizes=SIZES, pad_to_multiple_of=LENGTH)
        super().__init__(max(SIZES), output_device="cpu", **options)
        self.encode = encode
        self.graphs = graphs

    @override
    def _forward(self, batch: Collated, /) -> torch.Tensor:
        ids: torch.Tensor = batch.data
        mask = batch.mask
        if mask is None:  # nothing was padded
            mask = torch.ones(ids.shape, dtype=torch.bool, device=ids.device)
        with torch.inference_mode():
            out = self.graphs(ids, mask) if self.graphs is not None else self.encode(ids, mask)
            return out.float()


def items(count: int, config: Config, seed: int = 0) -> list[torch.Tensor]:
    """Token-id tensors of random lengths from `config.min_length` to LENGTH."""
    rng = random.Random(seed)
    return [
        torch.tensor(
            [rng.randrange(1000, 30000) for _ in range(rng.randint(config.min_length, LENGTH))]
        )
        for _ in range(count)
    ]


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


async def lone(proxy: Encoder, data: Sequence[torch.Tensor]) -> list[float]:
    """Seconds per call, one call at a time."""
    times = []
    for item in data:
        start = time.perf_counter()
        await proxy.inference(item)
        times.append(time.perf_counter() - start)
    return times


async def throughput(proxy: Encoder, data: Sequence[torch.Tensor], per_client: int) -> float:
    """Items/s of CLIENTS coroutines, each sending `per_client` calls in turn."""

    async def client(index: int) -> None:
        for turn in range(per_client):
            await proxy.inference(data[(index * per_client + turn) % len(data)])

    start = time.perf_counter()
    await asyncio.gather(*(client(index) for index in range(CLIENTS)))
    return CLIENTS * per_client / (time.perf_counter() - start)


async def measure(args: argparse.Namespace, config: Config) -> dict[str, Any]:
    dtype = DTYPES[args.dtype]
    data = items(CLIENTS * config.per_client, config)
    samples: dict[str, dict[str, list[float]]] = {
        side: {"lone": [], "items_per_s": []} for side in ("any size", "fixed sizes")
    }
    counts = {side: {"batches": 0, "items": 0, "padded_rows": 0} for side in samples}
    async with worker_thread("gpu-graphs", args.device) as worker:

        def prepare(_: object) -> tuple[BertModel, Graphs | None, str, list[str], float]:
            start = time.perf_counter()
            model = build_model(config, args.device, dtype)
            graphs, recipe, errors = prepare_graphs(model, args.device)
            return model, graphs, recipe, errors, time.perf_counter() - start

        model, graphs, recipe, errors, ready = await worker.run(prepare, [])
        print(f"  model ready in {ready:.1f} s", flush=True)
        # the any-size side: transformers' own path (the 2-D mask, the default attention)
        eager = encode_2d(model)
        fixed_encode = encode_4d(model)
        device = args.device
        proxies = {
            "any size": Encoder(eager, fixed=False, device=device, offload=worker),
            "fixed sizes": Encoder(fixed_encode, graphs, fixed=True, device=device, offload=worker),
        }
        try:
            outputs = {}
            for side, proxy in proxies.items():  # warm-up, and the outputs to compare
                outputs[side] = await proxy.inference_many(data[: max(SIZES)])
                await lone(proxy, data[:3])
            difference = max(
                float((a - b).abs().max())
                for a, b in zip(outputs["any size"], outputs["fixed sizes"], strict=True)
            )
            print(f"  warmed up; outputs differ by at most {difference:.2e}", flush=True)
            for repetition in range(config.repetitions):
                order = list(proxies)[:: 1 if repetition % 2 == 0 else -1]
                for side in order:
                    times = await lone(proxies[side], data[: config.lone])
                    before = proxies[side].stats
                    rate = await throughput(proxies[side], data, config.per_client)
                    after = proxies[side].stats
                    for name, count in counts[side].items():
                        counts[side][name] = count + getattr(after, name) - getattr(before, name)
                    samples[side]["lone"] += times
                    samples[side]["items_per_s"].append(rate)
                    print(
                        f"  {side}: lone p50 {percentile(times, 0.5) * 1e3:.2f} ms, "
                        f"{CLIENTS} clients {rate:.0f} items/s",
                        flush=True,
                    )
            attention = model.config._attn_implementation
        finally:
            for proxy in proxies.values():
                await proxy.aclose()
    sides = []
    for side, sample in samples.items():
        counted = counts[side]
        sides.append(
            {
                "side": side,
                "lone_p50_ms": percentile(sample["lone"], 0.5) * 1e3,
                "lone_p99_ms": percentile(sample["lone"], 0.99) * 1e3,
                "lone_calls": len(sample["lone"]),
                "items_per_s": max(sample["items_per_s"]),
                "items_per_s_runs": sample["items_per_s"],
                # of the throughput runs
                "batches": counted["batches"],
                "mean_batch": counted["items"] / counted["batches"] if counted["batches"] else 0.0,
                "padded_rows": counted["padded_rows"],
            }
        )
    return {
        "graphs": graphs is not None,
        "graph_recipe": recipe or None,
        "attention": attention,
        "capture_errors": errors,
        "model_ready_s": ready,
        "max_output_difference": difference,
        "sides": sides,
    }


def table(sides: Sequence[dict[str, Any]], graphs: bool) -> str:
    lines = [
        f"| side | lone p50 (ms) | lone p99 (ms) | items/s ({CLIENTS} clients) | batches "
        "| mean batch | filler rows |",
        "|:--|--:|--:|--:|--:|--:|--:|",
    ]
    for s in sides:
        name = s["side"] + (" (CUDA graphs)" if s["side"] == "fixed sizes" and graphs else "")
        lines.append(
            f"| {name} | {s['lone_p50_ms']:.2f} | {s['lone_p99_ms']:.2f} "
            f"| {s['items_per_s']:.0f} | {s['batches']} | {s['mean_batch']:.1f} "
            f"| {s['padded_rows']} |"
        )
    return "\n".join(lines)


def plot(out: Path, sides: Sequence[dict[str, Any]], title: str) -> str | None:
    """Lone latency and throughput per side, as a PNG in `out`; None without matplotlib."""
    plt = pyplot()
    if plt is None:
        return None
    out.mkdir(parents=True, exist_ok=True)
    path = out / "gpu_graphs.png"
    names = [s["side"] for s in sides]
    figure, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    x = range(len(names))
    left.bar([i - 0.2 for i in x], [s["lone_p50_ms"] for s in sides], 0.4, label="p50")
    left.bar([i + 0.2 for i in x], [s["lone_p99_ms"] for s in sides], 0.4, label="p99")
    left.set_xticks(list(x), names)
    left.set_ylabel("ms")
    left.set_title("lone request")
    left.legend()
    right.bar(names, [s["items_per_s"] for s in sides], color=["#999999", "#1f77b4"])
    right.set_ylabel("items/s")
    right.set_title(f"{CLIENTS} concurrent clients")
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return str(path)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The section: measure, print a Markdown table, return the numbers."""
    config = QUICK if args.quick else FULL
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    model_name = f"BERT, {config.layers} layers, hidden {config.hidden}"
    print(
        f"## preferred batch sizes with CUDA graphs vs any size ({model_name}, {args.dtype}, "
        f"{device_name})",
        flush=True,
    )
    start = time.perf_counter()
    with no_cudnn_attention(args.device):
        result = asyncio.run(measure(args, config))
    sides = {s["side"]: s for s in result["sides"]}
    fixed, free = sides["fixed sizes"], sides["any size"]
    print()
    print(table(result["sides"], result["graphs"]))
    print()
    what = "CUDA graphs" if result["graphs"] else "eager (no graphs)"
    print(
        f"fixed sizes, {what}: lone p50 {free['lone_p50_ms'] / fixed['lone_p50_ms']:.2f}x "
        f"faster, {fixed['items_per_s'] / free['items_per_s']:.2f}x the items/s of any size"
    )
    for error in result["capture_errors"]:
        print(f"capture error: {error}")
    result.update(
        section="graphs",
        device=device_name,
        dtype=args.dtype,
        quick=args.quick,
        model=model_name,
        config=asdict(config),
        batch_sizes=list(SIZES),
        sequence_length=LENGTH,
        clients=CLIENTS,
        cudnn_attention=False if args.device == "cuda" else None,
        batchproxy=batchproxy.__version__,
        fixed_over_any_lone_p50=free["lone_p50_ms"] / fixed["lone_p50_ms"],
        fixed_over_any_items_per_s=fixed["items_per_s"] / free["items_per_s"],
    )
    result["plot"] = plot(args.out, result["sides"], f"{model_name}, {args.dtype}, {device_name}")
    result["seconds"] = time.perf_counter() - start
    print(f"(section took {result['seconds']:.1f} s)", flush=True)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """For testing the section alone."""
    return run_alone(run, "gpu_graphs", __doc__.splitlines()[0] if __doc__ else None, argv)


if __name__ == "__main__":
    sys.exit(main())
