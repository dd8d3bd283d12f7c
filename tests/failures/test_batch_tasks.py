"""A batch task belongs to the runs from its start to its end: the binding only holds
what they write (`batch_tasks`, `not_started`, `overran`), and each entry is there
exactly as long as its invariant says."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from _support import Recorder, cancel_batches_before_they_run

import batchproxy
from batchproxy._loops.binding import Binder, Binding


def binding_of(proxy: batchproxy.Proxy[Any, Any]) -> Binding[Any]:
    binding = proxy._binder.current
    assert binding is not None
    return binding


def test_the_binding_is_handed_nothing_of_the_runner() -> None:
    assert "never_started" not in Binding.__slots__
    assert not hasattr(Binding, "task_done")
    assert "never_started" not in Binder.__init__.__code__.co_varnames


async def test_a_running_batch_is_in_batch_tasks_and_no_longer_not_started() -> None:
    release = asyncio.Event()
    seen: list[tuple[bool, bool]] = []

    class Held(batchproxy.Proxy[int, int]):
        async def _inference(self, items: list[int]) -> list[int]:
            binding = binding_of(self)
            task = asyncio.current_task()
            seen.append((task in binding.batch_tasks, task in binding.not_started))
            await release.wait()
            return items

    async with Held(batch_size=4, max_delay_ms=0) as proxy:
        call = asyncio.create_task(proxy.inference(1))
        await asyncio.sleep(0.01)
        binding = binding_of(proxy)
        assert len(binding.batch_tasks) == 1
        assert not binding.not_started  # it ran its first step
        release.set()
        assert await call == 1
        assert seen == [(True, False)]
        assert not binding.batch_tasks  # it left at its end
        assert not binding.not_started


async def test_a_task_started_but_not_yet_run_is_not_started_with_its_done_callback() -> None:
    async with Recorder(batch_size=4, max_delay_ms=0) as proxy:
        calls = [asyncio.create_task(proxy.inference(i)) for i in range(2)]
        for _ in range(3):  # the decision runs, the task is made but has not stepped
            binding = proxy._binder.current
            if binding is not None and binding.not_started:
                break
            await asyncio.sleep(0)
        assert binding is not None
        (task,) = binding.not_started
        assert task in binding.batch_tasks
        assert await asyncio.gather(*calls) == [("out", 0), ("out", 1)]
        assert not binding.not_started
        assert not binding.batch_tasks


@pytest.mark.parametrize("streaming", [False, True], ids=["batches", "streams"])
async def test_a_task_cancelled_before_its_first_step_settles_its_batch_and_leaves(
    streaming: bool,
) -> None:
    class Streamer(batchproxy.Proxy[int, int]):
        async def _inference(self, items: list[int]) -> Any:
            yield [item * 10 for item in items]

    proxy: batchproxy.Proxy[int, int] = (
        Streamer(batch_size=4, max_delay_ms=0) if streaming else Recorder(batch_size=4)
    )
    cancel_batches_before_they_run(proxy, lambda n: n == 0)

    async def call(item: int) -> object:
        if not streaming:
            return await proxy.inference(item)
        return [chunk async for chunk in proxy.stream(item)]

    outcome = await asyncio.gather(call(1), return_exceptions=True)
    assert isinstance(outcome[0], batchproxy.InferenceError)
    binding = binding_of(proxy)
    assert not binding.batch_tasks
    assert not binding.not_started
    assert proxy.stats.in_flight == 0  # its slot was freed
    assert await call(2) in (("out", 2), [20])  # and the proxy serves on
    await proxy.aclose()


async def test_an_overrun_batch_stays_in_overran_until_its_model_call_ends() -> None:
    release = asyncio.Event()

    class Slow(batchproxy.Proxy[int, int]):
        async def _inference(self, items: list[int]) -> list[int]:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:  # the watchdog cancels it: it ends when told
                await release.wait()
            return items

    async with Slow(batch_size=2, max_delay_ms=0, batch_timeout=0.01) as proxy:
        with pytest.raises(batchproxy.BatchTimeout):
            await proxy.inference(1)
        binding = binding_of(proxy)
        (task,) = binding.overran
        assert task in binding.batch_tasks
        release.set()
        await asyncio.wait([task])
        assert not binding.overran
        assert not binding.batch_tasks
