"""`stream_sync`: a stream read from a plain thread (inside `with proxy:`, or through
the default `BackgroundLoop`), each chunk read on the proxy's loop; closing it early,
or its deadline, withdraws the call as closing the async stream does."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
from _host_models import Counting
from _support import wait_for
from typing_extensions import override

import batchproxy
from batchproxy import GenerationProxy, Last, Step


@pytest.fixture
def no_thread_left() -> Iterator[None]:
    before = set(threading.enumerate())
    yield
    wait_for(lambda: not set(threading.enumerate()) - before, 10)


class Countdown(GenerationProxy[int, int]):
    """Each item `n` streams n, n-1, ..., 1, one chunk per step, slots joining as
    others leave."""

    @override
    def _step(self, step: Step[int]) -> Sequence[Any]:
        out: list[Any] = []
        for slot in step.active:
            told = slot.state = slot.item if slot.state is None else slot.state - 1
            out.append(Last(told) if told == 1 else told)
        return out


def in_threads(calls: dict[int, Callable[[], Any]]) -> dict[int, Any]:
    """Each call in a plain thread of its own, at once: its result or its exception."""
    results: dict[int, Any] = {}

    def run(n: int) -> None:
        try:
            results[n] = calls[n]()
        except Exception as exc:
            results[n] = exc

    threads = [threading.Thread(target=run, args=(n,)) for n in calls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return results


@pytest.mark.usefixtures("no_thread_left")
def test_each_thread_reads_its_own_stream_in_order() -> None:
    proxy = Counting()
    with proxy:
        got = in_threads({n: lambda n=n: list(proxy.stream_sync(n)) for n in range(1, 6)})
    assert got == {n: [(n, step) for step in range(n)] for n in range(1, 6)}
    assert proxy.closed


@pytest.mark.usefixtures("no_thread_left")
def test_a_generation_proxy_inside_with_streams_to_plain_threads() -> None:
    proxy = Countdown(batch_size=2)  # 2 slots: 5 streams take turns
    with proxy:
        got = in_threads({n: lambda n=n: list(proxy.stream_sync(n)) for n in range(1, 6)})
        with pytest.raises(TypeError, match="streams its results"):
            proxy.inference_sync(1)  # (its calls are streams)
    assert got == {n: list(range(n, 0, -1)) for n in range(1, 6)}


@pytest.mark.usefixtures("no_thread_left")
def test_closing_it_early_withdraws_the_call() -> None:
    proxy = Counting()
    with proxy:
        with contextlib.closing(proxy.stream_sync(10**6)) as chunks:
            assert next(chunks) == (10**6, 0)
            assert next(chunks) == (10**6, 1)
        wait_for(lambda: proxy.stats.cancelled == 1)
        steps = proxy.steps_run
        time.sleep(0.05)
        assert proxy.steps_run <= steps + 1  # it stopped, not a million steps
        assert list(proxy.stream_sync(2)) == [(2, 0), (2, 1)]  # it still serves


@pytest.mark.usefixtures("no_thread_left")
def test_its_timeout_bounds_the_whole_stream_and_errors_arrive_in_order() -> None:
    proxy = Counting(stream_buffer=10**7)  # (the model runs ahead of a chunk per round trip)
    with proxy:
        chunks: list[Any] = []
        with pytest.raises(batchproxy.DeadlineExceeded):
            chunks.extend(proxy.stream_sync(10**9, timeout=0.05))
        assert chunks[:2] == [(10**9, 0), (10**9, 1)]
        wait_for(lambda: proxy.stats.timed_out == 1)
        chunks.clear()
        with pytest.raises(ValueError, match="refused 'boom' at step 1"):
            chunks.extend(proxy.stream_sync("boom"))
        assert chunks == [("boom", 0)]
        with pytest.raises(TypeError, match="unexpected keyword"):
            proxy.stream_sync(1, timeuot=1)  # type: ignore[call-arg]  # checked here


@pytest.mark.usefixtures("no_thread_left")
def test_a_function_that_does_not_stream_yields_its_one_result() -> None:
    @batchproxy.batch(batch_size=8, max_delay_ms=1.0)
    async def f(items: list[int]) -> list[Any]:
        return [("out", item) for item in items]

    @batchproxy.batch_args(batch_size=8, max_delay_ms=1.0)
    def g(items: list[int], /, *, tag: str = "") -> list[Any]:
        return [("out", item, tag) for item in items]

    with f, g:
        assert list(f.stream_sync(3)) == [("out", 3)]
        assert list(g.stream_sync(3, tag="t")) == [("out", 3, "t")]


@pytest.mark.usefixtures("no_thread_left")
def test_a_generator_function_streams_from_a_plain_thread() -> None:
    @batchproxy.batch(batch_size=8, max_delay_ms=1.0)
    async def letters(items: list[str]) -> Any:
        for i in range(3):
            yield [f"{item}{i}" if i < 2 else Last(f"{item}{i}") for item in items]

    with letters:
        got = in_threads({n: lambda n=n: list(letters.stream_sync(str(n))) for n in range(4)})
    assert got == {n: [f"{n}0", f"{n}1", f"{n}2"] for n in range(4)}
