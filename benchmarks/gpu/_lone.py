"""The GPU headline's lone-client section: `run(args)`, called by `benchmarks/gpu/gpu.py`.

Where one client's request spends its time, in process (no HTTP), on the first of
`args.models` (bert-base on the GPU; bert-tiny in a quick CPU run), three paths on one
event loop:

- `regular`: the examples' regular way (`OneAtATime` with `bert_app.classify_alone`:
  tokenize, copy in, forward, copy back, on one model thread);
- `batched`: `proxy.inference(tokenize(text))` on the app's `BertClassifier` and its
  worker thread (`bert_app.gpu_options`, overlap off), inputs copied as the library
  does by default (not pinned on the fly);
- `batched_pinned`: the same with `PIN_INPUTS` on (each input pinned, then a
  non-blocking copy): the library's default before this section measured it.

Its parts (`PARTS`; `gpu.py --lone-parts` picks some):

- `interleaved`: ROUNDS texts, each sent down every path in turn, the first path
  rotating, so every path sees the same machine round by round;
- `back_to_back`: the same texts in blocks of BLOCK down one path, the paths taking
  turns (a client that sends one request after another).
  Per path: p50, mean and p99 latency and the mean time of each stage (regular:
  tokenize, copy in, forward launch, wait and copy back; batched: tokenize on the
  loop, then on the model thread prepare (collate, copy in), compute (forward launch,
  copy back started) and finish (wait, split)). What is left of a call's time outside
  its stages is the hand-offs between the loop and the thread. The speedups (regular
  / path, summed) come with a 95 % bootstrap interval; the scheduler's departure
  reasons come from a short untimed run after (logging them costs time);
- `launch`: one item's forward pass back to back on each kind of thread (the loop's,
  a pool thread, one with its own stream, a `WorkerThread` plain and bound to the
  device): the thread's own cost apart from the proxy's;
- `http`: the app (`bert_app`, overlap off) in a child process, wrapped in `TimedApp`
  (the server's time per route), and one client process: closed loops down each
  route taking turns, fresh and after a 150-client loop, then interleaved pairs;
- `under_load`: the proxy with OVERLAP_CLIENTS closed-loop callers, inputs pinned
  against not: items/s and the mean batch.

Standalone (for testing): `python -m benchmarks.gpu._lone --device cpu --quick`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import re
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from sample_text import make_sentences  # (light: no torch)

from benchmarks._harness.clients import Clients, percentile_ms
from benchmarks.gpu._http_measure import OVERLAP_CLIENTS, InProcess, log
from benchmarks.gpu._http_measure import PATHS as ROUTES
from benchmarks.gpu._launch import LAUNCH_CALLS, QUICK_LAUNCH_CALLS, launch_by_thread
from benchmarks.gpu._server import launch_server, timings

PATHS = ("regular", "batched", "batched_pinned")
PARTS = ("interleaved", "back_to_back", "launch", "http", "under_load")
ROUNDS = 400
BLOCK = 50  # back to back: calls down one path in a row
QUICK_ROUNDS = 30
WARMUP_ROUNDS = 40
QUICK_WARMUP_ROUNDS = 5
HTTP_REPEATS = 3  # over HTTP: closed loops per path, the paths alternating
HTTP_LOOP_SECONDS = 1.5
QUICK_HTTP_LOOP_SECONDS = 0.3
HTTP_PAIRS = 300
QUICK_HTTP_PAIRS = 20
LOAD_SECONDS = 2.0
QUICK_LOAD_SECONDS = 0.3


class Stages:
    """Seconds per stage name, summed over the calls being measured (`on`)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.on = False

    def add(self, name: str, seconds: float) -> None:
        if self.on:
            self.seconds[name] += seconds

    def timed(self, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.add(name, time.perf_counter() - started)

        return wrapper


@contextlib.contextmanager
def timed_batch_stages(stages: Stages) -> Iterator[None]:
    """The TensorProxy's three stages (prepare, compute, finish) timed while inside."""
    from batchproxy import _tensor_proxy

    cls = _tensor_proxy._Stages
    saved = {name: getattr(cls, name) for name in ("prepare", "compute", "finish")}
    for name, method in saved.items():
        setattr(cls, name, stages.timed(f"thread_{name}", method))
    try:
        yield
    finally:
        for name, method in saved.items():
            setattr(cls, name, method)


@contextlib.contextmanager
def pinned_inputs(on: bool) -> Iterator[None]:
    from batchproxy import _tensor_proxy

    before = _tensor_proxy.PIN_INPUTS
    _tensor_proxy.PIN_INPUTS = on
    try:
        yield
    finally:
        _tensor_proxy.PIN_INPUTS = before


def regular_alone(stages: Stages) -> Callable[[Any, Any, str], Any]:
    """`bert_app.classify_alone`, its steps timed one by one (the same calls)."""
    from bert_app import probabilities
    from minilm import tokenize

    def run(tokenizer: Any, model: Any, text: str) -> Any:
        device = next(model.parameters()).device
        t0 = time.perf_counter()
        item = tokenize(tokenizer, text)
        t1 = time.perf_counter()
        ids = item["input_ids"].unsqueeze(0).to(device)
        mask = item["attention_mask"].unsqueeze(0).to(device)
        t2 = time.perf_counter()
        probs = probabilities(model, ids, mask)
        t3 = time.perf_counter()
        result = probs[0].cpu()  # waits for the GPU
        t4 = time.perf_counter()
        stages.add("tokenize", t1 - t0)
        stages.add("thread_copy_in", t2 - t1)
        stages.add("thread_forward", t3 - t2)
        stages.add("thread_wait_copy_out", t4 - t3)
        return result

    return run


def interleaved(count: int) -> list[tuple[int, str]]:
    """Each text down every path in turn, the first path rotating: (text index, path)."""
    order = []
    for index in range(count):
        shift = index % len(PATHS)
        order.extend((index, path) for path in PATHS[shift:] + PATHS[:shift])
    return order


def back_to_back(count: int) -> list[tuple[int, str]]:
    """Blocks of BLOCK calls down one path in a row (a client that sends one request
    after another), the paths taking turns block by block."""
    order = []
    for start in range(0, count, BLOCK):
        for path in PATHS:
            order.extend((index, path) for index in range(start, min(count, start + BLOCK)))
    return order


class Departures(logging.Handler):
    """The scheduler's departure reasons ("idle", "window", ...), counted."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.reasons: dict[str, int] = defaultdict(int)

    def emit(self, record: logging.LogRecord) -> None:
        found = re.search(r" left \(([^)]*)\)", record.getMessage())
        if found:
            self.reasons[found.group(1)] += 1


@contextlib.contextmanager
def departures() -> Iterator[Departures]:
    logger = logging.getLogger("batchproxy")
    handler, level = Departures(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


async def lone_rounds(
    model: Any,
    tokenizer: Any,
    device: str,
    rounds: int,
    warmup: int,
    schedule: Callable[[int], list[tuple[int, str]]],
) -> dict[str, Any]:
    from bert_app import BertClassifier, gpu_options
    from embeddings import OneAtATime
    from minilm import tokenize

    stages = {path: Stages() for path in PATHS}
    regular = OneAtATime(tokenizer, model, regular_alone(stages["regular"]), "lone-regular")
    placement = gpu_options(device, False, "lone")
    proxy = BertClassifier(
        tokenizer, model, 64, max_delay_ms=2.0, pad_to_multiple_of=8, **placement
    )

    async def batched(text: str, path: str) -> Any:
        with pinned_inputs(path == "batched_pinned"):
            started = time.perf_counter()
            item = tokenize(tokenizer, text)
            stages[path].add("tokenize", time.perf_counter() - started)
            return await proxy.inference(item)

    calls: dict[str, Callable[[str], Any]] = {
        "regular": regular.run,
        "batched": lambda text: batched(text, "batched"),
        "batched_pinned": lambda text: batched(text, "batched_pinned"),
    }
    texts = make_sentences(warmup + rounds, seed=13)
    latencies: dict[str, list[float]] = {path: [] for path in PATHS}
    try:
        async with proxy:
            for index, path in interleaved(warmup):
                await calls[path](texts[index])
            for index, path in schedule(rounds):
                stages[path].on = True
                with timed_batch_stages(stages[path]):
                    started = time.perf_counter()
                    await calls[path](texts[warmup + index])
                    latencies[path].append(time.perf_counter() - started)
            stages["batched"].on = False
            # why the batches left, from a short untimed run (logging them costs time)
            with departures() as departed:
                for index, path in schedule(min(rounds, 2 * BLOCK)):
                    if path == "batched":
                        await calls[path](texts[index])
    finally:
        regular.close()
        await placement["offload"].aclose()
    return {**summarize(latencies, stages, rounds), "departures": dict(departed.reasons)}


def summarize(
    latencies: dict[str, list[float]], stages: dict[str, Stages], rounds: int
) -> dict[str, Any]:
    from demo import spread_of

    paths: dict[str, Any] = {}
    for path, values in latencies.items():
        stage_ms = {name: 1000 * s / rounds for name, s in sorted(stages[path].seconds.items())}
        inside = sum(v for k, v in stage_ms.items() if k.startswith("thread_"))
        mean_ms = 1000 * statistics.fmean(values)
        stage_ms["hand_offs"] = mean_ms - inside - stage_ms.get("tokenize", 0.0)
        paths[path] = {
            "p50_ms": percentile_ms(values, "p50"),
            "mean_ms": mean_ms,
            "p99_ms": percentile_ms(values, "p99"),
            "stages_ms": stage_ms,
        }
    speedups = {}
    for path in PATHS[1:]:
        spread = spread_of(latencies["regular"], latencies[path])
        speedups[path] = {
            "speedup": sum(latencies["regular"]) / sum(latencies[path]),
            "low": spread.low,
            "high": spread.high,
        }
    return {"rounds": rounds, "paths": paths, "speedup_over_regular": speedups}


def report(key: str, measured: dict[str, Any]) -> None:
    for path, numbers in measured["paths"].items():
        stages = ", ".join(f"{k} {v:.3f}" for k, v in numbers["stages_ms"].items())
        log(
            f"{key} {path}: p50 {numbers['p50_ms']:.3f} ms, mean {numbers['mean_ms']:.3f}; {stages}"
        )
    for path, numbers in measured["speedup_over_regular"].items():
        log(
            f"{key} {path}: {numbers['speedup']:.3f}x the regular way "
            f"(95 % {numbers['low']:.3f}-{numbers['high']:.3f})"
        )
    log(f"{key}: departures {measured.get('departures')}")


def over_http(args: argparse.Namespace, name: str, quick: bool) -> dict[str, Any]:
    """The app (`bert_app`, overlap off) in a child process and one client process: a
    lone client's closed loops, the two paths taking turns, then interleaved pairs."""
    from demo import spread_of

    seconds = QUICK_HTTP_LOOP_SECONDS if quick else HTTP_LOOP_SECONDS
    config = {
        "model": name, "device": args.device, "dtype": args.dtype,
        "cpus": getattr(args, "server_cpus", None), "overlap": False, "timed": True,
    }  # fmt: skip
    server = launch_server(config)
    clients = Clients(1, getattr(args, "client_cpus", None))
    phases: dict[str, dict[str, list[float]]] = {}
    on_server: dict[str, dict[str, Any]] = {}
    try:
        server.ready()
        clients.open(server.base_url)
        texts = make_sentences(200, seed=1001)
        for path in ROUTES:  # warm-up
            clients.loop(ROUTES[path], 1, seconds / 2, 1, texts)
        for phase in ("back_to_back", "back_to_back_after_load"):
            if phase == "back_to_back_after_load":  # as the http section's levels follow
                clients.loop(ROUTES["batched"], 150, seconds, 1, texts)  # 150 clients
            loops: dict[str, list[float]] = {"regular": [], "batched": []}
            timings(server.base_url)  # from here on
            for repeat in range(HTTP_REPEATS):
                for path in list(loops) if repeat % 2 == 0 else list(loops)[::-1]:
                    loops[path] += clients.loop(ROUTES[path], 1, seconds, 1, texts)["latencies"]
            phases[phase] = loops
            on_server[phase] = timings(server.base_url)
        pairs = clients.pairs(
            ROUTES["regular"],
            ROUTES["batched"],
            make_sentences(QUICK_HTTP_PAIRS if quick else HTTP_PAIRS, seed=11),
        )
        on_server["interleaved"] = timings(server.base_url)
    finally:
        clients.close()
        server.stop()
    result: dict[str, Any] = {}
    compared = [(phase, loops["regular"], loops["batched"]) for phase, loops in phases.items()]
    for mode, regular, batched in [*compared, ("interleaved", pairs["first"], pairs["second"])]:
        result[mode] = {
            "regular_p50_ms": percentile_ms(regular, "p50"),
            "batched_p50_ms": percentile_ms(batched, "p50"),
            "regular_mean_ms": 1000 * statistics.fmean(regular),
            "batched_mean_ms": 1000 * statistics.fmean(batched),
            "speedup": statistics.fmean(regular) / statistics.fmean(batched),
        }
        if mode == "interleaved":
            spread = spread_of(regular, batched)
            result[mode]["low"], result[mode]["high"] = spread.low, spread.high
        result[mode]["on_server"] = on_server[mode]
        log(f"over HTTP, {mode}: {result[mode]}")
    return result


def under_load(runs: Any, seconds: float) -> dict[str, Any]:
    """The proxy at OVERLAP_CLIENTS closed-loop callers, inputs pinned or not."""
    asyncio.run(runs.through_proxy(False, min(0.5, seconds)))  # warm-up
    result: dict[str, Any] = {"clients": OVERLAP_CLIENTS}
    for pinned in (False, True, False, True):  # twice each, alternating
        with pinned_inputs(pinned):
            rate, mean = asyncio.run(runs.through_proxy(False, seconds))
        key = "pinned" if pinned else "not_pinned"
        result.setdefault(key, {"items_s": [], "mean_batch": []})
        result[key]["items_s"].append(rate)
        result[key]["mean_batch"].append(mean)
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The section: see the module docstring. Returns its numbers (JSON-able)."""
    started = time.perf_counter()
    quick = bool(args.quick)
    name = "bert-tiny" if quick and args.device != "cuda" else args.models[0]
    device = "cuda:0" if args.device == "cuda" else args.device
    rounds = QUICK_ROUNDS if quick else ROUNDS
    log(f"lone client: {name} on {device} ({args.dtype}), {rounds} rounds")
    runs = InProcess(name, device, args.dtype)
    result: dict[str, Any] = {"section": "gpu-lone", "model": name, "device": args.device}
    parts = getattr(args, "lone_parts", None) or PARTS
    warmup = QUICK_WARMUP_ROUNDS if quick else WARMUP_ROUNDS
    for key, schedule in (("interleaved", interleaved), ("back_to_back", back_to_back)):
        if key in parts:
            result[key] = asyncio.run(
                lone_rounds(runs.model, runs.tokenizer, device, rounds, warmup, schedule)
            )
            report(key, result[key])
    if "launch" in parts:
        calls = QUICK_LAUNCH_CALLS if quick else LAUNCH_CALLS
        result["launch"] = asyncio.run(launch_by_thread(runs.model, runs.tokenizer, device, calls))
        for variant, numbers in result["launch"].items():
            log(f"launch on {variant}: {numbers}")
    if "http" in parts:
        result["http"] = over_http(args, name, quick)
    if "under_load" in parts:
        result["under_load"] = under_load(runs, QUICK_LOAD_SECONDS if quick else LOAD_SECONDS)
        for key in ("not_pinned", "pinned"):
            numbers = result["under_load"][key]
            clients = result["under_load"]["clients"]
            log(f"{clients} callers in process, {key}: items/s {numbers['items_s']}")
    result["seconds"] = time.perf_counter() - started
    return result


def main(argv: Sequence[str] | None = None) -> int:
    from benchmarks.gpu import _common as _gpu_common

    def with_models(args: argparse.Namespace) -> dict[str, Any]:
        args.models = ["bert-base"]
        return run(args)

    return _gpu_common.run_alone(with_models, "gpu-lone", __doc__, argv)


if __name__ == "__main__":
    raise SystemExit(main())
