"""Result handling: own results, positional calls, sync models, errors.

Guarantees 1, 2 and 4 of docs/failures.md: every accepted call ends exactly once;
caller i of a batch gets result i; an `Exception` returned in slot i fails caller i
only, one raised fails every caller of the batch.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import random
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
from _support import Recorder, ThreadRecorder, wait_until
from typing_extensions import override

import batchproxy


class ModelCrash(BaseException):
    """A BaseException that is not an Exception, raised by a model."""


def raising(error: BaseException) -> Callable[[list[Any]], Sequence[Any]]:
    def respond(items: list[Any]) -> Sequence[Any]:
        raise error

    return respond


def default(items: list[Any]) -> list[Any]:
    return [("out", item) for item in items]


# how a model can run: async on the loop, async on a worker thread, plain def
MODEL_KINDS: dict[str, Callable[..., Any]] = {
    "async": Recorder,
    "async-offloaded": functools.partial(Recorder, offload=True),
    "sync": ThreadRecorder,
}

# not Exceptions: they must reach the callers wrapped in InferenceError
BASE_EXCEPTIONS = [KeyboardInterrupt, SystemExit, ModelCrash, asyncio.CancelledError]


# -- every caller gets its own result ------------------------------------------------------


async def test_each_caller_gets_its_own_result(no_leftovers):
    p = Recorder(batch_size=8)
    results = await asyncio.gather(*(p.inference(i) for i in range(50)))
    assert results == [("out", i) for i in range(50)]
    assert sorted(x for batch in p.batches for x in batch) == list(range(50))
    assert max(len(b) for b in p.batches) > 1  # they really were batched
    await p.aclose()


async def test_result_i_goes_to_caller_i_by_position_not_by_item():
    """Identical items: only the slot position tells the callers apart."""
    p = Recorder(lambda items: list(range(len(items))), batch_size=8)
    results = await asyncio.gather(*(p.inference("same") for _ in range(5)))
    assert p.batches == [["same"] * 5]
    assert results == [0, 1, 2, 3, 4]
    await p.aclose()


class Unordered(Recorder):
    """Batches take less time the later they start, so they finish in reverse order."""

    @override
    async def _inference(self, items: list[Any]) -> Sequence[Any]:
        self.batches.append(list(items))
        await asyncio.sleep(10.0 - len(self.batches))
        return [item * 10 for item in items]


@pytest.mark.looptime
async def test_own_results_when_concurrent_batches_finish_out_of_order(no_leftovers):
    p = Unordered(batch_size=3, max_concurrent_batches=4)
    finished: list[int] = []

    async def call(i: int) -> int:
        result: int = await p.inference(i)
        finished.append(i)
        return result

    results = await asyncio.gather(*(call(i) for i in range(12)))
    assert results == [i * 10 for i in range(12)]
    assert len(p.batches) == 4
    assert finished[:3] == p.batches[-1]  # the last batch really finished first
    await p.aclose()


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.looptime
async def test_own_results_under_random_arrivals_and_durations(seed):
    rng = random.Random(seed)

    class Jittery(Recorder):
        @override
        async def _inference(self, items: list[Any]) -> Sequence[Any]:
            self.batches.append(list(items))
            await asyncio.sleep(rng.uniform(0.0, 0.02))
            return [f"r{item}" for item in items]

    p = Jittery(batch_size=4, max_delay_ms=5, max_concurrent_batches=3)

    async def call(i: int) -> tuple[int, str]:
        await asyncio.sleep(rng.uniform(0.0, 0.05))
        return i, await p.inference(i)

    pairs = await asyncio.gather(*(call(i) for i in range(60)))
    assert all(result == f"r{i}" for i, result in pairs)
    assert p.stats.succeeded == 60
    await p.aclose()


async def test_numpy_rows_go_to_their_callers():
    p = Recorder(lambda items: np.stack([np.full(3, x, dtype=float) for x in items]), batch_size=4)
    results = await asyncio.gather(*(p.inference(i) for i in range(10)))
    for i, row in enumerate(results):
        assert isinstance(row, np.ndarray)
        np.testing.assert_array_equal(row, np.full(3, i, dtype=float))
    await p.aclose()


async def test_numpy_1d_result_gives_each_caller_its_element():
    p = Recorder(lambda items: np.asarray(items) * 2, batch_size=4)
    results = await asyncio.gather(*(p.inference(i) for i in range(7)))
    assert [int(r) for r in results] == [i * 2 for i in range(7)]
    await p.aclose()


async def test_numpy_array_items_go_in_and_results_come_back_in_order():
    p = Recorder(lambda items: [float(a.sum()) for a in items], batch_size=4)
    arrays = [np.arange(i + 1) for i in range(6)]
    results = await asyncio.gather(*(p.inference(a) for a in arrays))
    assert results == [float(a.sum()) for a in arrays]
    await p.aclose()


async def test_tuple_results_go_to_their_callers():
    p = Recorder(lambda items: tuple(("t", x, x * x) for x in items), batch_size=3)
    results = await asyncio.gather(*(p.inference(i) for i in range(7)))
    assert results == [("t", i, i * i) for i in range(7)]
    await p.aclose()


# -- how _inference is called --------------------------------------------------------------


async def test_inference_called_positionally_with_a_list():
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    class Spy(batchproxy.Proxy[Any, Any]):
        async def _inference(self, *args: Any, **kwargs: Any) -> Sequence[Any]:  # type: ignore[override]
            calls.append((args, kwargs))
            return list(args[0])

    p = Spy(batch_size=4)
    assert await asyncio.gather(p.inference("a"), p.inference("b")) == ["a", "b"]
    assert calls == [((["a", "b"],), {})]
    assert type(calls[0][0][0]) is list
    await p.aclose()


async def test_parameter_named_arguments_works():
    class BERTProxy(batchproxy.Proxy[str, int]):
        def __init__(self) -> None:
            super().__init__(batch_size=4)

        @override
        async def _inference(self, arguments: list[str]) -> list[int]:
            return [len(a) for a in arguments]

    async with BERTProxy() as p:
        assert await asyncio.gather(p.inference("ab"), p.inference("abcd")) == [2, 4]


async def test_sync_parameter_named_arguments_works(no_leftovers):
    class SyncBERT(batchproxy.Proxy[str, int]):
        @override
        def _inference(self, arguments: list[str]) -> list[int]:
            return [len(a) for a in arguments]

    async with SyncBERT(batch_size=4) as p:
        assert await p.inference_many(["a", "bcd"]) == [1, 3]


# -- plain def models ------------------------------------------------------------------------


async def test_plain_def_model_works_off_the_loop_thread(no_leftovers):
    loop_thread = threading.get_ident()
    p = ThreadRecorder(batch_size=4)
    results = await asyncio.gather(*(p.inference(i) for i in range(10)))
    assert results == [("out", i) for i in range(10)]
    assert p.threads
    assert loop_thread not in p.threads
    await p.aclose()


async def test_loop_keeps_running_while_plain_def_model_blocks(no_leftovers):
    gate = threading.Event()
    p = ThreadRecorder(batch_size=4, gate=gate)
    task = asyncio.create_task(p.inference(1))
    await wait_until(p.entered.is_set)  # we are awaiting while the model is inside a call
    assert not task.done()
    assert p.stats.in_flight == 1
    gate.set()
    assert await task == ("out", 1)
    assert p.threads[0] != threading.get_ident()
    await p.aclose()


async def test_offloaded_async_model_runs_off_the_loop_thread(no_leftovers):
    threads: list[int] = []

    class Offloaded(batchproxy.Proxy[int, int]):
        @override
        async def _inference(self, items: list[int]) -> list[int]:
            threads.append(threading.get_ident())
            return [x + 1 for x in items]

    p = Offloaded(batch_size=4, offload=True)
    assert await asyncio.gather(*(p.inference(i) for i in range(6))) == list(range(1, 7))
    assert threads
    assert threading.get_ident() not in threads
    await p.aclose()


# -- wrong result count ----------------------------------------------------------------------


class Miscounter(Recorder):
    """Its class name must show up in BatchSizeMismatch."""


@pytest.mark.parametrize(
    ("respond", "got"),
    [(lambda items: default(items)[:-1], 3), (lambda items: [*default(items), "extra"], 5)],
    ids=["too-few", "too-many"],
)
async def test_wrong_count_fails_every_caller_of_the_batch(respond, got):
    p = Miscounter(respond, batch_size=4)
    results = await asyncio.gather(*(p.inference(i) for i in range(4)), return_exceptions=True)
    assert p.batches == [[0, 1, 2, 3]]
    for error in results:
        assert isinstance(error, batchproxy.BatchSizeMismatch)
        assert isinstance(error, batchproxy.BatchProxyError)
        assert (error.expected, error.got) == (4, got)
        assert "Miscounter" in str(error)
        assert f"returned {got} results for a batch of 4 items" in str(error)
    stats = p.stats
    assert (stats.errors, stats.failed_batches, stats.succeeded) == (4, 1, 0)

    p.respond = default  # the proxy keeps serving
    assert await asyncio.gather(p.inference(7), p.inference(8)) == [("out", 7), ("out", 8)]
    stats = p.stats
    assert (stats.errors, stats.failed_batches, stats.succeeded) == (4, 1, 2)
    await p.aclose()


async def test_wrong_count_from_sync_model_fails_the_batch(no_leftovers):
    p = ThreadRecorder(lambda items: [], batch_size=4)
    results = await asyncio.gather(*(p.inference(i) for i in range(3)), return_exceptions=True)
    assert all(isinstance(e, batchproxy.BatchSizeMismatch) for e in results)
    assert "ThreadRecorder" in str(results[0])
    p.respond = default
    assert await p.inference(1) == ("out", 1)
    await p.aclose()


# -- per-item errors returned in a slot --------------------------------------------------------


async def test_exception_in_slot_fails_only_that_caller():
    errors = {2: ValueError("bad item 2")}
    p = Recorder(lambda items: [errors.get(x, ("out", x)) for x in items], batch_size=4)
    results = await asyncio.gather(*(p.inference(i) for i in range(4)), return_exceptions=True)
    assert p.batches == [[0, 1, 2, 3]]
    assert results[2] is errors[2]
    assert [results[i] for i in (0, 1, 3)] == [("out", 0), ("out", 1), ("out", 3)]
    stats = p.stats
    assert (stats.errors, stats.failed_batches, stats.succeeded) == (1, 0, 3)
    await p.aclose()


@pytest.mark.parametrize("kind", MODEL_KINDS)
@pytest.mark.parametrize("make", BASE_EXCEPTIONS, ids=lambda t: t.__name__)
async def test_base_exception_returned_in_slot_arrives_wrapped(kind, make, no_leftovers):
    returned = make("slot 1")
    p = MODEL_KINDS[kind](
        lambda items: [returned if x == 1 else ("out", x) for x in items], batch_size=4
    )
    tasks = [asyncio.create_task(p.inference(i)) for i in range(3)]
    await asyncio.wait(tasks)
    assert not tasks[1].cancelled()
    error = tasks[1].exception()
    assert isinstance(error, batchproxy.InferenceError)
    assert error.__cause__ is returned
    assert [tasks[0].result(), tasks[2].result()] == [("out", 0), ("out", 2)]
    assert (p.stats.errors, p.stats.succeeded, p.stats.failed_batches) == (1, 2, 0)
    await p.aclose()


# -- the model raising ---------------------------------------------------------------------


@pytest.mark.parametrize("kind", MODEL_KINDS)
async def test_raised_exception_fails_every_caller_with_it(kind, no_leftovers):
    boom = ValueError("model exploded")
    p = MODEL_KINDS[kind](raising(boom), batch_size=4)
    results = await asyncio.gather(*(p.inference(i) for i in range(4)), return_exceptions=True)
    assert p.batches == [[0, 1, 2, 3]]
    assert all(error is boom for error in results)
    stats = p.stats
    assert (stats.errors, stats.failed_batches, stats.succeeded) == (4, 1, 0)

    p.respond = default  # the proxy keeps serving
    assert await asyncio.gather(p.inference(5), p.inference(6)) == [("out", 5), ("out", 6)]
    assert (p.stats.failed_batches, p.stats.succeeded) == (1, 2)
    await p.aclose()


@pytest.mark.parametrize("kind", MODEL_KINDS)
@pytest.mark.parametrize("make", BASE_EXCEPTIONS, ids=lambda t: t.__name__)
async def test_raised_base_exception_arrives_wrapped_and_proxy_serves_on(kind, make, no_leftovers):
    raised = make("from the model")
    p = MODEL_KINDS[kind](raising(raised), batch_size=4)
    tasks = [asyncio.create_task(p.inference(i)) for i in range(3)]
    await asyncio.wait(tasks)
    for task in tasks:
        assert not task.cancelled()  # a stray CancelledError is not the caller's cancellation
        error = task.exception()
        assert isinstance(error, batchproxy.InferenceError)
        assert error.__cause__ is raised
        assert type(raised).__name__ in str(error)
    current = asyncio.current_task()
    assert current is not None
    assert current.cancelling() == 0
    stats = p.stats
    assert (stats.errors, stats.failed_batches, stats.succeeded) == (3, 1, 0)

    p.respond = default
    assert await asyncio.gather(p.inference(8), p.inference(9)) == [("out", 8), ("out", 9)]
    assert p.stats.succeeded == 2
    await p.aclose()


# -- results that are not a sequence -----------------------------------------------------------


@pytest.mark.parametrize(
    ("respond", "type_name"),
    [
        (lambda items: None, "NoneType"),
        (lambda items: 42, "int"),
        (lambda items: (("out", x) for x in items), "generator"),
        (lambda items: {i: x for i, x in enumerate(items)}, "dict"),
        (lambda items: "ab", "str"),  # right length, still not one result per item
        (lambda items: {("out", x) for x in items}, "set"),
    ],
    ids=["None", "int", "generator", "dict", "str", "set"],
)
async def test_non_sequence_result_fails_batch_with_clear_type_error(respond, type_name):
    p = Recorder(respond, batch_size=4)
    results = await asyncio.gather(p.inference("a"), p.inference("b"), return_exceptions=True)
    assert p.batches == [["a", "b"]]
    for error in results:
        assert isinstance(error, TypeError)
        assert "Recorder._inference must return a sequence" in str(error)
        assert type_name in str(error)
    stats = p.stats
    assert (stats.errors, stats.failed_batches, stats.succeeded) == (2, 1, 0)

    p.respond = default
    assert await p.inference("c") == ("out", "c")
    assert p.stats.succeeded == 1
    await p.aclose()


async def test_zero_dim_array_result_fails_batch_with_clear_type_error():
    """`model(x).sum()` instead of `model(x)`: a 0-d array is not one result per item."""
    p = Recorder(lambda items: np.array(float(len(items))), batch_size=4)
    results = await asyncio.gather(p.inference(1), p.inference(2), return_exceptions=True)
    for error in results:
        assert isinstance(error, TypeError)
        assert "Recorder._inference must return a sequence" in str(error)
    assert p.stats.failed_batches == 1
    await p.aclose()


CALLER_TAG: contextvars.ContextVar[str] = contextvars.ContextVar("caller_tag", default="none")


@pytest.mark.parametrize("offload", [False, True])
async def test_model_never_sees_a_callers_context(offload, no_leftovers):
    """A batch serves many callers, so it runs in a context of its own, not in the
    context of whichever caller happened to trigger it."""
    seen: list[str] = []

    class Peek(batchproxy.Proxy[int, int]):
        @override
        async def _inference(self, items: list[int]) -> list[int]:
            seen.append(CALLER_TAG.get())
            return items

    async def tagged_call(proxy: Peek, tag: str) -> int:
        CALLER_TAG.set(tag)
        return await proxy.inference(1)

    async with Peek(offload=offload) as proxy:
        await asyncio.gather(tagged_call(proxy, "a"), tagged_call(proxy, "b"))
        await tagged_call(proxy, "c")
    assert seen
    assert set(seen) == {"none"}
