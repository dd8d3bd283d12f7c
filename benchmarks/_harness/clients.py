"""The HTTP load generator every HTTP benchmark shares: closed-loop aiohttp clients in
child processes of their own (`Clients`), driven together from the parent.

Each child (`python -m benchmarks._harness.clients CPUS`) pins itself to CPUS (a JSON
list, empty: any), keeps one aiohttp session and reads JSON commands on stdin, one JSON
answer line each: `open` a server, a `burst` of texts at once, a closed `loop` of N
clients for a time, or `pairs` down two paths from one client. The times are
CLOCK_MONOTONIC, the same in every process, so every child starts at one moment.
Used by the GPU benchmark (`benchmarks/gpu`), the servers (`benchmarks/servers`) and
the host's CPU benchmark (`benchmarks/host`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import IO, Any

REQUEST_TIMEOUT = 120.0


def pin(cpus: Sequence[int] | None) -> None:
    if cpus:
        os.sched_setaffinity(0, set(cpus))


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
                    [sys.executable, "-m", "benchmarks._harness.clients", json.dumps(pinned)],
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


# ------------------------------------------------------------------------ measuring


def percentile_ms(latencies: Sequence[float], which: str) -> float | None:
    if not latencies:
        return None
    from batchproxy import Percentiles

    return 1000 * float(getattr(Percentiles.of(latencies), which))


if __name__ == "__main__":
    client_worker(json.loads(sys.argv[1]))
