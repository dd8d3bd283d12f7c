"""A real Ray cluster of several nodes on this one machine, for tests (`RayCluster`).

Each node is a `ray start` of the virtualenv's own `ray` CLI, with its own loopback
address (the head on 127.0.0.2, the others on 127.0.0.3, ...: Linux routes all of
127/8 to `lo`, and Ray tells nodes apart by address), its own `--temp-dir`, free
ports, its CPUs and a custom resource naming it (`node_a`, `node_b`, ...: 1 unit,
so `resources={"node_b": 0.01}` pins a task to that node). The cluster uses Ray's
token authentication, with a token of its own.

```python
with RayCluster() as cluster:         # a head and a second node, a driver connected
    ray.get_runtime_context().get_node_id() == cluster.head.node_id
    cluster.kill_node(cluster.second)  # every process of that node SIGKILLed
    cluster.add_node()                 # a new second node (the next free address)
```

Processes: each node runs under a small reaper of its own (a Python child of this
process, made a "child subreaper" with prctl), so every process of the node, once
orphaned by `ray start`, stays its descendant and is reaped there. A node's
processes are its reaper's descendants together with every process whose command
line, working directory or an open file names the node's temp dir (Ray's workers
and agents rename themselves `ray::...`, but keep their log files open there).
Teardown SIGTERMs them, waits briefly (`grace`: the GCS does not end on SIGTERM,
the others do at once), SIGKILLs what is left and waits for the reaper to have
reaped them all; then it checks that no process of the temp dir is left. It never
runs `ray stop` (which stops every Ray on the machine) and touches no other
process; it runs even when starting failed halfway. Should this process die
without a teardown, each reaper sees its stdin close and SIGKILLs its node.

Linux only (prctl, /proc, 127/8 on `lo`).

The driver (this process) joins with `ray.init(address=...)` for the duration of
the `with`, with the token in `RAY_AUTH_MODE`/`RAY_AUTH_TOKEN`; on exit it calls
`ray.shutdown()` and restores those variables (and Ray's cached view of them), so
a local `ray.init()` works again afterwards in the same process.

Failure detection is made fast: the GCS health-checks each raylet every
`HEALTH_CHECK["health_check_period_ms"]` ms and declares a node dead after
`health_check_failure_threshold` checks failed in a row (Ray's defaults take 15 s
or more), so the actors of a killed node are reported dead within about 2 s.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

HEAD_IP = "127.0.0.2"

HEALTH_CHECK = {
    "health_check_initial_delay_ms": 1000,
    "health_check_period_ms": 500,
    "health_check_timeout_ms": 2000,  # a live raylet slow to answer on a busy machine
    "health_check_failure_threshold": 3,
}
"""GCS settings (`--system-config` of the head) for noticing a lost node in ~2 s."""

LIGHT = {
    "prestart_worker_first_driver": False,  # no idle workers started for the driver
}
"""Settings that keep the nodes light on a small machine."""

AUTH_VARIABLES = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS")
"""What the driver's connection sets or clears in `os.environ` (restored after)."""

_REAPER = r"""
import ctypes, json, os, select, signal, subprocess, sys, time

PR_SET_CHILD_SUBREAPER = 36
if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
    print("error prctl", ctypes.get_errno(), flush=True)
    sys.exit(1)
order = json.loads(sys.stdin.readline())
with open(order["log"], "ab") as log:
    code = subprocess.call(order["argv"], stdin=subprocess.DEVNULL, stdout=log, stderr=log)
print("started", code, flush=True)


def descendants():
    children = {}
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/stat") as stat:
                ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(name))
    found, todo = [], [os.getpid()]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


orphaned = False  # stdin closed: the test process is gone, or tells us to finish
while True:
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        break  # nothing of the node is left
    if not orphaned and select.select([sys.stdin], [], [], 0.05)[0]:
        orphaned = not sys.stdin.buffer.read1(1024)
    if orphaned:
        for pid in descendants():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
"""
"""The reaper a node runs under: a child subreaper that runs `ray start` (argv from a
JSON line on stdin), prints `started <exit code>`, then reaps every orphan until
none is left, and exits. On EOF on stdin it SIGKILLs all its descendants first."""


@dataclass
class RayNode:
    """One node: `ray start` under its reaper."""

    name: str  # its custom resource: "node_a" (the head), "node_b", ...
    ip: str
    temp_dir: Path
    num_cpus: int
    head: bool
    reaper: subprocess.Popen[bytes] | None = None
    started: float = 0.0  # seconds `ray start` took
    killed: bool = False
    _node_id: str | None = field(default=None, repr=False)

    @property
    def log(self) -> Path:
        """What `ray start` printed."""
        return self.temp_dir.parent / f"{self.temp_dir.name}.log"

    @property
    def node_id(self) -> str:
        """The node's Ray id in hex (what `get_runtime_context().get_node_id()` says),
        known once a driver has seen the node join."""
        assert self._node_id is not None, f"{self.name}: no driver has seen it join"
        return self._node_id

    def processes(self) -> set[int]:
        """Every process of this node (see the module docstring); never this one."""
        found = processes_of(self.temp_dir)
        if self.reaper is not None:
            found |= descendants(self.reaper.pid)
            found.discard(self.reaper.pid)
        found.discard(os.getpid())
        return found


class RayCluster:
    """A head and `len(cpus) - 1` more nodes on this machine, a driver connected.

    `with RayCluster(...) as cluster:` starts the nodes and connects this process
    (`ray.init`); leaving the block disconnects and stops every process the cluster
    started. `cpus` are the CPUs of each node (head first). `object_store_mb` is each
    node's object store. `connect=False` starts the nodes only (`cluster.connect()`
    joins later).
    """

    def __init__(
        self,
        cpus: tuple[int, ...] = (4, 4),
        *,
        object_store_mb: int = 100,
        system_config: dict[str, Any] | None = None,
        connect: bool = True,
        grace: float = 1.0,
    ) -> None:
        self.cpus = cpus
        self.object_store_mb = object_store_mb
        self.system_config = {**HEALTH_CHECK, **LIGHT, **(system_config or {})}
        self.connect_driver = connect
        self.grace = grace
        self.token = ""
        self.base: Path | None = None
        self.nodes: list[RayNode] = []
        self.port = 0
        self.connected = False
        self._saved_env: dict[str, str | None] = {}
        self._taken_ports: set[int] = set()

    # -- the cluster ------------------------------------------------------------------

    @property
    def address(self) -> str:
        """The GCS address, for `ray.init(address=...)` and `ray start --address`."""
        return f"{HEAD_IP}:{self.port}"

    @property
    def head(self) -> RayNode:
        return self.nodes[0]

    @property
    def second(self) -> RayNode:
        """The newest node that is not the head (a replacement once one was killed)."""
        return self.nodes[-1]

    def alive_nodes(self) -> list[RayNode]:
        return [node for node in self.nodes if not node.killed]

    def node_named(self, node_id: str) -> RayNode:
        """The node of a Ray node id (killed ones too)."""
        for node in self.nodes:
            if node._node_id == node_id:
                return node
        raise LookupError(f"no node of this cluster has id {node_id}")

    def __enter__(self) -> RayCluster:
        self.token = secrets.token_hex(32)  # as `ray get-auth-token --generate` makes one
        self.base = Path(tempfile.mkdtemp(prefix="rc-", dir="/tmp"))  # socket paths: short
        try:
            for cpus in self.cpus:
                self.add_node(cpus, wait=False)
            if self.connect_driver:
                self.connect()
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        try:
            self.disconnect()
        finally:
            leftovers: list[str] = []
            for node in reversed(self.nodes):
                leftovers += self._stop(node)
            if self.base is not None and not leftovers:
                shutil.rmtree(self.base, ignore_errors=True)
            assert not leftovers, f"processes of the cluster left running: {leftovers}"

    # -- nodes ------------------------------------------------------------------------

    def add_node(self, num_cpus: int | None = None, *, wait: bool = True) -> RayNode:
        """Start one more node (the head first): its own address, temp dir and ports.

        `num_cpus`: default, the second node's. With a driver connected (and `wait`),
        returns once the cluster lists it alive.
        """
        assert self.base is not None, "use the cluster in a `with`"
        number = len(self.nodes)
        if num_cpus is None:
            num_cpus = self.cpus[min(number, len(self.cpus) - 1)]
        letter = chr(ord("a") + number)
        node = RayNode(
            name=f"node_{letter}",
            ip=f"127.0.0.{2 + number}",
            temp_dir=self.base / letter,
            num_cpus=num_cpus,
            head=not self.nodes,
        )
        self.nodes.append(node)
        argv = self._start_argv(node)
        started = time.monotonic()
        with node.log.open("ab") as log:  # the reaper's own errors, if any
            node.reaper = subprocess.Popen(
                [sys.executable, "-c", _REAPER],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=self._node_env(),
                cwd=self.base,
            )
        assert node.reaper.stdin is not None
        node.reaper.stdin.write(json.dumps({"argv": argv, "log": str(node.log)}).encode() + b"\n")
        node.reaper.stdin.flush()
        line = _read_line(node.reaper, timeout=60)
        node.started = time.monotonic() - started
        if line != "started 0":
            raise RuntimeError(
                f"`ray start` of {node.name} failed ({line or 'no answer'}):\n{_tail(node.log)}"
            )
        if wait and self.connected:
            self._wait_registered(node)
        return node

    def kill_node(self, node: RayNode) -> None:
        """SIGKILL every process of `node` at once, as a machine lost would (not the head)."""
        assert not node.head, "the head holds the GCS: the cluster would be gone"
        _kill_all(node, signal.SIGKILL, seconds=10)
        node.killed = True
        reaper = node.reaper
        assert reaper is not None
        assert _exited(reaper, seconds=10), f"{node.name}: a process outlived SIGKILL"
        _close_pipes(reaper)
        leftovers = node.processes()
        assert not leftovers, f"{node.name}: processes left after the kill: {leftovers}"

    def _stop(self, node: RayNode) -> list[str]:
        """Stop `node` for certain; return what is still running (should be nothing)."""
        reaper = node.reaper
        if reaper is None:
            return []
        try:
            if node.processes():
                _kill_all(node, signal.SIGTERM, seconds=self.grace)
            _kill_all(node, signal.SIGKILL, seconds=10)
        finally:
            _close_pipes(reaper)  # on EOF the reaper SIGKILLs whatever it still has
            if not _exited(reaper, seconds=10):
                reaper.kill()
                reaper.wait(10)
            node.killed = True
        return [f"{pid} {_cmdline(pid)[:200]}" for pid in sorted(node.processes())]

    def _start_argv(self, node: RayNode) -> list[str]:
        ray_cli = str(Path(sys.executable).parent / "ray")
        argv = [
            ray_cli,
            "start",
            f"--node-ip-address={node.ip}",
            f"--num-cpus={node.num_cpus}",
            "--num-gpus=0",
            f"--resources={json.dumps({node.name: 1})}",
            f"--temp-dir={node.temp_dir}",
            f"--object-store-memory={self.object_store_mb * 1024 * 1024}",
            "--disable-usage-stats",
            "--include-log-monitor=false",
            f"--node-manager-port={self._free_port()}",
            f"--object-manager-port={self._free_port()}",
            f"--dashboard-agent-listen-port={self._free_port()}",
            f"--dashboard-agent-grpc-port={self._free_port()}",
            f"--runtime-env-agent-port={self._free_port()}",
            f"--metrics-export-port={self._free_port()}",
            "--min-worker-port=0",  # workers bind ports the OS picks: raylets on one
            "--max-worker-port=0",  # machine would hand out the same ones from a range
            "--log-style=record",
        ]
        if node.head:
            self.port = self._free_port()
            argv += [
                "--head",
                f"--port={self.port}",
                "--include-dashboard=false",
                f"--dashboard-port={self._free_port()}",  # a minimal one runs regardless
                "--no-monitor",  # no autoscaler
                f"--system-config={json.dumps(self.system_config)}",
            ]
            if _has_ray_client():
                argv.append(f"--ray-client-server-port={self._free_port()}")
        else:
            argv.append(f"--address={self.address}")
        return argv

    def _node_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in AUTH_VARIABLES}
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=self.token)
        return env

    def _free_port(self) -> int:
        """A TCP port free now on every address, not handed out before by this cluster."""
        while True:
            with socket.socket() as probe:
                probe.bind(("", 0))
                port = int(probe.getsockname()[1])
            if port not in self._taken_ports:
                self._taken_ports.add(port)
                return port

    # -- the driver -------------------------------------------------------------------

    def connect(self) -> None:
        """Join this process to the cluster as its driver (`ray.init(address=...)`)."""
        assert not ray.is_initialized(), "this process is connected to another Ray already"
        self._saved_env = {name: os.environ.get(name) for name in AUTH_VARIABLES}
        for name in AUTH_VARIABLES:
            os.environ.pop(name, None)
        os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=self.token)
        _reload_auth()
        self.connected = True
        ray.init(
            address=self.address,
            _node_ip_address=HEAD_IP,  # the driver joins through the head's raylet
            log_to_driver=False,
            configure_logging=False,
        )
        for node in self.alive_nodes():
            self._wait_registered(node)

    def disconnect(self) -> None:
        """`ray.shutdown()`, and the environment as it was before `connect()`."""
        if not self.connected:
            return
        self.connected = False
        try:
            ray.shutdown()
        finally:
            for name, value in self._saved_env.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
            _reload_auth()

    def _wait_registered(self, node: RayNode, seconds: float = 30) -> None:
        """Wait until the cluster lists `node` alive; learn its node id."""
        deadline = time.monotonic() + seconds
        while True:
            listed = [n for n in ray.nodes() if n["Alive"] and n["NodeManagerAddress"] == node.ip]
            if listed:
                assert len(listed) == 1, f"{node.name}: two live nodes at {node.ip}: {listed}"
                node._node_id = str(listed[0]["NodeID"])
                return
            assert time.monotonic() < deadline, f"{node.name} never joined the cluster"
            time.sleep(0.1)


# -- processes ------------------------------------------------------------------------


def processes_of(temp_dir: Path) -> set[int]:
    """Processes whose command line, working directory or an open file names `temp_dir`.

    Ray's workers and agents rename themselves (`ray::IDLE`, `ray::DashboardAgent`), so
    their command line no longer says where they belong; their log files do.
    """
    mark = str(temp_dir)
    named = re.compile(re.escape(mark) + r"(/|\s|$)")  # not /tmp/rc-x/a.log for /tmp/rc-x/a
    found = set()
    for pid in _pids():
        if named.search(_cmdline(pid)) or _under(f"/proc/{pid}/cwd", mark):
            found.add(pid)
            continue
        with contextlib.suppress(OSError):
            if any(_under(f"/proc/{pid}/fd/{fd}", mark) for fd in os.listdir(f"/proc/{pid}/fd")):
                found.add(pid)
    return found


def descendants(root: int) -> set[int]:
    """Every process below `root` in the process tree."""
    children: dict[int, list[int]] = {}
    for pid in _pids():
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(pid)
    found: set[int] = set()
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _kill_all(node: RayNode, signum: int, seconds: float) -> None:
    """Send `signum` to every process of `node` (again to any that appears) until none
    is left or `seconds` have passed."""
    deadline = time.monotonic() + seconds
    signalled: set[int] = set()
    while True:
        running = {pid for pid in node.processes() if not _zombie(pid)}
        if not running or time.monotonic() > deadline:
            return
        for pid in running - signalled if signum != signal.SIGKILL else running:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)
        signalled |= running
        time.sleep(0.05)


def _pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _cmdline(pid: int) -> str:
    try:
        return (
            Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        )
    except OSError:
        return ""


def _under(link: str, directory: str) -> bool:
    try:
        target = os.readlink(link)
    except OSError:
        return False
    return target == directory or target.startswith(directory + "/")


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True  # gone


def _exited(process: subprocess.Popen[bytes], seconds: float) -> bool:
    try:
        process.wait(seconds)
    except subprocess.TimeoutExpired:
        return False
    return True


def _close_pipes(process: subprocess.Popen[bytes]) -> None:
    for pipe in (process.stdin, process.stdout):
        if pipe is not None:
            with contextlib.suppress(OSError):
                pipe.close()


def _read_line(process: subprocess.Popen[bytes], timeout: float) -> str:
    """One line of `process`'s stdout, or "" if none comes in `timeout` seconds."""
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], timeout)
    return process.stdout.readline().decode().strip() if ready else ""


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"({path} not written)"


def _has_ray_client() -> bool:
    from ray._private.utils import get_ray_client_dependency_error

    return get_ray_client_dependency_error() is None


def _reload_auth() -> None:
    """Make Ray in this process read the authentication variables again (it caches
    the mode in its config and the token in a loader). The config first: Ray's own
    tests do it in this order (a draining thread could reload the token otherwise)."""
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()
