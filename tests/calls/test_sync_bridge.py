"""The sync bridge: `inference_sync`, `submit` from plain threads, and `BackgroundLoop`."""

from __future__ import annotations

import asyncio
import concurrent.futures
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from _support import (
    LoopThread,
    Recorder,
    ThreadRecorder,
    assert_settled,
    blocked_in,
    tag_with_thread,
    wait_for,
)
from typing_extensions import override

import batchproxy
from batchproxy import BackgroundLoop, DeadlineExceeded, ProxyClosed
from batchproxy._loops.bridge import LoopBridge

DEFAULT_THREAD = "batchproxy-loop"


@pytest.fixture
def background() -> Iterator[BackgroundLoop]:
    """The default background loop, closed after the test (made anew on demand)."""
    default = BackgroundLoop.default()
    yield default
    default.close()
    assert not thread_names() & {DEFAULT_THREAD}


def thread_names() -> set[str]:
    return {thread.name for thread in threading.enumerate() if thread.is_alive()}


def run_threads(target: Callable[[int], object], count: int) -> None:
    """Run `target(0)` .. `target(count - 1)`, each in a plain thread of its own."""
    threads = [threading.Thread(target=target, args=(n,)) for n in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not any(thread.is_alive() for thread in threads)


# -- inference_sync and submit from plain threads -------------------------------------------


def test_threads_get_their_own_results_in_shared_batches(background: BackgroundLoop) -> None:
    proxy = Recorder(delay=0.01)
    start = threading.Barrier(32)
    results: dict[int, list[Any]] = {}

    def caller(n: int) -> None:
        start.wait()
        results[n] = [proxy.inference_sync((n, k)) for k in range(4)]

    run_threads(caller, 32)
    assert results == {n: [("out", (n, k)) for k in range(4)] for n in range(32)}
    stats = proxy.stats
    assert stats.items == 128
    assert stats.items / stats.batches > 1
    assert_settled(stats)


def test_submit_starts_a_proxy_running_nowhere_on_the_default_loop(
    background: BackgroundLoop,
) -> None:
    proxy = Recorder(respond=tag_with_thread)
    futures: dict[int, concurrent.futures.Future[Any]] = {}

    def caller(n: int) -> None:
        futures[n] = proxy.submit(n)

    run_threads(caller, 8)
    assert all(isinstance(future, concurrent.futures.Future) for future in futures.values())
    assert {n: f.result(10) for n, f in futures.items()} == {
        n: (DEFAULT_THREAD, n) for n in range(8)
    }


@pytest.mark.parametrize("where", ["per call", "proxy default"])
def test_timeout_raises_deadline_exceeded_and_leaves_nothing_queued(
    background: BackgroundLoop, where: str
) -> None:
    gate = threading.Event()
    options: dict[str, Any] = {"timeout": 0.05} if where == "proxy default" else {}
    proxy = ThreadRecorder(gate=gate, batch_size=1, **options)
    busy = proxy.submit(0, timeout=30)
    try:
        assert proxy.entered.wait(10)
        with pytest.raises(DeadlineExceeded):
            proxy.inference_sync(1, timeout=0.05 if where == "per call" else None)
        assert proxy.stats.timed_out == 1
        assert proxy.stats.queue_depth == 0
    finally:
        gate.set()
    assert busy.result(10) == ("out", 0)
    assert proxy.batches == [[0]]


class _RefusalThenStall(batchproxy.Listener):
    """On a refusal, queue a second's stall on the loop: it runs before anything the
    loop schedules after the refusing step (the step's own done callbacks)."""

    @override
    def request_rejected(self, proxy: str, count: int) -> None:
        asyncio.get_running_loop().call_soon(time.sleep, 1.0)


def test_a_refusal_reaches_a_thread_whose_guard_ends_just_after(
    background: BackgroundLoop,
) -> None:
    """The proxy refuses a thread's call, then its loop stalls past the thread's own
    guard (timeout + 0.5 s): the thread still gets the `QueueFull` the proxy counted,
    not a `DeadlineExceeded` of its own (the outcome leaves in the refusing step)."""
    gate = threading.Event()
    proxy = ThreadRecorder(gate=gate, batch_size=1, max_queue_size=1)
    busy = proxy.submit(0, timeout=30)
    try:
        assert proxy.entered.wait(10)
        queued = proxy.submit(1, timeout=30)
        wait_for(lambda: proxy.stats.queue_depth == 1)
        proxy.add_listener(_RefusalThenStall())
        with pytest.raises(batchproxy.QueueFull):
            proxy.inference_sync(2, timeout=0.05)
        assert (proxy.stats.rejected, proxy.stats.timed_out) == (1, 0)
    finally:
        gate.set()
    assert (busy.result(10), queued.result(10)) == (("out", 0), ("out", 1))


def test_a_call_its_thread_gave_up_on_before_it_started_is_never_made(
    background: BackgroundLoop,
) -> None:
    """The loop stalls between taking a thread's call and its first step, past the
    thread's guard: the thread gets `DeadlineExceeded`, and the call is never made
    (not accepted, then cancelled: the proxy counts nothing its caller did not see)."""
    gate = threading.Event()
    proxy = ThreadRecorder(gate=gate, batch_size=1)
    busy = proxy.submit(0, timeout=30)

    def stall_once_routed() -> None:  # on the loop, ahead of the call's start
        wait_for(lambda: bool(binding.bridge._open))
        binding.loop.call_soon(time.sleep, 1.0)  # after the start, before the first step

    try:
        assert proxy.entered.wait(10)
        binding = proxy._binder.current
        assert binding is not None
        binding.loop.call_soon_threadsafe(stall_once_routed)
        with pytest.raises(DeadlineExceeded):
            proxy.inference_sync(1, timeout=0.05)
        assert background.run(asyncio.sleep(0, "the loop's next step"), timeout=10)
        assert (proxy.stats.requests, proxy.stats.cancelled) == (1, 0)  # the busy one
        assert proxy.stats.queue_depth == 0
    finally:
        gate.set()
    assert busy.result(10) == ("out", 0)
    assert proxy.batches == [[0]]


@pytest.mark.usefixtures("python_sigint")
def test_an_interrupted_wait_withdraws_the_call(background: BackgroundLoop) -> None:
    """Ctrl-C in a thread blocked in inference_sync takes its request out of the queue."""
    assert threading.current_thread() is threading.main_thread()
    gate = threading.Event()
    proxy = ThreadRecorder(gate=gate, batch_size=1)
    busy = proxy.submit(0)
    failed: list[BaseException] = []

    def interrupt_once_queued() -> None:
        # the signal goes once the main thread waits in the bridge for its queued call:
        # not in any other wait of `threading` (starting this thread is one)
        main = threading.main_thread().ident or 0
        try:
            wait_for(
                lambda: proxy.stats.queue_depth == 1 and blocked_in(main, LoopBridge.wait.__code__)
            )
        except BaseException as exc:
            failed.append(exc)
            gate.set()  # the main thread's call then ends at once: the test fails, not hangs
        else:
            signal.pthread_kill(main, signal.SIGINT)

    interrupter = threading.Thread(target=interrupt_once_queued)
    try:
        assert proxy.entered.wait(10)
        interrupter.start()
        with pytest.raises(KeyboardInterrupt):
            proxy.inference_sync(1)
        wait_for(lambda: proxy.stats.cancelled == 1)
        assert proxy.stats.queue_depth == 0
    finally:
        gate.set()
        interrupter.join(10)
        assert failed == []
    assert busy.result(10) == ("out", 0)
    assert proxy.batches == [[0]]


def test_calls_on_the_proxys_own_loop_thread_are_refused(background: BackgroundLoop) -> None:
    proxy = Recorder()
    assert proxy.inference_sync(1) == ("out", 1)  # now it runs on the default loop

    async def on_that_loop() -> object:
        with pytest.raises(RuntimeError, match="own event-loop thread"):
            proxy.inference_sync(2)
        with pytest.raises(RuntimeError, match="own event-loop thread"):
            proxy.submit(2)
        with pytest.raises(RuntimeError, match="own event-loop thread"):
            Recorder().inference_sync(3)  # running nowhere: it would start right here
        return await proxy.inference(4)

    assert background.run(on_that_loop(), timeout=10) == ("out", 4)
    assert proxy.stats.requests == 2


def test_a_proxy_running_in_a_server_loop_is_reached_through_it() -> None:
    proxy = Recorder(respond=tag_with_thread)
    with LoopThread("server-loop") as server:
        server.run(proxy.start())
        results: dict[int, Any] = {}

        def caller(n: int) -> None:
            results[n] = proxy.inference_sync(n)

        run_threads(caller, 4)
        assert results == {n: ("server-loop", n) for n in range(4)}
        assert proxy.submit(5).result(10) == ("server-loop", 5)

        async def on_the_server_loop() -> None:
            proxy.inference_sync(6)

        with pytest.raises(RuntimeError, match="own event-loop thread"):
            server.run(on_the_server_loop())
        server.run(proxy.aclose())
    assert proxy.stats.succeeded == 5


def test_the_decorator_has_a_blocking_entry(background: BackgroundLoop) -> None:
    @batchproxy.batch(batch_size=8)
    async def double(items: list[int]) -> list[int]:
        return [2 * item for item in items]

    results: dict[int, int] = {}

    def caller(n: int) -> None:
        results[n] = double.inference_sync(n, timeout=10)

    run_threads(caller, 8)
    assert results == {n: 2 * n for n in range(8)}


# -- BackgroundLoop ---------------------------------------------------------------------------


def test_close_finishes_accepted_calls_and_leaves_no_thread() -> None:
    default = BackgroundLoop.default()
    proxy = Recorder(batch_size=2, delay=0.02, offload=True, name="drained")
    futures = [proxy.submit(i) for i in range(5)]
    wait_for(lambda: proxy.stats.requests == 5)
    default.close()
    assert [future.result(0) for future in futures] == [("out", i) for i in range(5)]
    assert proxy.closed
    assert not thread_names() & {DEFAULT_THREAD, "batchproxy-drained"}
    with pytest.raises(ProxyClosed):
        proxy.inference_sync(9)
    assert not thread_names() & {DEFAULT_THREAD}  # no loop started to refuse it
    default.close()  # idempotent
    assert BackgroundLoop.default() is not default  # the next use gets a fresh one


def test_the_default_loop_is_one_per_process() -> None:
    seen: set[BackgroundLoop] = set()
    run_threads(lambda n: seen.add(BackgroundLoop.default()), 16)
    assert seen == {BackgroundLoop.default()}


def test_background_loop_runs_coroutines_for_plain_threads() -> None:
    async def where() -> str:
        await asyncio.sleep(0)
        return threading.current_thread().name

    cancelled = threading.Event()

    async def forever() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def run_here() -> str:
        return bg.run(where())

    with BackgroundLoop("test-background") as bg:
        assert "test-background" in thread_names()
        assert bg.run(where()) == "test-background"
        future = bg.submit(where())
        assert isinstance(future, concurrent.futures.Future)
        assert future.result(10) == "test-background"
        with pytest.raises(TimeoutError):
            bg.run(forever(), timeout=0.01)
        assert cancelled.wait(10)
        with pytest.raises(RuntimeError, match="own thread"):
            bg.run(run_here())
        left_running = bg.submit(forever())
    assert "test-background" not in thread_names()
    assert left_running.cancelled()
    bg.close()
    with pytest.raises(RuntimeError, match="closed"):
        bg.run(where())


SCRIPT = """
import asyncio, atexit, threading, time
import batchproxy

class Double(batchproxy.Proxy[int, int]):
    async def _inference(self, items):
        await asyncio.sleep(0.01)
        return [2 * item for item in items]

class Slow(batchproxy.Proxy[int, int]):  # a plain def: runs on a worker thread
    def _inference(self, items):
        time.sleep(0.1)
        return [item + 100 for item in items]

in_flight = []
# registered before the library's handler, so it runs after it (atexit is LIFO)
atexit.register(lambda: print("in flight:", in_flight[0].result(0)))
double, slow = Double(), Slow()
results = {}
threads = [
    threading.Thread(target=lambda n=n: results.update({n: double.inference_sync(n)}))
    for n in range(8)
]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print("results:", results == {n: 2 * n for n in range(8)})
in_flight.append(slow.submit(1))  # exits while this runs: the exit lets it finish
"""


def test_a_script_that_closes_nothing_exits_cleanly(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, "-W", "always", str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["results: True", "in flight: 101"]
    assert done.stderr == ""


def test_a_proxy_that_bound_to_a_background_loop_by_hand_closes_with_it() -> None:
    """Not started by submit() or inference_sync(): awaited in a coroutine run there."""
    loop = BackgroundLoop(name="by-hand")
    proxy = Recorder(batch_size=2, delay=0.02, offload=True, name="by-hand-model")
    assert loop.run(proxy.inference(1), timeout=10) == ("out", 1)
    pending = [loop.submit(proxy.inference(n)) for n in range(2, 6)]
    wait_for(lambda: proxy.stats.requests == 5)
    loop.close()
    assert [future.result(0) for future in pending] == [("out", n) for n in range(2, 6)]
    assert proxy.closed
    assert not thread_names() & {"by-hand", "batchproxy-by-hand-model"}


# -- the serving loop ending under callers from other threads and loops (issue 16.2, 16.3) ----


class Hammer:
    """Plain threads calling `inference_sync` one call after another until stopped; each
    outcome is kept: a result, or the exception the call raised."""

    def __init__(self, proxy: batchproxy.Proxy[Any, Any], threads: int) -> None:
        self.proxy = proxy
        self.outcomes: list[object] = []
        self.stop = threading.Event()
        self.threads = [
            threading.Thread(target=self._call, args=(n,), name=f"hammer-{n}", daemon=True)
            for n in range(threads)
        ]

    def _call(self, n: int) -> None:
        while not self.stop.is_set():
            try:
                outcome: object = self.proxy.inference_sync(n)
            except BaseException as exc:
                outcome = exc
            self.outcomes.append(outcome)

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def finish(self) -> list[object]:
        """Stop the callers; every one must return (none left blocked); the outcomes
        that are neither a result nor ProxyClosed/InferenceError."""
        self.stop.set()
        for thread in self.threads:
            thread.join(15)
        hung = [thread.name for thread in self.threads if thread.is_alive()]
        assert hung == [], f"callers left blocked: {hung}"
        assert any(not isinstance(o, BaseException) for o in self.outcomes)
        return [
            outcome
            for outcome in self.outcomes
            if isinstance(outcome, BaseException)
            and not isinstance(outcome, (ProxyClosed, batchproxy.InferenceError))
        ]


@pytest.mark.parametrize("offload", [False, True], ids=["loop-model", "thread-model"])
def test_sync_callers_never_hang_when_the_serving_asyncio_run_returns(offload: bool) -> None:
    """Issue 16.2: threads calling `inference_sync` while `asyncio.run()` returned: calls
    that reached the loop after its last iteration were dropped with it (their threads
    blocked for ever), others got a message-less CancelledError."""

    async def serve(proxy: batchproxy.Proxy[Any, Any], hammer: Hammer) -> None:
        await proxy.start()
        hammer.start()
        await asyncio.sleep(0.1)

    for _ in range(3):  # the race is in the loop's last moments: end it several times
        proxy = Recorder(batch_size=8, delay=0.0005, offload=offload, name="served")
        hammer = Hammer(proxy, 32)
        try:
            asyncio.run(serve(proxy, hammer))
            time.sleep(0.05)  # the callers go on: the proxy moves to the default loop
            assert hammer.finish() == []
        finally:
            hammer.stop.set()
            BackgroundLoop.default().close()


def test_sync_callers_never_hang_when_their_background_loop_closes() -> None:
    """Issue 16.2, `BackgroundLoop.close()` while threads call: each gets its result or
    ProxyClosed (the loop closes its proxies), and none is left blocked."""
    for round_ in range(5):
        background = BackgroundLoop(f"closing-{round_}")
        proxy = Recorder(batch_size=8, delay=0.0005, name="background-served")
        background.run(proxy.start())
        hammer = Hammer(proxy, 32)
        hammer.start()
        time.sleep(0.1)
        background.close()
        assert hammer.finish() == []
        assert proxy.closed


def test_callers_on_another_loop_get_inference_error_not_cancelled_when_its_loop_ends() -> None:
    """Issue 16.3: callers awaiting a proxy served by another thread's loop got a
    CancelledError, in a task nobody cancelled, when that loop ended."""
    proxy = Recorder(batch_size=8, delay=0.0005, name="elsewhere")
    server = LoopThread("ending-server")
    server.__enter__()
    server.run(proxy.start())

    async def callers() -> list[object]:
        outcomes: list[object] = []
        stop = asyncio.Event()

        async def call(n: int) -> None:
            while not stop.is_set():
                try:
                    outcomes.append(await proxy.inference(n))
                except asyncio.CancelledError:
                    task = asyncio.current_task()
                    assert task is not None
                    outcomes.append(("CancelledError", task.cancelling()))
                    if task.cancelling():
                        raise
                except Exception as exc:
                    outcomes.append(exc)

        tasks = [asyncio.create_task(call(n)) for n in range(32)]
        await asyncio.sleep(0.1)
        await asyncio.to_thread(server.__exit__)  # the serving loop ends under the calls
        await asyncio.sleep(0.1)  # the callers go on: the proxy moves to this loop
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 15)
        await proxy.aclose()
        return outcomes

    outcomes = asyncio.run(callers())

    def wrong(outcome: object) -> bool:
        if isinstance(outcome, tuple):
            return outcome[0] == "CancelledError"
        return isinstance(outcome, BaseException) and not isinstance(
            outcome, (ProxyClosed, batchproxy.InferenceError)
        )

    assert [o for o in outcomes if wrong(o)] == []
    assert sum(isinstance(o, tuple) and o[0] == "out" for o in outcomes) > 0


def test_a_sync_caller_is_released_when_its_loop_is_closed_without_shutting_down() -> None:
    """A loop closed by hand (no `shutdown_asyncgens()`, its tasks not cancelled) runs no
    hook at its end: a thread blocked on a call there notices the closed loop itself."""
    gate = threading.Event()
    proxy = ThreadRecorder(gate=gate, name="abandoned")
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="closed-by-hand")
    thread.start()
    outcome: list[object] = []

    def call() -> None:
        try:
            outcome.append(proxy.inference_sync(1))
        except BaseException as exc:
            outcome.append(exc)

    try:
        asyncio.run_coroutine_threadsafe(proxy.start(), loop).result(10)
        caller = threading.Thread(target=call)
        caller.start()
        assert proxy.entered.wait(10)  # its batch runs in the model
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()  # by hand: no hook runs, the batch task is left pending
        caller.join(5)
        assert not caller.is_alive()
        (error,) = outcome
        assert isinstance(error, batchproxy.InferenceError)
        assert "event loop serving it ended" in str(error)
    finally:
        gate.set()
    assert proxy.inference_sync(2, timeout=10) == ("out", 2)  # it moves on
    BackgroundLoop.default().close()


class StopsItsLoopWhenCancelled(Recorder):
    """A model that stops its loop when its batch is cancelled: the loop-end hook, which
    cancels the batches still running, is then cut short (as by a stray `loop.stop()`)."""

    @override
    async def _inference(self, items: list[Any]) -> list[Any]:
        try:
            return await super()._inference(items)
        except asyncio.CancelledError:
            asyncio.get_running_loop().stop()
            raise


def test_a_sync_caller_is_released_when_the_loops_end_hook_is_cut_short() -> None:
    """The loop-end hook began (the bridge routes nothing more: callers wait for it to
    finish) but the loop was closed before it finished: its shutdown stopped early
    (`run_until_complete` raised "Event loop stopped before Future completed"). A
    thread that calls then must not wait for that hook for ever: it finds the loop
    closed, and the call moves on (as after any loop closed unannounced)."""
    proxy = StopsItsLoopWhenCancelled(batch_size=1, delay=3600, name="cut-short")
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="cut-short-loop")
    thread.start()
    asyncio.run_coroutine_threadsafe(proxy.start(), loop).result(10)
    stuck = proxy.submit(0)  # its batch runs: the hook cancels it, and the loop stops
    wait_for(lambda: proxy.stats.in_flight == 1)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    with pytest.raises(RuntimeError, match="stopped before Future completed"):
        loop.run_until_complete(loop.shutdown_asyncgens())
    loop.close()
    assert isinstance(stuck.exception(0), batchproxy.InferenceError)  # the hook settled it
    proxy.delay = 0  # the next loop's batches answer at once
    outcome: list[object] = []

    def call() -> None:
        try:
            outcome.append(proxy.inference_sync(1, timeout=30))
        except BaseException as exc:
            outcome.append(exc)

    caller = threading.Thread(target=call, daemon=True)
    try:
        caller.start()
        caller.join(10)
        assert not caller.is_alive(), "the caller waits for a hook that will never finish"
        assert outcome == [("out", 1)]  # it moved on to the default loop
    finally:
        BackgroundLoop.default().close()


# -- the event loop the suite runs on (`--loop`, tests/conftest.py) ------------------------------


def loop_kind(loop: asyncio.AbstractEventLoop) -> str:
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"


async def test_async_tests_run_on_the_loop_asked_for(request: pytest.FixtureRequest) -> None:
    assert loop_kind(asyncio.get_running_loop()) == request.config.getoption("loop")


def test_asyncio_run_and_background_loops_run_on_the_loop_asked_for(
    request: pytest.FixtureRequest,
) -> None:
    async def running() -> asyncio.AbstractEventLoop:
        return asyncio.get_running_loop()

    wanted = request.config.getoption("loop")
    assert loop_kind(asyncio.run(running())) == wanted
    with BackgroundLoop("which-loop") as background:
        assert loop_kind(background.run(running(), timeout=10)) == wanted
