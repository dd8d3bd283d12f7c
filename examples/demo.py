"""`make demo`: the regular way versus the batch way, over HTTP, with a real model.

Starts the embedding service of `examples/fastapi_app.py` (all-MiniLM-L6-v2, loaded
offline) under uvicorn on 127.0.0.1 at a free port, in a child process that this script
starts and stops. Then, at concurrency 1, 5, 100 and 150, `httpx.AsyncClient`s send
the same deterministic sentences (8 to 60 words, from a fixed word list) twice: once
through the service's no-batching path (every request runs the model on its own) and
once through `POST /embed` (the requests are batched by a `batchproxy` proxy). Each
concurrency level is a fixed number of requests (REQUESTS below: 450 at 100 and 150,
200 at 5) taken by `concurrency` workers, each sending its next request as soon as the
previous one is answered. Both paths are warmed up first.

At one client both paths do the same work, and the question is whether batching costs
anything: a few percent, far less than this machine moves from one second to the next.
So there the two paths are not measured one after the other but interleaved: the one
client sends each of 600 sentences both ways, back to back, the path that goes first
alternating. Both see the same machine, pair by pair, and the printed speedup comes
with its spread: the 95% interval a rerun's figure falls in (a bootstrap over the
pairs) and the figures of the run's consecutive rounds (ROUNDS of them). A verdict on
the "no penalty" target is given only when that interval is clear of it.

Printed: per level and mode the total wall time (at one client: the time of that
path's requests), throughput, p50/p99 latency and mean batch size (from the service's
`/metrics`), the speedup (regular wall time / batched wall time), and the targets
(batched at least 2.0x faster at 150, no penalty at 1), not asserted. Written: `demo.json`
(the numbers, date and machine) and `demo.png` (throughput and p99 latency against
concurrency, both modes) in `benchmarks/results/runs/`, which git ignores: a run changes
no file of the repository. `--publish` writes them to `benchmarks/results/` instead,
where the documentation takes them from. Whole run, model load included: about a minute
on 2 CPU cores.

Run: `python examples/demo.py` (`--quick` for a smoke run with few requests,
`--output-dir DIR` to write the JSON and PNG elsewhere, `--publish` to replace the
published ones). Needs the `models`, `serve` and `demo` extras:
`pip install -e '.[models,serve,prometheus,demo]' 'torch==2.13.0'`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol, TextIO

import httpx
import numpy as np

from batchproxy import Percentiles

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
sys.path[:0] = [str(EXAMPLES), str(ROOT)]  # (also when imported, by a test)

from sample_text import MAX_WORDS, MIN_WORDS, make_sentences  # noqa: E402

from benchmarks._harness.report import RESULTS, environment, write_json  # noqa: E402

LEVELS = (1, 5, 100, 150)
# requests per concurrency level, per mode: enough for steady numbers, few enough that
# the whole demo (model load and warm-up included) takes about a minute on 2 cores; at
# one client, the pairs of interleaved requests (one each way)
REQUESTS = {1: 600, 5: 200, 100: 450, 150: 450}
QUICK_REQUESTS = {1: 4, 5: 10, 100: 100, 150: 150}
INTERLEAVED = 1  # the level measured in interleaved pairs
ROUNDS = 5  # consecutive rounds of pairs, each with its own figure
RESAMPLES = 2000  # bootstrap resamples of the pairs, for the 95% interval
RUNS = RESULTS / "runs"  # git-ignored: where a run writes; RESULTS: the published figures
WARMUP = 150  # requests per mode, at the highest concurrency, before anything is measured
QUICK_WARMUP = 20
BATCH_SIZE = 32
DIMENSION = 384  # all-MiniLM-L6-v2's embedding size
TARGET_SPEEDUP_HIGH = 2.0  # at concurrency 150: regular wall time / batched wall time
TARGET_SPEEDUP_LOW = 0.97  # at concurrency 1: no penalty for batching
STARTUP_TIMEOUT = 180.0
REQUEST_TIMEOUT = 120.0

BATCHED_PATH = "/embed"
REGULAR_PATH = "/embed/regular"
MODES = ("regular", "batched")


def versions(*packages: str) -> dict[str, str | None]:
    """Installed versions, read from the package metadata (nothing is imported)."""
    found: dict[str, str | None] = {}
    for package in packages:
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = None
    return found


# --------------------------------------------------------------------------- the server


def serve(batch_size: int) -> None:
    """The child process: the embedding service, served by `serve_app`."""
    sys.path.insert(0, str(EXAMPLES))
    from fastapi_app import create_app

    # a generous deadline: a demo on a busy machine should report slow, not fail
    app = create_app(batch_size=batch_size, timeout=60.0, freeze_gc=True)
    serve_app(app, timeout_keep_alive=120, backlog=2048)  # (connections idle between levels)


def serve_app(app: Any, **options: Any) -> None:
    """In a child process: bind a free loopback port, report it (`PORT n` on stdout, the
    one line the parent reads), serve `app` under uvicorn (`options`: its `Config`'s)
    until told to stop.

    Stops on SIGTERM or when its stdin closes: the parent holds the other end, so even a
    parent killed outright takes the server (and its loaded model) down with it.
    """
    import uvicorn

    # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say they are
    # TCP, and without it every keep-alive response waits ~40 ms for a delayed ACK
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    print(f"PORT {sock.getsockname()[1]}", flush=True)
    sys.stdout = sys.stderr  # the parent reads only that one line
    config = uvicorn.Config(app, log_level="warning", access_log=False, **options)
    server = uvicorn.Server(config)

    def stop_when_the_parent_goes() -> None:
        sys.stdin.read()  # returns at EOF: the parent closed the pipe, or died
        server.should_exit = True

    threading.Thread(target=stop_when_the_parent_goes, daemon=True).start()
    asyncio.run(server.serve(sockets=[sock]))


class Service:
    """A service in a child process (`command`, which runs `serve_app`), on 127.0.0.1,
    started and stopped here. `start()` is `launch()` (returns once the port is known)
    then `ready()` (once `is_ready()`: `/readyz` answers 200, the model loaded); apart,
    several services can load at the same time.

    `env`: variables added to the child's environment. `own_group`: the child leads a
    process group of its own, and `stop()` kills whatever is left in that group once the
    child is gone (a server that starts processes of its own)."""

    def __init__(
        self,
        command: list[str],
        startup_timeout: float = STARTUP_TIMEOUT,
        *,
        env: Mapping[str, str] | None = None,
        own_group: bool = False,
    ) -> None:
        self.command = command
        self.startup_timeout = startup_timeout
        self.env = dict(env or {})
        self.own_group = own_group
        self.process: subprocess.Popen[str] | None = None
        self.base_url = ""
        self.launched = 0.0
        self.startup_seconds = 0.0

    def start(self) -> Service:
        return self.launch().ready()

    def launch(self) -> Service:
        self.launched = time.perf_counter()
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **self.env}
        self.process = subprocess.Popen(
            self.command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=self.own_group,
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline()  # the child prints its port before the model loads
        match = re.fullmatch(r"PORT (\d+)\s*", line)
        if match is None:
            self.stop()
            raise RuntimeError(f"the service did not start (first line: {line!r})")
        self.base_url = f"http://127.0.0.1:{match.group(1)}"
        return self

    def ready(self) -> Service:
        assert self.process is not None
        deadline = time.monotonic() + self.startup_timeout
        while True:  # /readyz turns 200 once the model is loaded and the proxy started
            if self.process.poll() is not None:
                raise RuntimeError(f"the service exited with code {self.process.returncode}")
            if self.is_ready():
                break
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the service was not ready after {self.startup_timeout:.0f} s")
            time.sleep(0.1)
        self.startup_seconds = time.perf_counter() - self.launched
        return self

    def is_ready(self) -> bool:
        """Whether the service answers yet: `GET /readyz` is 200."""
        try:
            return httpx.get(f"{self.base_url}/readyz", timeout=5.0).status_code == 200
        except httpx.TransportError:
            return False

    def stop(self) -> None:
        try:
            self._stop_child()
        finally:
            if self.own_group and self.process is not None:
                with contextlib.suppress(ProcessLookupError):  # (none left: nothing to kill)
                    os.killpg(self.process.pid, signal.SIGKILL)

    def _stop_child(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)  # uvicorn: graceful, the lifespan closes
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


# ------------------------------------------------------------------------------ metrics

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def batch_size_totals(metrics_text: str) -> dict[str, tuple[float, float]]:
    """From Prometheus text: per label set, (items, batches) of the batch-size histogram."""
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for line in metrics_text.splitlines():
        match = _SAMPLE.match(line)
        if match is None:
            continue
        name, labels, value = match.group(1), match.group(2) or "", match.group(3)
        if name.endswith("batch_size_sum"):
            sums[labels] = float(value)
        elif name.endswith("batch_size_count"):
            counts[labels] = float(value)
    return {labels: (sums[labels], counts[labels]) for labels in sums if labels in counts}


def mean_batch_size(
    before: Mapping[str, tuple[float, float]], after: Mapping[str, tuple[float, float]]
) -> float | None:
    """Items per model call over the series that changed in between (None: no batches)."""
    items = batches = 0.0
    for labels, (total, count) in after.items():
        old_total, old_count = before.get(labels, (0.0, 0.0))
        items += total - old_total
        batches += count - old_count
    return items / batches if batches > 0 else None


# ------------------------------------------------------------------------------ the load


class Progress(Protocol):
    def update(self, n: int = 1) -> object: ...
    def close(self) -> None: ...


class TextBar:
    """A minimal in-place progress bar on stderr, for when tqdm is not installed."""

    def __init__(self, total: int, description: str, stream: TextIO = sys.stderr) -> None:
        self.total, self.description, self.stream = total, description, stream
        self.done = 0
        self.started = time.perf_counter()
        self.drawn = -1
        self._draw()

    def _draw(self) -> None:
        width = 30
        filled = width * self.done // max(1, self.total)
        elapsed = time.perf_counter() - self.started
        self.stream.write(
            f"\r{self.description:<16} |{'#' * filled}{'.' * (width - filled)}| "
            f"{self.done}/{self.total} {elapsed:5.1f}s"
        )
        self.stream.flush()
        self.drawn = self.done

    def update(self, n: int = 1) -> None:
        self.done += n
        if self.done == self.total or self.done - self.drawn >= max(1, self.total // 50):
            self._draw()

    def close(self) -> None:
        self._draw()
        self.stream.write("\n")
        self.stream.flush()


def progress_bar(total: int, description: str) -> Progress:
    try:
        from tqdm import tqdm
    except ImportError:
        return TextBar(total, description)
    bar: Progress = tqdm(
        total=total, desc=description, unit="req", file=sys.stderr, mininterval=0.2, ncols=90
    )
    return bar


@dataclass
class Measurement:
    mode: str
    concurrency: int
    requests: int
    wall_seconds: float
    throughput: float
    latency_p50_ms: float
    latency_p99_ms: float
    mean_batch_size: float | None


async def post(client: httpx.AsyncClient, path: str, text: str) -> float:
    """One request, its answer checked: its latency in seconds."""
    started = time.perf_counter()
    response = await client.post(path, json={"text": text})
    if response.status_code != 200:
        raise RuntimeError(f"POST {path}: {response.status_code} {response.text[:200]}")
    if len(response.json()["embedding"]) != DIMENSION:
        raise RuntimeError(f"POST {path}: not a {DIMENSION}-float embedding")
    return time.perf_counter() - started


async def drive(
    clients: Sequence[httpx.AsyncClient],
    path: str,
    sentences: Sequence[str],
    concurrency: int,
    progress: Progress | None,
) -> tuple[float, list[float]]:
    """`concurrency` workers send the sentences one request at a time: wall s, latencies."""
    latencies: list[float] = []
    pending: Iterator[str] = iter(sentences)  # shared: each worker takes the next sentence

    async def worker(client: httpx.AsyncClient) -> None:
        for text in pending:
            latencies.append(await post(client, path, text))
            if progress is not None:
                progress.update(1)

    started = time.perf_counter()
    await asyncio.gather(*(worker(client) for client in clients[:concurrency]))
    return time.perf_counter() - started, latencies


async def measure(
    clients: Sequence[httpx.AsyncClient], mode: str, concurrency: int, sentences: Sequence[str]
) -> Measurement:
    path = REGULAR_PATH if mode == "regular" else BATCHED_PATH
    before = batch_size_totals((await clients[0].get("/metrics")).text)
    progress = progress_bar(len(sentences), f"{mode} c={concurrency}")
    try:
        wall, latencies = await drive(clients, path, sentences, concurrency, progress)
    finally:
        progress.close()
    after = batch_size_totals((await clients[0].get("/metrics")).text)
    batch_mean = mean_batch_size(before, after)
    if mode == "regular" and batch_mean is None:
        batch_mean = 1.0  # no batching: the model runs once per request
    return Measurement(
        mode=mode,
        concurrency=concurrency,
        requests=len(sentences),
        wall_seconds=wall,
        throughput=len(sentences) / wall,
        latency_p50_ms=1000 * Percentiles.of(latencies).p50,
        latency_p99_ms=1000 * Percentiles.of(latencies).p99,
        mean_batch_size=batch_mean,
    )


@dataclass
class Spread:
    """How far the interleaved speedup moves: what a rerun would print, foreseen."""

    pairs: int
    low: float
    """The 95% interval of the speedup: bootstrap resamples of the pairs."""
    high: float
    rounds: list[float]
    """The speedup of each consecutive round of pairs (ROUNDS of them)."""


def spread_of(regular: Sequence[float], batched: Sequence[float]) -> Spread:
    """The spread of sum(regular) / sum(batched) over latency pairs (regular[i], batched[i])."""
    pairs = np.array([regular, batched])
    picks = np.random.default_rng(0).integers(0, len(regular), (RESAMPLES, len(regular)))
    ratios = np.sort(pairs[0][picks].sum(axis=1) / pairs[1][picks].sum(axis=1))
    chunks = np.array_split(np.arange(len(regular)), min(ROUNDS, len(regular)))
    return Spread(
        pairs=len(regular),
        low=float(ratios[int(0.025 * RESAMPLES)]),
        high=float(ratios[int(0.975 * RESAMPLES) - 1]),
        rounds=[float(pairs[0][c].sum() / pairs[1][c].sum()) for c in chunks],
    )


async def measure_interleaved(
    client: httpx.AsyncClient, sentences: Sequence[str]
) -> tuple[Measurement, Measurement, Spread]:
    """One client sends each sentence both ways, back to back, the path that goes first
    alternating: both paths see the same machine, pair by pair."""
    latencies: dict[str, list[float]] = {mode: [] for mode in MODES}
    before = batch_size_totals((await client.get("/metrics")).text)
    progress = progress_bar(2 * len(sentences), "interleaved c=1")
    try:
        for index, text in enumerate(sentences):
            for mode in MODES if index % 2 == 0 else MODES[::-1]:
                path = REGULAR_PATH if mode == "regular" else BATCHED_PATH
                latencies[mode].append(await post(client, path, text))
                progress.update(1)
    finally:
        progress.close()
    after = batch_size_totals((await client.get("/metrics")).text)
    # (the regular path does not batch: its model calls are not in the proxy's histogram)
    batch_means = {"regular": 1.0, "batched": mean_batch_size(before, after)}
    measured = []
    for mode in MODES:
        wall = sum(latencies[mode])  # the time of this path's requests
        measured.append(
            Measurement(
                mode=mode,
                concurrency=1,
                requests=len(sentences),
                wall_seconds=wall,
                throughput=len(sentences) / wall,
                latency_p50_ms=1000 * Percentiles.of(latencies[mode]).p50,
                latency_p99_ms=1000 * Percentiles.of(latencies[mode]).p99,
                mean_batch_size=batch_means[mode],
            )
        )
    return measured[0], measured[1], spread_of(latencies["regular"], latencies["batched"])


@contextlib.asynccontextmanager
async def http_clients(base_url: str, count: int) -> AsyncIterator[list[httpx.AsyncClient]]:
    """One `httpx.AsyncClient` per worker, each keeping its one connection alive.

    Not one client with a pool of `count` connections: httpx's pool does work in
    proportion to its size on every request, and at 150 connections the client burns
    several times the CPU the server does, on the same two cores. One TLS context is
    shared (it is never used on plain http, but building one per client costs ~30 ms).
    """
    tls = ssl.create_default_context()
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    async with contextlib.AsyncExitStack() as stack:
        yield [
            await stack.enter_async_context(
                httpx.AsyncClient(
                    base_url=base_url, limits=limits, timeout=REQUEST_TIMEOUT, verify=tls
                )
            )
            for _ in range(count)
        ]


async def run_load(
    base_url: str, requests: Mapping[int, int], warmup: int
) -> tuple[list[tuple[Measurement, Measurement]], Spread]:
    """Every level, both modes: the measurements, and the interleaved level's spread."""
    async with http_clients(base_url, max(LEVELS)) as clients:
        warm = make_sentences(warmup, seed=1)
        for mode in MODES:  # first model calls, worker threads, every client's connection
            path = REGULAR_PATH if mode == "regular" else BATCHED_PATH
            progress = progress_bar(len(warm), f"warm-up {mode}")
            try:
                await drive(clients, path, warm, min(max(LEVELS), warmup), progress)
            finally:
                progress.close()
        results = []
        spread: Spread | None = None
        for index, level in enumerate(LEVELS):
            sentences = make_sentences(requests[level], seed=100 + level)
            if level == INTERLEAVED:
                regular, batched, spread = await measure_interleaved(clients[0], sentences)
                results.append((regular, batched))
                continue
            measured: dict[str, Measurement] = {}
            # alternate which mode goes first, so neither always runs on a fresher machine
            for mode in MODES if index % 2 == 0 else MODES[::-1]:
                measured[mode] = await measure(clients, mode, level, sentences)
            results.append((measured["regular"], measured["batched"]))
        assert spread is not None
        return results, spread


# ---------------------------------------------------------------------------- reporting


def speedup(regular: Measurement, batched: Measurement) -> float:
    return regular.wall_seconds / batched.wall_seconds


def table(results: Sequence[tuple[Measurement, Measurement]]) -> str:
    lines = [
        "| concurrency | mode    | requests | wall time (s) | throughput (req/s) "
        "| p50 (ms) | p99 (ms) | mean batch size | speedup |",
        "|------------:|:--------|---------:|--------------:|-------------------:"
        "|---------:|---------:|----------------:|--------:|",
    ]
    for regular, batched in results:
        for row in (regular, batched):
            batch = "-" if row.mean_batch_size is None else f"{row.mean_batch_size:.1f}"
            ratio = f"{speedup(regular, batched):.2f}x" if row is batched else ""
            lines.append(
                f"| {row.concurrency:>11} | {row.mode:<7} | {row.requests:>8} "
                f"| {row.wall_seconds:>13.2f} | {row.throughput:>18.1f} "
                f"| {row.latency_p50_ms:>8.1f} | {row.latency_p99_ms:>8.1f} "
                f"| {batch:>15} | {ratio:>7} |"
            )
    return "\n".join(lines)


def target_lines(results: Sequence[tuple[Measurement, Measurement]], spread: Spread) -> list[str]:
    """The targets and their verdicts; at the interleaved level, a verdict only where the
    95% interval is clear of the target, and the spread on a line of its own."""
    by_level = {regular.concurrency: speedup(regular, batched) for regular, batched in results}
    lines = []
    for level, target, meaning in (
        (max(LEVELS), TARGET_SPEEDUP_HIGH, "batched at least 2x faster"),
        (min(LEVELS), TARGET_SPEEDUP_LOW, "no penalty for batching"),
    ):
        got = by_level[level]
        verdict = "met" if got >= target else "NOT met"
        if level == INTERLEAVED and spread.low < target <= spread.high:
            verdict = "too close to call (the target is inside the 95% interval)"
        elif level == INTERLEAVED:
            verdict = "met" if spread.low >= target else "NOT met"
        lines.append(
            f"target at concurrency {level}: speedup >= {target:.2f}x ({meaning}): "
            f"{got:.2f}x, {verdict}"
        )
        if level == INTERLEAVED:
            lines.append(
                f"  its spread: 95% interval {spread.low:.2f}x-{spread.high:.2f}x (bootstrap "
                f"over {spread.pairs} interleaved request pairs); by round of "
                f"{spread.pairs // len(spread.rounds)} pairs: "
                + " ".join(f"{r:.2f}x" for r in spread.rounds)
            )
    return lines


def client_axes(
    levels: Sequence[int], *panels: tuple[Any, str, str], xlabel: str = "concurrent clients"
) -> None:
    """Each panel (a matplotlib axis, its y label, its title): the client counts on a log
    x axis, a tick at each of `levels`, a light grid."""
    for axis, ylabel, heading in panels:
        axis.set_xscale("log")
        axis.set_xticks(levels)
        axis.set_xticklabels([str(level) for level in levels])
        axis.minorticks_off()
        axis.set_xlabel(xlabel)
        axis.set_ylabel(ylabel)
        axis.set_title(heading)
        axis.grid(True, alpha=0.3)


def plot(
    results: Sequence[tuple[Measurement, Measurement]], spread: Spread, output: Path, title: str
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = [regular.concurrency for regular, _ in results]
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8), dpi=110)
    styles = {
        "regular": ("tab:red", "o", "regular (no batching)"),
        "batched": ("tab:blue", "s", "batched (batchproxy)"),
    }
    for position, mode in enumerate(MODES):
        color, marker, label = styles[mode]
        rows = [pair[position] for pair in results]
        left.plot(levels, [r.throughput for r in rows], marker=marker, color=color, label=label)
        right.plot(
            levels, [r.latency_p99_ms for r in rows], marker=marker, color=color, label=label
        )
    for regular, batched in results:
        label = f"{speedup(regular, batched):.2f}x"
        first = regular.concurrency == INTERLEAVED
        if first:  # with the interval a rerun's figure falls in
            label += f" (95%: {spread.low:.2f}-{spread.high:.2f}x)"
        left.annotate(
            label,
            (batched.concurrency, batched.throughput),
            textcoords="offset points",
            xytext=(2, -12) if first else (0, 8),  # (1: below the two lines that meet there)
            ha="left" if first else "center",
            va="top" if first else "baseline",
            fontsize=9,
            color="tab:blue",
        )
    client_axes(
        levels,
        (left, "throughput (requests/s)", "Throughput (labels: batched speedup)"),
        (right, "p99 latency (ms)", "p99 latency"),
    )
    left.legend(loc="lower right")
    right.legend(loc="upper left")
    left.set_ylim(bottom=0)
    right.set_yscale("log")
    figure.suptitle(title)
    figure.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output)
    plt.close(figure)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="a smoke run with few requests")
    parser.add_argument(
        "--output-dir",
        type=Path,
        default=None,
        help=f"where demo.json and demo.png go (default: {RUNS.relative_to(ROOT)}/)",
    )
    parser.add_argument(
        "--publish",
        action="store_true",
        help=f"write them to {RESULTS.relative_to(ROOT)}/, where the docs take them from",
    )
    parser.add_argument("--batch-size", type=int, default=BATCH_SIZE, help=argparse.SUPPRESS)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        serve(args.batch_size)
        return 0
    if args.publish and (args.quick or args.output_dir is not None):
        parser.error("--publish writes a full run to the published place: no --quick, --output-dir")

    began = time.perf_counter()
    requests = QUICK_REQUESTS if args.quick else REQUESTS
    warmup = QUICK_WARMUP if args.quick else WARMUP
    print(
        f"all-MiniLM-L6-v2 behind FastAPI + uvicorn on 127.0.0.1, batch_size={args.batch_size}; "
        f"requests per level and mode: "
        + ", ".join(f"{requests[level]} at concurrency {level}" for level in LEVELS)
        + (" (--quick)" if args.quick else ""),
        flush=True,
    )
    service = Service([sys.executable, __file__, "--serve", "--batch-size", str(args.batch_size)])
    try:
        service.start()
        print(f"service ready at {service.base_url} in {service.startup_seconds:.1f} s", flush=True)
        results, spread = asyncio.run(run_load(service.base_url, requests, warmup))
    finally:
        service.stop()

    print()
    print(table(results))
    print()
    for line in target_lines(results, spread):
        print(line)

    document: dict[str, Any] = {
        "environment": environment(
            model="all-MiniLM-L6-v2",
            server="FastAPI + uvicorn, 127.0.0.1, separate process",
            client="httpx.AsyncClient, one per concurrent worker",
            versions=versions("torch", "transformers", "fastapi", "uvicorn", "httpx"),
        ),
        "quick": args.quick,
        "config": {
            "batch_size": args.batch_size,
            "levels": list(LEVELS),
            "requests": {str(level): requests[level] for level in LEVELS},
            "warmup": warmup,
            "regular_path": REGULAR_PATH,
            "batched_path": BATCHED_PATH,
            "words": [MIN_WORDS, MAX_WORDS],
        },
        "targets": {
            f"speedup_at_{max(LEVELS)}": TARGET_SPEEDUP_HIGH,
            f"speedup_at_{min(LEVELS)}": TARGET_SPEEDUP_LOW,
        },
        "startup_seconds": service.startup_seconds,
        "levels": [
            {
                "concurrency": regular.concurrency,
                "speedup": speedup(regular, batched),
                **({"interleaved": asdict(spread)} if regular.concurrency == INTERLEAVED else {}),
                "regular": asdict(regular),
                "batched": asdict(batched),
            }
            for regular, batched in results
        ],
    }
    output_dir: Path = RESULTS if args.publish else args.output_dir or RUNS
    write_json(output_dir / "demo.json", document)
    png = output_dir / "demo.png"
    plot(
        results,
        spread,
        png,
        f"all-MiniLM-L6-v2 over HTTP, regular vs batched "
        f"({document['environment']['date']}, {os.cpu_count()} CPUs)",
    )
    print(f"plot written to {png}")
    if not args.publish and output_dir == RUNS:
        print(f"(the published figures in {RESULTS.relative_to(ROOT)}/: make demo-publish)")
    print(f"total time: {time.perf_counter() - began:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
