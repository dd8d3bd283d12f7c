"""The run of the soak through a model host: the host generations and the client processes
started, killed and replaced on schedule, their counters read, and what they add up to
(`Result`: the callers' and the hosts' counts, the checks, RSS, leftovers).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from benchmarks import ROOT, pythonpath
from benchmarks.soak import _mix
from benchmarks.soak._counters import (
    HOST,
    TALLY,
    Counters,
    read_counters,
)

HOST_FACTORY = "benchmarks.soak._host:host_proxy"  # (the host process imports it)
CLIENT = "benchmarks.soak._client"  # (a client process: `python -m`)
TARGET_RSS_GROWTH_MB = _mix.TARGET_RSS_GROWTH_MB


@dataclass(frozen=True)
class Config:
    requests: int = 1_000_000
    clients: int = 4
    concurrency: int = 250  # callers per client
    seed: int = 7
    host_kills: tuple[float, ...] = (0.30, 0.65)  # at these fractions of the calls
    client_kills: tuple[float, ...] = (0.45,)
    checkpoints: int = 20


FULL = Config()
QUICK = replace(FULL, requests=20_000)


# -- the run -------------------------------------------------------------------------------


def environ() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": pythonpath()}


@dataclass
class Process:
    """A host generation or a client, started here."""

    role: str  # "host" or "client"
    number: int  # the generation, or the client's slot (a replacement keeps it)
    popen: subprocess.Popen[bytes]
    counters: Path
    result: Path
    started_at: int  # calls issued (all clients) when it started
    ended: str = "running"  # "exited N", "killed", "stopped N" (SIGTERM)
    rss: list[tuple[int, float]] = field(default_factory=list)  # (calls issued, MB)
    counts: dict[str, int] = field(default_factory=dict)  # its counters at the end
    log: Path = Path(os.devnull)  # its stderr

    @property
    def pid(self) -> int:
        return self.popen.pid

    def read_rss(self, issued: int) -> None:
        try:
            with open(f"/proc/{self.pid}/statm") as statm:
                pages = int(statm.read().split()[1])
        except (OSError, ValueError, IndexError):
            return
        self.rss.append((issued, pages * os.sysconf("SC_PAGE_SIZE") / 1e6))

    def warm_and_growth(self, warmup: int) -> tuple[float, float] | None:
        """RSS at its warm-up (the first reading `warmup` calls after it started), and its
        highest later reading minus that; None if it did not live that long."""
        readings = [mb for issued, mb in self.rss if issued - self.started_at >= warmup]
        if not readings:
            return None
        return readings[0], max(readings) - readings[0]


class Run:
    """The processes of one soak, in a temporary folder; every one stopped at the end."""

    def __init__(self, config: Config, progress: bool) -> None:
        self.config = config
        self.progress = progress
        self.folder = Path(tempfile.mkdtemp(prefix="bp-soak-", dir="/tmp"))
        self.path = str(self.folder / "m.sock")
        self.hosts: list[Process] = []
        self.clients: list[Process] = []
        self.shares = [config.requests // config.clients] * config.clients
        self.shares[-1] += config.requests - sum(self.shares)

    def say(self, text: str) -> None:
        if self.progress:
            print(text, file=sys.stderr, flush=True)

    def start_host(self, issued: int) -> Process:
        number = len(self.hosts)
        counters = self.folder / f"host{number}.counts"
        Counters(counters, HOST, create=True).close()
        final = self.folder / f"host{number}.json"
        log = self.folder / f"host{number}.log"
        env = environ()
        env.update(
            SOAK_COUNTERS=str(counters),
            SOAK_FINAL=str(final),
            SOAK_SEED=str(self.config.seed + 100 * number),
        )
        with open(log, "wb") as stderr:
            popen = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "batchproxy.host",
                    HOST_FACTORY,
                    "--socket",
                    self.path,
                    "--drain-timeout",
                    "60",
                ],
                env=env,
                stdin=subprocess.DEVNULL,
                stderr=stderr,
                cwd=ROOT,
            )
        host = Process("host", number, popen, counters, final, issued, log=log)
        self.hosts.append(host)
        deadline = time.monotonic() + 120
        while b"serving" not in log.read_bytes():
            if popen.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the host did not start: {log.read_text()}")
            time.sleep(0.01)
        self.say(f"  host {number} (pid {popen.pid}) serving at {issued:,} calls")
        return host

    def start_client(self, number: int, requests: int, issued: int) -> Process:
        serial = len(self.clients)
        counters = self.folder / f"client{serial}.counts"
        Counters(counters, TALLY, create=True).close()
        result = self.folder / f"client{serial}.json"
        seed = self.config.seed + 1_000 * (serial + 1)
        log = self.folder / f"client{serial}.log"
        with open(log, "wb") as stderr:
            popen = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    CLIENT,
                    self.path,
                    str(counters),
                    str(result),
                    str(requests),
                    str(self.config.concurrency),
                    str(seed),
                ],
                env=environ(),
                stdin=subprocess.DEVNULL,
                stderr=stderr,
                cwd=ROOT,
            )
        process = Process("client", number, popen, counters, result, issued, log=log)
        self.clients.append(process)
        return process

    def issued(self) -> int:
        return sum(read_counters(c.counters, TALLY)["issued"] for c in self.clients)

    def kill(self, process: Process) -> None:
        process.popen.send_signal(signal.SIGKILL)
        process.popen.wait()
        process.ended = "killed"
        names = HOST if process.role == "host" else TALLY
        process.counts = read_counters(process.counters, names)

    def drive(self) -> float:
        """Start everything, kill and restart on schedule, until every client is done;
        the seconds it took."""
        config = self.config
        started = time.perf_counter()
        host = self.start_host(0)
        for number, share in enumerate(self.shares):
            self.start_client(number, share, 0)
        events = sorted(
            [(at, "host") for at in config.host_kills]
            + [(at, "client") for at in config.client_kills]
        )
        every = max(1, config.requests // config.checkpoints)
        next_checkpoint = every
        while True:
            live = [c for c in self.clients if c.popen.poll() is None]
            issued = self.issued()
            if issued >= next_checkpoint:
                for process in [host, *live]:
                    process.read_rss(issued)
                self.say(
                    f"  {issued:>9,} calls  {time.perf_counter() - started:6.1f} s  RSS host "
                    f"{host.rss[-1][1] if host.rss else 0:6.1f} MB  clients "
                    + " ".join(f"{c.rss[-1][1]:.1f}" for c in live if c.rss)
                )
                next_checkpoint = (issued // every + 1) * every
            # (and not before the host serving now has served some: on a loaded machine a
            # restart takes seconds, while the callers' HostUnavailable count as calls)
            served = read_counters(host.counters, HOST)["accepted"]
            if events and issued >= events[0][0] * config.requests and served >= every // 2:
                _, what = events.pop(0)
                if what == "host":
                    self.kill(host)
                    self.say(f"  host {host.number} killed at {issued:,} calls")
                    host = self.start_host(issued)
                else:
                    # the one with the most calls left (mid-way, surely)
                    victim = max(
                        live,
                        key=lambda c: (
                            self.shares[c.number] - read_counters(c.counters, TALLY)["issued"]
                        ),
                    )
                    self.kill(victim)
                    left = self.shares[victim.number] - victim.counts["issued"]
                    self.say(f"  client {victim.number} killed at {issued:,} calls; {left:,} left")
                    self.start_client(victim.number, left, issued)
            if not live:
                break
            time.sleep(0.02)
        seconds = time.perf_counter() - started
        for process in self.clients:
            if process.ended == "running":
                process.ended = f"exited {process.popen.returncode}"
                process.counts = read_counters(process.counters, TALLY)
        host.popen.send_signal(signal.SIGTERM)
        host.popen.wait(timeout=120)
        host.ended = f"stopped {host.popen.returncode}"
        host.counts = read_counters(host.counters, HOST)
        return seconds

    def stop_all(self) -> None:
        """Kill whatever still runs (after a failure), and remove the folder."""
        for process in [*self.hosts, *self.clients]:
            if process.popen.poll() is None:
                process.popen.kill()
            process.popen.wait()
        shutil.rmtree(self.folder, ignore_errors=True)

    def logged(self) -> dict[str, list[str]]:
        """What each process wrote on stderr, but the host's line saying it serves."""
        logs = {}
        for process in [*self.hosts, *self.clients]:
            lines = process.log.read_text(errors="replace").splitlines()
            lines = [line for line in lines if not line.startswith("batchproxy.host: serving")]
            if lines:
                logs[f"{process.role} {process.number} (pid {process.pid})"] = lines
        return logs

    def leftovers(self) -> list[str]:
        """What the run left: processes, the socket file, shared-memory segments."""
        left = [
            f"{p.role} {p.number} (pid {p.pid}) still runs"
            for p in [*self.hosts, *self.clients]
            if p.popen.poll() is None
        ]
        if os.path.exists(self.path):
            left.append(f"the socket file {self.path}")
        pids = {os.getpid(), *(p.pid for p in [*self.hosts, *self.clients])}
        try:
            names = os.listdir("/dev/shm")
        except OSError:
            names = []
        left += [
            f"/dev/shm/{n}"
            for n in names
            if n.startswith("bp-") and n.split("-")[1].isdigit() and int(n.split("-")[1]) in pids
        ]
        return left


@dataclass
class Result:
    config: Config
    seconds: float
    hosts: list[dict[str, Any]]  # per generation: pid, ended, counts, final stats
    clients: list[dict[str, Any]]  # per client process: ended, counts, its result
    rss: list[dict[str, Any]]  # per process: role, number, pid, warm MB, growth MB
    leftovers: list[str]
    logged: dict[str, list[str]]  # by process: what it wrote on stderr (warnings, errors)

    def callers(self) -> dict[str, int]:
        """Every client's tally summed (the killed one's up to its death)."""
        return {name: sum(c["counts"][name] for c in self.clients) for name in TALLY}

    def host_counts(self) -> dict[str, int]:
        """Every host generation's counts summed (the killed ones' up to their death)."""
        return {name: sum(h["counts"][name] for h in self.hosts) for name in HOST}

    def killed_in_flight(self) -> int:
        """Bound on the calls in flight in the killed clients when they died: their
        callers (each has one call at a time)."""
        return self.config.concurrency * sum(c["ended"] == "killed" for c in self.clients)

    def ambiguous(self) -> int:
        c = self.callers()
        return c["cancelled"] + c["timed_out"] + c["unavailable"] + self.killed_in_flight()

    def checks(self) -> list[tuple[str, bool, str]]:
        """Each comparison: (what, whether it holds, the numbers)."""
        out: list[tuple[str, bool, str]] = []
        for c in self.clients:
            if c["ended"] == "killed":
                continue
            t = c["counts"]
            ended = sum(t[name] for name in TALLY[1:-1])
            replacement = " (the replacement)" if c["serial"] >= self.config.clients else ""
            out.append(
                (
                    f"client {c['number']}{replacement}: every call ended once",
                    t["issued"] == ended
                    and t["wrong"] == 0
                    and not c["result"]["tally"]["unexpected"],
                    f"issued {t['issued']:,}, ended {ended:,}, wrong {t['wrong']}, "
                    f"unexpected {c['result']['tally']['unexpected'][:3]}",
                )
            )
            before, closed = c["result"]["census"]["before"], c["result"]["census"]["closed"]
            sockets = c["result"]["sockets"]
            out.append(
                (
                    f"client {c['number']}{replacement}: nothing left after aclose()",
                    (closed["tasks"], closed["futures"], sockets["closed"])
                    == (before["tasks"], before["futures"], sockets["before"]),
                    f"tasks {before['tasks']} → {closed['tasks']}, futures "
                    f"{before['futures']} → {closed['futures']}, sockets "
                    f"{sockets['before']} → {sockets['closed']}",
                )
            )
        in_flight = self.config.clients * self.config.concurrency
        for h in self.hosts:
            n = h["counts"]
            ended = n["succeeded"] + n["error"] + n["timed_out"] + n["cancelled"]
            if h["ended"] == "killed":
                ok = 0 <= n["accepted"] - ended <= in_flight
                what = f"host {h['number']} (killed): accepted - ended ≤ {in_flight:,} in flight"
            else:
                stats = h["final"]
                ok = (
                    n["accepted"] == ended == stats["requests"]
                    and n["rejected"] == stats["rejected"]
                    and stats["queue_depth"] == stats["in_flight"] == 0
                )
                what = f"host {h['number']} (stopped): every accepted call ended; = proxy.stats"
            out.append((what, ok, f"accepted {n['accepted']:,}, ended {ended:,}"))
        c, h, d = self.callers(), self.host_counts(), self.ambiguous()
        for mine, theirs in (
            ("succeeded", "succeeded"),
            ("failed", "error"),
            ("rejected", "rejected"),
        ):
            out.append(
                (
                    f"{mine}: callers ≤ hosts ≤ callers + ambiguous",
                    c[mine] <= h[theirs] <= c[mine] + d,
                    f"{c[mine]:,} ≤ {h[theirs]:,} ≤ {c[mine]:,} + {d:,}",
                )
            )
        for name in ("timed_out", "cancelled"):
            out.append((f"hosts' {name} ≤ ambiguous", h[name] <= d, f"{h[name]:,} ≤ {d:,}"))
        seen = h["accepted"] + h["rejected"] + h["shed"]
        low = c["issued"] - c["cancelled"] - c["timed_out"] - c["unavailable"]
        high = c["issued"] + self.killed_in_flight()
        out.append(("calls the hosts saw", low <= seen <= high, f"{low:,} ≤ {seen:,} ≤ {high:,}"))
        return out


def soak_through_host(config: Config, *, progress: bool = False) -> Result:
    run = Run(config, progress)
    try:
        seconds = run.drive()
        hosts = [
            {
                "number": p.number,
                "pid": p.pid,
                "ended": p.ended,
                "counts": p.counts,
                "final": json.loads(p.result.read_text()) if p.result.exists() else None,
            }
            for p in run.hosts
        ]
        clients = [
            {
                "serial": serial,
                "number": p.number,
                "pid": p.pid,
                "ended": p.ended,
                "counts": p.counts,
                "result": json.loads(p.result.read_text()) if p.result.exists() else None,
            }
            for serial, p in enumerate(run.clients)
        ]
        warmup = max(1, config.requests // 10)
        rss = []
        for p in [*run.hosts, *run.clients]:
            measured = p.warm_and_growth(warmup)
            rss.append(
                {
                    "role": p.role,
                    "number": p.number,
                    "pid": p.pid,
                    "readings": p.rss,
                    "warm_mb": measured and measured[0],
                    "growth_mb": measured and measured[1],
                }
            )
        leftovers = run.leftovers()
        logged = run.logged()
    finally:
        run.stop_all()
    return Result(config, seconds, hosts, clients, rss, leftovers, logged)
