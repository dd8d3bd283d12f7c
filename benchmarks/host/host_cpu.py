"""`make bench-host-cpu`: the server CPU one HTTP request costs in each layout, on a model
that uses none (issue 39).

On a GPU the model's compute leaves the CPU, and what is left per request (HTTP, JSON,
the proxy, the model host's transport) sets the pace. This measures it as CPU seconds,
which a loaded machine does not skew as it skews wall time: the sum of `utime + stime`
(`/proc/PID/stat`) of every server process over a closed loop, divided by the requests
it answered. The model and the servers: `_cpu_roles.py` (the model sleeps 1 +
0.3·n ms per batch of n, the GIL released, and answers a fixed 384-float vector).

The layouts, each a set of server processes on 127.0.0.1:
- `one`: one uvicorn process, FastAPI with `Serving` and `install`, the proxy in it
  (`offload=True`, as the README's service);
- `host`: docs/serving.md's "Several web workers": one model host (`python -m
  batchproxy.host`, `--freeze-gc`) and WORKERS web workers, each with a `RemoteProxy`;
- `floor`: the same FastAPI server answering the constant vector, no proxy (1 worker),
  and `floor2`: the same with WORKERS workers.

The web workers share one port (`SO_REUSEPORT`). The load: `_gpu_http.Clients`, one
aiohttp client process, closed loops at each of LEVELS clients for SECONDS; every
layout is measured at a level before the next level, the order of the layouts
reversed every other round; each row is the median over ROUNDS rounds. Reported per
layout and level: server CPU ms per request (each process's share too), requests/s,
p50 and p99, and each layout's throughput over `one`'s (side by side in the same run).

`--transport`: no HTTP, the proxy's calls alone: CPU microseconds per call of a caller
process with the proxy in it, and of a caller process plus its host. `--base REF`: the
package as it was at git REF (`git archive`) measured too, beside this checkout's, as
`NAME@base` (`one` and `host` layouts, or both transports). `--profile DIR`: every
server process runs under cProfile (CPU time, the loop's thread), written to DIR when
it stops; one round, the highest level only.

Writes `benchmarks/results/host-cpu.json` (`--quick`: `host-cpu-quick.json`;
`--transport`: `host-cpu-transport.json`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import ROOT
from benchmarks._harness.base import archived_package
from benchmarks.host._cpu_roles import (
    BATCH_SIZE,
    LAUNCH_S,
    MODULE,
    PACKAGE_VARIABLE,
    PER_ITEM_S,
    PROFILE_VARIABLE,
    SOCKET_VARIABLE,
    WINDOW_MS,
)

ROLES = [sys.executable, "-m", MODULE]  # a server or caller process, its role after
LEVELS = (32, 150)
QUICK_LEVELS = (32,)
ROUNDS = 2
QUICK_ROUNDS = 1
SECONDS = 8.0
QUICK_SECONDS = 2.0
WARMUP_SECONDS = 1.0
WORKERS = 2
LAYOUTS = ("one", "host", "floor", "floor2")
STARTUP_TIMEOUT = 120.0
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def log(message: str) -> None:
    print(f"[host-cpu {time.strftime('%H:%M:%S')}] {message}", flush=True)


def transport(callers: int, seconds: float, rounds: int, base: str | None) -> dict[str, Any]:
    """CPU per call with no HTTP: a caller process with the proxy in it, and one with a
    `RemoteProxy` to a host process (and both again with the `base` package)."""
    folder = tempfile.mkdtemp(prefix="bp-host-cpu-", dir="/tmp")
    names = ["in_process", "host"] + (["in_process@base", "host@base"] if base else [])
    hosts: dict[str, subprocess.Popen[bytes]] = {}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    try:
        for name in names:
            if name.startswith("host"):
                path = os.path.join(folder, f"{name}.sock")
                hosts[name] = _started([*ROLES, "--host", path], _env(name, base))
        for index in range(rounds):
            for name in names if index % 2 == 0 else names[::-1]:
                host = hosts.get(name)
                target = "local" if host is None else os.path.join(folder, f"{name}.sock")
                before = 0.0 if host is None else _cpu_seconds(host.pid)
                out = subprocess.run(
                    [*ROLES, "--caller", target, str(callers), str(seconds)],
                    env=_env(name, base), check=True, capture_output=True, text=True,
                ).stdout  # fmt: skip
                host_cpu = 0.0 if host is None else _cpu_seconds(host.pid) - before
                done = json.loads(out)
                row = {
                    "calls_s": done["calls"] / seconds,
                    "caller_us_per_call": 1e6 * done["cpu_s"] / done["calls"],
                    "host_us_per_call": 1e6 * host_cpu / done["calls"],
                }
                row["us_per_call"] = row["caller_us_per_call"] + row["host_us_per_call"]
                runs[name].append(row)
                log(
                    f"transport {name:15} {callers:3} callers: {row['us_per_call']:.0f} us CPU "
                    f"per call (caller {row['caller_us_per_call']:.0f}, host "
                    f"{row['host_us_per_call']:.0f}), {row['calls_s']:.0f} calls/s"
                )
    finally:
        for host in hosts.values():
            host.send_signal(signal.SIGTERM)
            host.wait(timeout=60)
        shutil.rmtree(folder, ignore_errors=True)
    return {
        name: {key: statistics.median(run[key] for run in values) for key in values[0]}
        for name, values in runs.items()
    }


def _env(name: str, base: str | None) -> dict[str, str]:
    """The environment of a server or caller process of layout `name` (`...@base`: the
    `base` package first on its path)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop(PACKAGE_VARIABLE, None)
    if name.endswith("@base") and base:
        env[PACKAGE_VARIABLE] = base
    return env


def _started(command: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    """A host process, once it serves (its stderr's first line says so)."""
    process = subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stderr=subprocess.PIPE)
    assert process.stderr is not None
    line = process.stderr.readline().decode()
    if "serving" not in line:
        process.kill()
        process.wait()
        raise RuntimeError(f"a host did not start: {line!r}")
    return process


# ------------------------------------------------------------------------------ layouts


class Layout:
    """A layout's server processes, started and stopped here."""

    def __init__(self, name: str, folder: str, base: str | None) -> None:
        self.name = name
        self.processes: list[subprocess.Popen[bytes]] = []
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**_env(name, base), SOCKET_VARIABLE: os.path.join(folder, f"{name}.sock")}
        kind = name.partition("@")[0]
        try:
            if kind == "host":
                self._start(["--host", env[SOCKET_VARIABLE]], env, wait_for="serving")
            for _ in range(1 if kind in ("one", "floor") else WORKERS):
                self._start(["--web", kind, str(self.port)], env)
        except BaseException:
            self.stop()
            raise

    def _start(self, args: list[str], env: dict[str, str], wait_for: str | None = None) -> None:
        process = subprocess.Popen(
            [*ROLES, *args],
            env=env,
            stdin=subprocess.PIPE,
            stderr=subprocess.PIPE if wait_for else None,
        )
        self.processes.append(process)
        if wait_for:
            assert process.stderr is not None
            line = process.stderr.readline().decode()
            if wait_for not in line:
                raise RuntimeError(f"{self.name}: {args[0]} did not start: {line!r}")

    def wait_ready(self) -> None:
        import httpx

        give_up = time.monotonic() + STARTUP_TIMEOUT
        ready = 0
        while ready < 20:  # (each worker answers: the port's listeners are all up)
            if time.monotonic() > give_up:
                raise RuntimeError(f"{self.name} did not answer in {STARTUP_TIMEOUT} s")
            try:
                answer = httpx.post(f"{self.url}/embed", json={"text": "ready?"}, timeout=10)
                ready = ready + 1 if answer.status_code == 200 else 0
            except httpx.TransportError:
                time.sleep(0.2)

    def cpu(self) -> list[float]:
        """CPU seconds of each server process so far."""
        return [_cpu_seconds(process.pid) for process in self.processes]

    def stop(self) -> None:
        """The web processes first (their stdin closed: uvicorn exits as on SIGTERM, but
        without re-raising it, so a profile is written), then the host (SIGTERM)."""
        for process in self.processes:
            if process.stdin is not None:
                process.stdin.close()
        for process in reversed(self.processes):  # (the host, started first, last)
            if process is self.processes[0] and self.name == "host":
                process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime (fields 14, 15)


# ---------------------------------------------------------------------------- measuring


def measure(
    layout: Layout, clients: Any, level: int, seconds: float, texts: list[str]
) -> dict[str, Any]:
    clients.open(layout.url)
    clients.loop("/embed", level, WARMUP_SECONDS, 1, texts)
    before = layout.cpu()
    began = time.monotonic()
    outcome = clients.loop("/embed", level, seconds, 1, texts)
    wall = time.monotonic() - began
    after = layout.cpu()
    if outcome["errors"]:
        raise RuntimeError(f"{layout.name} at {level}: {outcome['error']}")
    latencies = sorted(outcome["latencies"])
    served = len(latencies) + level  # (each client's last request ends past the window)
    per_process = [1000 * (b - a) / served for a, b in zip(before, after, strict=True)]
    return {
        "cpu_ms_per_request": sum(per_process),
        "cpu_ms_per_request_by_process": per_process,
        "cpu_share_of_wall": sum(b - a for a, b in zip(before, after, strict=True)) / wall,
        "requests_s": len(latencies) / seconds,
        "p50_ms": 1000 * latencies[len(latencies) // 2],
        "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
    }


def run_rounds(
    names: list[str], levels: tuple[int, ...], rounds: int, seconds: float, base: str | None
) -> dict[str, Any]:
    from sample_text import make_sentences

    from benchmarks._harness.clients import Clients

    texts = make_sentences(2000, seed=0, min_words=5, max_words=60)
    folder = tempfile.mkdtemp(prefix="bp-host-cpu-", dir="/tmp")
    clients = Clients(1, None)
    layouts: list[Layout] = []
    rows: dict[str, dict[int, list[dict[str, Any]]]] = {n: {v: [] for v in levels} for n in names}
    try:
        for name in names:
            layouts.append(Layout(name, folder, base))
        for layout in layouts:
            layout.wait_ready()
        log(f"load average {os.getloadavg()}")
        for index in range(rounds):
            order = layouts if index % 2 == 0 else layouts[::-1]
            for level in levels:
                for layout in order:
                    row = measure(layout, clients, level, seconds, texts)
                    rows[layout.name][level].append(row)
                    by_process = ", ".join(f"{x:.2f}" for x in row["cpu_ms_per_request_by_process"])
                    log(
                        f"round {index + 1} {layout.name:11} {level:3} clients: "
                        f"{row['cpu_ms_per_request']:.2f} ms CPU/request ({by_process}), "
                        f"{row['requests_s']:.0f} req/s, p99 {row['p99_ms']:.0f} ms"
                    )
    finally:
        for process in clients.processes:
            process.kill()
            process.wait()
        for layout in layouts:
            layout.stop()
        shutil.rmtree(folder, ignore_errors=True)
    return _medians(rows)


def _medians(rows: dict[str, dict[int, list[dict[str, Any]]]]) -> dict[str, Any]:
    table: dict[str, Any] = {}
    for name, by_level in rows.items():
        table[name] = {}
        for level, runs in by_level.items():
            median = {
                key: statistics.median(run[key] for run in runs)
                for key in ("cpu_ms_per_request", "requests_s", "p50_ms", "p99_ms")
            }
            median["rounds"] = runs
            table[name][str(level)] = median
    if "one" in table:
        for by_level in table.values():
            for level, row in by_level.items():
                row["throughput_over_one"] = row["requests_s"] / table["one"][level]["requests_s"]
    return table


def main() -> None:
    from benchmarks._harness.report import arguments, environment, no_targets, write_report

    def extra(parser: Any) -> None:
        parser.add_argument("--layouts", default=",".join(LAYOUTS))
        parser.add_argument("--profile", type=Path, default=None, metavar="DIR")
        parser.add_argument("--base", default=None, metavar="REF", help="a git ref to compare")

    run = arguments(
        "host-cpu",
        (__doc__ or "").splitlines()[0],
        None,
        mode=("transport", "no HTTP: the proxy's calls alone, in process and through a host"),
        extra=extra,
    )
    names = run.args.layouts.split(",")
    levels = QUICK_LEVELS if run.quick else LEVELS
    rounds = QUICK_ROUNDS if run.quick else ROUNDS
    seconds = QUICK_SECONDS if run.quick else SECONDS
    if run.args.profile is not None:
        run.args.profile.mkdir(parents=True, exist_ok=True)
        os.environ[PROFILE_VARIABLE] = str(run.args.profile.resolve())
        levels, rounds = levels[-1:], 1
    load = os.getloadavg()
    with contextlib.ExitStack() as stack:
        base = (
            None if run.args.base is None else stack.enter_context(archived_package(run.args.base))
        )
        if base is not None:
            names += [f"{name}@base" for name in names if name.startswith(("one", "host"))]
        if run.mode:
            results = {"transport": {str(n): transport(n, seconds, rounds, base) for n in levels}}
        else:
            results = {"layouts": run_rounds(names, levels, rounds, seconds, base)}
    write_report(
        run.output,
        environment(load_average=[load, os.getloadavg()]),
        quick=run.quick,
        config={
            "levels": levels,
            "rounds": rounds,
            "seconds": seconds,
            "workers": WORKERS,
            "batch_size": BATCH_SIZE,
            "window_ms": WINDOW_MS,
            "device_ms": f"{1000 * LAUNCH_S} + {1000 * PER_ITEM_S}·n",
            "base": run.args.base,
        },
        targets=no_targets("issue 39: a measurement (server CPU per request), not a pass mark"),
        results=results,
    )


if __name__ == "__main__":
    main()
