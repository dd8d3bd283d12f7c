"""`proxy.configure(...)`: limits changed at runtime, from the next batch, validated
like the constructor, from any thread."""

from __future__ import annotations

import asyncio
import threading

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
        assert (proxy._batch_size, proxy._max_concurrent) == (3, 1)


def test_unknown_limits_are_refused() -> None:
    proxy = Recorder()
    with pytest.raises(TypeError):
        proxy.configure(timeout=3)  # type: ignore[call-arg]


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
