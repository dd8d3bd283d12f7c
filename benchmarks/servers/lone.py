"""A lone client, interleaved across servers: how much slower batchproxy's service is
than the regular way at one client, and whether the garbage collector is why.

Starts each server of `lone_server.py` (the regular way and batchproxy's service as
the README shows it, with variants) on 127.0.0.1, then sends one request at a time on
one keep-alive connection per server, in rotating order, so the machine's changing
load falls on every server alike. With `--run K`, K requests in a row go to each
server in turn (the same texts to each): back to back, as one client of one server
sends them, where a server's work after its answer delays the next request. Per
server: latency mean and median, the process's CPU per request (and its event loop's,
its model thread's and its other threads'), the collector's passes per generation
during the run (and their time, and what they collected), and what is frozen. Per
batchproxy server: its speed against the regular way (ratio of mean latencies, with a
bootstrap 95 % interval; the paired geometric mean of the per-request ratios, with a
95 % interval) and the median ratio. The machine's load average is printed before and
after. With `--base REF`, batchproxy's service also runs with the package as it was at
git REF (`batchproxy@base`), interleaved with the others, and batchproxy's row has its
speed against it (`speed_vs_base`): a change measured side by side, in one run.

    python -m benchmarks.servers.lone --requests 500 --threads 1
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from sample_text import make_sentences

from benchmarks import pythonpath
from benchmarks._harness.base import archived_package

WARMUP = 30


def start(
    kind: str, threads: int, log: Path, base: str | None = None
) -> tuple[subprocess.Popen[bytes], int]:
    """Server `kind` (`KIND@base`: KIND with the package of `base`, a folder holding it,
    which its working directory puts first on its path)."""
    env = dict(os.environ, PYTHONPATH=pythonpath(), BENCH_SERVER_LOG=str(log))
    kind, _, of_base = kind.partition("@")
    command = [sys.executable, "-m", "benchmarks.servers.lone_server", kind, str(threads)]
    process = subprocess.Popen(
        command,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        cwd=base if of_base else None,
    )
    assert process.stdout is not None
    port = int(process.stdout.readline().split()[1])
    return process, port


def call(connection: http.client.HTTPConnection, method: str, path: str, body: Any = None) -> Any:
    data = None if body is None else json.dumps(body)
    headers = {} if body is None else {"content-type": "application/json"}
    connection.request(method, path, body=data, headers=headers)
    response = connection.getresponse()
    answer = response.read()
    assert response.status == 200, (path, response.status, answer[:200])
    return json.loads(answer)


def connect(port: int, kind: str, seconds: float = 600.0) -> http.client.HTTPConnection:
    """A connection once the server answers (batchproxy's: once `/readyz` is 200)."""
    deadline = time.monotonic() + seconds
    path = "/gcstats" if kind == "regular" else "/readyz"
    while True:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        try:
            connection.request("GET", path)
            if connection.getresponse().status == 200:
                connection.close()
                return http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        except OSError:
            pass
        connection.close()
        if time.monotonic() > deadline:
            raise RuntimeError(f"{kind} did not get ready")
        time.sleep(0.5)


def ratios(base: list[float], other: list[float]) -> dict[str, float]:
    """`other`'s speed against `base`'s (> 1: faster), three ways."""
    n = len(base)
    rng = random.Random(1)
    boots = []
    for _ in range(2000):
        picks = [rng.randrange(n) for _ in range(n)]
        boots.append(sum(base[i] for i in picks) / sum(other[i] for i in picks))
    boots.sort()
    logs = [math.log(b / o) for b, o in zip(base, other, strict=True)]
    mean, error = statistics.mean(logs), 1.96 * statistics.stdev(logs) / math.sqrt(n)
    return {
        "means": statistics.mean(base) / statistics.mean(other),
        "means_low": boots[50],
        "means_high": boots[1949],
        "paired_geometric": math.exp(mean),
        "paired_low": math.exp(mean - error),
        "paired_high": math.exp(mean + error),
        "medians": statistics.median(base) / statistics.median(other),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", default="regular,batchproxy,batchproxy-nofreeze")
    parser.add_argument("--requests", type=int, default=500, help="per server")
    parser.add_argument("--threads", type=int, default=1, help="torch's threads per server")
    parser.add_argument(
        "--run",
        type=int,
        default=1,
        help="requests in a row to one server before the next (default 1: interleaved "
        "request by request; more: back to back, as one client of one server sends them)",
    )
    parser.add_argument(
        "--base",
        default=None,
        metavar="REF",
        help="also batchproxy's service with the package as it was at git REF "
        "(`batchproxy@base`), interleaved with the others",
    )
    parser.add_argument("--output", type=Path, default=None, help="a JSON file")
    args = parser.parse_args()
    kinds = args.kinds.split(",") + (["batchproxy@base"] if args.base else [])
    assert kinds[0] == "regular", "the regular way first: the others are read against it"
    with contextlib.ExitStack() as stack:
        base = None if args.base is None else stack.enter_context(archived_package(args.base))
        report = measure(args, kinds, base)
    if args.output is not None:
        args.output.write_text(json.dumps(report, indent=2) + "\n")


def measure(args: argparse.Namespace, kinds: list[str], base: str | None) -> dict[str, Any]:
    """Every server of `kinds` up, `args.requests` requests to each, interleaved: the
    report (printed as it is made)."""
    texts = make_sentences(2000, seed=30, min_words=5, max_words=60)
    logs = Path(os.environ.get("TMPDIR", "/tmp"))
    servers = {kind: start(kind, args.threads, logs / f"lone-{kind}.log", base) for kind in kinds}
    try:
        connections = {kind: connect(port, kind) for kind, (_, port) in servers.items()}
        for i in range(WARMUP):
            for kind in kinds:
                call(connections[kind], "POST", "/embed", {"text": texts[i]})
        before = {kind: call(connections[kind], "GET", "/gcstats") for kind in kinds}
        load_before = os.getloadavg()
        times: dict[str, list[float]] = {kind: [] for kind in kinds}
        run = max(1, args.run)
        for block in range(-(-args.requests // run)):
            shift = block % len(kinds)
            order = kinds[shift:] + kinds[:shift]
            first = block * run
            block_texts = [
                texts[(WARMUP + i) % len(texts)]
                for i in range(first, min(first + run, args.requests))
            ]
            for kind in order if (block // len(kinds)) % 2 == 0 else order[::-1]:
                for text in block_texts:  # the same texts, in the same order, to each
                    began = time.perf_counter()
                    call(connections[kind], "POST", "/embed", {"text": text})
                    times[kind].append(time.perf_counter() - began)
        after = {kind: call(connections[kind], "GET", "/gcstats") for kind in kinds}
        load_after = os.getloadavg()
    finally:
        for process, _ in servers.values():
            assert process.stdin is not None
            process.stdin.close()
        for process, _ in servers.values():
            process.wait(timeout=60)
    n = args.requests
    report: dict[str, Any] = {
        "config": {
            "requests": n,
            "threads": args.threads,
            "kinds": kinds,
            "run": run,
            "base": args.base,
        },
        "load_average": {"before": load_before, "after": load_after},
        "servers": {},
    }
    print(f"{n} requests per server; load average {load_before} -> {load_after}")
    for kind in kinds:
        b, a = before[kind], after[kind]
        row = {
            "mean_ms": 1e3 * statistics.mean(times[kind]),
            "median_ms": 1e3 * statistics.median(times[kind]),
            "cpu_ms_per_request": 1e3 * (a["cpu"] - b["cpu"]) / n,
            "thread_cpu_ms_per_request": {
                role: 1e3 * (seconds - b["threads"].get(role, 0.0)) / n
                for role, seconds in a["threads"].items()
            },
            "passes": [x - y for x, y in zip(a["passes"], b["passes"], strict=True)],
            "gc_us_per_request": [
                1e6 * (x - y) / n for x, y in zip(a["seconds"], b["seconds"], strict=True)
            ],
            "collected": [x - y for x, y in zip(a["collected"], b["collected"], strict=True)],
            "frozen": a["frozen"],
        }
        if kind != "regular":
            row["speed_vs_regular"] = ratios(times["regular"], times[kind])
        if kind == "batchproxy" and "batchproxy@base" in times:
            row["speed_vs_base"] = ratios(times["batchproxy@base"], times[kind])
        report["servers"][kind] = row
        print(kind, json.dumps({k: v for k, v in row.items()}, default=float))
    return report


if __name__ == "__main__":
    main()
