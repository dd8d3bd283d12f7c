"""`@batchproxy.batch`: functions and methods awaited per item, with Proxy's semantics."""

from __future__ import annotations

import asyncio
import inspect
import threading
from typing import Any

import pytest

import batchproxy
from batchproxy import BatchSizeMismatch, DeadlineExceeded, ProxyClosed, QueueFull, batch

seen_by_square: list[list[int]] = []


@batch(batch_size=4, max_delay_ms=1.0)
async def square(numbers: list[int]) -> list[int]:
    """Square each number."""
    seen_by_square.append(list(numbers))
    return [n * n for n in numbers]


async def test_module_level_function(no_leftovers: None) -> None:
    """The one test that uses (and closes) the module-level `square`."""
    assert await asyncio.wait_for(square(3), 10) == 9
    assert await asyncio.wait_for(square.inference_many([1, 2, 5]), 10) == [1, 4, 25]
    assert await square.inference_many([]) == []

    seen_by_square.clear()
    results = await asyncio.wait_for(asyncio.gather(*(square(i) for i in range(10))), 10)
    assert results == [i * i for i in range(10)]
    assert max(len(b) for b in seen_by_square) > 1
    assert max(len(b) for b in seen_by_square) <= 4
    assert sorted(n for b in seen_by_square for n in b) == list(range(10))

    stats = square.stats
    assert isinstance(stats, batchproxy.ProxyStats)
    assert stats.requests == 14
    assert stats.succeeded == 14
    assert stats.items == 14
    assert stats.name == "square"

    await square.aclose()
    with pytest.raises(ProxyClosed):
        await square(2)


async def test_concurrent_calls_are_batched_and_each_gets_its_own(no_leftovers: None) -> None:
    seen: list[list[str]] = []

    @batch(batch_size=4)
    async def shout(words: list[str]) -> list[str]:
        seen.append(list(words))
        return [w.upper() for w in words]

    words = [f"w{i}" for i in range(10)]
    results = await asyncio.wait_for(asyncio.gather(*(shout(w) for w in words)), 10)
    assert results == [w.upper() for w in words]
    assert seen == [words[0:4], words[4:8], words[8:10]]
    assert shout.stats.batches == 3
    assert dict(shout.stats.batch_sizes) == {4: 2, 2: 1}
    await shout.aclose()


def test_metadata_is_copied_from_the_function() -> None:
    async def embed(items: list[str]) -> list[int]:
        """Embed some strings."""
        return [len(i) for i in items]

    decorated = batch(batch_size=2)(embed)
    assert decorated.__name__ == "embed"
    assert decorated.__doc__ == "Embed some strings."
    assert decorated.__qualname__ == embed.__qualname__
    assert decorated.__module__ == __name__
    assert decorated.__wrapped__ is embed  # type: ignore[attr-defined]
    assert square.__name__ == "square"
    assert square.__doc__ == "Square each number."


class Model:
    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.batches: list[list[int]] = []
        self.selves: list[object] = []

    @batch(batch_size=8)
    async def predict(self, items: list[int]) -> list[tuple[str, int]]:
        """Tag each item with this model's tag."""
        self.batches.append(list(items))
        self.selves.append(self)
        return [(self.tag, item) for item in items]


async def test_method_gets_one_proxy_per_instance(no_leftovers: None) -> None:
    a, b = Model("a"), Model("b")
    assert a.predict is a.predict
    assert a.predict.proxy is not b.predict.proxy
    calls = [(a if i % 2 else b).predict(i) for i in range(8)]
    results = await asyncio.wait_for(asyncio.gather(*calls), 10)
    assert results == [("a" if i % 2 else "b", i) for i in range(8)]
    assert a.batches == [[1, 3, 5, 7]]
    assert b.batches == [[0, 2, 4, 6]]
    assert a.selves == [a]
    assert b.selves == [b]
    assert a.predict.stats.requests == 4
    assert b.predict.stats.requests == 4
    assert await asyncio.wait_for(a.predict.inference_many([10, 11]), 10) == [("a", 10), ("a", 11)]
    await a.predict.aclose()
    with pytest.raises(ProxyClosed):
        await a.predict(1)
    assert await asyncio.wait_for(b.predict(12), 10) == ("b", 12)  # b is not closed
    await b.predict.aclose()


def test_method_metadata() -> None:
    model = Model("m")
    assert model.predict.__name__ == "predict"
    assert model.predict.__doc__ == "Tag each item with this model's tag."
    assert Model.predict.__name__ == "predict"


def test_method_on_a_class_without_instance_dict_raises() -> None:
    class Slotted:
        __slots__ = ()

        @batch()
        async def run(self, items: list[int]) -> list[int]:
            return items

    with pytest.raises(TypeError, match="__dict__"):
        _ = Slotted().run


async def test_sync_function_runs_on_a_worker_thread(no_leftovers: None) -> None:
    threads: list[threading.Thread] = []

    @batch(batch_size=4, name="sync-fn")
    def double(items: list[int]) -> list[int]:
        threads.append(threading.current_thread())
        return [2 * i for i in items]

    results = await asyncio.wait_for(asyncio.gather(*(double(i) for i in range(6))), 10)
    assert results == [2 * i for i in range(6)]
    assert await asyncio.wait_for(double.inference_many([7, 8]), 10) == [14, 16]
    assert threads
    assert threading.current_thread() not in threads
    assert {t.name for t in threads} == {"batchproxy-sync-fn"}
    await double.aclose()


async def test_sync_method_works(no_leftovers: None) -> None:
    class Scaler:
        def __init__(self, factor: int) -> None:
            self.factor = factor

        @batch(batch_size=4)
        def scale(self, items: list[int]) -> list[int]:
            return [self.factor * i for i in items]

    two, three = Scaler(2), Scaler(3)
    results = await asyncio.wait_for(asyncio.gather(two.scale(5), three.scale(5)), 10)
    assert results == [10, 15]
    await two.scale.aclose()
    await three.scale.aclose()


@pytest.mark.parametrize(
    ("options", "error", "name"),
    [
        ({"batch_size": 0}, ValueError, "batch_size"),
        ({"batch_size": "4"}, TypeError, "batch_size"),
        ({"batch_size": True}, TypeError, "batch_size"),
        ({"max_delay_ms": -1}, ValueError, "max_delay_ms"),
        ({"max_delay_ms": float("nan")}, ValueError, "max_delay_ms"),
        ({"max_queue_size": 0}, ValueError, "max_queue_size"),
        ({"timeout": 0}, ValueError, "timeout"),
        ({"timeout": "1"}, TypeError, "timeout"),
        ({"max_concurrent_batches": 0}, ValueError, "max_concurrent_batches"),
        ({"offload": "yes"}, TypeError, "offload"),
        ({"name": 3}, TypeError, "name"),
    ],
)
def test_bad_options_raise_at_decoration_time(
    options: dict[str, Any], error: type[Exception], name: str
) -> None:
    async def f(items: list[int]) -> list[int]:
        return items

    with pytest.raises(error, match=name):
        batch(**options)(f)


def test_decorator_without_parentheses_is_refused() -> None:
    async def f(items: list[int]) -> list[int]:
        return items

    with pytest.raises(TypeError, match="parentheses"):
        batch(f)  # type: ignore[arg-type]


def test_decorating_a_non_callable_is_refused() -> None:
    with pytest.raises(TypeError, match="function or method"):
        batch()(42)  # type: ignore[call-overload]


async def test_exception_in_a_slot_fails_only_that_caller(no_leftovers: None) -> None:
    @batch(batch_size=4)
    async def checked(items: list[int]) -> list[Any]:
        return [ValueError(f"bad {i}") if i < 0 else i for i in items]

    calls = [checked(1), checked(-2), checked(3)]
    results = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 10)
    assert results[0] == 1
    assert isinstance(results[1], ValueError)
    assert str(results[1]) == "bad -2"
    assert results[2] == 3
    assert checked.stats.errors == 1
    assert checked.stats.succeeded == 2
    await checked.aclose()


async def test_raising_function_fails_its_batch_and_keeps_serving(no_leftovers: None) -> None:
    @batch(batch_size=4)
    async def fragile(items: list[int]) -> list[int]:
        if 0 in items:
            raise KeyError("zero")
        return items

    results = await asyncio.wait_for(
        asyncio.gather(fragile(0), fragile(1), return_exceptions=True), 10
    )
    assert all(isinstance(r, KeyError) for r in results)
    assert await asyncio.wait_for(fragile(2), 10) == 2
    assert fragile.stats.failed_batches == 1
    await fragile.aclose()


async def test_wrong_result_count_raises_batch_size_mismatch(no_leftovers: None) -> None:
    @batch(batch_size=4)
    async def lossy(items: list[int]) -> list[int]:
        return items[:-1]

    results = await asyncio.wait_for(asyncio.gather(lossy(1), lossy(2), return_exceptions=True), 10)
    assert all(isinstance(r, BatchSizeMismatch) for r in results)
    assert isinstance(results[0], BatchSizeMismatch)
    assert (results[0].expected, results[0].got) == (2, 1)
    await lossy.aclose()


@pytest.mark.looptime
async def test_timeout_and_queue_size_options_apply(no_leftovers: None) -> None:
    @batch(batch_size=1, timeout=0.5, max_queue_size=1)
    async def slow(items: list[int]) -> list[int]:
        await asyncio.sleep(1.0)
        return items

    running = asyncio.create_task(slow(1))
    await asyncio.sleep(0.1)
    queued = asyncio.create_task(slow(2))
    await asyncio.sleep(0)
    with pytest.raises(QueueFull):
        await slow(3)
    with pytest.raises(DeadlineExceeded):
        await asyncio.wait_for(queued, 10)
    with pytest.raises(DeadlineExceeded):
        await asyncio.wait_for(running, 10)
    assert await asyncio.wait_for(slow(4, timeout=5), 10) == 4
    stats = slow.stats
    assert (stats.rejected, stats.timed_out) == (1, 2)
    await slow.aclose()


@pytest.mark.looptime
async def test_priority_is_passed_through(no_leftovers: None) -> None:
    seen: list[list[str]] = []

    @batch(batch_size=1)
    async def ordered(items: list[str]) -> list[str]:
        seen.append(list(items))
        await asyncio.sleep(1.0)
        return items

    first = asyncio.create_task(ordered("first"))
    await asyncio.sleep(0.1)
    low = asyncio.create_task(ordered("low"))
    high = asyncio.create_task(ordered("high", priority=5))
    await asyncio.wait_for(asyncio.gather(first, low, high), 10)
    assert seen == [["first"], ["high"], ["low"]]
    await ordered.aclose()


def test_batch_takes_every_proxy_option() -> None:
    proxy_options = set(inspect.signature(batchproxy.Proxy.__init__).parameters) - {"self"}
    assert proxy_options == set(inspect.signature(batchproxy.batch).parameters)


async def test_it_has_proxys_inference_submit_lifecycle_and_health(no_leftovers: None) -> None:
    """`f.inference`, `f.submit`, `async with f`, `f.closed`, `f.healthy`, `f.name`:
    what a `Proxy` offers, by the same names (a `ModelHost` serves such a function)."""

    @batch(batch_size=4, max_delay_ms=1.0)
    async def halve(numbers: list[int]) -> list[float]:
        return [n / 2 for n in numbers]

    async with halve as entered:
        assert entered is halve
        assert not halve.closed
        assert halve.healthy
        assert halve.name == halve.__qualname__
        assert await asyncio.wait_for(halve.inference(3, priority=1), 10) == 1.5

        futures: list[Any] = []
        thread = threading.Thread(
            target=lambda: futures.extend(halve.submit(n, timeout=10) for n in range(4))
        )
        thread.start()
        thread.join(10)
        answers = [await asyncio.wait_for(asyncio.wrap_future(f), 10) for f in futures]
        assert answers == [0, 0.5, 1, 1.5]
        with pytest.raises(TypeError, match="nope"):
            halve.submit(1, nope=2)  # type: ignore[call-arg]
    assert halve.closed
    with pytest.raises(ProxyClosed):
        await halve.inference(1)
