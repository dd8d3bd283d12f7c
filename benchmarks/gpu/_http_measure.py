"""The BERT-over-HTTP section's measurements (`run_model`: see `_http`'s docstring): the
levels over HTTP, the lone client, the check of the answers, in process, and the GPU's
utilisation meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import statistics
import subprocess
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from sample_text import make_sentences  # (light: no torch)

if TYPE_CHECKING:
    from demo import Service

from benchmarks._harness.clients import Clients, percentile_ms
from benchmarks.gpu._server import BATCH_SIZE, batch_totals, launch_server

LEVELS = (1, 5, 100, 150)
PATHS = {"regular": "/classify/regular", "batched": "/classify", "floor": "/constant"}
OVERLAP_CLIENTS = 150
HEADLINE_OVERLAP = False  # the levels run on WorkerThread's default; the other at 150 only
# (the published run of 2026-11-26 measured the levels with overlap on, the default then)
PAIRS = 300  # one client, each text both ways back to back (the path first alternating)
QUICK_PAIRS = 20
LOOP_SECONDS = 2.0  # closed loop per level and path, on the GPU
QUICK_LOOP_SECONDS = 0.5
BURSTS = 3  # bursts per level and path: the median is reported
QUICK_BURSTS = 2
IN_PROCESS_SECONDS = 2.0
QUICK_IN_PROCESS_SECONDS = 0.5
WARMUP_SECONDS = 1.0
QUICK_WARMUP_SECONDS = 0.5
CHECK_TEXTS = 64
TOLERANCE = {"float32": 1e-3, "float16": 1e-2, "bfloat16": 3e-2}
"""Max |batched - regular| probability of label 1, per dtype (padding changes rounding)."""
SHORT = {"regular": "reg", "batched": "batch", "floor": "floor"}


def log(message: str) -> None:
    print(f"[gpu-http {time.strftime('%H:%M:%S')}] {message}", flush=True)


# ------------------------------------------------------------------------ GPU use


class GpuSampler:
    """`nvidia-smi` sampling the GPU's utilisation every 100 ms while in the `with`."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.process: subprocess.Popen[str] | None = None
        self.mean: float | None = None

    def __enter__(self) -> GpuSampler:
        smi = shutil.which("nvidia-smi")
        if self.device.startswith("cuda") and smi is not None:
            index = self.device.partition(":")[2] or "0"
            self.process = subprocess.Popen(
                [
                    smi,
                    "--query-gpu=utilization.gpu",
                    "--format=csv,noheader,nounits",
                    "-lms",
                    "100",
                    "-i",
                    index,
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.process is None:
            return
        self.process.terminate()
        out, _ = self.process.communicate(timeout=10)
        samples = [float(v) for v in out.split() if v.replace(".", "", 1).isdigit()]
        self.mean = statistics.fmean(samples) if samples else None


def measure_level(
    server: Service,
    clients: Clients,
    path_name: str,
    level: int,
    processes: int,
    plan: dict[str, Any],
    sampler_device: str | None = None,
) -> dict[str, Any]:
    from demo import mean_batch_size

    path = PATHS[path_name]
    texts = make_sentences(max(level, 200), seed=1000 + level)
    walls = []
    errors = 0
    error = None
    for burst_index in range(plan["bursts"]):
        burst = clients.burst(path, texts[burst_index : burst_index + level], processes)
        walls.append(burst["wall"])
        errors += burst["errors"]
        error = error or burst["error"]
    before = batch_totals(server)
    with GpuSampler(sampler_device or "") as sampler:
        loop = clients.loop(path, level, plan["loop_seconds"], processes, texts)
    after = batch_totals(server)
    batch = mean_batch_size(before, after)
    if path_name == "regular":
        batch = 1.0  # one forward pass per request; not in the proxy's histogram
    elif path_name == "floor":
        batch = None
    latencies = loop["latencies"]
    return {
        "clients": level,
        "path": path_name,
        "client_processes": processes,
        "burst_s": statistics.median(walls),
        "bursts_s": walls,
        "requests": len(latencies),
        "throughput": len(latencies) / plan["loop_seconds"],
        "p50_ms": percentile_ms(latencies, "p50"),
        "p99_ms": percentile_ms(latencies, "p99"),
        "mean_batch_size": batch,
        "gpu_util": sampler.mean,
        "errors": errors + loop["errors"],
        "error": error or loop["error"],
    }


def one_client(clients: Clients, plan: dict[str, Any]) -> dict[str, Any]:
    """A lone client, the regular and the batched path interleaved request by request, so
    both see the same machine (clocks, other load) pair by pair: the speedup (regular time
    / batched time) with its 95 % bootstrap interval, as `make demo` measures it."""
    from demo import spread_of

    texts = make_sentences(plan["pairs"], seed=11)
    latencies = clients.pairs(PATHS["regular"], PATHS["batched"], texts)
    regular, batched = latencies["first"], latencies["second"]
    spread = spread_of(regular, batched)
    return {
        "pairs": len(texts),
        "speedup": sum(regular) / sum(batched),
        "low": spread.low,
        "high": spread.high,
        "rounds": spread.rounds,
        "regular_p50_ms": percentile_ms(regular, "p50"),
        "batched_p50_ms": percentile_ms(batched, "p50"),
        "regular_p99_ms": percentile_ms(regular, "p99"),
        "batched_p99_ms": percentile_ms(batched, "p99"),
    }


def warm_up(server: Service, clients: Clients, plan: dict[str, Any]) -> None:
    texts = make_sentences(400, seed=3)
    top = max(LEVELS)
    for path_name in ("batched", "floor"):  # every client process opens its connections
        clients.loop(PATHS[path_name], top, plan["warmup_seconds"], plan["processes"], texts)
    clients.burst(PATHS["regular"], texts[:16], 1)


def check_answers(server: Service, clients: Clients, dtype: str) -> dict[str, Any]:
    """The same texts batched (all at once) and the regular way: label 1's probability."""
    texts = make_sentences(CHECK_TEXTS, seed=5)
    batched = clients.burst(PATHS["batched"], texts, clients_count(clients))["answers"]
    regular = clients.burst(PATHS["regular"], texts, 1)["answers"]

    def class_one(answer: Any) -> float:
        if not isinstance(answer, dict):
            return float("nan")
        p = float(answer["probability"])
        return p if answer["label"] == 1 else 1.0 - p

    differences = [abs(class_one(b) - class_one(r)) for b, r in zip(batched, regular, strict=True)]
    worst = max(differences)
    ok = worst <= TOLERANCE[dtype]  # (NaN: an error answer, never ok)
    return {"samples": len(texts), "max_abs_diff": worst, "tolerance": TOLERANCE[dtype], "ok": ok}


def clients_count(clients: Clients) -> int:
    return len(clients.processes)


class InProcess:
    """The model in this process, no HTTP: one item per forward pass, full batches, and
    the proxy with 150 coroutines (with and without overlap)."""

    def __init__(self, name: str, device: str, dtype: str) -> None:
        from bert_app import load_bert
        from minilm import load_tokenizer, tokenize

        self.device = device
        self.tokenizer = load_tokenizer()
        self.model = load_bert(name, device, dtype, self.tokenizer)
        texts = make_sentences(2000, seed=7)
        self.items = [tokenize(self.tokenizer, text) for text in texts]
        self.batches = []
        for start in range(0, 640, BATCH_SIZE):
            encoded = self.tokenizer(
                texts[start : start + BATCH_SIZE], padding=True, truncation=True,
                max_length=256, pad_to_multiple_of=8, return_tensors="pt",
            )  # fmt: skip
            self.batches.append(
                (encoded["input_ids"].to(device), encoded["attention_mask"].to(device))
            )

    def one_at_a_time(self, seconds: float) -> float:
        """Items/s, each alone: to the device, forward, probabilities back."""
        from bert_app import probabilities

        count, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds:
            item = self.items[count % len(self.items)]
            ids = item["input_ids"].unsqueeze(0).to(self.device)
            mask = item["attention_mask"].unsqueeze(0).to(self.device)
            probabilities(self.model, ids, mask).cpu()
            count += 1
        return count / (time.perf_counter() - started)

    def full_batches(self, seconds: float) -> float:
        """Items/s in batches of 64 already on the device (the ceiling)."""
        from bert_app import probabilities

        count, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds:
            ids, mask = self.batches[(count // BATCH_SIZE) % len(self.batches)]
            probabilities(self.model, ids, mask).cpu()
            count += BATCH_SIZE
        return count / (time.perf_counter() - started)

    async def through_proxy(self, overlap: bool, seconds: float) -> tuple[float, float | None]:
        """Items/s and the mean batch through the proxy, OVERLAP_CLIENTS closed-loop callers."""
        from bert_app import BertClassifier, gpu_options

        placement = gpu_options(self.device, overlap, f"bert-{'overlap' if overlap else 'plain'}")
        proxy = BertClassifier(
            self.tokenizer, self.model, BATCH_SIZE, max_delay_ms=2.0, pad_to_multiple_of=8,
            **placement,
        )  # fmt: skip
        count = 0
        try:
            async with proxy:
                started = time.perf_counter()
                stop_at = started + seconds

                async def caller(position: int) -> None:
                    nonlocal count
                    while time.perf_counter() < stop_at:
                        await proxy.inference(self.items[position % len(self.items)])
                        count += 1
                        position += OVERLAP_CLIENTS

                await asyncio.gather(*(caller(i) for i in range(OVERLAP_CLIENTS)))
                elapsed = time.perf_counter() - started
                stats = proxy.stats
        finally:
            await placement["offload"].aclose()
        return count / elapsed, (stats.items / stats.batches if stats.batches else None)


def in_process(name: str, args: argparse.Namespace, plan: dict[str, Any]) -> dict[str, Any]:
    """`InProcess`'s runs, each with the GPU's utilisation meanwhile."""
    seconds = plan["in_process_seconds"]
    runs = InProcess(name, args.device, args.dtype)
    # the direct runs first, each warmed up just before: once another thread has run the
    # model, this one's CPU ops can wait on that thread's idle OpenMP team (seen on 2 cores)
    log(f"{name}: in process")
    result: dict[str, Any] = {}
    for key, measure in (("batch1", runs.one_at_a_time), ("batch64", runs.full_batches)):
        measure(min(0.5, seconds))  # warm-up
        with GpuSampler(args.device) as sampler:
            result[f"{key}_items_s"] = measure(seconds)
        result[f"{key}_gpu_util"] = sampler.mean
        log(f"{name}: in process {key}: {result[f'{key}_items_s']:.0f} items/s")
    asyncio.run(runs.through_proxy(True, min(0.5, seconds)))  # warm-up
    for overlap in (True, False):
        key = "proxy_overlap" if overlap else "proxy_plain"
        with GpuSampler(args.device) as sampler:
            rate, mean = asyncio.run(runs.through_proxy(overlap, seconds))
        result[f"{key}_items_s"], result[f"{key}_mean_batch"] = rate, mean
        result[f"{key}_gpu_util"] = sampler.mean
        log(f"{name}: in process, proxy overlap={overlap}: {rate:.0f} items/s, batch {mean}")
    return result


@contextlib.contextmanager
def affinity(cpus: Sequence[int] | None) -> Iterator[None]:
    """This process pinned to `cpus` inside the `with` (restored after)."""
    if not cpus:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, set(cpus))
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def run_model(
    name: str, args: argparse.Namespace, clients: Clients, plan: dict[str, Any]
) -> dict[str, Any]:
    started = time.perf_counter()
    base = {"model": name, "device": args.device, "dtype": args.dtype, "cpus": args.server_cpus}
    # both servers load at once; the one without overlap idles (no CPU, no GPU) until used
    servers = {overlap: launch_server({**base, "overlap": overlap}) for overlap in (True, False)}
    try:
        for server in servers.values():
            server.ready()
        server = servers[HEADLINE_OVERLAP]
        log(f"{name}: servers ready in {server.startup_seconds:.1f} s; warm-up")
        clients.open(server.base_url)
        warm_up(server, clients, plan)
        rows = []
        for index, level in enumerate(LEVELS):
            processes = 1 if level <= 5 else plan["processes"]
            order = list(PATHS) if index % 2 == 0 else list(PATHS)[::-1]
            for path_name in order:
                sampled = (
                    args.device if (path_name, level) == ("batched", OVERLAP_CLIENTS) else None
                )
                row = measure_level(server, clients, path_name, level, processes, plan, sampled)
                rows.append(row)
                log(
                    f"{name}: c={level:>3} {path_name:<7} burst {row['burst_s']:.3f} s, "
                    f"{row['throughput']:.0f} req/s, p99 {row['p99_ms'] or 0:.1f} ms, "
                    f"batch {row['mean_batch_size']}, errors {row['errors']}"
                )
        check = check_answers(server, clients, args.dtype)
        log(f"{name}: batched vs regular: max |diff| {check['max_abs_diff']:.2e} ok={check['ok']}")
        lone = one_client(clients, plan)
        log(
            f"{name}: one client, {lone['pairs']} interleaved pairs: batched "
            f"{lone['speedup']:.3f}x the regular way (95 % {lone['low']:.3f}-{lone['high']:.3f})"
        )
        headline = next(
            r for r in rows if (r["path"], r["clients"]) == ("batched", OVERLAP_CLIENTS)
        )
        server.stop()
        other = servers[not HEADLINE_OVERLAP]
        clients.open(other.base_url)
        warm_up(other, clients, plan)
        compared = measure_level(
            other, clients, "batched", OVERLAP_CLIENTS, plan["processes"], plan, args.device
        )
        state = "on" if not HEADLINE_OVERLAP else "off"
        log(f"{name}: overlap {state} over HTTP: {compared['throughput']:.0f} req/s")
        on, off = (compared, headline) if not HEADLINE_OVERLAP else (headline, compared)
    finally:
        for server in servers.values():
            server.stop()
    with affinity(args.server_cpus):
        local = in_process(name, args, plan)
    return {
        "http": rows,
        "overlap_in_levels": HEADLINE_OVERLAP,
        "one_client": lone,
        "check": check,
        "overlap": {
            "http": {"on": on, "off": off},
            "in_process": {
                "on": {
                    "items_s": local["proxy_overlap_items_s"],
                    "gpu_util": local["proxy_overlap_gpu_util"],
                },
                "off": {
                    "items_s": local["proxy_plain_items_s"],
                    "gpu_util": local["proxy_plain_gpu_util"],
                },
            },
        },
        "in_process": local,
        "startup_s": servers[HEADLINE_OVERLAP].startup_seconds,
        "seconds": time.perf_counter() - started,
    }
