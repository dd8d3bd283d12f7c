"""`make bench-host`: what a model host costs and whether it keeps everything (issue 32).

The model is a stand-in with a fixed cost, so that the numbers are the transport's
and the batching's, not a model's: `_host_models.Tagged` with a `delay` per batch
(an `asyncio.sleep`, no CPU), answering each item with its own tag.

1. **A lone call**: LONE_CALLS calls one after another, interleaved call by call,
   to one proxy in this process and to the same proxy in a host process (`python -m
   batchproxy.host`) through `RemoteProxy`: p50 and p99, and what the host adds.
2. **150 callers**: closed loops of 150 callers for SECONDS, all in this process on
   one in-process proxy, then split over 1, 2 and 4 client processes sending to one
   host: calls/s, the mean batch, and every answer checked (its own item back,
   none lost, no error).
3. **A 16 MB array**: a float32 array's round trip (item and answer) through a host
   process that echoes it, LARGE_CALLS calls each way interleaved call by call:
   through shared memory (the default threshold, 1 MiB) and through the socket (the
   threshold at infinity, in this process and in its host). The median of each,
   the answer's every page touched, and the ratio.

Writes `benchmarks/results/host.json` (`--quick`: `host-quick.json`, git-ignored;
`--large`: section 3 alone, `host-large.json`).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

from benchmarks import ROOT, pythonpath

sys.path.insert(0, str(ROOT / "tests"))  # the host tests' model, `tests/_host_models.py`
MODULE = "benchmarks.host.host"  # (its client and echo-host processes: `python -m`)

from _host_models import Tagged  # noqa: E402

from batchproxy import Percentiles  # noqa: E402
from batchproxy.host import RemoteProxy, _shm  # noqa: E402
from batchproxy.host.__main__ import serve  # noqa: E402
from benchmarks._harness.report import arguments, environment, no_targets, write_report  # noqa: E402

LONE_CALLS = 2000
QUICK_LONE_CALLS = 200
CALLERS = 150
PROCESSES = (1, 2, 4)
SECONDS = 5.0
QUICK_SECONDS = 1.0
DELAY = 0.005  # the model's cost per batch
LARGE_BYTES = 16 * 2**20
LARGE_CALLS = 30
QUICK_LARGE_CALLS = 8


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), pythonpath()])}


class Host:
    """`python -m batchproxy.host _host_models:tagged`, or the `command` given."""

    def __init__(self, path: str, command: list[str] | None = None) -> None:
        tagged = ["-m", "batchproxy.host", "_host_models:tagged", "--socket", path]
        self.process = subprocess.Popen(
            [sys.executable, *(command or tagged)],
            env={**_env(), "HOST_MODEL_DELAY": str(DELAY)},
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.process.stderr is not None
        line = self.process.stderr.readline()
        if "serving" not in line:
            raise RuntimeError(f"the host did not start: {line!r}")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


async def lone(path: str, calls: int) -> dict[str, Any]:
    local: dict[str, list[float]] = {"in_process": [], "host": []}
    async with Tagged(delay=DELAY) as proxy, RemoteProxy(path) as remote:
        paths = {"in_process": proxy.inference, "host": remote.inference}
        for index in range(calls + 20):
            order = list(paths) if index % 2 == 0 else list(paths)[::-1]
            for name in order:
                started = time.perf_counter()
                await paths[name](index)
                if index >= 20:  # after a warm-up
                    local[name].append(time.perf_counter() - started)
    spreads = {name: Percentiles.of(v) for name, v in local.items()}
    result: dict[str, Any] = {
        name: {"p50_ms": 1000 * spread.p50, "p99_ms": 1000 * spread.p99}
        for name, spread in spreads.items()
    }
    result["added_p50_ms"] = result["host"]["p50_ms"] - result["in_process"]["p50_ms"]
    added = statistics.fmean(local["host"]) - statistics.fmean(local["in_process"])
    result["added_mean_ms"] = 1000 * added
    return result


async def closed_loop(call: Any, tag: str, callers: int, seconds: float) -> dict[str, Any]:
    """`callers` callers each sending its next call as soon as the last is answered."""
    right = wrong = failed = shared = 0
    stop_at = time.monotonic() + seconds

    async def caller(number: int) -> None:
        nonlocal right, wrong, failed, shared
        sent = 0
        while time.monotonic() < stop_at:
            item = (tag, number, sent)
            try:
                answer = await call(item)
            except Exception:
                failed += 1
            else:
                if tuple(answer[0]) == item:
                    right += 1
                    shared += answer[2]  # the size of the batch it was in
                else:
                    wrong += 1
            sent += 1

    await asyncio.gather(*(caller(n) for n in range(callers)))
    return {"right": right, "wrong": wrong, "failed": failed, "batch_sum": shared}


def client_main(path: str, tag: str, callers: int, seconds: float) -> None:
    async def run() -> dict[str, Any]:
        async with RemoteProxy(path) as remote:
            return await closed_loop(remote.inference, tag, callers, seconds)

    print(json.dumps(asyncio.run(run())), flush=True)


async def in_process(callers: int, seconds: float) -> dict[str, Any]:
    async with Tagged(delay=DELAY) as proxy:
        counts = await closed_loop(proxy.inference, "local", callers, seconds)
    return _rates(counts, callers, seconds)


def _rates(counts: dict[str, Any], callers: int, seconds: float) -> dict[str, Any]:
    """The counts with calls/s and the batch a call was in, on average."""
    batch = counts.pop("batch_sum") / max(1, counts["right"])
    return {**counts, "callers": callers, "calls_s": counts["right"] / seconds,
            "batch_per_call": batch}  # fmt: skip


def through_host(path: str, processes: int, seconds: float) -> dict[str, Any]:
    shares = [CALLERS // processes + (i < CALLERS % processes) for i in range(processes)]
    command = [sys.executable, "-m", MODULE, "--client", path]
    clients = [
        subprocess.Popen(
            [*command, f"p{i}", str(share), str(seconds)],
            env=_env(),
            stdout=subprocess.PIPE,
            text=True,
        )
        for i, share in enumerate(shares)
    ]
    totals = {"right": 0, "wrong": 0, "failed": 0, "batch_sum": 0}
    for client in clients:
        out, _ = client.communicate(timeout=seconds + 120)
        for key, value in json.loads(out).items():
            totals[key] += value
    return _rates(totals, sum(shares), seconds)


THRESHOLDS = {"shared_memory": _shm.THRESHOLD, "socket": math.inf}


def echo_host_main(path: str, way: str) -> None:
    """A host of `_host_models.echo` whose answers go `way` (a key of THRESHOLDS)."""
    from _host_models import echo

    _shm.THRESHOLD = THRESHOLDS[way]
    asyncio.run(serve(echo, path, 30.0))


async def large(paths: dict[str, str], calls: int) -> dict[str, Any]:
    """Section 3: `paths` holds an echo host's socket for each way of THRESHOLDS."""
    array = np.random.default_rng(0).random(LARGE_BYTES // 4, dtype=np.float32)
    times: dict[str, list[float]] = {way: [] for way in paths}
    remotes = {way: RemoteProxy(path) for way, path in paths.items()}
    try:
        for index in range(calls + 3):
            order = list(paths) if index % 2 == 0 else list(paths)[::-1]
            for way in order:
                _shm.THRESHOLD = THRESHOLDS[way]
                started = time.perf_counter()
                answer = await remotes[way].inference(array)
                answer[:: 4096 // answer.itemsize].sum()  # every page touched
                if index >= 3:  # after a warm-up
                    times[way].append(time.perf_counter() - started)
                elif not np.array_equal(answer, array):
                    raise AssertionError(f"the echo through {way} is not the array sent")
                del answer
    finally:
        _shm.THRESHOLD = THRESHOLDS["shared_memory"]
        for remote in remotes.values():
            await remote.aclose()
    p50 = {way: 1000 * statistics.median(values) for way, values in times.items()}
    return {
        "bytes": LARGE_BYTES,
        "calls": calls,
        **{f"{way}_p50_ms": value for way, value in p50.items()},
        "socket_over_shared_memory": p50["socket"] / p50["shared_memory"],
    }


def run_large(folder: str, calls: int) -> dict[str, Any]:
    paths = {way: os.path.join(folder, f"{way}.sock") for way in THRESHOLDS}
    hosts = [Host(path, ["-m", MODULE, "--echo-host", path, way]) for way, path in paths.items()]
    try:
        result = asyncio.run(large(paths, calls))
    finally:
        for host in hosts:
            host.stop()
    print(f"16 MB round trip: {result}", flush=True)
    return result


def main() -> None:
    if sys.argv[1:2] == ["--client"]:
        path, tag, callers, seconds = sys.argv[2:6]
        client_main(path, tag, int(callers), float(seconds))
        return
    if sys.argv[1:2] == ["--echo-host"]:
        echo_host_main(*sys.argv[2:4])
        return
    run = arguments(
        "host",
        __doc__.splitlines()[0] if __doc__ else None,
        None,
        mode=("large", "section 3 alone: a 16 MB array with and without shared memory"),
    )
    seconds = QUICK_SECONDS if run.quick else SECONDS
    large_calls = QUICK_LARGE_CALLS if run.quick else LARGE_CALLS
    config: dict[str, Any] = {"large_bytes": LARGE_BYTES, "large_calls": large_calls}
    results: dict[str, Any] = {}
    folder = tempfile.mkdtemp(prefix="bp-bench-host-", dir="/tmp")
    try:
        if not run.mode:
            config.update(model_delay_s=DELAY, callers=CALLERS, seconds=seconds)
            results.update(lone_and_load(os.path.join(folder, "model.sock"), run.quick, seconds))
        results["large"] = run_large(folder, large_calls)
    finally:
        os.rmdir(folder)
    write_report(
        run.output,
        environment(),
        quick=run.quick,
        config=config,
        targets=no_targets("issue 32 on 2 cores: nothing lost, the added latency small"),
        results=results,
    )


def lone_and_load(path: str, quick: bool, seconds: float) -> dict[str, Any]:
    """Sections 1 and 2."""
    host = Host(path)
    try:
        lone_result = asyncio.run(lone(path, QUICK_LONE_CALLS if quick else LONE_CALLS))
        print(f"lone call: {lone_result}", flush=True)
        loads: dict[str, Any] = {"in_process": asyncio.run(in_process(CALLERS, seconds))}
        print(f"150 callers in process: {loads['in_process']}", flush=True)
        for processes in PROCESSES:
            loads[f"{processes}_processes"] = through_host(path, processes, seconds)
            print(f"150 callers over {processes} processes: {loads[f'{processes}_processes']}")
    finally:
        host.stop()
    return {"lone": lone_result, "load": loads}


if __name__ == "__main__":
    main()
