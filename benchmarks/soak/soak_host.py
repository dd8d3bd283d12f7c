"""The soak of `soak.py` through a model host: four client processes, the host killed and
restarted twice and a client killed once while the calls run.

Run: `python -m benchmarks.soak.soak_host` (or `make bench-soak-host`); `--quick` for a smoke
run of 20,000 calls. Prints a Markdown table and writes `benchmarks/results/soak-host.json`
and `.md` (`soak-host-quick.*`). `tests/host/test_host_soak.py` runs it on 20,000 calls
and asserts the accounting and that nothing is left.

The load is `soak.py`'s mix (its `Load`, `plan` and model, `Chaotic`), split over
`clients` processes (4), each a `RemoteProxy` with `concurrency` callers (250: 1,000 in
flight at the host, as in `soak.py`) and its share of the calls. The host is `python -m
batchproxy.host soak_host:host_proxy --socket PATH`, serving a `Chaotic` that
reconfigures itself every 5 to 50 ms (a client cannot). While the calls run:

- at 30 % and 65 % of the calls the host is killed (`SIGKILL`) and started again on
  the same socket path (the calls in flight fail with `HostUnavailable`; each
  client's next call connects to the new host; a caller told `HostUnavailable` waits
  1 to 2 s before its next call, as a client told 503 with `Retry-After: 1` would);
- at 45 % one client is killed (`SIGKILL`) and a new one takes over the calls it had
  left, as a server restarts a worker that died.

(Each fault waits until the host serving then has accepted a fortieth of the calls:
on a loaded machine a restart takes seconds, during which the callers' calls end as
`HostUnavailable` and count towards the total.)

Counting. Each client keeps its tally (`soak.Tally`: how its calls ended, as its
callers saw it) and each host generation its proxy's counts (a `Listener`: accepted,
rejected, and each accepted call's ending) in a file of counters it maps
(`MAP_SHARED`), so that they survive a `SIGKILL`: what a killed process counted up to
its death is read after it. What is compared (`checks`):

- every call of a client that lived to the end ended exactly once: `issued` equals
  the sum of its outcomes (succeeded, failed, cancelled, rejected, timed out,
  unavailable), none got another's result, no error of an unexpected kind;
- each host generation: the calls it accepted all ended (the last one, drained by
  `SIGTERM`: exactly, and its counters equal its `proxy.stats`), or were in flight
  when it was killed (at most the 1,000 callers);
- the callers' counts (every client, the killed one's up to its death) against the
  hosts' (every generation's, the killed ones' up to their death). A result, a model
  error or a `QueueFull` reached a caller only if a host counted it so: each of the
  callers' counts is at most the hosts'. The hosts' may be higher by the calls whose
  ending the two sides may see differently, `ambiguous`: those cancelled by their
  caller (the host may have answered first), timed out (maybe in the host before its
  proxy saw them, `ModelHost.expired`, or in the client), lost with a host
  (`HostUnavailable`: the dead host may have counted them anyhow, or never seen them),
  and those in flight in the killed client (at most its callers). The hosts' timed
  out and cancelled are at most `ambiguous`, and the calls the hosts saw (accepted or
  rejected) lie between the callers' calls less `ambiguous` and the callers' calls
  plus the killed client's in flight.

RSS of every process (from `/proc/PID/statm`, read by this process) at each twentieth
of the calls; a process's growth is its highest later reading minus its reading at
its warm-up, the first once a tenth of the calls were made since it started. Left
behind, checked after the last host stopped: any process started here still running,
the socket file, a `bp-PID-*` segment in `/dev/shm` of any process of the run, and in
each client its open sockets and its live tasks and futures (after vs before).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import mmap
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from typing_extensions import override

import batchproxy
from batchproxy.host import RemoteProxy
from benchmarks import ROOT, pythonpath
from benchmarks._harness.report import arguments, environment, headline, write_report
from benchmarks.soak import soak

MODULE = "benchmarks.soak.soak_host"  # (its clients: `python -m`; its host imports it)
TARGET_RSS_GROWTH_MB = soak.TARGET_RSS_GROWTH_MB


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


# -- counters that outlive their process ---------------------------------------------------

TALLY = ["issued", "succeeded", "failed", "cancelled", "rejected", "timed_out", "unavailable"]
TALLY += ["wrong"]
HOST = ["accepted", "rejected", "shed", "succeeded", "error", "timed_out", "cancelled"]
HOST += ["reconfigurations"]


class Counters:
    """Named int64 counters in a file mapped `MAP_SHARED`: each write is in the page cache
    at once, so another process reads them while this one runs, or after it was killed."""

    def __init__(self, path: str | Path, names: Sequence[str], *, create: bool = False) -> None:
        self.index = {name: i for i, name in enumerate(names)}
        size = 8 * len(names)
        with open(path, "w+b" if create else "r+b") as file:
            if create:
                file.truncate(size)
            self.map = mmap.mmap(file.fileno(), size)
        self.view = memoryview(self.map).cast("q")

    def __getitem__(self, name: str) -> int:
        return int(self.view[self.index[name]])

    def __setitem__(self, name: str, value: int) -> None:
        self.view[self.index[name]] = value

    def add(self, name: str, count: int = 1) -> None:
        self.view[self.index[name]] += count

    def read(self) -> dict[str, int]:
        return {name: int(self.view[i]) for name, i in self.index.items()}

    def close(self) -> None:
        self.view.release()
        self.map.close()


def read_counters(path: Path, names: Sequence[str]) -> dict[str, int]:
    counters = Counters(path, names)
    try:
        return counters.read()
    finally:
        counters.close()


def _slot(name: str) -> property:
    return property(
        lambda self: self.counters[name], lambda self, v: self.counters.__setitem__(name, v)
    )


class SharedTally(soak.Tally):
    """A `soak.Tally` whose counts live in `Counters` (its `unexpected` list stays here)."""

    def __init__(self, counters: Counters) -> None:
        self.counters = counters
        super().__init__()


for _name in TALLY:
    setattr(SharedTally, _name, _slot(_name))


# -- the host ------------------------------------------------------------------------------


class HostCounts(batchproxy.Listener):
    """The host proxy's counts, in `Counters` (read after a `SIGKILL` too)."""

    def __init__(self, counters: Counters) -> None:
        self.counters = counters

    @override
    def request_queued(self, proxy: str, queue_depth: int) -> None:
        self.counters.add("accepted")

    @override
    def request_rejected(self, proxy: str, count: int) -> None:
        self.counters.add("rejected", count)

    @override
    def request_shed(self, proxy: str) -> None:
        self.counters.add("shed")

    @override
    def request_finished(self, proxy: str, outcome: str, seconds: float) -> None:
        self.counters.add(outcome)


class HostChaotic(soak.Chaotic):
    """`soak.Chaotic` that reconfigures itself, as `soak.Load.reconfigure` does (a client
    cannot), and writes its final `stats` to `final` when it closes."""

    def __init__(self, config: soak.Config, counters: Counters, final: str) -> None:
        super().__init__(config)
        self.counters = counters
        self.final = final
        self.add_listener(HostCounts(counters))
        self._reconfigurer: asyncio.Task[None] | None = None

    @override
    async def start(self) -> None:
        await super().start()
        if self._reconfigurer is None:
            self._reconfigurer = asyncio.get_running_loop().create_task(self._reconfigure())

    async def _reconfigure(self) -> None:
        rng = random.Random(self.config.seed + 2)
        assert self.config.reconfigure_every_ms is not None
        low, high = self.config.reconfigure_every_ms
        while True:
            await asyncio.sleep(rng.uniform(low, high) / 1e3)
            self.configure(
                batch_size=rng.choice([8, 16, 32, 64, 128]),
                max_delay_ms=rng.choice([0.0, 0.5, 1.0, 2.0, 5.0]),
                max_concurrent_batches=rng.choice([1, 1, 2, 4]),
                max_queue_size=rng.choice([None, None, 300, 600, 1_000, 2_000]),
            )
            self.counters.add("reconfigurations")

    @override
    async def aclose(self, *, timeout: float | None = None) -> None:
        reconfigurer, self._reconfigurer = self._reconfigurer, None
        if reconfigurer is not None:
            reconfigurer.cancel()
            await asyncio.wait([reconfigurer])
        await super().aclose(timeout=timeout)
        stats = self.stats
        write_json(self.final, {key: getattr(stats, key) for key in soak.STATS})


def write_json(path: str | Path, document: Any) -> None:
    Path(path).write_text(json.dumps(document))


def host_proxy() -> HostChaotic:
    """The factory `python -m batchproxy.host soak_host:host_proxy` calls (its files and
    seed in `$SOAK_COUNTERS`, `$SOAK_FINAL`, `$SOAK_SEED`)."""
    counters = Counters(os.environ["SOAK_COUNTERS"], HOST)
    config = replace(soak.FULL, seed=int(os.environ["SOAK_SEED"]))
    return HostChaotic(config, counters, os.environ["SOAK_FINAL"])


# -- a client ------------------------------------------------------------------------------


def open_sockets() -> int:
    """This process's open sockets."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # (the directory's own descriptor, gone)
            count += os.readlink(os.path.join("/proc/self/fd", fd)).startswith("socket:")
    return count


async def client(
    path: str, counters_path: str, result_path: str, requests: int, concurrency: int, seed: int
) -> None:
    """One client process: `requests` calls of the mix through a `RemoteProxy`; its
    tally in `counters_path` as it goes, its result in `result_path` at the end."""
    config = replace(
        soak.FULL, requests=requests, concurrency=concurrency, seed=seed, reconfigure_every_ms=None
    )
    counters = Counters(counters_path, TALLY)
    sockets = open_sockets()
    remote = RemoteProxy(path, connect_timeout=30.0)
    load = soak.Load(config, remote, progress=False)  # type: ignore[arg-type]
    load.tally = SharedTally(counters)
    before = load.census()
    seconds = await load.run()
    await asyncio.sleep(0)
    after = load.census()
    await remote.aclose()
    await asyncio.sleep(0)
    closed = load.census()
    result = {
        "tally": asdict(load.tally),
        "seconds": seconds,
        "census": {"before": asdict(before), "after": asdict(after), "closed": asdict(closed)},
        "sockets": {"before": sockets, "closed": open_sockets()},
    }
    write_json(result_path, result)
    counters.close()


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
                    f"{MODULE}:host_proxy",
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
                    MODULE,
                    "--client",
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


# -- report --------------------------------------------------------------------------------


def markdown(result: Result) -> str:
    config, c, h = result.config, result.callers(), result.host_counts()
    reconfigurations = h["reconfigurations"]
    lines = [
        f"{c['issued']:,} calls from {config.clients} client processes "
        f"({config.concurrency} callers each), {result.seconds:.1f} s "
        f"({c['issued'] / result.seconds:,.0f} calls/s); host killed at "
        + ", ".join(f"{at:.0%}" for at in config.host_kills)
        + " of the calls and restarted, a client killed at "
        + ", ".join(f"{at:.0%}" for at in config.client_kills)
        + f" and replaced; {reconfigurations:,} reconfigurations.",
        "",
        "| outcome | counted by the callers | counted by the hosts |",
        "|---|---:|---:|",
        f"| succeeded | {c['succeeded']:,} | {h['succeeded']:,} |",
        f"| failed | {c['failed']:,} | {h['error']:,} |",
        f"| cancelled | {c['cancelled']:,} | {h['cancelled']:,} |",
        f"| rejected | {c['rejected']:,} | {h['rejected']:,} |",
        f"| timed out | {c['timed_out']:,} | {h['timed_out']:,} |",
        f"| HostUnavailable | {c['unavailable']:,} | |",
        f"| calls | {c['issued']:,} issued | {h['accepted'] + h['rejected'] + h['shed']:,} seen |",
        "",
        "| check | holds | numbers |",
        "|---|---|---|",
        *(
            f"| {what} | {'yes' if ok else '**no**'} | {numbers} |"
            for what, ok, numbers in result.checks()
        ),
        "",
        "| process | pid | ended | RSS at warm-up (MB) | growth after (MB) |",
        "|---|---:|---|---:|---:|",
    ]
    ended = {("host", x["pid"]): x["ended"] for x in result.hosts} | {
        ("client", x["pid"]): x["ended"] for x in result.clients
    }
    for serial, r in enumerate(result.rss):
        ended_as = ended[r["role"], r["pid"]]
        if r["role"] == "client" and serial - len(result.hosts) >= config.clients:
            ended_as += " (the replacement)"
        warm = "too short" if r["warm_mb"] is None else f"{r['warm_mb']:.1f}"
        growth = "" if r["growth_mb"] is None else f"{r['growth_mb']:+.1f}"
        lines.append(f"| {r['role']} {r['number']} | {r['pid']} | {ended_as} | {warm} | {growth} |")
    lines += ["", "Left behind: " + (", ".join(result.leftovers) or "nothing") + "."]
    lines += ["", "Logged: " + ("nothing" if not result.logged else "")]
    for process, logged in result.logged.items():
        lines.append(f"- {process}: {len(logged)} lines, first: `{logged[0]}`")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--client"]:
        path, counters, result, requests, concurrency, seed = argv[1:7]
        asyncio.run(client(path, counters, result, int(requests), int(concurrency), int(seed)))
        return 0
    cli = arguments("soak-host", (__doc__ or "").splitlines()[0], argv)
    config = QUICK if cli.quick else FULL
    env = environment()
    print(headline("soak-host", env, quick=cli.quick))
    print()
    result = soak_through_host(config, progress=True)
    text = markdown(result)
    print(text)
    cli.output.parent.mkdir(parents=True, exist_ok=True)
    cli.output.with_suffix(".md").write_text(
        headline("soak-host", env, quick=cli.quick) + "\n\n" + text + "\n"
    )
    write_report(
        cli.output,
        env,
        quick=cli.quick,
        config=asdict(config),
        targets={"rss_growth_mb": TARGET_RSS_GROWTH_MB},
        results={
            "seconds": result.seconds,
            "callers": result.callers(),
            "hosts_counted": result.host_counts(),
            "checks": result.checks(),
            "hosts": result.hosts,
            "clients": result.clients,
            "rss": result.rss,
            "leftovers": result.leftovers,
            "logged": result.logged,
        },
    )
    clean = not result.leftovers and not result.logged
    return 0 if clean and all(ok for _, ok, _ in result.checks()) else 1


if __name__ == "__main__":
    sys.exit(main())
