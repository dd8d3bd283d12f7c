"""A model host in a web service: `Serving(RemoteProxy(...))` waits for the host at
startup, its readiness includes the host (reached, and its proxy healthy), its drain
lets the calls in flight finish; with `host="module:factory"` the workers start the
host themselves (one, however many start at once), start it again when it is lost,
and it exits once no worker is left."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
from _host_models import Tagged
from _support import wait_until

import batchproxy
from batchproxy.host import ModelHost, RemoteProxy
from batchproxy.host import _remote as remote_module
from batchproxy.host._launch import LOAD_FAILED, Candidate
from batchproxy.integrations._serving import NotReady, Serving, State  # (framework-free)

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="Unix sockets, flock and /proc"),
    pytest.mark.usefixtures("no_leftovers"),
]

TESTS = Path(__file__).resolve().parents[1]


@pytest.fixture
def factories(monkeypatch: pytest.MonkeyPatch) -> None:
    """Host processes started from here can import tests/_host_models.py."""
    paths = [str(TESTS), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in paths if p))


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][0]
    except FileNotFoundError:
        return False
    return state != "Z"


def _command_line(pid: int) -> list[bytes]:
    return (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")


def _exists(path: str) -> bool:
    return os.path.exists(path)


def _hosts_on(path: str) -> list[int]:
    """The pids of the host processes serving `path` (by their command line)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            command = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if b"batchproxy.host" in command and path.encode() in command and _alive(int(entry.name)):
            pids.append(int(entry.name))
    return pids


def _remote(path: str, **options: object) -> RemoteProxy:
    settings = {"host": "_host_models:tagged", "health_every": 0.05, "host_idle_exit": 0.5}
    return RemoteProxy(path, **{**settings, **options})  # type: ignore[arg-type]


@pytest.mark.usefixtures("factories")
async def test_the_workers_start_one_host_restart_it_when_lost_and_it_exits_after_them(
    socket_path: str,
) -> None:
    workers = [_remote(socket_path, name=f"model{i}") for i in range(3)]
    services = [Serving(remote) for remote in workers]
    try:
        for service in services:  # three web workers starting at once
            await service.start()
        for service in services:
            await service.wait_ready()
        answers = [await remote.inference(("call", i)) for i, remote in enumerate(workers)]
        [host] = {answer[3] for answer in answers}  # one host answered them all
        # the other candidates find the lock taken and leave, having loaded nothing
        await wait_until(lambda: _hosts_on(socket_path) == [host])
        ready = services[0].readiness()
        assert ready.status == 200
        assert ready.body["proxies"]["model0"] == {"state": "healthy"}

        os.kill(host, signal.SIGKILL)  # lost: readiness fails, then a worker starts another
        await wait_until(lambda: all(s.readiness().status == 503 for s in services))
        report = services[1].readiness().body["proxies"]["model1"]
        assert report["state"] == "unhealthy"
        assert "model host" in report["reason"]
        await wait_until(lambda: all(s.readiness().status == 200 for s in services), seconds=30)
        again = (await workers[2].inference("again"))[3]
        assert again != host
        await wait_until(lambda: _hosts_on(socket_path) == [again])
    finally:
        for service in services:
            await service.aclose()
    with pytest.raises(batchproxy.ProxyClosed):
        await workers[0].inference("closed")
    await wait_until(lambda: not _alive(again))  # no worker left: it exits on its own
    assert not _exists(socket_path)


@pytest.mark.usefixtures("factories")
@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ("no_such_module_xyz:factory", "ModuleNotFoundError: No module named 'no_such_module_xyz'"),
        ("_host_models:no_such_factory", "AttributeError: module '_host_models' has no attri"),
        ("_host_models:broken", "OSError: weights not found"),
    ],
)
async def test_a_host_that_fails_to_load_is_a_failed_load_at_once(
    socket_path: str, spec: str, why: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The candidate says why and exits; the worker's start raises that at once, having
    started one candidate (not one per retry until `start_timeout`)."""
    started: list[Candidate] = []

    def candidate(*args: Any) -> Candidate:
        started.append(Candidate(*args))
        return started[-1]

    monkeypatch.setattr(remote_module, "Candidate", candidate)
    remote = _remote(socket_path, host=spec, start_timeout=120)
    service = Serving(remote)
    await service.start()
    with pytest.raises(NotReady, match=f"failed to load: {why}"):
        await asyncio.wait_for(service.wait_ready(), 60)
    assert service.state is State.FAILED
    answer = service.readiness()
    assert answer.status == 503
    assert "Retry-After" not in answer.headers  # a retry cannot help
    assert spec in answer.body["error"]
    assert [c.process.returncode for c in started] == [LOAD_FAILED]
    await service.aclose()
    assert not _exists(socket_path)


@pytest.mark.usefixtures("factories")
async def test_async_with_starts_the_host_as_it_starts_a_proxy(socket_path: str) -> None:
    async with _remote(socket_path) as remote:  # (host="_host_models:tagged")
        assert remote.healthy  # the host answered before the body runs
        host = (await remote.inference("x"))[3]
        assert _hosts_on(socket_path) == [host]
        # started frozen after loading (as Serving(freeze_gc=True) freezes a worker)
        assert b"--freeze-gc" in _command_line(host)
    assert not remote.healthy  # closed
    await wait_until(lambda: not _alive(host))  # no worker left: it exits on its own
    assert not _exists(socket_path)


async def test_without_a_host_start_fails_after_start_timeout(socket_path: str) -> None:
    service = Serving(RemoteProxy(socket_path, start_timeout=0.2))
    await service.start()
    with pytest.raises(NotReady):
        await service.wait_ready()
    answer = service.readiness()
    assert answer.status == 503
    assert "no model host answered within 0.2 s" in answer.body["error"]
    await service.aclose()


async def test_the_hosts_proxy_health_is_the_workers_readiness(socket_path: str) -> None:
    proxy = Tagged(batch_timeout=0.05)
    async with ModelHost(proxy, socket_path):
        remote = RemoteProxy(socket_path, health_every=0.02)
        service = Serving(remote)
        await service.start()
        await service.wait_ready()
        assert service.readiness().status == 200
        proxy.gate.clear()  # the model hangs: the host's proxy overruns batch_timeout
        with pytest.raises(batchproxy.BatchTimeout):
            await remote.inference("slow")
        await wait_until(lambda: service.readiness().status == 503)
        assert "batch_timeout" in remote.health.reason  # type: ignore[operator]
        proxy.gate.set()
        await remote.inference("in time")  # a batch in time: healthy again
        await wait_until(lambda: service.readiness().status == 200)
        await service.aclose()


async def test_the_drain_lets_calls_in_flight_finish(socket_path: str) -> None:
    proxy = Tagged(delay=0.2)
    async with ModelHost(proxy, socket_path):
        remote = RemoteProxy(socket_path)
        service = Serving(remote, drain_timeout=5)
        await service.start()
        await service.wait_ready()
        calls = [asyncio.ensure_future(remote.inference(i)) for i in range(5)]
        await wait_until(lambda: proxy.stats.requests == 5)
        await service.aclose()
        assert [answer[0] for answer in await asyncio.gather(*calls)] == list(range(5))
        assert remote.closed
        assert not remote.health.healthy


async def test_a_drain_deadline_fails_the_calls_still_in_flight(socket_path: str) -> None:
    """The worker's drain deadline cuts its calls off with `DrainDeadline`, as a
    proxy's does (`running`: the worker cannot tell, so True), and withdraws them in
    the host."""
    proxy = Tagged()
    async with ModelHost(proxy, socket_path, drain_timeout=0.1) as host:
        remote = RemoteProxy(socket_path)
        service = Serving(remote, drain_timeout=0.1)
        await service.start()
        await service.wait_ready()
        proxy.gate.clear()
        call = asyncio.ensure_future(remote.inference("held"))
        await wait_until(lambda: proxy.seen == [["held"]])
        await asyncio.wait_for(service.aclose(), 5)
        with pytest.raises(batchproxy.DrainDeadline) as cut:
            await call
        assert cut.value.running
        assert 0 <= cut.value.timeout <= 0.1  # (what was left of the service's deadline)
        await wait_until(lambda: host.connections == 0)
        await wait_until(lambda: proxy.stats.cancelled == 1)  # withdrawn in the host
        proxy.gate.set()


def test_bad_remote_options_are_refused() -> None:
    for options, error in [
        ({"host": "no_colon"}, ValueError),
        ({"connect_timeout": 0}, ValueError),
        ({"start_timeout": -1}, ValueError),
        ({"health_every": "1"}, TypeError),
        ({"host_idle_exit": 0}, ValueError),
        ({"name": ""}, ValueError),
    ]:
        with pytest.raises(error):
            RemoteProxy("/tmp/x.sock", **options)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Serving takes batchproxy proxies"):
        Serving(object())  # type: ignore[arg-type]


@pytest.mark.looptime
async def test_a_lost_host_that_fails_to_load_again_is_started_less_and_less_often(
    socket_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The watch starts a lost host again; one whose load fails is started again after a
    pause that doubles (`health_every`, 2x, 4x...) up to a minute, not at every
    health question (each start imports the model and prints a traceback), and the
    health says why. An answer resets the pause. On the virtual clock."""
    launched: list[float] = []

    class FailsToLoad:
        running = False
        failure = "OSError: weights gone"

        def __init__(self, *args: Any) -> None:
            launched.append(asyncio.get_running_loop().time())

    monkeypatch.setattr(remote_module, "Candidate", FailsToLoad)
    remote = RemoteProxy(socket_path, host="_host_models:tagged", health_every=1.0)
    try:
        async with ModelHost(Tagged(), socket_path):
            await remote.start()  # the host answers: nothing started
            assert launched == []
        started = asyncio.get_running_loop().time()
        await asyncio.sleep(200)  # lost: each host started from now on fails to load
        assert not remote.healthy
        assert remote.health.reason is not None
        assert "failed to load: OSError: weights gone" in remote.health.reason
        # the first at once (one health question); then, from each failure seen at the
        # next question, a pause of 1, 2, 4... 60 s: not one start per second
        assert launched[0] - started <= 1.5
        gaps = [round(b - a) for a, b in itertools.pairwise(launched)]
        assert gaps == [2, 3, 5, 9, 17, 33, 61, 61]

        async with ModelHost(Tagged(), socket_path):  # back (another worker's host)
            await asyncio.sleep(2)
            assert remote.healthy
            launched.clear()
        await asyncio.sleep(10)  # lost again: started at once, the pause begins anew
        assert [round(b - a) for a, b in itertools.pairwise(launched)] == [2, 3]
    finally:
        await remote.aclose()
