"""The GPU headline's BERT-over-HTTP section: `run(args)`, called by `benchmarks/gpu.py`.

Per model (`examples/bert_app.py`: BERT classification, random weights, seed 0):

1. Over HTTP, the app under uvicorn in a child process on 127.0.0.1 (pinned to
   `args.server_cpus`), loaded by closed-loop aiohttp clients in `CLIENT_PROCESSES`
   child processes (pinned one each to `args.client_cpus`; one process at 1 and 5
   clients). At 1, 5, 100 and 150 concurrent clients, for the regular path (one
   forward pass per request), the batched one (`TensorProxy`) and the HTTP floor
   (`/constant`, the model untouched), the order of the paths alternating by level:
   the time for N requests fired at once until the last answer (the median of
   BURSTS bursts), then a closed loop for LOOP_SECONDS: throughput, p50/p99 latency,
   mean batch size (the server's `/metrics`). A sample of batched answers must equal
   the regular ones within a tolerance for the dtype. The levels run on the proxy's
   default thread (HEADLINE_OVERLAP). Then one client sends PAIRS texts both ways,
   interleaved request by request: the lone client's speedup with its 95 % interval.
2. In process, no HTTP, the same model: items/s one forward pass per item, in full
   batches of 64 fed directly (the ceiling), and through the proxy with 150
   coroutines.
3. The overlap's gain (CUDA: the next batch's collate and copy overlapping the
   current batch's compute): batched at 150 clients over HTTP on a second server
   started with the other `overlap`, and through the proxy in process with and without,
   each with the GPU's utilisation meanwhile (`nvidia-smi`; None on a CPU).

Returns the numbers as a JSON-able dict, prints a Markdown table, writes
`args.out / "gpu-http.png"`. Progress lines go to stdout as it runs.

Standalone (for testing): `python benchmarks/_gpu_http.py --device cpu --quick`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))

from sample_text import make_sentences  # noqa: E402  (light: no torch)

if TYPE_CHECKING:
    from demo import Service

LEVELS = (1, 5, 100, 150)
PATHS = {"regular": "/classify/regular", "batched": "/classify", "floor": "/constant"}
BATCH_SIZE = 64
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
STARTUP_TIMEOUT = 300.0
REQUEST_TIMEOUT = 120.0
SHORT = {"regular": "reg", "batched": "batch", "floor": "floor"}


def log(message: str) -> None:
    print(f"[gpu-http {time.strftime('%H:%M:%S')}] {message}", flush=True)


def pin(cpus: Sequence[int] | None) -> None:
    if cpus:
        os.sched_setaffinity(0, set(cpus))


# ------------------------------------------------------------------------- the server


def serve(config: dict[str, Any]) -> None:
    """The server child: pin, then serve the app (`demo.serve_app`: a free loopback port,
    printed; until stdin closes, or SIGTERM)."""
    pin(config.get("cpus"))
    from bert_app import create_app
    from demo import serve_app

    app = create_app(
        config["model"],
        config["device"],
        config["dtype"],
        BATCH_SIZE,
        overlap=config["overlap"],
        timeout=REQUEST_TIMEOUT,
    )
    if config.get("timed"):  # the lone-client section's server: where its time goes
        from _gpu_lone import TimedApp

        app = TimedApp(app)
    serve_app(app, timeout_keep_alive=300, backlog=4096)


def launch_server(config: dict[str, Any]) -> Service:
    """The app in a child process (`demo.Service`), launched: the port is known; its
    `ready()` returns once the model is loaded (so two servers can load at the same time)."""
    from demo import Service

    command = [sys.executable, __file__, "--serve", json.dumps(config)]
    return Service(command, STARTUP_TIMEOUT).launch()


def batch_totals(service: Service) -> dict[str, tuple[float, float]]:
    """The proxy's batch-size histogram in the server's `/metrics`: (items, batches)."""
    from demo import batch_size_totals

    with urllib.request.urlopen(f"{service.base_url}/metrics", timeout=30) as response:
        return batch_size_totals(response.read().decode())


# ------------------------------------------------------------------------- the clients


class LoadWorker:
    """A load-generator child's requests: one aiohttp session, kept across commands."""

    def __init__(self) -> None:
        self.session: Any = None

    async def open(self, url: str) -> dict[str, Any]:
        import aiohttp

        await self.close()  # a new server: the old one's session goes
        connector = aiohttp.TCPConnector(limit=0, force_close=False)  # TCP_NODELAY by default
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT)
        self.session = aiohttp.ClientSession(url, connector=connector, timeout=timeout)
        return {}

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None

    async def post(self, path: str, text: str) -> tuple[float, float, Any]:
        started = time.monotonic()
        async with self.session.post(path, json={"text": text}) as response:
            body = await response.json() if response.status == 200 else await response.text()
            if response.status != 200:
                raise RuntimeError(f"POST {path}: {response.status} {str(body)[:200]}")
        ended = time.monotonic()
        return ended - started, ended, body

    async def burst(self, command: dict[str, Any]) -> dict[str, Any]:
        await _wait_until(command["start_at"])
        outcomes = await asyncio.gather(
            *(self.post(command["path"], text) for text in command["texts"]),
            return_exceptions=True,
        )
        done = [o for o in outcomes if not isinstance(o, BaseException)]
        errors = [repr(o) for o in outcomes if isinstance(o, BaseException)]
        return {
            "latencies": [o[0] for o in done],
            "end": max((o[1] for o in done), default=time.monotonic()),
            "answers": [None if isinstance(o, BaseException) else o[2] for o in outcomes],
            "errors": len(errors),
            "error": errors[0] if errors else None,
        }

    async def loop(self, command: dict[str, Any]) -> dict[str, Any]:
        texts, clients = command["texts"], command["clients"]
        stop_at = command["start_at"] + command["duration"]
        latencies: list[float] = []
        errors: list[str] = []

        async def one_client(position: int) -> None:
            while time.monotonic() < stop_at:
                try:
                    latency, ended, _ = await self.post(
                        command["path"], texts[position % len(texts)]
                    )
                except Exception as exc:
                    errors.append(repr(exc))
                    return
                if ended <= stop_at:
                    latencies.append(latency)
                position += clients

        await _wait_until(command["start_at"])
        await asyncio.gather(*(one_client(i) for i in range(clients)))
        return {
            "latencies": latencies,
            "errors": len(errors),
            "error": errors[0] if errors else None,
        }

    async def pairs(self, command: dict[str, Any]) -> dict[str, Any]:
        """One client: each text to `first` and `second`, back to back, the path that
        goes first alternating; the latencies of each path, pair by pair."""
        latencies: dict[str, list[float]] = {"first": [], "second": []}
        for index, text in enumerate(command["texts"]):
            order = ("first", "second") if index % 2 == 0 else ("second", "first")
            for key in order:
                latency, _, _ = await self.post(command[key], text)
                latencies[key].append(latency)
        return latencies


async def _wait_until(moment: float) -> None:
    await asyncio.sleep(max(0.0, moment - time.monotonic()))


def client_worker(cpus: Sequence[int] | None) -> None:
    """A load-generator child: JSON commands on stdin, one JSON answer line each."""
    pin(cpus)
    try:
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:
        runner = asyncio.Runner()
    worker = LoadWorker()
    with runner:
        for line in sys.stdin:
            command = json.loads(line)
            if command["op"] == "open":
                answer = runner.run(worker.open(command["url"]))
            elif command["op"] in ("burst", "loop", "pairs"):
                answer = runner.run(getattr(worker, command["op"])(command))
            else:
                break
            print(json.dumps(answer), flush=True)
        runner.run(worker.close())


def _split(items: Sequence[Any], parts: int) -> list[list[Any]]:
    return [list(items[i::parts]) for i in range(parts)]


class Clients:
    """`count` load-generator processes, driven together; the times are CLOCK_MONOTONIC,
    the same in every process, so all of them start at one moment."""

    def __init__(self, count: int, cpus: Sequence[int] | None) -> None:
        self.processes: list[subprocess.Popen[str]] = []
        for index in range(count):
            pinned = [cpus[index % len(cpus)]] if cpus else []
            self.processes.append(
                subprocess.Popen(
                    [sys.executable, __file__, "--client", json.dumps(pinned)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )

    def _ask(self, commands: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        for process, command in zip(self.processes, commands, strict=False):
            stdin: IO[str] | None = process.stdin
            assert stdin is not None
            stdin.write(json.dumps(command) + "\n")
            stdin.flush()
        answers = []
        for process in self.processes[: len(commands)]:
            assert process.stdout is not None
            line = process.stdout.readline()
            if not line:
                raise RuntimeError(f"a client process exited (code {process.wait()})")
            answers.append(json.loads(line))
        return answers

    def open(self, url: str) -> None:
        self._ask([{"op": "open", "url": url}] * len(self.processes))

    def burst(self, path: str, texts: Sequence[str], processes: int) -> dict[str, Any]:
        """`texts` sent at once: the time until the last answer, each latency, answers."""
        processes = min(processes, len(texts), len(self.processes))
        start_at = time.monotonic() + 0.05
        parts = _split(texts, processes)
        answers = self._ask(
            [{"op": "burst", "path": path, "texts": p, "start_at": start_at} for p in parts]
        )
        in_order: list[Any] = [None] * len(texts)
        for index, answer in enumerate(answers):
            in_order[index::processes] = answer["answers"]
        return {
            "wall": max(a["end"] for a in answers) - start_at,
            "latencies": [x for a in answers for x in a["latencies"]],
            "answers": in_order,
            "errors": sum(a["errors"] for a in answers),
            "error": next((a["error"] for a in answers if a["error"]), None),
        }

    def loop(
        self, path: str, clients: int, seconds: float, processes: int, texts: Sequence[str]
    ) -> dict[str, Any]:
        """`clients` closed-loop clients for `seconds`: latencies of what finished in time."""
        processes = min(processes, clients, len(self.processes))
        start_at = time.monotonic() + 0.05
        shares = [len(p) for p in _split(range(clients), processes)]
        answers = self._ask(
            [
                {
                    "op": "loop",
                    "path": path,
                    "clients": share,
                    "texts": texts[index::processes],
                    "start_at": start_at,
                    "duration": seconds,
                }
                for index, share in enumerate(shares)
            ]
        )
        return {
            "latencies": [x for a in answers for x in a["latencies"]],
            "errors": sum(a["errors"] for a in answers),
            "error": next((a["error"] for a in answers if a["error"]), None),
        }

    def pairs(self, first: str, second: str, texts: Sequence[str]) -> dict[str, list[float]]:
        """One client (the first process) sends each text to both paths, interleaved."""
        command = {"op": "pairs", "first": first, "second": second, "texts": list(texts)}
        return self._ask([command])[0]

    def close(self) -> None:
        for process in self.processes:
            if process.stdin is not None:
                with contextlib.suppress(OSError):
                    process.stdin.close()
        for process in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


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


# ------------------------------------------------------------------------ measuring


def percentile_ms(latencies: Sequence[float], which: str) -> float | None:
    if not latencies:
        return None
    from batchproxy import Percentiles

    return 1000 * float(getattr(Percentiles.of(latencies), which))


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


# ------------------------------------------------------------------------ reporting


def _f(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if not a or not b else f"{a / b:.2f}x"


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"### BERT over HTTP ({result['device']}, {result['dtype']}, batch_size {BATCH_SIZE}, "
        f"{result['client_processes']} client processes at 100/150, 1 at 1/5; overlap "
        f"{'on' if HEADLINE_OVERLAP else 'off'})",
        "",
        "| model | clients | path | N at once (s) | req/s | p50 (ms) | p99 (ms) "
        "| mean batch | vs regular |",
        "|:--|--:|:--|--:|--:|--:|--:|--:|--:|",
    ]
    for name, model in result["models"].items():
        regular = {r["clients"]: r for r in model["http"] if r["path"] == "regular"}
        for path_name in PATHS:
            for row in (r for r in model["http"] if r["path"] == path_name):
                base = regular[row["clients"]]
                lines.append(
                    f"| {name} | {row['clients']} | {path_name} | {row['burst_s']:.3f} "
                    f"| {row['throughput']:.0f} | {_f(row['p50_ms'])} | {_f(row['p99_ms'])} "
                    f"| {_f(row['mean_batch_size'])} "
                    f"| {_ratio(row['throughput'], base['throughput'])} |"
                )
    lines += [
        "",
        "| model | batched = regular (max diff, tol) | in process: batch 1 items/s "
        "| batches of 64 items/s | proxy, 150 coroutines items/s (mean batch) |",
        "|:--|:--|--:|--:|--:|",
    ]
    for name, model in result["models"].items():
        local, check = model["in_process"], model["check"]
        lines.append(
            f"| {name} | {'yes' if check['ok'] else 'NO'} ({check['max_abs_diff']:.1e}, "
            f"{check['tolerance']:g}) | {local['batch1_items_s']:.0f} "
            f"| {local['batch64_items_s']:.0f} | {local['proxy_overlap_items_s']:.0f} "
            f"({_f(local['proxy_overlap_mean_batch'])}) |"
        )
    lines += [
        "",
        "| model | one client, interleaved pairs | batched / regular speed (95 %) "
        "| p50 ms: regular, batched | p99 ms: regular, batched |",
        "|:--|--:|--:|--:|--:|",
    ]
    for name, model in result["models"].items():
        lone = model["one_client"]
        lines.append(
            f"| {name} | {lone['pairs']} | {lone['speedup']:.3f}x ({lone['low']:.3f}-"
            f"{lone['high']:.3f}) | {_f(lone['regular_p50_ms'])}, {_f(lone['batched_p50_ms'])} "
            f"| {_f(lone['regular_p99_ms'])}, {_f(lone['batched_p99_ms'])} |"
        )
    lines += [
        "",
        "| model | where | overlap on: items/s (GPU %) | overlap off: items/s (GPU %) | gain |",
        "|:--|:--|--:|--:|--:|",
    ]
    for name, model in result["models"].items():
        for where, pair in model["overlap"].items():
            on, off = pair["on"], pair["off"]
            on_rate = on.get("throughput", on.get("items_s"))
            off_rate = off.get("throughput", off.get("items_s"))
            where_text = (
                f"HTTP, {OVERLAP_CLIENTS} clients"
                if where == "http"
                else (f"in process, {OVERLAP_CLIENTS} coroutines")
            )
            lines.append(
                f"| {name} | {where_text} | {on_rate:.0f} ({_f(on['gpu_util'], 0)}) "
                f"| {off_rate:.0f} ({_f(off['gpu_util'], 0)}) | {_ratio(on_rate, off_rate)} |"
            )
    return "\n".join(lines)


def plot(result: dict[str, Any], output: Path, where: str | None = None) -> None:
    """Throughput and p99 against clients, per model; `where` (the card, the date) goes
    into the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = result["models"]
    figure, axes = plt.subplots(len(models), 2, figsize=(12, 4.2 * len(models)), squeeze=False)
    styles = {"regular": ("tab:red", "o"), "batched": ("tab:blue", "s"), "floor": ("gray", "^")}
    for row_axes, (name, model) in zip(axes, models.items(), strict=True):
        left, right = row_axes
        for path_name, (color, marker) in styles.items():
            rows = [r for r in model["http"] if r["path"] == path_name]
            levels = [r["clients"] for r in rows]
            left.plot(levels, [r["throughput"] for r in rows], marker=marker, color=color,
                      label=path_name)  # fmt: skip
            right.plot(levels, [r["p99_ms"] or float("nan") for r in rows], marker=marker,
                       color=color, label=path_name)  # fmt: skip
        for axis, ylabel in ((left, "throughput (req/s)"), (right, "p99 latency (ms)")):
            axis.set_xscale("log")
            axis.set_xticks(list(LEVELS))
            axis.set_xticklabels([str(level) for level in LEVELS])
            axis.minorticks_off()
            axis.set_xlabel("concurrent clients")
            axis.set_ylabel(ylabel)
            axis.set_title(f"{name}: {ylabel.split(' (')[0]}")
            axis.grid(True, alpha=0.3)
            axis.legend()
        right.set_yscale("log")
        left.set_ylim(bottom=0)
    title = f"BERT classification over HTTP ({result['device']}, {result['dtype']})"
    figure.suptitle(title if where is None else f"{title}\n{where}")
    figure.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, dpi=110)
    plt.close(figure)


# ------------------------------------------------------------------------ the entry


def client_process_count(cpus: Sequence[int] | None) -> int:
    if cpus:
        return max(1, min(4, len(cpus)))
    return min(4, max(2, (os.cpu_count() or 2) // 4))


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The section: see the module docstring. Returns its numbers (JSON-able)."""
    started = time.perf_counter()
    quick = bool(args.quick)
    plan = {
        "loop_seconds": QUICK_LOOP_SECONDS if quick else LOOP_SECONDS,
        "bursts": QUICK_BURSTS if quick else BURSTS,
        "in_process_seconds": QUICK_IN_PROCESS_SECONDS if quick else IN_PROCESS_SECONDS,
        "warmup_seconds": QUICK_WARMUP_SECONDS if quick else WARMUP_SECONDS,
        "pairs": QUICK_PAIRS if quick else PAIRS,
        "processes": client_process_count(args.client_cpus),
    }
    models = list(args.models)
    if quick and not args.device.startswith("cuda"):
        models = ["bert-tiny"]
    log(f"models {models} on {args.device} ({args.dtype}), plan {plan}")
    result: dict[str, Any] = {
        "section": "gpu-http",
        "device": args.device,
        "dtype": args.dtype,
        "quick": quick,
        "batch_size": BATCH_SIZE,
        "levels": list(LEVELS),
        "client_processes": plan["processes"],
        "server_cpus": args.server_cpus,
        "client_cpus": args.client_cpus,
        "plan": plan,
        "models": {},
    }
    clients = Clients(plan["processes"], args.client_cpus)
    try:
        for name in models:
            result["models"][name] = run_model(name, args, clients, plan)
    finally:
        clients.close()
    out = Path(args.out)
    figure = out / "gpu-http.png"
    plot(result, figure)
    result["figure"] = str(figure)
    result["seconds"] = time.perf_counter() - started
    text = markdown(result)
    result["markdown"] = text
    print(text, flush=True)
    log(f"done in {result['seconds']:.1f} s; figure {figure}")
    return result


def _cpus(text: str | None) -> list[int] | None:
    return [int(c) for c in text.split(",")] if text else None


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--client", help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dtype", default="float32", choices=sorted(TOLERANCE))
    parser.add_argument("--models", default="bert-base,bert-large")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "runs")
    parser.add_argument("--server-cpus", type=_cpus, default=None, help="e.g. 0,1,2,3")
    parser.add_argument("--client-cpus", type=_cpus, default=None)
    args = parser.parse_args(argv)
    if args.serve:
        serve(json.loads(args.serve))
    elif args.client is not None:
        client_worker(json.loads(args.client))
    else:
        args.models = args.models.split(",")
        result = run(args)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu-http.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
