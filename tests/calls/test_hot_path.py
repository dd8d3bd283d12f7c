"""What every call pays for: the objects a queued call keeps alive.

Each object the garbage collector tracks adds to its work, and under load that is a
large share of a request's CPU (1,000 concurrent callers collect every few batches).
A closure in a function every call runs is the easy way to lose this: Python gives
each captured variable a cell when the function starts, used or not.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable
from typing import Any

import pytest
from typing_extensions import override

from batchproxy import Proxy
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
