"""`with proxy:` from plain code (issue 40, item 1): every callable kind started on the
process's `with` loop, its calls from any thread inside, drained on exit; refused in
a thread running an event loop. (`RemoteProxy`'s: tests/host/test_remote_sync_with.py.)"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from _support import LoopThread, ThreadRecorder, blocked_in, wait_for
from typing_extensions import override

import batchproxy
from batchproxy import DeadlineExceeded, DrainDeadline, ProxyClosed
from batchproxy._loops import sync_scope
from batchproxy.tensors import Collated

WITH_THREAD = "batchproxy-with"


def threads() -> set[threading.Thread]:
    return {thread for thread in threading.enumerate() if thread.is_alive()}


@pytest.fixture
def no_thread_left() -> Iterator[None]:
    """Fail the test if a thread it started is still running after it."""
    before = threads()
    yield
    end = time.monotonic() + 10
    while threads() - before and time.monotonic() < end:
        time.sleep(0.005)  # (a worker thread given up on by a forced stop ends on its own)
    assert threads() - before == set()


# -- the kinds ----------------------------------------------------------------------------


class Doubler(batchproxy.TensorProxy[Any, Any]):
    """A `TensorProxy`: each item's values doubled (a plain `def`: the worker thread)."""

    @override
    def _forward(self, batch: Collated, /) -> Any:
        return batch.data * 2


@dataclass
class Kind:
    """One callable kind: how to make it and call it, and what a call answers."""

    make: Callable[[], Any]
    call: dict[str, Any]  # the function's own arguments (`@batch_args`)
    item: Callable[[int], Any]
    plain: Callable[[Any], Any]  # a result, comparable

    def expect(self, n: int) -> Any:
        if self.make is tensor:
            return [2 * n] * (n % 3 + 1)
        return ("out", n, *self.call.values())

    def proxy(self, front: Any) -> batchproxy.Proxy[Any, Any]:
        return front if isinstance(front, batchproxy.Proxy) else front.proxy


def plain() -> Any:
    return ThreadRecorder(batch_size=8, max_delay_ms=1.0)


def tensor() -> Any:
    return Doubler(batch_size=8, max_delay_ms=1.0)


def decorated() -> Any:
    @batchproxy.batch(batch_size=8, max_delay_ms=1.0)
    async def f(items: list[int]) -> list[Any]:
        await asyncio.sleep(0.001)
        return [("out", item) for item in items]

    return f


def with_arguments() -> Any:
    @batchproxy.batch_args(batch_size=8, max_delay_ms=1.0)
    def f(items: list[int], /, *, tag: str = "") -> list[Any]:
        return [("out", item, tag) for item in items]

    return f


def same(result: Any) -> Any:
    return result


KINDS = {
    "proxy": Kind(plain, {}, lambda n: n, same),
    "tensor": Kind(tensor, {}, lambda n: np.full(n % 3 + 1, n), lambda r: r.tolist()),
    "batch": Kind(decorated, {}, lambda n: n, same),
    "batch_args": Kind(with_arguments, {"tag": "t"}, lambda n: n, same),
}


@pytest.fixture(params=list(KINDS))
def kind(request: pytest.FixtureRequest, no_thread_left: None) -> Kind:
    return KINDS[request.param]


# -- the call forms inside, each kind ---------------------------------------------------


def test_inference_sync_from_the_thread_that_entered(kind: Kind) -> None:
    with kind.make() as front:
        assert {t.name for t in threads()} >= {WITH_THREAD}
        assert kind.plain(front.inference_sync(kind.item(3), **kind.call)) == kind.expect(3)
    assert front.closed
    assert kind.proxy(front).stats.items == 1


def test_inference_sync_from_four_threads_at_once(kind: Kind) -> None:
    results: dict[int, Any] = {}
    start = threading.Barrier(4)

    def caller(n: int) -> None:
        start.wait(10)
        for k in range(5):
            results[5 * n + k] = kind.plain(front.inference_sync(kind.item(5 * n + k), **kind.call))

    with kind.make() as front:
        callers = [threading.Thread(target=caller, args=(n,)) for n in range(4)]
        for thread in callers:
            thread.start()
        for thread in callers:
            thread.join(30)
    assert results == {n: kind.expect(n) for n in range(20)}
    stats = kind.proxy(front).stats
    assert (stats.requests, stats.items, stats.errors) == (20, 20, 0)


def test_submit_futures_are_drained_on_exit(kind: Kind) -> None:
    with kind.make() as front:
        futures = [front.submit(kind.item(n), **kind.call) for n in range(10)]
    # (the exit drained them: each has its result, nobody waited before)
    assert all(future.done() for future in futures)
    assert [kind.plain(future.result()) for future in futures] == [
        kind.expect(n) for n in range(10)
    ]


def test_inference_many_sync_from_threads(kind: Kind) -> None:
    results: dict[int, list[Any]] = {}

    def caller(n: int) -> None:
        items = [kind.item(n * 4 + k) for k in range(4)]
        results[n] = [kind.plain(r) for r in front.inference_many_sync(items, **kind.call)]

    with kind.make() as front:
        assert front.inference_many_sync([], **kind.call) == []
        callers = [threading.Thread(target=caller, args=(n,)) for n in range(3)]
        for thread in callers:
            thread.start()
        for thread in callers:
            thread.join(30)
        caller(3)  # and from the thread that entered
    assert results == {n: [kind.expect(n * 4 + k) for k in range(4)] for n in range(4)}


def test_an_exception_in_the_body_drains_then_propagates(kind: Kind) -> None:
    front = kind.make()
    futures = []

    def body() -> None:
        with front:
            futures.append(front.submit(kind.item(1), **kind.call))
            raise ValueError("body")

    with pytest.raises(ValueError, match="body"):
        body()
    [future] = futures
    assert front.closed
    assert kind.plain(future.result(0)) == kind.expect(1)


def test_calls_after_the_exit_are_refused_without_a_thread(kind: Kind) -> None:
    with kind.make() as front:
        pass
    with pytest.raises(ProxyClosed):
        front.inference_sync(kind.item(1), **kind.call)
    with pytest.raises(ProxyClosed):
        front.submit(kind.item(1), **kind.call).result(0)
    with pytest.raises(ProxyClosed):
        front.inference_many_sync([kind.item(1)], **kind.call)
    with pytest.raises(ProxyClosed), front:  # entered again: closed, as `async with` says
        pass
    assert WITH_THREAD not in {t.name for t in threads()}


# -- the drain, the loop and its thread -------------------------------------------------


def test_the_exit_waits_for_a_call_in_flight_from_another_thread(no_thread_left: None) -> None:
    gate = threading.Event()
    proxy = ThreadRecorder(gate=gate, batch_size=1)
    with proxy:
        running = proxy.submit("running")
        assert proxy.entered.wait(10)
        queued = proxy.submit("queued")
        wait_for(lambda: proxy.stats.queue_depth == 1)
        # the gate opens once the exit has begun its drain (new calls are refused then)
        opener = threading.Thread(target=lambda: (wait_for(lambda: proxy.closed), gate.set()))
        opener.start()
    opener.join(10)
    assert (running.result(0), queued.result(0)) == (("out", "running"), ("out", "queued"))
    with pytest.raises(ProxyClosed):
        proxy.inference_sync("late")


def test_a_thread_calling_while_the_exit_drains_gets_one_outcome_each(
    no_thread_left: None,
) -> None:
    proxy = ThreadRecorder(batch_size=4)
    outcomes: dict[int, list[Any]] = {i: [] for i in range(4)}

    def caller(i: int) -> None:
        n = 0
        while True:  # until the drain refuses it
            try:
                outcomes[i].append(proxy.inference_sync((i, n)))
            except ProxyClosed as exc:
                outcomes[i].append(exc)
                return
            n += 1

    with proxy:
        callers = [threading.Thread(target=caller, args=(i,)) for i in range(4)]
        for thread in callers:
            thread.start()
        wait_for(lambda: proxy.stats.items >= 20)
    for thread in callers:
        thread.join(30)
    answered = 0
    for i, seen in outcomes.items():  # each call one outcome: its own result, or refused last
        assert isinstance(seen[-1], ProxyClosed)
        assert seen[:-1] == [("out", (i, n)) for n in range(len(seen) - 1)]
        answered += len(seen) - 1
    assert proxy.stats.items == answered


def test_no_thread_is_left_and_one_loop_serves_nested_blocks(no_thread_left: None) -> None:
    a, b = ThreadRecorder(batch_size=4), ThreadRecorder(batch_size=4)
    with a, b:
        names = [t.name for t in threads()]
        assert names.count(WITH_THREAD) == 1  # both on the one `with` loop
        assert a._binder.current is not None
        assert b._binder.current is not None
        assert a._binder.current.loop is b._binder.current.loop
        assert (a.inference_sync(1), b.inference_sync(2)) == (("out", 1), ("out", 2))
    assert a.closed
    assert b.closed


def test_the_loop_runs_until_the_last_block_in_any_thread_leaves(no_thread_left: None) -> None:
    first, second = ThreadRecorder(batch_size=4), ThreadRecorder(batch_size=4)
    entered, leave = threading.Event(), threading.Event()

    def other() -> None:
        with second:
            entered.set()
            assert leave.wait(30)
            assert second.inference_sync("late") == ("out", "late")

    thread = threading.Thread(target=other)
    with first:
        thread.start()
        assert entered.wait(10)
    assert first.closed
    assert not second.closed
    assert WITH_THREAD in {t.name for t in threads()}  # still held by the other block
    leave.set()
    thread.join(30)
    assert second.closed


def test_the_same_proxy_entered_twice_closes_at_the_inner_exit(no_thread_left: None) -> None:
    proxy = ThreadRecorder(batch_size=4)
    with proxy:
        with proxy:
            assert proxy.inference_sync(1) == ("out", 1)
        assert proxy.closed  # as with `async with` twice
        with pytest.raises(ProxyClosed):
            proxy.inference_sync(2)
    assert proxy.closed


def test_a_proxy_running_in_another_threads_loop_is_refused(no_thread_left: None) -> None:
    proxy = ThreadRecorder(batch_size=4)
    with LoopThread() as other:
        other.run(proxy.start())
        with pytest.raises(RuntimeError, match="already running in another event loop"), proxy:
            pass
        assert not proxy.closed
        assert proxy.inference_sync(1) == ("out", 1)  # still served there
        other.run(proxy.aclose())
    assert WITH_THREAD not in {t.name for t in threads()}


def test_a_proxy_whose_loop_ended_is_entered_anew(no_thread_left: None) -> None:
    proxy = ThreadRecorder(batch_size=4)

    async def once() -> Any:
        return await proxy.inference(1)

    assert asyncio.run(once()) == ("out", 1)
    with proxy:
        assert proxy.inference_sync(2) == ("out", 2)
    assert proxy.closed


def test_deadlines_dedup_and_keys_inside(no_thread_left: None) -> None:
    gate = threading.Event()
    proxy = ThreadRecorder(gate=gate, batch_size=8, max_delay_ms=5.0, dedup=True)
    with proxy:
        busy = proxy.submit("busy")
        assert proxy.entered.wait(10)
        with pytest.raises(DeadlineExceeded):  # queued behind `busy` past its deadline
            proxy.inference_sync("late", timeout=0.05)
        twins = [proxy.submit("twin") for _ in range(3)]
        keyed = [proxy.submit(n, key=n % 2) for n in range(4)]
        wait_for(lambda: proxy.stats.queue_depth >= 1)
        gate.set()
    assert busy.result(0) == ("out", "busy")
    assert [f.result(0) for f in twins] == [("out", "twin")] * 3
    assert [f.result(0) for f in keyed] == [("out", n) for n in range(4)]
    batches = proxy.batches[1:]
    assert sum(batch.count("twin") for batch in batches) == 1  # one model call for the twins
    for batch in batches:  # a batch holds one key's calls only
        assert len({item % 2 for item in batch if isinstance(item, int)}) <= 1
    assert proxy.stats.timed_out == 1


def test_a_generation_proxy_is_started_and_drained(no_thread_left: None) -> None:
    """Its calls are streams, read on its loop: from a thread, `inference_sync` gets the
    error it gets under `async with`; a stream started on the loop is drained."""

    class Generate(batchproxy.GenerationProxy[int, int]):
        @override
        async def _step(self, step: batchproxy.Step[int]) -> list[Any]:
            return [batchproxy.Last(slot.item * 2) for slot in step.active]

    proxy = Generate(batch_size=4)
    with proxy:
        binding = proxy._binder.current
        assert binding is not None

        async def read() -> list[int]:
            return [chunk async for chunk in proxy.stream(3)]

        chunks = asyncio.run_coroutine_threadsafe(read(), binding.loop)
        with pytest.raises(TypeError, match="streams its results"):
            proxy.inference_sync(1)
    assert chunks.result(0) == [6]
    assert proxy.closed


# -- refused in a running loop ------------------------------------------------------------


@pytest.mark.parametrize("name", list(KINDS))
async def test_with_is_refused_in_a_running_loop_before_anything_starts(name: str) -> None:
    kind = KINDS[name]
    before = threads()
    front = kind.make()
    with pytest.raises(RuntimeError, match=r"running an event loop.*use `async with"), front:
        raise AssertionError("entered")
    assert threads() == before  # no `with` loop, no worker thread
    proxy = kind.proxy(front)
    assert proxy._binder.current is None
    assert not proxy.closed
    async with front:  # the way it says
        assert kind.plain(await front.inference(kind.item(2), **kind.call)) == kind.expect(2)
    assert threads() == before


def test_with_is_refused_on_the_with_loops_own_thread(no_thread_left: None) -> None:
    """A model on the `with` loop entering another proxy: a thread running a loop."""
    inner = ThreadRecorder(batch_size=1)

    class Enters(batchproxy.Proxy[int, Any]):
        @override
        async def _inference(self, items: list[int]) -> list[Any]:
            try:
                with inner:
                    pass
            except RuntimeError as exc:
                return [exc for _ in items]
            return ["entered" for _ in items]

    with Enters(batch_size=1) as outer, pytest.raises(RuntimeError, match="async with"):
        outer.inference_sync(1)
    assert not inner.closed
    assert inner._binder.current is None


# -- interrupted --------------------------------------------------------------------------


def test_keyboard_interrupt_in_the_body_drains_then_propagates(no_thread_left: None) -> None:
    proxy = ThreadRecorder(batch_size=4)
    futures = []

    def body() -> None:
        with proxy:
            futures.append(proxy.submit(1))
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        body()
    [future] = futures
    assert future.result(0) == ("out", 1)
    assert proxy.closed


@pytest.mark.usefixtures("python_sigint")
def test_an_interrupted_drain_stops_at_once(no_thread_left: None) -> None:
    """Ctrl-C while the exit waits for the drain: what is left gets `DrainDeadline`."""
    assert threading.current_thread() is threading.main_thread()
    gate = threading.Event()
    proxy = ThreadRecorder(gate=gate, batch_size=1)
    failed: list[BaseException] = []

    def interrupt_once_draining() -> None:
        main = threading.main_thread().ident or 0
        try:
            wait_for(lambda: proxy.closed and blocked_in(main, sync_scope._drain.__code__))
        except BaseException as exc:
            failed.append(exc)
            gate.set()
        else:
            signal.pthread_kill(main, signal.SIGINT)

    interrupter = threading.Thread(target=interrupt_once_draining)
    futures = []

    def body() -> None:
        with proxy:
            futures.append(proxy.submit("running"))
            assert proxy.entered.wait(10)
            futures.append(proxy.submit("queued"))
            wait_for(lambda: proxy.stats.queue_depth == 1)
            interrupter.start()

    try:
        with pytest.raises(KeyboardInterrupt):
            body()
        assert failed == []
        running, queued = futures
        with pytest.raises(DrainDeadline) as queued_error:
            queued.result(0)
        assert not queued_error.value.running
        with pytest.raises(DrainDeadline) as running_error:
            running.result(0)
        assert running_error.value.running
    finally:
        gate.set()
        interrupter.join(10)
    assert proxy.closed


# -- misuse, and inference_many_sync's own checks ------------------------------------------


def test_a_proxy_that_forgot_super_init_says_so_and_leaves_no_thread(
    no_thread_left: None,
) -> None:
    class Forgot(batchproxy.Proxy[int, int]):
        def __init__(self) -> None:
            pass

        @override
        async def _inference(self, items: list[int]) -> list[int]:
            return items

    with pytest.raises(RuntimeError, match=r"must call super\(\).__init__\(\)"), Forgot():
        raise AssertionError("entered")


def test_a_batched_method_is_entered_on_an_instance(no_thread_left: None) -> None:
    class Model:
        @batchproxy.batch(batch_size=4)
        async def double(self, items: list[int]) -> list[int]:
            return [2 * item for item in items]

    with pytest.raises(TypeError, match="use it on an instance"), Model.double:
        raise AssertionError("entered")
    model = Model()
    with model.double:
        assert model.double.inference_sync(2) == 4
    assert model.double.closed


def test_inference_many_sync_checks_its_arguments_and_returns_exceptions(
    no_thread_left: None,
) -> None:
    def respond(items: list[Any]) -> list[Any]:
        return [ValueError(item) if item == "bad" else ("out", item) for item in items]

    class Units(batchproxy.Proxy[str, str]):
        @override
        async def _inference(self, items: list[str], /, *, unit: str = "") -> list[str]:
            return [item + unit for item in items]

    proxy = ThreadRecorder(respond, batch_size=8)
    units = Units(batch_size=8)
    gate = threading.Event()
    slow = ThreadRecorder(gate=gate, batch_size=1)
    with proxy, units, slow:
        with pytest.raises(TypeError, match="iterable of items"):
            proxy.inference_many_sync("ab")
        with pytest.raises(TypeError, match=r"inference_many_sync\(\).*did you mean `timeout`"):
            proxy.inference_many_sync([1], timeot=1)  # type: ignore[call-overload]
        with pytest.raises(ValueError, match="bad"):
            proxy.inference_many_sync(["a", "bad"])
        results = proxy.inference_many_sync(["a", "bad", "c"], return_exceptions=True)
        assert results[0] == ("out", "a")
        assert isinstance(results[1], ValueError)
        assert results[2] == ("out", "c")
        assert units.with_args(unit="m").inference_many_sync(["1", "2"]) == ["1m", "2m"]
        busy = slow.submit(0)
        assert slow.entered.wait(10)
        with pytest.raises(DeadlineExceeded):  # queued behind `busy` past its deadline
            slow.inference_many_sync([1, 2], timeout=0.05)
        gate.set()
    assert busy.result(0) == ("out", 0)
    assert slow.stats.timed_out == 2
