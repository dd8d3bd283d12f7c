"""What every call pays for: the objects a queued call keeps alive.

Each object the garbage collector tracks adds to its work, and under load that is a
large share of a request's CPU (1,000 concurrent callers collect every few batches).
A closure in a function every call runs is the easy way to lose this: Python gives
each captured variable a cell when the function starts, used or not.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from contextlib import aclosing, suppress
from typing import Any

import pytest
from _support import batchproxy_cycles, fails_with, in_a_task_of_its_own
from typing_extensions import override

import batchproxy
from batchproxy import InvalidItem, Proxy
from batchproxy._intake import Intake
from batchproxy._runs.batches import Runner, run_batch
from batchproxy._scheduling.queue import Request, RequestQueue
from batchproxy._scheduling.scheduler import Scheduler
from batchproxy._settle import Settlement

CALLERS = 1_000

EVERY_CALL: list[Callable[..., Any]] = [
    Proxy.inference,
    Intake.admit,
    Request.__init__,
    Scheduler.submit,
    RequestQueue.push,
    RequestQueue.pop_batch,
    run_batch,
    Runner.claim,
    Settlement.deliver,
]


@pytest.mark.parametrize("function", EVERY_CALL, ids=lambda f: f.__qualname__)
def test_no_function_every_call_runs_makes_closure_cells(function: Callable[..., Any]) -> None:
    assert function.__code__.co_cellvars == ()


class Held(Proxy[int, int]):
    """Holds its batch until `release` is set, so the calls stay alive to be counted."""

    def __init__(self) -> None:
        super().__init__(batch_size=CALLERS)
        self.release = asyncio.Event()

    @override
    async def _inference(self, items: list[int]) -> list[int]:
        await self.release.wait()
        return items


async def tracked_per_call(start: Callable[[int], asyncio.Task[int]]) -> tuple[float, list[Any]]:
    """Tracked objects alive per call while `CALLERS` callers started by `start` wait;
    then the callers' results."""
    for _ in range(3):  # what ended before (a gather, say) lets go of its callers
        await asyncio.sleep(0)
    gc.collect()
    before = len(gc.get_objects())
    callers = [start(i) for i in range(CALLERS)]
    for _ in range(3):  # every caller runs to its await, and the batch starts
        await asyncio.sleep(0)
    gc.collect()  # what is left is alive
    per_call = (len(gc.get_objects()) - before) / CALLERS
    return per_call, callers


async def test_a_waiting_call_keeps_one_object_more_than_a_bare_hand_off() -> None:
    """A caller waiting in `inference` holds what a caller awaiting a future of its own
    holds (its task, coroutine, future), and its request: nothing more."""
    loop = asyncio.get_running_loop()
    futures: list[asyncio.Future[int]] = []

    async def await_bare(i: int) -> int:
        future: asyncio.Future[int] = loop.create_future()
        futures.append(future)
        return await future

    baseline, callers = await tracked_per_call(lambda i: asyncio.ensure_future(await_bare(i)))
    for i, future in enumerate(futures):
        future.set_result(i)
    results = await asyncio.gather(*callers)
    assert results == list(range(CALLERS))
    futures.clear()
    del callers

    async with Held() as proxy:
        held, callers = await tracked_per_call(lambda i: asyncio.ensure_future(proxy.inference(i)))
        proxy.release.set()
        results = await asyncio.gather(*callers)
        assert results == list(range(CALLERS))
    assert held - baseline <= 1.05, f"{held - baseline:.2f} tracked objects more per call"


class Doubles(Proxy[int, int]):
    """Doubles each item; refuses an odd item over 100 (an `InvalidItem` for it), raises
    for a batch holding 999, and takes 0.2 s over one holding 555."""

    @override
    async def _inference(self, items: list[int]) -> list[int | BaseException]:
        if 999 in items:
            raise RuntimeError("boom")
        if 555 in items:
            await asyncio.sleep(0.2)
        return [InvalidItem("odd") if i > 100 and i % 2 else 2 * i for i in items]


class Counts(Proxy[int, int]):
    """Streams item, item + 1, item + 2."""

    @override
    def _inference(self, items: list[int]) -> Iterator[list[int]]:
        for step in range(3):
            yield [item + step for item in items]


async def _cancelled(call: Awaitable[Any]) -> None:
    task = asyncio.ensure_future(call)
    await asyncio.sleep(0.01)
    task.cancel()
    with suppress(asyncio.CancelledError):
        await task


async def _from_threads(proxy: Doubles) -> None:
    loop = asyncio.get_running_loop()
    assert await loop.run_in_executor(None, lambda: proxy.submit(4).result()) == 8
    assert await loop.run_in_executor(None, lambda: proxy.inference_sync(5)) == 10


async def _streamed(proxy: Counts) -> None:
    assert [chunk async for chunk in proxy.stream(3)] == [3, 4, 5]
    async with aclosing(proxy.stream(3)) as chunks:
        async for _ in chunks:
            break


async def _results(proxy: Doubles) -> None:
    assert await asyncio.gather(*(proxy.inference(i) for i in range(20))) == [
        2 * i for i in range(20)
    ]


CYCLE_CASES: dict[str, Callable[[Any], Coroutine[Any, Any, Any]]] = {
    "results": _results,
    "inference_many": lambda p: p.inference_many([1, 2, 3]),
    "an invalid item": lambda p: fails_with(p.inference(101), InvalidItem),
    "a model error": lambda p: fails_with(p.inference(999), RuntimeError),
    "inference_many, an invalid item": lambda p: fails_with(
        p.inference_many([1, 103]), InvalidItem
    ),
    "inference_many, a model error": lambda p: fails_with(p.inference_many([1, 999]), RuntimeError),
    "a deadline": lambda p: fails_with(p.inference(555, timeout=0.05), batchproxy.DeadlineExceeded),
    "wait_for": lambda p: fails_with(
        asyncio.wait_for(p.inference(555), 0.05), asyncio.TimeoutError
    ),
    "a cancel": lambda p: _cancelled(p.inference(555)),
    "keys and priorities": lambda p: p.inference(7, key="k", priority=1, timeout=5.0),
    "threads": _from_threads,
    "a stream": _streamed,
}


@pytest.mark.parametrize("offload", [False, True], ids=["on-the-loop", "offload"])
@pytest.mark.parametrize("case", list(CYCLE_CASES))
async def test_a_call_leaves_no_reference_cycle(case: str, offload: bool) -> None:
    """Whatever its outcome, a call's batch task, requests, futures and errors are freed
    by reference counting as it ends, not left in cycles for the collector's full
    passes, which under load stall the model's thread for as long as they walk the
    heap (hundreds of ms with a model loaded). Each of these left one: a batch task's
    context held the task (`current_batch`); an error raised in a frame whose locals
    led back to it (the request, its future, the worker thread's job); a thread's
    routed call held its future, whose callback held the call."""
    proxy = (
        Counts(batch_size=8, offload=offload)
        if case == "a stream"
        else Doubles(batch_size=8, offload=offload)
    )
    async with proxy:
        await proxy.inference_many([])  # (bind it, and start what stays: the thread)
        if case != "a stream":
            await proxy.inference_many([0])
        with batchproxy_cycles() as cycles:
            await in_a_task_of_its_own(CYCLE_CASES[case](proxy))
            for _ in range(3):
                await asyncio.sleep(0)
        assert cycles == []


class Spells(batchproxy.GenerationProxy[str, str]):
    """Each sequence: item + "0", item + "1", then item + "2" as its last token."""

    @override
    async def _step(self, step: batchproxy.Step[str]) -> list[Any]:
        out: list[Any] = []
        for slot in step.active:
            slot.state = 0 if slot.state is None else slot.state + 1
            token = f"{slot.item}{slot.state}"
            out.append(batchproxy.Last(token) if slot.state == 2 else token)
        return out


@batchproxy.batch(batch_size=8)
async def halves(items: list[int]) -> list[float]:
    return [item / 2 for item in items]


async def test_generation_and_batch_functions_leave_no_reference_cycle() -> None:
    """The same for a `GenerationProxy`'s sequences (whole, and one left mid-way) and a
    `@batch` function's calls."""
    async with Spells(batch_size=4) as spells, halves.proxy:
        assert [token async for token in spells.stream("a")] == ["a0", "a1", "a2"]
        await halves(0)

        async def calls() -> None:
            for x in "bc":
                assert [token async for token in spells.stream(x)] == [f"{x}{i}" for i in range(3)]
            async with aclosing(spells.stream("d")) as tokens:
                async for _ in tokens:
                    break
            assert await asyncio.gather(*(halves(i) for i in range(10))) == [
                i / 2 for i in range(10)
            ]
            assert await halves.inference_many([2, 4]) == [1.0, 2.0]

        with batchproxy_cycles() as cycles:
            await in_a_task_of_its_own(calls())
            for _ in range(3):
                await asyncio.sleep(0.01)
        assert cycles == []
