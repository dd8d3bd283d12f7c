"""A flood of callers against a bounded queue, and shutdown under it: guarantees 7
(`QueueFull` immediately) and 9 (`aclose()` runs every accepted call) of docs/failures.md.

- 20,000 callers arrive at once at a proxy with `max_queue_size=256` whose model
  takes 10 ms (virtual) per batch: the rejected ones get `QueueFull` at virtual
  time 0, before the model has answered anyone; memory peaks at a small multiple
  of what 256 queued calls take (an unbounded queue, checked as a control, takes
  about a hundred times that); every caller gets its own result or `QueueFull`.
- `aclose()` in the middle of a flood: every accepted call gets its result before
  `aclose()` returns, calls made before the close that found no room get
  `QueueFull`, calls made after it get `ProxyClosed`; none is lost.
- SIGTERM to a uvicorn-served FastAPI app in the middle of a flood of HTTP
  requests: every request the app accepted gets a complete response (200 with
  its own body, or 503), the rest are refused at the connection, the server
  exits 0.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import signal
import subprocess
import sys
import threading
import tracemalloc
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from _support import assert_settled
from typing_extensions import override

import batchproxy

if TYPE_CHECKING:
    import aiohttp

FLOOD = 20_000
LIMIT = 256  # max_queue_size
BATCH = 32
MODEL_SECONDS = 0.01  # per batch, on the virtual clock
PAYLOAD = 1024  # bytes each caller sends: what a queued request holds on to
WAVE = 256  # callers started per event-loop iteration (all at virtual time 0)


@dataclass(frozen=True)
class Job:
    n: int
    payload: bytes


class Slow(batchproxy.Proxy[Job, int]):
    """Answers job n with n after `MODEL_SECONDS` of (virtual) time; keeps no item."""

    def __init__(self, **options: Any) -> None:
        super().__init__(batch_size=BATCH, name="slow", **options)
        self.batches_done = 0

    @override
    async def _inference(self, items: list[Job]) -> list[int]:
        await asyncio.sleep(MODEL_SECONDS)
        self.batches_done += 1
        return [job.n for job in items]


class DeepestQueue(batchproxy.Listener):
    """The most requests seen waiting in the queue at once."""

    def __init__(self) -> None:
        self.deepest = 0

    @override
    def request_queued(self, proxy: str, queue_depth: int) -> None:
        self.deepest = max(self.deepest, queue_depth)


@dataclass
class Flood:
    """How a flood went; aggregates only, so recording it allocates nothing per caller."""

    answered: int = 0  # callers that got their own result
    wrong: int = 0  # callers that got someone else's (cross-talk)
    rejected: int = 0  # callers that got QueueFull
    last_rejection: float = 0.0  # virtual seconds after the flood began
    batches_before_rejection: int = 0  # most batches the model had finished at a rejection
    first_answer: float = float("inf")  # virtual seconds
    all_called_by: float = float("nan")  # virtual seconds, when the last caller had called
    peak_bytes: int = 0  # traced memory at its peak, over the memory before the flood
    left_running: set[asyncio.Task[None]] = field(default_factory=set)


@contextlib.contextmanager
def tracing() -> Iterator[None]:
    """Trace Python allocations inside the block (left on if it already was)."""
    if tracemalloc.is_tracing():
        yield
        return
    tracemalloc.start()
    try:
        yield
    finally:
        tracemalloc.stop()


async def flood(proxy: Slow, callers: int) -> Flood:
    """`callers` concurrent callers, each sending a job with a `PAYLOAD`-byte payload.

    They are started `WAVE` per loop iteration (so at most a wave of them exists
    before it has called) and all have called before any virtual time passes:
    for the proxy they arrive at once, while its first batch runs. The peak of
    traced memory is taken over the whole flood, until the last caller is done.
    """
    loop = asyncio.get_running_loop()
    start = loop.time()
    result = Flood()
    running: set[asyncio.Task[None]] = set()

    async def caller(n: int) -> None:
        job = Job(n, bytes(PAYLOAD))  # held by this caller while its call lasts
        try:
            got = await proxy.inference(job)
        except batchproxy.QueueFull:
            result.rejected += 1
            result.last_rejection = max(result.last_rejection, loop.time() - start)
            result.batches_before_rejection = max(
                result.batches_before_rejection, proxy.batches_done
            )
            return
        result.first_answer = min(result.first_answer, loop.time() - start)
        if got == n:
            result.answered += 1
        else:
            result.wrong += 1

    with tracing():
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        for first in range(0, callers, WAVE):
            for n in range(first, min(first + WAVE, callers)):
                task = asyncio.create_task(caller(n))
                running.add(task)
                task.add_done_callback(running.discard)
            await asyncio.sleep(0)  # this wave calls before the next one is started
        result.all_called_by = loop.time() - start
        done_by = loop.time() + 3600  # virtual: a hang fails fast, not after real minutes
        while running and loop.time() < done_by:
            await asyncio.wait(set(running), timeout=done_by - loop.time())
        result.peak_bytes = tracemalloc.get_traced_memory()[1] - before
    result.left_running = running
    return result


async def queued_bytes(count: int) -> int:
    """Traced memory taken by `count` callers (the flood's caller) queued in a proxy."""
    proxy = Slow()
    tasks = [asyncio.create_task(proxy.inference(Job(-1, bytes(PAYLOAD))))]
    await asyncio.sleep(0)  # the first call starts a batch: the others wait in the queue
    assert proxy.stats.in_flight == 1

    async def caller(n: int) -> int:
        job = Job(n, bytes(PAYLOAD))
        return await proxy.inference(job)

    with tracing():
        before = tracemalloc.get_traced_memory()[0]
        tasks += [asyncio.create_task(caller(n)) for n in range(count)]
        await asyncio.sleep(0)
        assert proxy.stats.queue_depth == count
        taken = tracemalloc.get_traced_memory()[0] - before
    assert await asyncio.gather(*tasks) == [-1, *range(count)]
    await proxy.aclose()
    return taken


@pytest.mark.looptime
async def test_flood_gets_queue_full_at_once_and_memory_stays_flat(no_leftovers: None) -> None:
    full_queue = await queued_bytes(LIMIT)
    proxy = Slow(max_queue_size=LIMIT)
    deepest = DeepestQueue()
    proxy.add_listener(deepest)

    result = await flood(proxy, FLOOD)

    # every caller answered: its own result or QueueFull; none pending
    assert not result.left_running
    assert result.wrong == 0
    assert result.answered + result.rejected == FLOOD
    stats = proxy.stats
    assert (stats.requests, stats.succeeded) == (result.answered, result.answered)
    assert stats.rejected == result.rejected
    assert_settled(stats)
    # accepted: the queue's worth, and the first batch, which left the queue at once
    assert LIMIT < result.answered <= LIMIT + BATCH
    assert deepest.deepest == LIMIT

    # QueueFull at once: every rejection at virtual time 0, before the model answered
    # anyone; the flood had all called by then; accepted calls waited for the model
    assert result.all_called_by == 0.0
    assert result.last_rejection == 0.0
    assert result.batches_before_rejection == 0
    assert result.first_answer >= MODEL_SECONDS

    # memory: 256 queued calls take `full_queue` bytes (about 2.4 KB each); the flood,
    # with its 20,000 payloads, peaks at about twice that (the accepted calls, a wave
    # not yet started, the exceptions). An unbounded queue holds all 20,000 callers:
    # about 95 times `full_queue` (see the control test below).
    assert full_queue > 0
    assert result.peak_bytes < 4 * full_queue, (result.peak_bytes, full_queue)
    await proxy.aclose()


@pytest.mark.looptime
async def test_control_an_unbounded_queue_fails_the_memory_bound() -> None:
    """The memory bound above has teeth: without max_queue_size the same flood takes
    far more than four times the memory of 256 queued calls."""
    full_queue = await queued_bytes(LIMIT)
    proxy = Slow()
    result = await flood(proxy, FLOOD)
    assert (result.answered, result.rejected) == (FLOOD, 0)
    assert result.peak_bytes > 20 * full_queue, (result.peak_bytes, full_queue)
    await proxy.aclose()


# -- aclose() mid-flood ----------------------------------------------------------------------

CLOSE_AT = 0.1  # virtual seconds into a flood lasting 0.2 s
PER_MS = 100  # callers arriving per virtual millisecond (the model serves 3.2)


@pytest.mark.looptime
async def test_aclose_mid_flood_drains_the_accepted_and_refuses_the_rest(
    no_leftovers: None,
) -> None:
    loop = asyncio.get_running_loop()
    proxy = Slow(max_queue_size=LIMIT)
    outcomes: dict[int, tuple[str, bool]] = {}  # n -> (outcome, the close had begun at call)
    at_close: dict[str, Any] = {}

    async def caller(n: int) -> None:
        closing = proxy.closed
        try:
            got = await proxy.inference(Job(n, b""))
        except batchproxy.QueueFull:
            outcome = "full"
        except batchproxy.ProxyClosed:
            outcome = "closed"
        else:
            outcome = "ok" if got == n else "wrong"
        assert n not in outcomes
        outcomes[n] = (outcome, closing)

    async def closer() -> None:
        await asyncio.sleep(CLOSE_AT)
        at_close["before"] = proxy.stats
        at_close["answered"] = sum(o == "ok" for o, _ in outcomes.values())
        await proxy.aclose()
        at_close["after"] = proxy.stats  # aclose() has returned: the accepted are answered

    closing = asyncio.create_task(closer())
    callers = []
    for first in range(0, FLOOD, PER_MS):
        callers += [asyncio.create_task(caller(n)) for n in range(first, first + PER_MS)]
        await asyncio.sleep(0.001)
    await asyncio.wait_for(asyncio.gather(closing, *callers), timeout=3600)  # virtual
    assert loop.time() > CLOSE_AT

    assert sorted(outcomes) == list(range(FLOOD))  # every caller ended, exactly once
    kinds = [outcome for outcome, _ in outcomes.values()]
    ok, full, closed = kinds.count("ok"), kinds.count("full"), kinds.count("closed")
    assert ok + full + closed == FLOOD  # nothing else, no cross-talk
    # a call made before the close began was accepted or found the queue full; one
    # made after it was refused with ProxyClosed, and only those were
    for outcome, closing_at_call in outcomes.values():
        assert (outcome == "closed") == closing_at_call
    assert ok > LIMIT
    assert full > 0
    assert closed > 0

    # the close came with calls queued, and aclose() returned only once every
    # accepted call had its result: the drain answered them, none got ProxyClosed
    before, after = at_close["before"], at_close["after"]
    assert before.queue_depth > 0
    assert after.requests == before.requests  # nothing accepted after the close began
    assert after.succeeded == after.requests == ok
    assert at_close["answered"] < ok
    assert after.rejected == full
    assert_settled(after)


# -- SIGTERM to a uvicorn-served app mid-flood -----------------------------------------------

SERVER = Path(__file__).resolve().parents[1] / "_flood_server.py"
BURST = 3_000  # concurrent requests fired at once
TRICKLE_EVERY = 0.01  # seconds between the requests sent after the signal, until the exit
HTTP_TIMEOUT = 20.0
REFUSED = {"ClientConnectorError", "ServerDisconnectedError", "ClientOSError"}
"""How aiohttp reports a connection refused, or closed or reset before any response."""


@dataclass(frozen=True)
class Answer:
    """What the client got for one request: a complete response, or the error instead."""

    status: int | None = None
    body: Any = None
    error: str | None = None


class Signaller:
    """Reads the server's output on a thread: the port, then "full" (its queue has filled
    up), upon which it sends SIGTERM at once, whatever the test's event loop is doing."""

    def __init__(self, server: subprocess.Popen[str], loop: asyncio.AbstractEventLoop) -> None:
        self.server = server
        self.loop = loop
        self.port: concurrent.futures.Future[int] = concurrent.futures.Future()
        self.sent = asyncio.Event()
        self.thread = threading.Thread(target=self._read, name="flood-signaller", daemon=True)
        self.thread.start()

    def _read(self) -> None:
        stdout = self.server.stdout
        assert stdout is not None
        first = stdout.readline()
        if not first.strip().isdigit():
            self.port.set_exception(RuntimeError(f"the server did not start: {first!r}"))
            return
        self.port.set_result(int(first))
        for line in stdout:
            if line.strip() == "full":
                self.server.send_signal(signal.SIGTERM)
                self.loop.call_soon_threadsafe(self.sent.set)
                break


async def get(http: aiohttp.ClientSession, n: int) -> Answer:
    import aiohttp

    try:
        async with http.get(f"/square/{n}") as response:
            return Answer(response.status, await response.json())
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return Answer(error=type(exc).__name__)


async def flood_through_sigterm(
    server: subprocess.Popen[str], signaller: Signaller
) -> list[Answer]:
    """Fire `BURST` requests at once; the signaller sends SIGTERM when the app's queue is
    full; then keep sending one request every `TRICKLE_EVERY` until the server exits, and
    one more.
    Returns every request's answer, request n at index n."""
    import aiohttp

    port = await asyncio.wait_for(asyncio.wrap_future(signaller.port), 60)
    connector = aiohttp.TCPConnector(limit=0, force_close=True)  # a connection per request
    async with aiohttp.ClientSession(
        f"http://127.0.0.1:{port}",
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=HTTP_TIMEOUT),
    ) as http:
        requests = [asyncio.create_task(get(http, n)) for n in range(BURST)]
        await asyncio.wait_for(signaller.sent.wait(), HTTP_TIMEOUT)
        while True:  # keep knocking while it shuts down, and once after it exited (on a
            # loaded machine it had exited before this loop ran again after the signal)
            requests.append(asyncio.create_task(get(http, len(requests))))
            if server.poll() is not None:
                break
            await asyncio.sleep(TRICKLE_EVERY)
        return await asyncio.gather(*requests)


async def test_sigterm_mid_flood_answers_every_accepted_request(tmp_path: Path) -> None:
    """SIGTERM to uvicorn while 3,000 requests are in flight.

    A request counts as accepted when uvicorn handed it to the app (its handler
    ran; the app records it). Before that it is only in the kernel's accept queue
    or in uvicorn's parser, and on SIGTERM uvicorn closes the listening socket and
    every connection that carries no request the app is handling: the client sees
    the connection refused, reset or closed with no response, the app never saw
    the request, and a retry is safe. Once accepted, uvicorn keeps the connection
    open until the response is complete, and the app's lifespan shutdown (which
    calls `aclose()`) runs only after that. So every accepted request must get a
    complete response, 200 with its own body or 503 for `QueueFull`, every other
    one a connection error, and no request anything else (no timeout, no 500, no
    truncated body, no ProxyClosed).
    """
    for module in ("fastapi", "uvicorn", "aiohttp"):
        pytest.importorskip(module)
    report_path, log_path = tmp_path / "report.json", tmp_path / "server.log"
    with log_path.open("w") as log:
        server = await asyncio.to_thread(
            subprocess.Popen,
            [sys.executable, str(SERVER), str(report_path)],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
    signaller = Signaller(server, asyncio.get_running_loop())
    try:
        answers = await flood_through_sigterm(server, signaller)
        exit_code = await asyncio.to_thread(server.wait, HTTP_TIMEOUT)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        signaller.thread.join(HTTP_TIMEOUT)  # done at "full", or at the end of the output
        assert server.stdout is not None
        server.stdout.close()
    assert exit_code == 0, log_path.read_text()
    report = json.loads(report_path.read_text())
    seen = {int(n): status for n, status in report["statuses"].items()}

    # every request has exactly one outcome: accepted ones a complete response, the
    # others a connection refused before any response
    assert len(answers) > BURST
    ok = full = refused = 0
    for n, answer in enumerate(answers):
        if n in seen:  # accepted: the app handled it, and answered with this status
            assert answer.status == seen[n], (n, answer, seen[n])
            if answer.status == 200:
                assert answer.body == {"n": n, "square": n * n}
                ok += 1
            else:
                assert answer.status == 503, (n, answer)
                assert "queue is full" in answer.body["detail"]
                full += 1
        else:  # never reached the app
            assert answer.status is None, (n, answer)
            assert answer.error in REFUSED, (n, answer)
            refused += 1

    # the server's own accounting agrees: the proxy ran exactly the 200s and refused
    # exactly the 503s, and nothing met ProxyClosed (aclose() came after the drain)
    final = report["final"]
    assert report["settled"]
    assert (final["requests"], final["succeeded"], final["rejected"]) == (ok, ok, full)
    assert report["closed"] == 0
    # the signal came mid-flight: calls were queued or running, and answered after it
    at_signal = report["at_signal"]
    assert at_signal is not None
    assert at_signal["queue_depth"] + at_signal["in_flight"] > 0
    assert final["succeeded"] > at_signal["succeeded"]
    assert ok > 0
    assert full > 0
    assert refused > 0  # the trickle after the signal found the door closed
