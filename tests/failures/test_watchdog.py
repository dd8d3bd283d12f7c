"""The model watchdog (`batch_timeout`): a batch that runs too long fails its callers
with `BatchTimeout`, the proxy says it is unhealthy and why, and it keeps serving or
stops taking work, as configured. Never silently stuck."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from _support import Hangs, Recorder, ThreadRecorder, assert_settled, outcome, thread_alive

import batchproxy


@pytest.mark.looptime
async def test_an_overrunning_batch_fails_its_callers_at_the_timeout() -> None:
    loop = asyncio.get_running_loop()
    async with Hangs(batch_timeout=2.0, batch_size=4) as proxy:
        start = loop.time()
        answers = await asyncio.gather(
            proxy.inference("hang"), proxy.inference("b"), return_exceptions=True
        )
        assert loop.time() - start == pytest.approx(2.0)
        assert all(isinstance(a, batchproxy.BatchTimeout) for a in answers)
        assert isinstance(answers[0], TimeoutError)
        assert "ran longer than batch_timeout=2 s" in str(answers[0])
        assert proxy.cancelled == 1  # the model call was abandoned (cancelled)
        health = proxy.health
        assert not proxy.healthy
        assert not health
        assert health.reason is not None
        assert "batch_timeout=2 s" in health.reason
        assert health.since is not None
        stats = proxy.stats
        assert stats.timed_out_batches == 1
        assert stats.errors == 2
        assert stats.failed_batches == 1
        assert_settled(stats)


@pytest.mark.looptime
async def test_the_proxy_serves_on_and_is_healthy_again_once_a_batch_returns_in_time() -> None:
    async with Hangs(batch_timeout=2.0) as proxy:
        with pytest.raises(batchproxy.BatchTimeout):
            await proxy.inference("hang")
        assert not proxy.healthy
        assert await proxy.inference("fine") == ("out", "fine")
        assert proxy.healthy
        assert proxy.health.reason is None


@pytest.mark.looptime
async def test_batches_that_return_in_time_are_untouched() -> None:
    async with Recorder(batch_timeout=1.0, delay=0.9) as proxy:
        assert await proxy.inference(1) == ("out", 1)
        assert proxy.healthy
        assert proxy.stats.timed_out_batches == 0


@pytest.mark.looptime
async def test_a_model_that_ignores_cancellation_still_frees_its_callers_and_slot() -> None:
    loop = asyncio.get_running_loop()
    proxy = Hangs(stubborn=True, batch_timeout=1.0)
    stuck = asyncio.create_task(proxy.inference("hang"))
    with pytest.raises(batchproxy.BatchTimeout):
        await stuck
    # the model still runs, but its slot was freed: the next batch goes at once
    start = loop.time()
    assert await proxy.inference("next") == ("out", "next")
    assert loop.time() == pytest.approx(start)
    assert proxy.healthy is False  # the abandoned call has not ended
    await asyncio.wait_for(proxy.aclose(), 1)  # does not wait for the abandoned call
    proxy.release.set()
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert proxy.finished == 1  # it ended on its own; its late result went nowhere
    stats = proxy.stats
    assert stats.succeeded == 1
    assert stats.errors == 1
    assert_settled(stats)


@pytest.mark.looptime
async def test_stop_mode_refuses_queued_and_new_calls_with_the_reason() -> None:
    async with Hangs(batch_timeout=batchproxy.Watchdog(1.0, on_timeout="stop")) as proxy:
        first = asyncio.create_task(proxy.inference("hang"))
        await asyncio.sleep(0.5)
        queued = asyncio.create_task(proxy.inference("waiting"))  # waits for the slot
        await asyncio.gather(first, queued, return_exceptions=True)
        assert outcome(first) == "BatchTimeout"
        assert outcome(queued) == "ProxyClosed"
        error = queued.exception()
        assert isinstance(error, batchproxy.ProxyClosed)
        assert error.reason is not None
        assert "batch_timeout=1 s" in str(error)
        assert isinstance(error.__cause__, batchproxy.BatchTimeout)
        with pytest.raises(batchproxy.ProxyClosed, match=r"stopped: .*batch_timeout"):
            await proxy.inference("new")
        assert proxy.closed
        assert not proxy.healthy
        assert_settled(proxy.stats)


async def test_a_stuck_model_thread_times_out_every_batch_until_it_frees() -> None:
    gate = threading.Event()
    proxy = ThreadRecorder(gate=gate, batch_timeout=0.2, name="stuck")
    try:
        with pytest.raises(batchproxy.BatchTimeout):
            await proxy.inference(1)
        assert not proxy.healthy
        # the thread is still in the model: the next batch waits for it, and overruns too
        with pytest.raises(batchproxy.BatchTimeout):
            await proxy.inference(2)
        assert not proxy.healthy
        gate.set()
        assert await asyncio.wait_for(proxy.inference(3), 5) == ("out", 3)
        assert proxy.healthy
        assert proxy.batches == [[1], [3]]  # the abandoned second batch never ran
    finally:
        gate.set()
        await proxy.aclose()


async def test_aclose_does_not_wait_for_a_model_thread_stuck_in_an_abandoned_call() -> None:
    gate = threading.Event()
    proxy = ThreadRecorder(gate=gate, batch_timeout=0.2, name="stuck-at-close")
    with pytest.raises(batchproxy.BatchTimeout):
        await proxy.inference(1)
    await asyncio.wait_for(proxy.aclose(), 5)  # returns although the thread is busy
    assert thread_alive("batchproxy-stuck-at-close")
    gate.set()  # the model returns: the thread, already told to stop, ends
    for _ in range(100):
        if not thread_alive("batchproxy-stuck-at-close"):
            break
        await asyncio.sleep(0.05)
    assert not thread_alive("batchproxy-stuck-at-close")


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"batch_timeout": 0}, ValueError, "batch_timeout must be > 0"),
        ({"batch_timeout": -1}, ValueError, "batch_timeout must be > 0"),
        ({"batch_timeout": float("nan")}, ValueError, "batch_timeout must be > 0"),
        ({"batch_timeout": True}, TypeError, "batch_timeout must be a number"),
        ({"batch_timeout": "1"}, TypeError, "batch_timeout must be a number"),
    ],
)
def test_bad_watchdog_options_are_refused(
    options: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        Recorder(**options)


def test_without_a_batch_timeout_the_proxy_is_always_healthy() -> None:
    proxy = Recorder()
    assert proxy.healthy
    assert proxy.health == batchproxy.Health(healthy=True, reason=None, since=None)


class Finished(batchproxy.Listener):
    """Records each `batch_finished` and `batch_timed_out`."""

    def __init__(self) -> None:
        self.finished: list[tuple[int, BaseException | None]] = []
        self.timed_out: list[int] = []

    def batch_finished(
        self, proxy: str, size: int, model_seconds: float, error: BaseException | None
    ) -> None:
        self.finished.append((size, error))

    def batch_timed_out(self, proxy: str, size: int, timeout: float) -> None:
        self.timed_out.append(size)


@pytest.mark.looptime
@pytest.mark.parametrize("stubborn", [False, True])
async def test_an_abandoned_batch_is_not_counted_as_finished(stubborn: bool) -> None:
    """Issue 38: the watchdog counts its batch (`batch_timed_out`, a failed batch); when
    the abandoned call then ended, it was counted in `batch_finished` too (a model time
    that never was one: the model neither returned nor raised for the proxy)."""
    listener = Finished()
    async with Hangs(batch_timeout=2.0, batch_size=4, stubborn=stubborn) as proxy:
        proxy.add_listener(listener)
        with pytest.raises(batchproxy.BatchTimeout):
            await proxy.inference("hang")
        proxy.release.set()
        await asyncio.sleep(1)  # the abandoned call ends (cancelled, or let go)
        assert proxy.cancelled == 1
        assert await proxy.inference("fine") == ("out", "fine")
        assert listener.timed_out == [1]
        assert listener.finished == [(1, None)]  # "fine"'s batch only
        stats = proxy.stats
        assert (stats.batches, stats.timed_out_batches, stats.failed_batches) == (2, 1, 1)
        assert stats.model_time.count == 1


@pytest.mark.looptime
async def test_a_batch_abandoned_at_the_drain_deadline_is_not_counted_as_finished() -> None:
    listener = Finished()
    proxy = Hangs(batch_size=2)
    proxy.add_listener(listener)
    assert await proxy.inference("fine") == ("out", "fine")
    task = asyncio.ensure_future(proxy.inference("hang"))
    await asyncio.sleep(0.1)
    await proxy.aclose(timeout=1)
    assert isinstance(task.exception(), batchproxy.DrainDeadline)
    await asyncio.sleep(0.1)  # its task has ended (cancelled)
    assert proxy.cancelled == 1
    assert listener.finished == [(1, None)]  # not the abandoned one, "ok" or otherwise
    stats = proxy.stats
    assert (stats.batches, stats.failed_batches, stats.model_time.count) == (2, 1, 1)
