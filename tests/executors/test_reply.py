"""`Reply`: a batch's answer wakes the task awaiting it in the answer's own callback, so
the batch's callers wake the iteration after a worker's answer arrives (as a
`run_in_executor` caller does), not two iterations after."""

from __future__ import annotations

import asyncio
from typing import Any

import _workers
import pytest

from batchproxy import ProcessWorkers, Proxy, WorkerThread
from batchproxy._executors import worker_thread
from batchproxy._executors.reply import Reply


async def _waiting(reply: Reply) -> asyncio.Task[Any]:
    """A task awaiting `reply`, started."""

    async def wait() -> Any:
        return await reply

    task = asyncio.create_task(wait())
    await asyncio.sleep(0)  # it takes its first step: it waits now
    assert not task.done()
    return task


async def test_an_answer_set_in_a_callback_runs_the_waiting_task_there() -> None:
    loop = asyncio.get_running_loop()
    reply = Reply(loop)
    task = await _waiting(reply)
    seen: list[bool] = []

    def answer() -> None:  # what the thread's `call_soon_threadsafe` runs
        reply.set_result(7)
        seen.append(task.done())  # an asyncio.Future: False, the task steps next time

    loop.call_soon(answer)
    await asyncio.sleep(0)
    assert seen == [True]
    assert task.result() == 7


async def test_an_error_wakes_the_waiting_task_next_iteration() -> None:
    """An outcome the task will raise (`wake_now=False`, what `_resolve` passes for a
    model's error) wakes it as a Future would: raised in a step run from the answer's
    callback, its traceback would reach that frame, which holds the outcome (a cycle
    per failed batch; `tests/calls/test_hot_path.py` finds it on Python 3.12)."""
    loop = asyncio.get_running_loop()
    reply = Reply(loop)
    task = await _waiting(reply)
    seen: list[bool] = []

    def answer() -> None:
        reply.set_result("an error to raise", wake_now=False)
        seen.append(task.done())

    loop.call_soon(answer)
    await asyncio.sleep(0)
    assert seen == [False]
    assert await task == "an error to raise"


async def test_an_answer_set_inside_a_task_wakes_the_waiting_one_next_iteration() -> None:
    """asyncio runs one task step at a time: from inside a task, `Reply` wakes the waiting
    task as a Future would."""
    reply = Reply(asyncio.get_running_loop())
    task = await _waiting(reply)
    reply.set_result("x")  # (this test is a task)
    assert not task.done()
    assert await task == "x"


async def test_a_cancelled_wait_raises_in_its_task_and_a_late_answer_is_dropped() -> None:
    loop = asyncio.get_running_loop()
    reply = Reply(loop)
    task = await _waiting(reply)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert reply.cancelled()
    assert reply.done()
    assert not reply.cancel()  # once
    worker_thread._resolve(reply, "late")  # the thread's answer after all: dropped
    with pytest.raises(asyncio.CancelledError):
        reply.result()


async def test_its_states_are_those_of_a_future() -> None:
    loop = asyncio.get_running_loop()
    reply = Reply(loop)
    assert reply.get_loop() is loop
    assert not reply.done()
    assert not reply.cancelled()
    with pytest.raises(asyncio.InvalidStateError):
        reply.result()
    reply.set_result(None)
    with pytest.raises(asyncio.InvalidStateError):
        reply.set_result(1)
    assert not reply.cancel()
    called: list[Reply] = []
    reply.add_done_callback(called.append)  # answered already: next iteration
    assert called == []
    await asyncio.sleep(0)
    assert called == [reply]
    assert await reply is None  # answered: no wait


def _mark_the_next_iteration(monkeypatch: pytest.MonkeyPatch, events: list[str]) -> None:
    """Each answer from a worker's thread also schedules "next iteration": it runs in the
    iteration after the one that takes the answer in."""
    resolve = worker_thread._resolve

    def marking(future: Any, outcome: Any) -> None:
        resolve(future, outcome)
        asyncio.get_running_loop().call_soon(events.append, "next iteration")

    monkeypatch.setattr(worker_thread, "_resolve", marking)


class _Echo(Proxy[int, int]):
    def _inference(self, items: list[int]) -> list[int]:
        return items


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_the_caller_wakes_the_iteration_after_the_threads_answer(
    monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """Found measuring the lone client (issue 39): the batch task woke one iteration
    after the worker thread's answer, and its callers one after that."""
    events: list[str] = []
    _mark_the_next_iteration(monkeypatch, events)

    class AsyncEcho(Proxy[int, int]):
        async def _inference(self, items: list[int]) -> list[int]:
            await asyncio.sleep(0)
            return items

    kind_of = _Echo if kind == "sync" else AsyncEcho
    async with WorkerThread() as thread, kind_of(offload=thread) as proxy:
        for item in range(3):
            assert await proxy.inference(item) == item
            events.append("caller")
            await asyncio.sleep(0)  # (lets this answer's mark run before the next call)
    assert events == ["caller", "next iteration"] * 3


@pytest.mark.timeout(120)
async def test_a_process_workers_caller_wakes_the_iteration_after_the_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    events: list[str] = []
    _mark_the_next_iteration(monkeypatch, events)
    async with ProcessWorkers(_workers.tagging, 1) as workers, Proxy(offload=workers) as p:
        await p.inference(1)
        events.append("caller")
        await asyncio.sleep(0)
    assert events == ["caller", "next iteration"]
