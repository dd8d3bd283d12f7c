"""The machinery of tests/host/test_host_faults.py: a model host in a process of its own,
a drawn program of calls through a `RemoteProxy`, a drawn fault at a drawn time, and
the oracle.

The faults:

- `kill`: the host process is killed (`SIGKILL`) and, once it is dead, started again
  on the same socket path (a `RemoteProxy` connects again on its next call);
- `stall`: the host process is stopped (`SIGSTOP`) for a drawn time, then continued
  (`SIGCONT`): its connections stay open, it answers late;
- `drop`: the client's connection is dropped (its socket shut down both ways) between
  calls and their answers.

The host serves `_host_models.Tagged` (each result names its item), taking `delay`
seconds per batch so that calls are in flight when the fault comes. Then a last call,
made after the fault is over, must get its result. The oracle (`problems`): each item
of each call ended exactly once, with its own result, the error its item asks for
("bad": `InvalidItem`, "boom": the model's `ValueError`), `DeadlineExceeded` if it had a
timeout, `CancelledError` if its caller was cancelled, or `HostUnavailable` if the
fault was a kill or a drop and the call was under way while it happened (made before
the host was serving again, ended after the fault began); never anything else. And
nothing is left: no host process, no socket file, no `/dev/shm/bp-PID-*` segment of
the host or of this process, no socket open in this process beyond those before, no
task; nothing logged on the host's stderr but its "serving" line, nor by asyncio or
batchproxy in this process.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _host_process import environment
from _support import descriptors
from hypothesis import strategies as st

import batchproxy
from batchproxy.host import RemoteProxy

FAULTS = ("kill", "stall", "drop")
ITEMS: list[Any] = [0, 1, 2, 3, "bad", "boom"]


@dataclass(frozen=True)
class Call:
    id: int
    at: float  # seconds after the start
    form: str  # "inference", "many" (inference_many, return_exceptions=True), "stream"
    items: tuple[Any, ...]  # one, but for "many"
    timeout: float | None
    cancel_after: float | None  # seconds after it was made


@dataclass(frozen=True)
class Fault:
    kind: str  # one of FAULTS
    at: float  # seconds after the start
    stall: float = 0.0  # seconds stopped ("stall")


@dataclass(frozen=True)
class Program:
    calls: list[Call]
    fault: Fault
    delay: float  # the host model's seconds per batch


@st.composite
def programs(draw: st.DrawFn, kinds: tuple[str, ...] = FAULTS) -> Program:
    horizon = 0.3
    calls = []
    for i in range(draw(st.integers(1, 12))):
        form = draw(st.sampled_from(["inference", "inference", "many", "stream"]))
        count = draw(st.integers(1, 3)) if form == "many" else 1
        calls.append(
            Call(
                id=i,
                at=draw(st.sampled_from([0.0, 0.0, horizon / 4, horizon / 2, horizon])),
                form=form,
                items=tuple(draw(st.lists(st.sampled_from(ITEMS), min_size=count, max_size=count))),
                timeout=draw(st.none() | st.sampled_from([0.05, 0.5, 5.0])),
                cancel_after=draw(st.none() | st.sampled_from([0.0, 0.02, 0.2])),
            )
        )
    kind = draw(st.sampled_from(kinds))
    at = draw(st.sampled_from([0.0, horizon / 8, horizon / 4, horizon / 2, horizon]))
    stall = draw(st.sampled_from([0.05, 0.3, 1.0])) if kind == "stall" else 0.0
    delay = draw(st.sampled_from([0.0, 0.02, 0.1]))
    return Program(calls, Fault(kind, at, stall), delay)


# -- the host process ---------------------------------------------------------------------


class HostProcess:
    """`python -m batchproxy.host _host_models:tagged --socket PATH`, its stderr in a file."""

    def __init__(self, path: str, log: Path, delay: float) -> None:
        self.path = path
        self.log = log
        with open(log, "wb") as stderr:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "batchproxy.host", "_host_models:tagged", "--socket", path],
                env=environment(HOST_MODEL_DELAY=str(delay)),
                stdin=subprocess.DEVNULL,
                stderr=stderr,
            )
        deadline = time.monotonic() + 60
        while b"serving" not in log.read_bytes():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.process.kill()
                self.process.wait()
                raise RuntimeError(f"the host did not start: {log.read_text()}")
            time.sleep(0.005)

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self) -> int:
        """SIGTERM (continued first, if stopped), and its exit status; killed if it does
        not exit in time."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=60)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()

    def logged(self) -> list[str]:
        lines = self.log.read_text(errors="replace").splitlines()
        return [line for line in lines if not line.startswith("batchproxy.host: serving")]


# -- the run ------------------------------------------------------------------------------


@dataclass
class Run:
    program: Program
    outcomes: dict[tuple[int, int], list[Any]] = field(default_factory=dict)
    spans: dict[int, tuple[float, float]] = field(default_factory=dict)  # made, ended
    fault_from: float = 0.0  # the fault's span (loop time): it began
    fault_to: float = 0.0  # ... and was over (a killed host's successor serving)
    after: Any = None  # the last call's outcome
    leftovers: list[str] = field(default_factory=list)


class Captured(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(f"{record.name}: {record.getMessage()}")


@contextlib.contextmanager
def captured_logs() -> Iterator[Captured]:
    handler = Captured()
    loggers = [logging.getLogger(name) for name in ("asyncio", "batchproxy")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield handler
    finally:
        for logger in loggers:
            logger.removeHandler(handler)


def open_sockets() -> set[str]:
    """This process's open Unix sockets (as /proc/self/fd links name them): what a run
    can leave (its connections to the host, its loop's own pair). Not every socket: a
    library's native threads open others at their own times (Ray's GCS client, left by
    `ray.shutdown()`, retries a TCP connection to its stopped cluster every 20-40 s)."""
    unix = set()
    with open("/proc/net/unix") as table:  # (the inode: the seventh column)
        for line in itertools.islice(table, 1, None):
            unix.add(f"socket:[{line.split()[6]}]")
    return {target for target in descriptors().values() if target in unix}


def segments(pids: set[int]) -> list[str]:
    """The shared-memory segments of `pids` in /dev/shm."""
    try:
        names = os.listdir("/dev/shm")
    except OSError:
        return []
    return [n for n in names if n.startswith("bp-") and n.split("-")[1] in {str(p) for p in pids}]


def run(program: Program) -> Run:
    """Run `program` with its fault; the outcomes and what was left."""
    folder = Path(tempfile.mkdtemp(prefix="bp-fault-", dir="/tmp"))
    path = str(folder / "m.sock")
    hosts = [HostProcess(path, folder / "host0.log", program.delay)]
    sockets = open_sockets()
    result = Run(program)
    try:
        with captured_logs() as logs:
            asyncio.run(asyncio.wait_for(_run(result, path, folder, hosts), timeout=60))
        result.leftovers += logs.records
    finally:
        for host in hosts:
            host.stop()
        result.leftovers += [f"host {h.pid} logged: {line}" for h in hosts for line in h.logged()]
        if os.path.exists(path):
            result.leftovers.append(f"the socket file {path}")
        result.leftovers += segments({os.getpid(), *(h.pid for h in hosts)})
        left = open_sockets() - sockets
        if left:
            result.leftovers.append(f"sockets left open here: {sorted(left)}")
        shutil.rmtree(folder, ignore_errors=True)
    return result


async def _run(result: Run, path: str, folder: Path, hosts: list[HostProcess]) -> None:
    program = result.program
    loop = asyncio.get_running_loop()
    remote = RemoteProxy(path)
    for call in program.calls:
        for index in range(len(call.items)):
            result.outcomes[call.id, index] = []

    async def caller(call: Call) -> None:
        await asyncio.sleep(call.at)
        made = loop.time()
        task = asyncio.ensure_future(one_call(remote, call, result))
        if call.cancel_after is not None:
            loop.call_later(call.cancel_after, task.cancel)
        with contextlib.suppress(BaseException):
            await task
        for index in range(len(call.items)):
            if not result.outcomes[call.id, index]:  # cancelled before it began
                result.outcomes[call.id, index].append(asyncio.CancelledError())
        result.spans[call.id] = (made, loop.time())

    tasks_before = asyncio.all_tasks()
    try:
        fault = inflict(result, remote, folder, hosts)
        await asyncio.gather(fault, *(caller(call) for call in program.calls))
        try:
            result.after = await remote.inference("after", timeout=30)
        except Exception as exc:
            result.after = exc
    finally:
        await remote.aclose()
    await asyncio.sleep(0)
    left = [t for t in asyncio.all_tasks() - tasks_before if not t.done()]
    left = [t for t in left if t is not asyncio.current_task()]
    if left:
        result.leftovers.append(f"tasks left running: {left}")


async def inflict(result: Run, remote: RemoteProxy, folder: Path, hosts: list[HostProcess]) -> None:
    """The program's fault, at its time; its span in `result`."""
    fault = result.program.fault
    loop = asyncio.get_running_loop()
    await asyncio.sleep(fault.at)
    host = hosts[-1]
    result.fault_from = loop.time()
    if fault.kind == "kill":
        host.process.kill()
        await asyncio.to_thread(host.process.wait)
        log = folder / f"host{len(hosts)}.log"
        delay = result.program.delay
        hosts.append(await asyncio.to_thread(HostProcess, host.path, log, delay))
    elif fault.kind == "stall":
        host.process.send_signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(fault.stall)
        finally:
            host.process.send_signal(signal.SIGCONT)
    else:
        connection = remote._connections.get(loop)
        if connection is not None:
            drop(connection.writer)
    result.fault_to = loop.time()


def drop(writer: asyncio.StreamWriter) -> None:
    """Drop a connection under its transport: shut its socket down both ways (through a
    duplicate of its descriptor: uvloop's transports lend no `shutdown`)."""
    fd = writer.get_extra_info("socket").fileno()
    duplicate = socket.fromfd(fd, socket.AF_UNIX, socket.SOCK_STREAM)
    with duplicate, contextlib.suppress(OSError):
        duplicate.shutdown(socket.SHUT_RDWR)


async def one_call(remote: RemoteProxy, call: Call, result: Run) -> None:
    """Make `call`; record each item's outcome (a result, or an exception)."""

    def settle(outcome: Any, index: int | None = None) -> None:
        for i in range(len(call.items)) if index is None else [index]:
            result.outcomes[call.id, i].append(outcome)

    item = call.items[0]
    try:
        if call.form == "inference":
            settle(await remote.inference(item, timeout=call.timeout))
        elif call.form == "many":
            answers = await remote.inference_many(
                call.items, timeout=call.timeout, return_exceptions=True
            )
            for index, answer in enumerate(answers):
                settle(answer, index)
        else:
            chunks = []
            async with contextlib.aclosing(remote.stream(item, timeout=call.timeout)) as stream:
                async for chunk in stream:
                    chunks.append(chunk)
            settle(("chunks", *chunks))
    except (Exception, asyncio.CancelledError) as exc:
        settle(exc)
        raise


# -- the oracle ---------------------------------------------------------------------------


def problems(result: Run) -> list[str]:
    """What went wrong (see the module's docstring); empty if nothing did."""
    program, fault = result.program, result.program.fault
    found = []
    for call in program.calls:
        made, ended = result.spans[call.id]
        under_way = made <= result.fault_to and ended >= result.fault_from
        for index, item in enumerate(call.items):
            outcomes = result.outcomes[call.id, index]
            where = f"call {call.id} ({call.form} of {item!r}, made {made:.3f}, ended {ended:.3f})"
            if len(outcomes) != 1:
                found.append(f"{where} ended {len(outcomes)} times: {outcomes}")
                continue
            why = wrong(call, item, outcomes[0], fault, under_way)
            if why:
                found.append(f"{where}: {why}")
    after = result.after
    if not (isinstance(after, tuple) and after[0] == "after"):
        found.append(f"the call after the fault got {after!r}")
    found += result.leftovers
    if found:
        found.append(f"the fault: {fault}, from {result.fault_from:.3f} to {result.fault_to:.3f}")
    return found


def wrong(call: Call, item: Any, outcome: Any, fault: Fault, under_way: bool) -> str | None:
    """Why `outcome` is not one this item of `call` may end with, or None."""
    if isinstance(outcome, tuple):
        value = outcome
        if call.form == "stream":  # a unary proxy's stream: its one result
            if len(outcome) != 2:
                return f"got chunks {outcome}, want one"
            value = outcome[1]
        if not (isinstance(value, tuple) and value[0] == item) or item in ("bad", "boom"):
            return f"got {value!r}"
        return None
    if isinstance(outcome, batchproxy.InvalidItem):
        return None if item == "bad" else f"{outcome!r}"
    if isinstance(outcome, ValueError) and "boom" in str(outcome):
        return None if item == "boom" else f"{outcome!r}"
    if isinstance(outcome, batchproxy.DeadlineExceeded):
        return None if call.timeout is not None else f"{outcome!r} without a timeout"
    if isinstance(outcome, asyncio.CancelledError):
        return None if call.cancel_after is not None else f"{outcome!r}, never cancelled"
    if isinstance(outcome, batchproxy.HostUnavailable):
        if fault.kind in ("kill", "drop") and under_way:
            return None
        return f"{outcome!r} ({'with' if under_way else 'not under way during'} a {fault.kind})"
    return f"unexpected {outcome!r}"
