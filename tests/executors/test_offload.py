"""offload: `_inference` on a worker thread, owned or shared, while the loop keeps batching."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Sequence
from typing import Any

import pytest
from _support import (
    Recorder,
    ThreadRecorder,
    peak_in_flight,
    tag_with_thread,
    thread_alive,
    wait_until,
)
from typing_extensions import override

import batchproxy
from batchproxy import WorkerThread


async def test_async_model_runs_on_one_dedicated_thread(no_leftovers: None) -> None:
    proxy = Recorder(respond=tag_with_thread, offload=True, batch_size=2, name="async-off")
    loop_thread = threading.current_thread().name
    results = [await asyncio.wait_for(proxy.inference(i), 10) for i in range(3)]
    results += await asyncio.wait_for(proxy.inference_many([3, 4, 5]), 10)
    assert {name for name, _ in results} == {"batchproxy-async-off"}
    assert loop_thread != "batchproxy-async-off"
    assert [item for _, item in results] == list(range(6))
    assert len(proxy.batches) >= 4
    await proxy.aclose()


@pytest.mark.parametrize("offload", [True, False])
async def test_sync_model_runs_off_the_loop_on_one_thread(
    no_leftovers: None, offload: bool
) -> None:
    """A plain `def` model runs on a worker thread with or without offload=True."""
    proxy = ThreadRecorder(offload=offload, batch_size=2)
    results = [await asyncio.wait_for(proxy.inference(i), 10) for i in range(3)]
    results += await asyncio.wait_for(proxy.inference_many([3, 4, 5]), 10)
    assert results == [("out", i) for i in range(6)]
    assert len(proxy.threads) >= 4
    assert len(set(proxy.threads)) == 1
    assert threading.get_ident() not in proxy.threads
    await proxy.aclose()


async def test_loop_keeps_queueing_while_the_model_is_blocked(no_leftovers: None) -> None:
    gate = threading.Event()
    proxy = ThreadRecorder(gate=gate, offload=True, batch_size=2)
    try:
        first = asyncio.create_task(proxy.inference(0))
        await wait_until(proxy.entered.is_set)
        waiting = []
        for i in range(1, 6):
            waiting.append(asyncio.create_task(proxy.inference(i)))
            await asyncio.sleep(0.001)  # the loop runs while the model thread is blocked
            assert proxy.stats.queue_depth == i
        assert proxy.stats.in_flight == 1
        assert proxy.batches == [[0]]
    finally:
        gate.set()
    results = await asyncio.wait_for(asyncio.gather(first, *waiting), 10)
    assert results == [("out", i) for i in range(6)]
    assert proxy.batches == [[0], [1, 2], [3, 4], [5]]
    await proxy.aclose()


async def test_shared_worker_thread_runs_both_proxies(no_leftovers: None) -> None:
    worker = WorkerThread(name="gpu-shared")
    first = Recorder(respond=tag_with_thread, offload=worker)
    second = ThreadRecorder(respond=tag_with_thread, offload=worker)
    results = await asyncio.wait_for(
        asyncio.gather(first.inference(1), second.inference(2), first.inference(3)), 10
    )
    assert results == [("gpu-shared", 1), ("gpu-shared", 2), ("gpu-shared", 3)]
    assert [t.name for t in threading.enumerate()].count("gpu-shared") == 1

    await first.aclose()
    await second.aclose()
    assert thread_alive("gpu-shared")  # a shared thread outlives the proxies
    third = Recorder(respond=tag_with_thread, offload=worker)
    assert await asyncio.wait_for(third.inference(4), 10) == ("gpu-shared", 4)
    await third.aclose()
    assert thread_alive("gpu-shared")

    worker.close()
    assert worker.closed
    assert not thread_alive("gpu-shared")
    worker.close()  # idempotent


async def test_worker_thread_async_with_stops_it(no_leftovers: None) -> None:
    async with WorkerThread(name="gpu-async-with") as worker:
        assert thread_alive("gpu-async-with")
        proxy = Recorder(respond=tag_with_thread, offload=worker)
        assert await asyncio.wait_for(proxy.inference(1), 10) == ("gpu-async-with", 1)
        await proxy.aclose()
        assert thread_alive("gpu-async-with")
    assert worker.closed
    assert not thread_alive("gpu-async-with")


def test_worker_thread_with_block_stops_it() -> None:
    with WorkerThread(name="gpu-with") as worker:
        proxy = ThreadRecorder(respond=tag_with_thread, offload=worker)

        async def use() -> object:
            try:
                return await asyncio.wait_for(proxy.inference(1), 10)
            finally:
                await proxy.aclose()

        assert asyncio.run(use()) == ("gpu-with", 1)
        assert thread_alive("gpu-with")
    assert worker.closed
    assert not thread_alive("gpu-with")


async def test_worker_thread_aclose_stops_it(no_leftovers: None) -> None:
    worker = WorkerThread(name="gpu-aclose")
    worker.start()
    assert thread_alive("gpu-aclose")
    await asyncio.wait_for(worker.aclose(), 10)
    await asyncio.wait_for(worker.aclose(), 10)
    assert not thread_alive("gpu-aclose")


async def test_owned_thread_is_stopped_by_proxy_aclose(no_leftovers: None) -> None:
    proxy = ThreadRecorder(respond=tag_with_thread, offload=True, name="owned")
    assert await asyncio.wait_for(proxy.inference(1), 10) == ("batchproxy-owned", 1)
    assert thread_alive("batchproxy-owned")
    await asyncio.wait_for(proxy.aclose(), 10)
    assert not thread_alive("batchproxy-owned")


async def test_closed_worker_thread_fails_calls_with_runtime_error(no_leftovers: None) -> None:
    worker = WorkerThread(name="gpu-closed-early")
    proxy = Recorder(offload=worker)
    assert await asyncio.wait_for(proxy.inference(1), 10) == ("out", 1)
    worker.close()
    with pytest.raises(RuntimeError, match="closed"):
        await asyncio.wait_for(proxy.inference(2), 10)
    with pytest.raises(RuntimeError, match="closed"):
        await asyncio.wait_for(proxy.inference(3), 10)
    assert proxy.stats.errors == 2
    await asyncio.wait_for(proxy.aclose(), 10)


class Stuck(batchproxy.Proxy[int, int]):
    """An async model that never finishes by itself (until its thread stops)."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.entered = threading.Event()

    @override
    async def _inference(self, items: list[int]) -> Sequence[int]:
        self.entered.set()
        await asyncio.sleep(3600)
        return items


async def test_worker_closed_under_a_running_batch_fails_it(no_leftovers: None) -> None:
    worker = WorkerThread(name="gpu-closed-mid-batch")
    proxy = Stuck(offload=worker)
    call = asyncio.create_task(proxy.inference(1))
    await wait_until(proxy.entered.is_set)
    await asyncio.wait_for(worker.aclose(), 10)
    with pytest.raises(RuntimeError, match="closed"):
        await asyncio.wait_for(call, 10)
    with pytest.raises(RuntimeError, match="closed"):
        await asyncio.wait_for(proxy.inference(2), 10)
    await asyncio.wait_for(proxy.aclose(), 10)


async def test_blocked_sync_batch_finishes_when_its_worker_closes(no_leftovers: None) -> None:
    """A sync batch already running on a closing thread still delivers its result."""
    gate = threading.Event()
    worker = WorkerThread(name="gpu-close-while-blocked")
    proxy = ThreadRecorder(gate=gate, offload=worker)
    try:
        call = asyncio.create_task(proxy.inference(1))
        await wait_until(proxy.entered.is_set)
        closing = asyncio.create_task(worker.aclose())
        await asyncio.sleep(0.01)
        assert not closing.done()
    finally:
        gate.set()
    assert await asyncio.wait_for(call, 10) == ("out", 1)
    await asyncio.wait_for(closing, 10)
    with pytest.raises(RuntimeError, match="closed"):
        await asyncio.wait_for(proxy.inference(2), 10)
    await asyncio.wait_for(proxy.aclose(), 10)


class Overlap(batchproxy.Proxy[int, int]):
    """An async model that holds each batch until another one runs alongside it.

    Gives up waiting after `patience` seconds; `most_active` is the most batches
    seen running at once.
    """

    def __init__(self, patience: float, **options: Any) -> None:
        super().__init__(**options)
        self.patience = patience
        self.active = 0
        self.most_active = 0
        self.partner: asyncio.Event | None = None

    @override
    async def _inference(self, items: list[int]) -> Sequence[int]:
        if self.partner is None:
            self.partner = asyncio.Event()
        self.active += 1
        self.most_active = max(self.most_active, self.active)
        if self.active >= 2:
            self.partner.set()
        try:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.partner.wait(), self.patience)
            return items
        finally:
            self.active -= 1


@pytest.mark.parametrize("offload", [True, False])
async def test_two_batch_slots_let_batches_overlap(no_leftovers: None, offload: bool) -> None:
    proxy = Overlap(5.0, batch_size=1, max_concurrent_batches=2, offload=offload)
    results = await asyncio.wait_for(asyncio.gather(proxy.inference(1), proxy.inference(2)), 10)
    assert results == [1, 2]
    assert proxy.most_active == 2
    assert proxy.stats.batches == 2
    await proxy.aclose()


async def test_one_batch_slot_never_overlaps(no_leftovers: None) -> None:
    proxy = Overlap(0.05, batch_size=1, max_concurrent_batches=1, offload=True)
    results = await asyncio.wait_for(asyncio.gather(proxy.inference(1), proxy.inference(2)), 10)
    assert results == [1, 2]
    assert proxy.most_active == 1
    assert proxy.stats.batches == 2
    await proxy.aclose()


async def test_worker_thread_survives_a_model_error(no_leftovers: None) -> None:
    def respond(items: list[int]) -> list[Any]:
        if 0 in items:
            raise ValueError("bad batch")
        return tag_with_thread(items)

    proxy = ThreadRecorder(respond=respond, offload=True, name="survivor")
    with pytest.raises(ValueError, match="bad batch"):
        await asyncio.wait_for(proxy.inference(0), 10)
    assert await asyncio.wait_for(proxy.inference(1), 10) == ("batchproxy-survivor", 1)
    assert len(set(proxy.threads)) == 1
    await proxy.aclose()


def test_bad_offload_value_is_refused() -> None:
    with pytest.raises(TypeError, match="offload"):
        Recorder(offload="gpu")


# -- a model hosted by the executor; capacity ------------------------------------------


class Counting:
    """A model factory that counts its calls and where they ran; fails the first
    `failures` times."""

    def __init__(self, failures: int = 0) -> None:
        self.built_on: list[str] = []
        self.failures = failures

    def __call__(self) -> Any:
        self.built_on.append(threading.current_thread().name)
        if len(self.built_on) <= self.failures:
            raise OSError("weights not there yet")
        return lambda items: [(threading.current_thread().name, item) for item in items]


async def test_worker_thread_hosts_a_model_built_once_on_its_thread(no_leftovers: None) -> None:
    factory = Counting()
    async with (
        WorkerThread("host", model=factory) as worker,
        batchproxy.Proxy[int, Any](offload=worker, batch_size=4) as proxy,
    ):
        results = await asyncio.gather(*(proxy.inference(i) for i in range(10)))
    assert results == [("host", i) for i in range(10)]
    assert factory.built_on == ["host"]


async def test_a_failing_hosted_factory_fails_the_batch_and_is_retried(no_leftovers: None) -> None:
    factory = Counting(failures=1)
    async with (
        WorkerThread("host", model=factory) as worker,
        batchproxy.Proxy[int, Any](offload=worker) as proxy,
    ):
        with pytest.raises(OSError, match="weights not there yet"):
            await proxy.inference(1)
        assert await proxy.inference(2) == ("host", 2)
    assert factory.built_on == ["host", "host"]


def test_hosted_model_and_own_inference_do_not_mix() -> None:
    with pytest.raises(TypeError, match="implements _inference, but offload="):
        ThreadRecorder(offload=WorkerThread(model=Counting()))
    with pytest.raises(TypeError, match="model must be a callable"):
        WorkerThread(model="weights.bin")  # type: ignore[arg-type]


class Resizable(batchproxy.Executor):
    """An executor whose capacity the test sets; runs batches on the loop."""

    def __init__(self, capacity: int) -> None:
        self.slots = capacity

    @property
    def capacity(self) -> int:
        return self.slots

    def resize(self, capacity: int) -> None:
        self.slots = capacity
        self._capacity_changed()

    async def run(self, fn: Any, items: list[Any]) -> Any:
        return await fn(items)


async def peak(proxy: Recorder, calls: int) -> int:
    most, _ = await peak_in_flight(proxy, range(calls))
    return most


async def test_concurrency_follows_the_executor_capacity_unless_set() -> None:
    executor = Resizable(3)
    async with Recorder(offload=executor, batch_size=1, delay=0.05) as proxy:
        assert await peak(proxy, 6) == 3
        executor.resize(1)
        assert await peak(proxy, 4) == 1
        proxy.configure(max_concurrent_batches=2)  # pinned: no longer follows
        executor.resize(4)
        assert await peak(proxy, 6) == 2
        proxy.configure(max_concurrent_batches=None)  # follows again
        assert await peak(proxy, 8) == 4
    async with Recorder(offload=executor, batch_size=1, delay=0.05, max_concurrent_batches=1) as p:
        assert await peak(p, 4) == 1


async def test_resize_from_another_thread_reaches_the_proxy() -> None:
    executor = Resizable(1)
    async with Recorder(offload=executor, batch_size=1, delay=0.05) as proxy:
        await asyncio.to_thread(executor.resize, 2)
        await asyncio.sleep(0)  # the change arrives through call_soon_threadsafe
        assert await peak(proxy, 4) == 2


def test_a_dropped_proxy_stops_following_its_executor() -> None:
    executor = Resizable(2)
    proxy = Recorder(offload=executor)
    del proxy
    executor.resize(3)  # the watcher holds the proxy weakly: nothing to call, no error
