"""`Serving(drain_timeout=...)`: the drain at shutdown has a deadline, counted from its
start (`aclose()`, or SIGTERM where a server handles it), `/readyz` says "draining"
for all of it, and under uvicorn every request in flight at SIGTERM gets an HTTP
answer by the deadline; aiohttp's `web.run_app`, SIGTERMed with calls in flight,
closes its port, answers them and exits. And a failed load: logged, and no
`Retry-After`."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import math
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from _support import Hangs

from batchproxy import DrainDeadline
from batchproxy.integrations._serving import NotReady, Serving, State, answer_for


@pytest.mark.parametrize(
    ("drain_timeout", "error"),
    [(-1, ValueError), (math.nan, ValueError), ("5", TypeError), (True, TypeError)],
)
def test_a_bad_drain_timeout_is_refused(drain_timeout: Any, error: type) -> None:
    with pytest.raises(error, match="drain_timeout"):
        Serving(Hangs(), drain_timeout=drain_timeout)


@pytest.mark.looptime
async def test_the_drain_deadline_is_shared_by_the_proxies_and_readiness_says_draining() -> None:
    loop = asyncio.get_running_loop()
    first, second = Hangs(name="first", batch_size=1), Hangs(name="second", batch_size=1)
    serving = Serving(first, second, drain_timeout=2)
    await serving.start()
    await serving.wait_ready()
    tasks = [asyncio.ensure_future(p.inference(x)) for p in (first, second) for x in ("hang", "a")]
    await asyncio.sleep(0.1)
    start = loop.time()
    closing = asyncio.ensure_future(serving.aclose())
    await asyncio.sleep(0)  # it began
    while not closing.done():  # the whole drain long
        ready = serving.readiness()
        assert ready.status == 503
        assert ready.body["status"] == "draining"
        assert "Retry-After" in ready.headers
        await asyncio.sleep(0.25)
    await closing
    assert loop.time() - start == pytest.approx(2.0, abs=0.3)  # once, not once per proxy
    assert serving.state is State.CLOSED
    errors = [t.exception() for t in tasks]
    assert all(isinstance(e, DrainDeadline) for e in errors), errors
    answer = answer_for(errors[0])  # what a web client gets: 503, retry elsewhere
    assert answer.status == 503
    assert "Retry-After" in answer.headers
    assert "drain deadline" in answer.body["detail"]


@pytest.mark.looptime
async def test_a_second_aclose_waits_for_the_first_drain() -> None:
    loop = asyncio.get_running_loop()
    proxy = Hangs(batch_size=1)
    serving = Serving(proxy, drain_timeout=1)
    await serving.start()
    await serving.wait_ready()
    task = asyncio.ensure_future(proxy.inference("hang"))
    await asyncio.sleep(0.1)
    start = loop.time()
    first = asyncio.ensure_future(serving.aclose())
    await asyncio.sleep(0)
    await serving.aclose()
    assert loop.time() - start == pytest.approx(1.0)
    await first
    assert isinstance(task.exception(), DrainDeadline)


async def test_without_a_drain_timeout_the_drain_is_unbounded_as_before() -> None:
    proxy = Hangs(batch_size=1)
    serving = Serving(proxy)
    assert serving.drain_timeout is None
    assert Serving(proxy, drain_timeout=math.inf).drain_timeout is None
    async with serving.running():
        await serving.wait_ready()
        assert await proxy.inference("a") == ("out", "a")
    assert serving.state is State.CLOSED


async def test_sigterm_begins_the_drain_then_calls_the_servers_handler() -> None:
    """In the main thread, over a server's SIGTERM handler (here a recorder), the signal
    starts the drain and its deadline at once; `aclose()` puts the handler back."""
    got: list[int] = []

    def servers_handler(signum: int, frame: Any) -> None:
        got.append(signum)

    original = signal.signal(signal.SIGTERM, servers_handler)
    try:
        proxy = Hangs(batch_size=1)
        serving = Serving(proxy, drain_timeout=0.5)
        await serving.start()
        await serving.wait_ready()
        assert signal.getsignal(signal.SIGTERM) is not servers_handler  # chained in front
        task = asyncio.ensure_future(proxy.inference("hang"))
        await asyncio.sleep(0.05)
        start = time.monotonic()
        signal.raise_signal(signal.SIGTERM)
        await asyncio.sleep(0.05)
        assert got == [signal.SIGTERM]
        assert serving.state is State.DRAINING
        assert serving.readiness().body["status"] == "draining"
        await asyncio.wait([task], timeout=2)  # the deadline ends it, before any aclose()
        assert isinstance(task.exception(), DrainDeadline)
        assert time.monotonic() - start < 1.5
        await serving.aclose()
        assert signal.getsignal(signal.SIGTERM) is servers_handler
    finally:
        signal.signal(signal.SIGTERM, original)


async def test_no_handler_is_chained_over_the_default_one() -> None:
    original = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        serving = Serving(Hangs(), drain_timeout=1)
        async with serving.running():
            assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, original)


# -- a failed load ---------------------------------------------------------------------------


async def test_a_failed_load_is_logged_with_its_traceback_and_has_no_retry_after(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def load() -> None:
        raise RuntimeError("no weights here")

    serving = Serving(Hangs(), load=load)
    with caplog.at_level(logging.ERROR, logger="batchproxy"):
        async with serving.running():
            with pytest.raises(NotReady) as refused:
                await serving.wait_ready()
            ready = serving.readiness()
    (record,) = [r for r in caplog.records if r.name == "batchproxy"]
    assert record.levelno == logging.ERROR
    assert "RuntimeError: no weights here" in record.getMessage()
    assert record.exc_info is not None
    assert record.exc_info[1] is serving.error
    assert ready.status == 503
    assert "Retry-After" not in ready.headers  # a retry cannot help
    answer = answer_for(refused.value)
    assert answer.status == 503
    assert "Retry-After" not in answer.headers
    assert "Retry-After" in answer_for(NotReady(State.LOADING)).headers  # loading: it can


# -- SIGTERM to a real uvicorn server --------------------------------------------------------

SERVER = Path(__file__).resolve().parents[1] / "_drain_server.py"


async def sigterm_with_a_backlog(
    tmp_path: Path, *, requests: int, model_seconds: float, drain: str, offload: bool
) -> tuple[list[tuple[Any, str]], float, int, dict[str, Any]]:
    """Start `_drain_server.py`, send `requests` requests, SIGTERM it once they are all in
    the app; the answers, the seconds from the signal to the exit, the exit status, the
    server's report. Stops only the server it started, whatever happens."""
    import aiohttp

    report, log = tmp_path / "report.json", tmp_path / "server.log"
    args = [str(SERVER), str(report), str(requests), str(model_seconds), drain, "none"]
    with log.open("w") as errors:
        server = await asyncio.to_thread(
            subprocess.Popen,
            [sys.executable, *args, *(["thread"] if offload else [])],
            stdout=subprocess.PIPE,
            stderr=errors,
            text=True,
        )
    try:
        assert server.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(server.stdout.readline), 60)
        assert line.strip().isdigit(), log.read_text()
        timeout = aiohttp.ClientTimeout(total=30)
        async with aiohttp.ClientSession(f"http://127.0.0.1:{int(line)}", timeout=timeout) as http:

            async def get(n: int) -> tuple[Any, str]:
                try:
                    async with http.get(f"/square/{n}") as response:
                        return response.status, (await response.json()).get("error", "")
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    return None, type(exc).__name__

            calls = [asyncio.ensure_future(get(n)) for n in range(requests)]
            busy = await asyncio.wait_for(asyncio.to_thread(server.stdout.readline), 30)
            assert busy.strip() == "busy", log.read_text()
            signalled = time.monotonic()
            server.send_signal(signal.SIGTERM)
            answers = await asyncio.gather(*calls)
        code = await asyncio.to_thread(server.wait, 30)
        took = time.monotonic() - signalled
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        if server.stdout is not None:
            server.stdout.close()
    return answers, took, code, json.loads(report.read_text())


@pytest.mark.parametrize("offload", [False, True], ids=["loop", "thread"])
async def test_sigterm_with_a_backlog_longer_than_the_deadline_answers_every_client(
    tmp_path: Path, offload: bool
) -> None:
    """uvicorn waits for the requests in flight before it runs the lifespan's exit; the
    drain, begun at the signal, settles each by its deadline, so uvicorn's wait ends
    then: 12 requests, batches of 2 taking 1 s each one at a time (6 s of work), a
    1.5 s deadline. Every client gets an HTTP answer: 200, or 503 `DrainDeadline`."""
    for module in ("fastapi", "uvicorn", "aiohttp"):
        pytest.importorskip(module)
    answers, took, code, report = await sigterm_with_a_backlog(
        tmp_path, requests=12, model_seconds=1.0, drain="1.5", offload=offload
    )
    assert code == 0
    kinds = collections.Counter(answers)
    assert set(kinds) <= {(200, ""), (503, "DrainDeadline")}, kinds
    assert kinds[(503, "DrainDeadline")] >= 6, kinds  # the backlog was cut, not served
    assert took < 4.0, took  # the deadline (1.5 s), not the backlog (6 s)
    assert report["drained_after"] < 2.5, report
    assert report["requests"] == report["succeeded"] + report["errors"] == 12, report


# -- SIGTERM to a real aiohttp `web.run_app` -------------------------------------------------

AIOHTTP_SERVER = Path(__file__).resolve().parents[1] / "_aiohttp_drain_server.py"


async def refused(port: int) -> bool:
    """Whether a new connection to `port` is refused (what a probe finds once the server
    stopped listening); one that is accepted is closed at once."""
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except ConnectionRefusedError:
        return True
    except ConnectionResetError:  # accepted into the backlog as the listener closed
        return False  # (seen on uvloop): the next probe finds it refused
    writer.close()
    with contextlib.suppress(ConnectionError):
        await writer.wait_closed()
    return False


async def sigterm_run_app(
    tmp_path: Path, *, requests: int, drain: str, grace: str, loop: str
) -> tuple[list[tuple[Any, Any]], float, int, list[str], dict[str, Any]]:
    """Start `_aiohttp_drain_server.py`, send `requests` requests, SIGTERM it once they
    are all in the app, wait until its port is closed (with no deadline, check they are
    all still in flight, then let the model go on); the answers, the seconds from the
    signal to the exit, the exit status, its stderr's lines, its report. Stops only the
    server it started, whatever happens."""
    import aiohttp

    report, log = tmp_path / "report.json", tmp_path / "server.log"
    args = [str(AIOHTTP_SERVER), str(report), str(requests), drain, loop, grace]
    with log.open("w") as errors:
        server = await asyncio.to_thread(
            subprocess.Popen,
            [sys.executable, *args],
            stdout=subprocess.PIPE,
            stderr=errors,
            text=True,
        )
    try:
        assert server.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(server.stdout.readline), 60)
        assert line.strip().isdigit(), log.read_text()
        port = int(line)
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}", timeout=timeout) as http:

            async def get(n: int) -> tuple[Any, Any]:
                try:
                    async with http.get(f"/square/{n}") as response:
                        return response.status, await response.json()
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    return None, type(exc).__name__

            calls = [asyncio.ensure_future(get(n)) for n in range(requests)]
            busy = await asyncio.wait_for(asyncio.to_thread(server.stdout.readline), 30)
            assert busy.strip() == "busy", log.read_text()
            signalled = time.monotonic()
            server.send_signal(signal.SIGTERM)
            while not await refused(port):
                assert time.monotonic() < signalled + 20, "the port is still open"
                await asyncio.sleep(0.05)
            if drain == "none":
                assert not any(call.done() for call in calls)  # held, not dropped
                assert server.poll() is None  # waiting for them
                server.send_signal(signal.SIGUSR1)  # the model goes on
            answers = await asyncio.gather(*calls)
        code = await asyncio.to_thread(server.wait, 30)
        took = time.monotonic() - signalled
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        if server.stdout is not None:
            server.stdout.close()
    return answers, took, code, log.read_text().splitlines(), json.loads(report.read_text())


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
@pytest.mark.parametrize(
    ("drain", "grace"),
    [("none", "60"), ("1.0", "60"), ("3.0", "1")],
    ids=["no deadline", "a 1 s deadline", "shutdown_timeout first"],
)
async def test_sigterm_to_run_app_answers_the_calls_in_flight_and_exits(
    tmp_path: Path, drain: str, grace: str, loop: str
) -> None:
    """`web.run_app` as the docs show it, SIGTERM with 6 calls in flight (held by the
    model): the port closes at once (a new client, a readiness probe, is refused),
    the calls in flight are answered (all 200 once the model goes on; with
    `drain_timeout` and a model that never does, 503 `DrainDeadline` at the
    deadline), then the helper's cleanup drains the proxy and the process exits 0,
    leaving no thread and nothing on stderr but the deadline's warning. When
    `run_app`'s `shutdown_timeout` passes before the deadline, aiohttp cancels the
    handlers and closes their connections unanswered: their calls are cancelled
    (not counted as disconnected) and the drain's deadline still ends the process.
    On asyncio's loop and on uvloop (`run_app(..., loop=uvloop.new_event_loop())`)."""
    pytest.importorskip("aiohttp")
    pytest.importorskip(loop)
    requests = 6
    answers, took, code, lines, report = await sigterm_run_app(
        tmp_path, requests=requests, drain=drain, grace=grace, loop=loop
    )
    assert code == 0, lines
    assert len(lines) == (0 if drain == "none" else 1), lines
    # the proxy's drain gets what was left of the service's deadline when its turn came
    # (a few ms less than drain_timeout on a loaded machine: "timeout=0.997 s")
    for line in lines:
        told = re.search(r"the drain deadline \(timeout=([0-9.e-]+) s\) passed", line)
        assert told is not None, line
        assert 0.5 * float(drain) <= float(told.group(1)) <= float(drain), line
    assert report["state"] == "CLOSED"
    assert report["threads"] == []
    assert report["requests"] == requests
    if drain == "none":
        assert answers == [(200, {"square": n * n}) for n in range(requests)]
        assert report["succeeded"] == requests, report
    elif grace == "60":
        assert all(
            status == 503 and body["error"] == "DrainDeadline" for status, body in answers
        ), answers
        assert report["errors"] == requests, report
        assert took < 15, took  # the deadline (1 s), not aiohttp's 60 s shutdown_timeout
    else:
        assert all(status is None for status, _ in answers), answers  # no answer
        assert (report["cancelled"], report["disconnected"]) == (requests, 0), report
        assert took < 15, took
