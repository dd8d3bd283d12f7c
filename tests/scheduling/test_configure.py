"""`proxy.configure(...)`: limits and policies changed at runtime, from the next batch
(or call), validated like the constructor, from any thread."""

from __future__ import annotations

import asyncio
import threading
from typing import Literal

import pytest
from _support import LoopThread, Recorder

import batchproxy


async def queue_behind_a_busy_model(proxy: Recorder, count: int) -> list[asyncio.Task[object]]:
    """One request running (the model takes 1 s), `count` more queued behind it."""
    tasks = [asyncio.create_task(proxy.inference("first"))]
    await asyncio.sleep(0.01)
    tasks += [asyncio.create_task(proxy.inference(i)) for i in range(count)]
    await asyncio.sleep(0)
    return tasks


@pytest.mark.looptime
async def test_batch_size_applies_from_the_next_batch() -> None:
    async with Recorder(batch_size=8, max_delay_ms=1, delay=1.0) as proxy:
        tasks = await queue_behind_a_busy_model(proxy, 6)
        proxy.configure(batch_size=2)
        await asyncio.gather(*tasks)
        assert [len(b) for b in proxy.batches] == [1, 2, 2, 2]


@pytest.mark.looptime
async def test_a_new_batch_slot_is_filled_at_once() -> None:
    loop = asyncio.get_running_loop()
    async with Recorder(batch_size=4, max_delay_ms=1, delay=1.0) as proxy:
        tasks = await queue_behind_a_busy_model(proxy, 4)
        changed_at = loop.time()
        proxy.configure(max_concurrent_batches=2)
        await asyncio.sleep(0.001)
        assert proxy.stats.in_flight == 2  # the queued four did not wait for the first
        assert proxy.started_at[1] == pytest.approx(changed_at)
        await asyncio.gather(*tasks)


@pytest.mark.looptime
async def test_a_shorter_delay_window_sends_a_waiting_batch_sooner() -> None:
    loop = asyncio.get_running_loop()
    options = {"batch_size": 64, "max_concurrent_batches": 2, "delay": 1.0}
    async with Recorder(max_delay_ms=10_000, **options) as proxy:
        first = asyncio.create_task(proxy.inference("first"))
        await asyncio.sleep(0.001)
        waiting = [asyncio.create_task(proxy.inference(i)) for i in range(3)]
        await asyncio.sleep(0.001)
        waiting.append(asyncio.create_task(proxy.inference(3)))  # overlapping: waits
        await asyncio.sleep(0.001)
        assert proxy.stats.queue_depth == 4
        start = loop.time()
        proxy.configure(max_delay_ms=0)
        await asyncio.gather(first, *waiting)
        assert proxy.started_at[1] - start < 0.01  # not the 10 s window


@pytest.mark.looptime
async def test_max_queue_size_can_be_lowered_and_removed() -> None:
    async with Recorder(batch_size=1, max_delay_ms=1, delay=1.0) as proxy:
        tasks = await queue_behind_a_busy_model(proxy, 3)
        proxy.configure(max_queue_size=3)
        with pytest.raises(batchproxy.QueueFull):
            await proxy.inference("refused")
        proxy.configure(max_queue_size=None)
        tasks.append(asyncio.create_task(proxy.inference("accepted")))
        results = await asyncio.gather(*tasks)
        assert results[-1] == ("out", "accepted")
        assert proxy.stats.rejected == 1


@pytest.mark.parametrize(
    ("limits", "error"),
    [
        ({"batch_size": 0}, ValueError),
        ({"batch_size": 2.5}, TypeError),
        ({"max_delay_ms": -1}, ValueError),
        ({"max_delay_ms": float("nan")}, ValueError),
        ({"max_concurrent_batches": 0}, ValueError),
        ({"max_queue_size": 0}, ValueError),
        ({"max_queue_size": "10"}, TypeError),
        ({"timeout": 0}, ValueError),
        ({"window": "slow"}, ValueError),
        ({"aging_ms": 0}, ValueError),
        ({"shed_late": 1}, TypeError),
        ({"isolate_errors": "yes"}, TypeError),
        ({"batch_timeout": -1.0}, ValueError),
    ],
)
async def test_a_bad_value_is_refused_and_changes_nothing(limits: dict, error: type) -> None:
    name = next(iter(limits))
    valid = {"max_concurrent_batches": 4} if name == "batch_size" else {"batch_size": 5}
    async with Recorder(batch_size=3, max_delay_ms=1) as proxy:
        with pytest.raises(error, match=name):
            proxy.configure(**valid, **limits)
        await asyncio.gather(*(proxy.inference(i) for i in range(6)))
        assert max(len(b) for b in proxy.batches) == 3  # the valid change was not applied
        assert (proxy.options.batch_size, proxy.stats.max_in_flight) == (3, 1)


def test_unknown_options_and_construction_only_ones_are_refused() -> None:
    proxy = Recorder()
    with pytest.raises(TypeError):
        proxy.configure(length=len)  # type: ignore[call-arg]  # chosen at construction
    with pytest.raises(TypeError):
        proxy.configure(max_delay=3)  # type: ignore[call-arg]


@pytest.mark.looptime
async def test_a_new_default_timeout_applies_to_calls_made_after_it() -> None:
    loop = asyncio.get_running_loop()
    async with Recorder(batch_size=1, delay=1.0) as proxy:
        before = asyncio.create_task(proxy.inference("before"))  # no deadline
        await asyncio.sleep(0)
        proxy.configure(timeout=0.5)
        start = loop.time()
        with pytest.raises(batchproxy.DeadlineExceeded):
            await proxy.inference("after")  # queued behind "before": out of time
        assert loop.time() - start == pytest.approx(0.5)
        assert await before == ("out", "before")
        proxy.configure(timeout=None)
        assert await proxy.inference("again") == ("out", "again")


@pytest.mark.parametrize(
    ("built_with", "configured", "wait"),
    [("adaptive", "fixed", 0.050), ("fixed", "adaptive", 0.002)],
)
@pytest.mark.looptime
async def test_the_window_policy_can_be_switched(
    built_with: Literal["adaptive", "fixed"], configured: Literal["adaptive", "fixed"], wait: float
) -> None:
    """With a second slot free, an arrival that overlaps a running batch waits out the
    whole 50 ms window under `fixed`, and under `adaptive` only until company stops
    coming (two gaps of 1 ms, the only gap seen)."""
    options = {"batch_size": 64, "max_concurrent_batches": 2, "delay": 1.0}
    async with Recorder(max_delay_ms=50, window=built_with, **options) as proxy:
        proxy.configure(window=configured)
        first = asyncio.create_task(proxy.inference("first"))  # idle: goes at once
        await asyncio.sleep(0.001)
        arrived = asyncio.get_running_loop().time()
        second = asyncio.create_task(proxy.inference("second"))
        await asyncio.gather(first, second)
        assert proxy.started_at[1] - arrived == pytest.approx(wait, abs=1e-6)


@pytest.mark.parametrize(("aging_ms", "order"), [(None, ["high", "low"]), (100, ["low", "high"])])
@pytest.mark.looptime
async def test_aging_can_be_turned_on_for_requests_already_queued(
    aging_ms: float | None, order: list[str]
) -> None:
    """A low-priority request queued 0.9 s before a request 5 levels higher: strict
    priority serves the high one first; aging at 100 ms per level, the old one."""
    async with Recorder(batch_size=1, delay=1.0) as proxy:
        first = asyncio.create_task(proxy.inference("first"))
        await asyncio.sleep(0.01)
        low = asyncio.create_task(proxy.inference("low", priority=0))
        await asyncio.sleep(0.89)
        high = asyncio.create_task(proxy.inference("high", priority=5))
        await asyncio.sleep(0)
        proxy.configure(aging_ms=aging_ms)
        await asyncio.gather(first, low, high)
        assert proxy.batches == [["first"]] + [[name] for name in order]


@pytest.mark.looptime
async def test_shedding_can_be_turned_on() -> None:
    async with Recorder(batch_size=1, delay=1.0) as proxy:
        for i in range(5):  # the cost model learns that a batch takes 1 s
            await proxy.inference(i)
        busy = asyncio.create_task(proxy.inference("busy"))
        await asyncio.sleep(0)
        proxy.configure(shed_late=True)
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(batchproxy.DeadlineExceeded):
            await proxy.inference("hopeless", timeout=0.5)
        assert loop.time() == start  # refused at once, not after waiting 0.5 s
        assert proxy.stats.shed == 1
        await busy
        proxy.configure(shed_late=False)
        with pytest.raises(batchproxy.DeadlineExceeded):
            await proxy.inference("slow", timeout=0.5)  # waits, then times out
        assert proxy.stats.shed == 1


def _fails_on_bad(items: list[object]) -> list[object]:
    if "bad" in items:
        raise ValueError("bad item")
    return [("out", item) for item in items]


@pytest.mark.looptime
async def test_error_isolation_can_be_turned_on() -> None:
    async with Recorder(_fails_on_bad, batch_size=4) as proxy:
        outcomes = await asyncio.gather(
            proxy.inference("a"), proxy.inference("bad"), return_exceptions=True
        )
        assert all(isinstance(o, ValueError) for o in outcomes)  # the whole batch failed
        proxy.configure(isolate_errors=True)
        a, bad = await asyncio.gather(
            proxy.inference("a"), proxy.inference("bad"), return_exceptions=True
        )
        assert a == ("out", "a")
        assert isinstance(bad, ValueError)
        assert proxy.stats.isolation_splits >= 1


def test_a_streaming_proxy_refuses_error_isolation() -> None:
    class Streams(batchproxy.Proxy[int, int]):
        async def _inference(self, items: list[int]):  # type: ignore[no-untyped-def,override]
            yield items

    proxy = Streams()
    with pytest.raises(TypeError, match="isolate_errors reruns parts of a batch"):
        proxy.configure(isolate_errors=True, batch_size=2)
    assert proxy.options.batch_size == 64  # nothing applied


@pytest.mark.looptime
async def test_the_watchdog_can_be_set_and_told_to_stop_intake() -> None:
    async with Recorder(batch_size=1, delay=1.0) as proxy:
        assert await proxy.inference("slow but unwatched") == ("out", "slow but unwatched")
        proxy.configure(batch_timeout=0.5)
        with pytest.raises(batchproxy.BatchTimeout):
            await proxy.inference("overruns")
        assert not proxy.closed  # "serve": it goes on
        proxy.configure(batch_timeout=batchproxy.Watchdog(0.5, on_timeout="stop"))
        with pytest.raises(batchproxy.BatchTimeout):
            await proxy.inference("overruns again")
        assert proxy.closed
        with pytest.raises(batchproxy.ProxyClosed):
            await proxy.inference("refused")


def test_configured_before_the_first_call_applies_when_it_starts() -> None:
    proxy = Recorder(batch_size=8, delay=0.0)
    proxy.configure(batch_size=2)

    async def burst() -> None:
        await asyncio.gather(*(proxy.inference(i) for i in range(6)))
        await proxy.aclose()

    asyncio.run(burst())
    assert [len(b) for b in proxy.batches] == [2, 2, 2]


def test_configure_from_another_thread_reaches_the_running_proxy() -> None:
    with LoopThread() as other:
        proxy = Recorder(batch_size=8, max_delay_ms=1, delay=0.2)
        other.run(proxy.start())
        first = proxy.submit("first")
        assert threading.current_thread() is not other.thread
        proxy.configure(batch_size=1)  # from this thread, not the proxy's loop thread
        rest = [proxy.submit(i) for i in range(3)]
        assert [f.result(10) for f in [first, *rest]] == [
            ("out", "first"),
            ("out", 0),
            ("out", 1),
            ("out", 2),
        ]
        assert max(len(b) for b in proxy.batches) == 1
        other.run(proxy.aclose())


async def test_the_decorator_forwards_configure() -> None:
    seen: list[int] = []

    @batchproxy.batch(batch_size=8, max_delay_ms=1)
    async def double(items: list[int]) -> list[int]:
        seen.append(len(items))
        return [2 * i for i in items]

    double.configure(batch_size=2)
    assert await asyncio.gather(*(double(i) for i in range(4))) == [0, 2, 4, 6]
    assert seen == [2, 2]
    await double.aclose()
