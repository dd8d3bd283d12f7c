"""`proxy.stats` snapshots, percentiles on a virtual clock, bounded windows, listener hooks."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import pytest
from _support import RaisingListener, Recorder, assert_settled

import batchproxy
from batchproxy import BatchSizeMismatch, DeadlineExceeded, Percentiles, QueueFull
from batchproxy._stats import WINDOW

# -- the snapshot --------------------------------------------------------------------------


async def test_stats_before_any_call_are_zero() -> None:
    proxy = Recorder(name="fresh")
    stats = proxy.stats
    assert stats.name == "fresh"
    counts = (stats.requests, stats.succeeded, stats.errors, stats.timed_out, stats.cancelled)
    assert counts == (0, 0, 0, 0, 0)
    assert (stats.rejected, stats.batches, stats.failed_batches, stats.items) == (0, 0, 0, 0)
    assert (stats.queue_depth, stats.in_flight) == (0, 0)
    assert dict(stats.batch_sizes) == {}
    assert stats.mean_batch_size == 0.0
    assert stats.model_time == Percentiles(0, 0.0, 0.0, 0.0, 0.0)
    assert Recorder().stats.name == "Recorder"
    await proxy.aclose()


@pytest.mark.looptime
async def test_snapshot_is_frozen_and_not_changed_by_later_batches(no_leftovers: None) -> None:
    proxy = Recorder(batch_size=4, delay=0.01)
    await asyncio.wait_for(asyncio.gather(*(proxy.inference(i) for i in range(3))), 10)
    before = proxy.stats
    with pytest.raises(dataclasses.FrozenInstanceError):
        before.requests = 0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        before.model_time.p50 = 1.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        before.batch_sizes[3] = 99  # type: ignore[index]

    await asyncio.wait_for(asyncio.gather(*(proxy.inference(i) for i in range(4))), 10)
    after = proxy.stats
    assert (before.requests, before.batches, before.items) == (3, 1, 3)
    assert dict(before.batch_sizes) == {3: 1}
    assert before.model_time.count == 1
    assert (after.requests, after.batches, after.items) == (7, 2, 7)
    assert dict(after.batch_sizes) == {3: 1, 4: 1}
    assert after.model_time.count == 2
    await proxy.aclose()


@pytest.mark.looptime
async def test_counts_successes_and_the_batch_size_histogram(no_leftovers: None) -> None:
    proxy = Recorder(batch_size=4)
    await asyncio.wait_for(asyncio.gather(*(proxy.inference(i) for i in range(10))), 10)
    stats = proxy.stats
    assert (stats.requests, stats.succeeded, stats.batches, stats.items) == (10, 10, 3, 10)
    assert dict(stats.batch_sizes) == {2: 1, 4: 2}
    assert list(stats.batch_sizes) == [2, 4]
    assert stats.mean_batch_size == pytest.approx(10 / 3)
    assert (stats.errors, stats.failed_batches, stats.rejected) == (0, 0, 0)
    assert_settled(stats)
    await proxy.aclose()


def _picky(items: list[int]) -> list[Any]:
    if 0 in items:
        raise RuntimeError("zero in batch")
    if 99 in items:
        return []  # wrong count
    return [ValueError(item) if item < 0 else item for item in items]


@pytest.mark.looptime
async def test_counts_errors_and_failed_batches(no_leftovers: None) -> None:
    proxy = Recorder(respond=_picky, batch_size=4)

    async def run(*items: int) -> list[Any]:
        calls = (proxy.inference(i) for i in items)
        return await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 10)

    one_bad = await run(1, -1, 2)
    assert isinstance(one_bad[1], ValueError)
    stats = proxy.stats
    assert (stats.succeeded, stats.errors, stats.failed_batches) == (2, 1, 0)

    raised = await run(0, 5)
    assert all(isinstance(r, RuntimeError) for r in raised)
    stats = proxy.stats
    assert (stats.succeeded, stats.errors, stats.failed_batches) == (2, 3, 1)

    mismatched = await run(99)
    assert isinstance(mismatched[0], BatchSizeMismatch)
    stats = proxy.stats
    assert (stats.succeeded, stats.errors, stats.failed_batches) == (2, 4, 2)
    assert (stats.requests, stats.batches, stats.items) == (6, 3, 6)
    assert_settled(stats)
    await proxy.aclose()


@pytest.mark.looptime
async def test_counts_rejected_calls(no_leftovers: None) -> None:
    proxy = Recorder(batch_size=1, delay=1.0, max_queue_size=2)
    accepted = [asyncio.create_task(proxy.inference(0))]
    await asyncio.sleep(0.1)  # 0 is running; the queue is empty again
    accepted += [asyncio.create_task(proxy.inference(i)) for i in (1, 2)]
    await asyncio.sleep(0)
    with pytest.raises(QueueFull):
        await proxy.inference(3)
    with pytest.raises(QueueFull):
        await proxy.inference_many([4, 5])
    assert proxy.stats.rejected == 3
    assert proxy.stats.queue_depth == 2
    await asyncio.wait_for(asyncio.gather(*accepted), 10)
    stats = proxy.stats
    assert (stats.requests, stats.succeeded, stats.rejected) == (3, 3, 3)
    assert_settled(stats)
    await proxy.aclose()


@pytest.mark.looptime
async def test_counts_timed_out_and_cancelled_calls(no_leftovers: None) -> None:
    proxy = Recorder(batch_size=1, delay=1.0)
    running = asyncio.create_task(proxy.inference(0, timeout=0.5))  # expires in its batch
    await asyncio.sleep(0.1)
    expiring = asyncio.create_task(proxy.inference(1, timeout=0.2))  # expires queued
    withdrawn = asyncio.create_task(proxy.inference(2))
    kept = asyncio.create_task(proxy.inference(3))
    await asyncio.sleep(0.1)
    withdrawn.cancel()
    with pytest.raises(DeadlineExceeded):
        await asyncio.wait_for(running, 10)
    with pytest.raises(DeadlineExceeded):
        await asyncio.wait_for(expiring, 10)
    assert await asyncio.wait_for(kept, 10) == ("out", 3)
    assert withdrawn.cancelled()
    stats = proxy.stats
    assert (stats.requests, stats.succeeded, stats.timed_out, stats.cancelled) == (4, 1, 2, 1)
    assert proxy.batches == [[0], [3]]
    assert_settled(stats)
    await proxy.aclose()


@pytest.mark.looptime
async def test_cancelling_a_running_call_counts_it_once(no_leftovers: None) -> None:
    proxy = Recorder(batch_size=2, delay=1.0)
    dropped = asyncio.create_task(proxy.inference(0))
    kept = asyncio.create_task(proxy.inference(1))
    await asyncio.sleep(0.5)
    assert proxy.stats.in_flight == 1
    dropped.cancel()
    assert await asyncio.wait_for(kept, 10) == ("out", 1)
    stats = proxy.stats
    assert (stats.succeeded, stats.cancelled, stats.errors) == (1, 1, 0)
    assert_settled(stats)
    await proxy.aclose()


@pytest.mark.looptime
async def test_queue_depth_and_in_flight_follow_the_batches(no_leftovers: None) -> None:
    proxy = Recorder(batch_size=2, delay=1.0)
    tasks = [asyncio.create_task(proxy.inference(i)) for i in range(5)]
    await asyncio.sleep(0.5)
    assert (proxy.stats.in_flight, proxy.stats.queue_depth) == (1, 3)
    await asyncio.sleep(1.0)
    assert (proxy.stats.in_flight, proxy.stats.queue_depth) == (1, 1)
    await asyncio.sleep(1.0)
    assert (proxy.stats.in_flight, proxy.stats.queue_depth) == (1, 0)
    await asyncio.wait_for(asyncio.gather(*tasks), 10)
    assert (proxy.stats.in_flight, proxy.stats.queue_depth) == (0, 0)
    await proxy.aclose()


@pytest.mark.looptime
async def test_in_flight_counts_concurrent_batches(no_leftovers: None) -> None:
    proxy = Recorder(batch_size=1, delay=1.0, max_concurrent_batches=2)
    tasks = [asyncio.create_task(proxy.inference(i)) for i in range(3)]
    await asyncio.sleep(0.5)
    assert (proxy.stats.in_flight, proxy.stats.queue_depth) == (2, 1)
    await asyncio.wait_for(asyncio.gather(*tasks), 10)
    assert proxy.stats.in_flight == 0
    await proxy.aclose()


# -- latencies -----------------------------------------------------------------------------


@pytest.mark.looptime
async def test_lone_calls_have_exact_model_time_and_no_queue_wait(no_leftovers: None) -> None:
    proxy = Recorder(delay=0.010)
    for i in range(5):
        await asyncio.wait_for(proxy.inference(i), 10)
    stats = proxy.stats
    assert stats.model_time.count == 5
    assert stats.model_time.p50 == pytest.approx(0.010, abs=1e-6)
    assert stats.model_time.p99 == pytest.approx(0.010, abs=1e-6)
    assert stats.queue_wait.max == pytest.approx(0.0, abs=1e-6)
    assert stats.total_latency.p50 == pytest.approx(0.010, abs=1e-6)
    await proxy.aclose()


@pytest.mark.looptime
async def test_percentiles_of_a_queue_on_the_virtual_clock(no_leftovers: None) -> None:
    """Ten calls at once, one per batch, 10 ms each: call i waits i * 10 ms."""
    proxy = Recorder(batch_size=1, delay=0.010)
    await asyncio.wait_for(asyncio.gather(*(proxy.inference(i) for i in range(10))), 10)
    stats = proxy.stats
    close = {"abs": 1e-6}
    assert stats.queue_wait.count == 10
    assert stats.queue_wait.p50 == pytest.approx(0.040, **close)
    assert stats.queue_wait.p90 == pytest.approx(0.080, **close)
    assert stats.queue_wait.p99 == pytest.approx(0.090, **close)
    assert stats.queue_wait.max == pytest.approx(0.090, **close)
    assert stats.model_time.count == 10
    assert stats.model_time.p50 == pytest.approx(0.010, **close)
    assert stats.model_time.max == pytest.approx(0.010, **close)
    assert stats.total_latency.count == 10
    assert stats.total_latency.p50 == pytest.approx(0.050, **close)
    assert stats.total_latency.p90 == pytest.approx(0.090, **close)
    assert stats.total_latency.p99 == pytest.approx(0.100, **close)
    await proxy.aclose()


@pytest.mark.looptime
async def test_latency_windows_keep_only_recent_samples(no_leftovers: None) -> None:
    proxy = Recorder(batch_size=1, delay=1.0)
    await asyncio.wait_for(asyncio.gather(*(proxy.inference(i) for i in range(20))), 100)
    assert proxy.stats.model_time.max == pytest.approx(1.0)
    proxy.delay = 0.0
    calls = (proxy.inference(i) for i in range(WINDOW + 10))
    await asyncio.wait_for(asyncio.gather(*calls), 100)
    stats = proxy.stats
    assert stats.requests == WINDOW + 30
    assert stats.batches == WINDOW + 30
    assert stats.queue_wait.count == WINDOW
    assert stats.model_time.count == WINDOW
    assert stats.total_latency.count == WINDOW
    assert stats.model_time.max == 0.0  # the slow early batches have left the window
    assert stats.total_latency.max == 0.0
    await proxy.aclose()


def test_percentiles_of_nothing_are_zero() -> None:
    assert Percentiles.of([]) == Percentiles(count=0, p50=0.0, p90=0.0, p99=0.0, max=0.0)


def test_percentiles_of_known_samples() -> None:
    hundred = [float(n) for n in range(100, 0, -1)]  # 100 .. 1, unsorted on purpose
    assert Percentiles.of(hundred) == Percentiles(100, 50.0, 90.0, 99.0, 100.0)
    assert hundred[0] == 100.0  # input left as it was
    ten = [float(n) for n in range(1, 11)]
    assert Percentiles.of(ten) == Percentiles(10, 5.0, 9.0, 10.0, 10.0)
    assert Percentiles.of([0.25]) == Percentiles(1, 0.25, 0.25, 0.25, 0.25)
    assert Percentiles.of([3.0, 1.0]) == Percentiles(2, 1.0, 3.0, 3.0, 3.0)


# -- listeners -----------------------------------------------------------------------------


class Log(batchproxy.Listener):
    """Records every hook call as a tuple."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def request_queued(self, proxy: str, queue_depth: int) -> None:
        self.calls.append(("request_queued", proxy, queue_depth))

    def request_rejected(self, proxy: str, count: int) -> None:
        self.calls.append(("request_rejected", proxy, count))

    def batch_started(self, proxy: str, size: int, queue_waits: Sequence[float]) -> None:
        self.calls.append(("batch_started", proxy, size, list(queue_waits)))

    def batch_finished(
        self, proxy: str, size: int, model_seconds: float, error: BaseException | None
    ) -> None:
        self.calls.append(("batch_finished", proxy, size, round(model_seconds, 6), error))

    def request_finished(self, proxy: str, outcome: str, seconds: float) -> None:
        self.calls.append(("request_finished", proxy, outcome, round(seconds, 6)))

    def error(self, proxy: str, error: BaseException, size: int) -> None:
        self.calls.append(("error", proxy, error, size))

    def batch_timed_out(self, proxy: str, size: int, timeout: float) -> None:
        self.calls.append(("batch_timed_out", proxy, size, timeout))

    def batch_split(self, proxy: str, size: int, reason: str) -> None:
        self.calls.append(("batch_split", proxy, size, reason))


def _slot_or_batch_error(items: list[int]) -> list[Any]:
    if 0 in items:
        raise RuntimeError("batch failed")
    return [ValueError("slot") if item == 2 else item for item in items]


@pytest.mark.looptime
async def test_listener_sees_a_batch_with_a_failed_slot(no_leftovers: None) -> None:
    log = Log()
    proxy = Recorder(respond=_slot_or_batch_error, delay=0.010, batch_size=3, name="lis")
    proxy.add_listener(log)
    calls = (proxy.inference(i) for i in (1, 2, 3))
    await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 10)
    assert log.calls[:4] == [
        ("request_queued", "lis", 1),
        ("request_queued", "lis", 2),
        ("request_queued", "lis", 3),
        ("batch_started", "lis", 3, [0.0, 0.0, 0.0]),
    ]
    assert sorted(log.calls[4:], key=repr) == sorted(
        [
            ("request_finished", "lis", "succeeded", 0.01),
            ("request_finished", "lis", "error", 0.01),
            ("request_finished", "lis", "succeeded", 0.01),
            ("batch_finished", "lis", 3, 0.01, None),
        ],
        key=repr,
    )
    await proxy.aclose()


@pytest.mark.looptime
async def test_listener_sees_a_batch_error(no_leftovers: None) -> None:
    log = Log()
    proxy = Recorder(respond=_slot_or_batch_error, delay=0.010, name="lis")
    proxy.add_listener(log)
    with pytest.raises(RuntimeError, match="batch failed") as raised:
        await asyncio.wait_for(proxy.inference(0), 10)
    error = raised.value
    assert log.calls[0] == ("request_queued", "lis", 1)
    assert log.calls[1] == ("batch_started", "lis", 1, [0.0])
    assert sorted(log.calls[2:], key=repr) == sorted(
        [
            ("request_finished", "lis", "error", 0.01),
            ("error", "lis", error, 1),
            ("batch_finished", "lis", 1, 0.01, error),
        ],
        key=repr,
    )
    await proxy.aclose()


@pytest.mark.looptime
async def test_listener_sees_timeouts_and_cancellations(no_leftovers: None) -> None:
    log = Log()
    proxy = Recorder(batch_size=1, delay=1.0, name="lis")
    proxy.add_listener(log)
    running = asyncio.create_task(proxy.inference(0))
    await asyncio.sleep(0.1)
    expiring = asyncio.create_task(proxy.inference(1, timeout=0.25))
    withdrawn = asyncio.create_task(proxy.inference(2))
    await asyncio.sleep(0.05)
    withdrawn.cancel()
    with pytest.raises(DeadlineExceeded):
        await asyncio.wait_for(expiring, 10)
    await asyncio.wait_for(running, 10)
    finished = [call for call in log.calls if call[0] == "request_finished"]
    assert finished == [
        ("request_finished", "lis", "cancelled", 0.05),
        ("request_finished", "lis", "timed_out", 0.25),
        ("request_finished", "lis", "succeeded", 1.0),
    ]
    await proxy.aclose()


@pytest.mark.looptime
async def test_listener_sees_overruns_and_splits() -> None:
    def respond(items: list[Any]) -> list[Any]:
        if len(items) > 2:
            raise MemoryError
        if 0 in items:
            raise ValueError("bad item")
        return list(items)

    log = Log()
    async with Recorder(respond, oom_backoff=True, isolate_errors=True, name="lis") as proxy:
        proxy.add_listener(log)
        results = await asyncio.wait_for(
            asyncio.gather(*(proxy.inference(i) for i in range(4)), return_exceptions=True), 10
        )
        assert isinstance(results[0], ValueError)
        assert results[1:] == [1, 2, 3]
    assert [call for call in log.calls if call[0] == "batch_split"] == [
        ("batch_split", "lis", 4, "oom"),
        ("batch_split", "lis", 2, "isolation"),
    ]
    log = Log()
    async with Recorder(delay=3.0, batch_timeout=2.0, name="lis") as proxy:
        proxy.add_listener(log)
        with pytest.raises(batchproxy.BatchTimeout):
            await asyncio.gather(proxy.inference(1), proxy.inference(2))
    assert [call for call in log.calls if call[0] == "batch_timed_out"] == [
        ("batch_timed_out", "lis", 2, 2.0)
    ]


@pytest.mark.looptime
@pytest.mark.parametrize("kind", [RuntimeError, asyncio.CancelledError, GeneratorExit])
async def test_raising_listener_is_logged_and_harmless(
    no_leftovers: None, caplog: pytest.LogCaptureFixture, kind: type[BaseException]
) -> None:
    # issue 16.6: a CancelledError or GeneratorExit from a hook reached a caller or hung
    # the proxy (the hooks run inside settlement); it must be as harmless as an Exception
    caplog.set_level(logging.ERROR, logger="batchproxy")
    after = Log()
    proxy = Recorder(respond=_slot_or_batch_error, batch_size=4, name="lis")
    proxy.add_listener(RaisingListener(kind))
    proxy.add_listener(after)

    results = await asyncio.wait_for(
        asyncio.gather(*(proxy.inference(i) for i in (1, 2, 3)), return_exceptions=True), 10
    )
    assert results[0] == 1
    assert isinstance(results[1], ValueError)
    assert results[2] == 3
    with pytest.raises(RuntimeError, match="batch failed"):
        await asyncio.wait_for(proxy.inference(0), 10)
    assert await asyncio.wait_for(proxy.inference(4), 10) == 4

    broken_hooks = {
        record.getMessage().split(" in ")[-1]
        for record in caplog.records
        if record.name == "batchproxy" and record.exc_info is not None
    }
    assert broken_hooks == {
        "request_queued",
        "batch_started",
        "batch_finished",
        "request_finished",
        "error",
    }
    assert all(record.levelno == logging.ERROR for record in caplog.records)
    hooks_after = {call[0] for call in after.calls}
    assert hooks_after == broken_hooks  # the next listener still hears everything
    stats = proxy.stats
    assert (stats.succeeded, stats.errors, stats.failed_batches) == (3, 2, 1)
    assert_settled(stats)
    await proxy.aclose()


@pytest.mark.parametrize("kind", [KeyboardInterrupt, SystemExit])
def test_a_listener_raising_keyboard_interrupt_stops_the_loop_after_settling(
    kind: type[BaseException],
) -> None:
    # the interrupt is not swallowed, but it never cuts a settlement short: it leaves the
    # event loop from a callback of its own, and a loop run again carries on where it was
    proxy = Recorder(batch_size=4, name="interrupted")
    proxy.add_listener(RaisingListener(kind))
    loop = asyncio.new_event_loop()
    messages: list[str] = []

    def run(task: asyncio.Task[Any]) -> None:
        while not task.done():
            try:
                loop.run_until_complete(task)
            except kind as exc:
                messages.append(str(exc))

    tasks = [loop.create_task(proxy.inference(i)) for i in range(3)]
    try:
        run(loop.create_task(asyncio.wait(tasks)))
        assert [task.result() for task in tasks] == [("out", i) for i in range(3)]
        assert messages
        assert all(message.startswith("listener broke") for message in messages)
    finally:
        run(loop.create_task(proxy.aclose()))
        loop.close()
    assert_settled(proxy.stats)


async def test_add_listener_refuses_other_objects() -> None:
    proxy = Recorder()

    class DuckTyped:
        def request_queued(self, proxy: str, queue_depth: int) -> None:
            pass

    with pytest.raises(TypeError, match="Listener"):
        proxy.add_listener(DuckTyped())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Listener"):
        proxy.add_listener(print)  # type: ignore[arg-type]
    await proxy.aclose()


@pytest.mark.looptime
async def test_removed_listener_hears_nothing_more(no_leftovers: None) -> None:
    log = Log()
    proxy = Recorder()
    proxy.add_listener(log)
    await asyncio.wait_for(proxy.inference(1), 10)
    heard = len(log.calls)
    assert heard > 0
    proxy.remove_listener(log)
    await asyncio.wait_for(proxy.inference(2), 10)
    assert len(log.calls) == heard
    await proxy.aclose()


@pytest.mark.looptime
async def test_listener_hears_rejections() -> None:
    log = Log()
    async with Recorder(delay=1.0, batch_size=1, max_queue_size=1, name="lis") as proxy:
        proxy.add_listener(log)
        first = asyncio.create_task(proxy.inference(1))
        await asyncio.sleep(0.01)
        second = asyncio.create_task(proxy.inference(2))
        await asyncio.sleep(0)
        with pytest.raises(batchproxy.QueueFull):
            await proxy.inference(3)
        with pytest.raises(batchproxy.QueueFull):
            await proxy.inference_many([4, 5])
        await asyncio.gather(first, second)
    assert [c for c in log.calls if c[0] == "request_rejected"] == [
        ("request_rejected", "lis", 1),
        ("request_rejected", "lis", 2),
    ]
