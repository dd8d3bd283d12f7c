"""uvicorn in front of a `Serving`, as docs/serving.md shows it, with a listener uvicorn
did not make for asyncio: the connections it answers have TCP_NODELAY, so a keep-alive
client's responses do not each wait for its delayed ACK (about 40 ms).

- `--workers N`: uvicorn binds the listener it shares with its workers as
  `socket.socket(AF_INET)`, whose `proto` is 0, and asyncio's loop sets TCP_NODELAY on
  an accepted connection only when its socket says `IPPROTO_TCP` (uvicorn issue
  #3149). uvloop sets the option itself, so these servers run on asyncio's loop
  (`--loop asyncio`, what plain `pip install uvicorn` runs on).
- `--fd N` (a socket handed down, as systemd's socket activation does): uvicorn takes
  it for a Unix socket (`socket.fromfd(fd, AF_UNIX, ...)`), so neither asyncio's loop
  nor uvloop sets the option; these run on uvicorn's default loop (uvloop here).

Each server is a process group of its own, on 127.0.0.1 and a port the kernel picks,
stopped on the way out, even when the test fails.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
STARTUP = 120.0  # seconds: two workers importing FastAPI on a loaded machine


class Uvicorn:
    """`uvicorn _nodelay_server:app` with `shape`'s options, started here, in a session of
    its own: "workers" (two, on asyncio's loop, on a port it binds) or "fd" (one
    process, on a TCP listener bound here and handed down)."""

    def __init__(self, shape: str, log: IO[str]) -> None:
        self.log = log
        paths = [str(ROOT), str(TESTS), os.environ.get("PYTHONPATH", "")]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
        with contextlib.ExitStack() as closing:
            if shape == "workers":
                options = ["--workers", "2", "--loop", "asyncio", "--host", "127.0.0.1",
                           "--port", "0"]  # fmt: skip
                handed: tuple[int, ...] = ()
            else:
                tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
                listener = closing.enter_context(tcp)  # (this process's copy: closed here)
                listener.bind(("127.0.0.1", 0))
                options, handed = ["--fd", str(listener.fileno())], (listener.fileno(),)
            self.process = subprocess.Popen(
                [sys.executable, "-m", "uvicorn", "_nodelay_server:app", *options,
                 "--no-access-log", "--log-level", "info"],
                cwd=TESTS, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=log, start_new_session=True, pass_fds=handed,
            )  # fmt: skip
            try:
                self.port = self._port() if shape == "workers" else listener.getsockname()[1]
            except BaseException:
                self.stop()
                raise

    def _output(self) -> str:
        return Path(self.log.name).read_text()

    def _port(self) -> int:
        """The port the supervisor bound, as it logs it."""
        deadline = time.monotonic() + STARTUP
        while time.monotonic() < deadline:
            found = re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", self._output())
            if found:
                return int(found.group(1))
            assert self.process.poll() is None, f"uvicorn exited:\n{self._output()}"
            time.sleep(0.05)
        raise AssertionError(f"uvicorn did not bind in {STARTUP} s:\n{self._output()}")

    def connect(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)

    def get(self, connection: http.client.HTTPConnection, path: str) -> Any:
        connection.request("GET", path)
        response = connection.getresponse()
        body = response.read()
        assert response.status == 200, (path, response.status, body)
        return json.loads(body)

    def wait_ready(self) -> None:
        """Until a worker answers `/readyz` 200 (its `Serving` started)."""
        deadline = time.monotonic() + STARTUP
        while True:
            assert self.process.poll() is None, f"uvicorn exited:\n{self._output()}"
            connection = self.connect()
            try:
                connection.request("GET", "/readyz")
                if connection.getresponse().status == 200:
                    return
            except OSError:
                pass
            finally:
                connection.close()
            assert time.monotonic() < deadline, f"not ready in {STARTUP} s:\n{self._output()}"
            time.sleep(0.1)

    def stop(self) -> None:
        """SIGTERM (uvicorn stops its workers), then whatever of the group is left."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError):  # the group is this test's only
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


@pytest.fixture(params=["workers", "fd"])
def server(request: pytest.FixtureRequest) -> Iterator[Uvicorn]:
    with tempfile.NamedTemporaryFile("w+", prefix="bp-nodelay-", suffix=".log") as log:
        server = Uvicorn(request.param, log)  # (stops what it started if it fails to bind)
        try:
            server.wait_ready()
            yield server
        finally:
            server.stop()


def test_uvicorn_answers_keep_alive_connections_without_delayed_acks(server: Uvicorn) -> None:
    for _ in range(8):  # fresh connections: either worker may accept each
        connection = server.connect()
        try:
            report = server.get(connection, "/nodelay")  # first: a client acknowledges
            # a connection's first answers at once, so those would not show the delay
            assert report["nodelay"] == 1, f"worker {report['pid']}: TCP_NODELAY off"
            latencies = []
            for n in range(20):  # keep-alive: the same connection
                began = time.perf_counter()
                assert server.get(connection, f"/echo/{n}") == {"n": n}
                latencies.append(time.perf_counter() - began)
        finally:
            connection.close()
        # with Nagle on, each of these waited for the client's delayed ACK (40 ms at
        # least on Linux; 44-48 measured); without, most take well under a
        # millisecond, so even a loaded machine answers one of 20 under 20 ms
        assert min(latencies) < 0.020, f"median {statistics.median(latencies) * 1e3:.1f} ms"
