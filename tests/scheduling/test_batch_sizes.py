"""`batch_sizes`: the model sees only the allowed sizes, padded (`pad_item`) or cut,
on every path that calls it; scheduling on the virtual clock."""

from __future__ import annotations

import asyncio
import functools
import math
from collections.abc import AsyncIterator, Sequence
from typing import Any

import numpy as np
import pytest
from _sized_models import ALLOWED, WrongSize, check, strict
from _support import wait_until
from typing_extensions import override

import batchproxy
from batchproxy import Options, Proxy
from batchproxy._events import Events
from batchproxy._executors.base import LoopExecutor
from batchproxy._listeners import Listeners
from batchproxy._runs.sized import SizedExecutor
from batchproxy._scheduling.sizes import NO_ITEM, AllowedSizes
from batchproxy._stats import StatsRecorder


class Strict(Proxy[Any, Any]):
    """A static-shape model: doubles each item, raises on a size not allowed. "bad"
    makes the batch raise; `memory` is the largest batch it can hold (MemoryError)."""

    def __init__(
        self,
        *,
        allowed: tuple[int, ...] = ALLOWED,
        delay: float = 0.0,
        memory: int | None = None,
        **options: Any,
    ) -> None:
        pad_item = options.pop("pad_item", NO_ITEM)
        options.setdefault("batch_sizes", batchproxy.BatchSizes(allowed, pad_item=pad_item))
        super().__init__(**options)
        self.allowed = allowed
        self.delay = delay
        self.memory = memory
        self.calls: list[list[Any]] = []
        self.started_at: list[float] = []

    @override
    async def _inference(self, items: list[Any]) -> Sequence[Any]:
        self.calls.append(list(items))
        self.started_at.append(asyncio.get_running_loop().time())
        check(len(items), self.allowed)
        if self.memory is not None and len(items) > self.memory:
            raise MemoryError(f"a batch of {len(items)} does not fit")
        if "bad" in items:
            raise ValueError("bad item in the batch")
        if self.delay:
            await asyncio.sleep(self.delay)
        return [None if item is None else item * 2 for item in items]

    @property
    def sizes(self) -> list[int]:
        return [len(call) for call in self.calls]


# -- options ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sizes", "error", "match"),
    [
        (8, TypeError, "batch_sizes must be a sequence"),
        ("1248", TypeError, "batch_sizes must be a sequence"),
        ((), ValueError, "at least one size"),
        ((1, 0), ValueError, "positive ints"),
        ((1, -2), ValueError, "positive ints"),
        ((1, 2.0), TypeError, "must hold ints"),
        ((1, True), TypeError, "must hold ints"),
        ((1, 2, 2), ValueError, "must not repeat"),
        ((16, 32), ValueError, "below the smallest of batch_sizes"),
    ],
)
def test_bad_batch_sizes_are_refused(sizes: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        Options(batch_size=8, batch_sizes=sizes)  # type: ignore[arg-type]


def test_batch_sizes_are_kept_sorted_as_a_tuple() -> None:
    assert Options(batch_size=8, batch_sizes=[4, 1, 2]).batch_sizes == batchproxy.BatchSizes(
        (1, 2, 4)
    )
    assert Options().batch_sizes is None


def test_pad_item_needs_batch_sizes() -> None:
    # (the deprecated flat spelling: BatchSizes(sizes, pad_item=...) cannot miss its sizes)
    with (
        pytest.warns(DeprecationWarning, match="pad_item"),
        pytest.raises(ValueError, match=r"pad_item .* needs batch_sizes"),
    ):
        Proxy(pad_item=0)


def test_cutting_needs_size_one() -> None:
    with pytest.raises(ValueError, match="without pad_item must include 1"):
        Strict(batch_size=8, allowed=(2, 4, 8))
    Strict(batch_size=8, allowed=(2, 4, 8), pad_item=0)  # a filler: fine


def test_streaming_models_refuse_batch_sizes() -> None:
    class Streamer(Proxy[int, int]):
        async def _inference(self, items: list[int]) -> AsyncIterator[list[int]]:  # type: ignore[override]
            yield items

    with pytest.raises(TypeError, match="batch_sizes is not supported for streaming"):
        Streamer(batch_size=8, batch_sizes=(1, 2, 4, 8))

    class Engine(batchproxy.GenerationProxy[int, int]):
        def _step(self, step: Any) -> Any:
            return []

    with pytest.raises(TypeError, match="batch_sizes"):
        Engine(batch_size=8, batch_sizes=(1, 2))  # type: ignore[call-arg]


def test_configure_batch_size_below_the_smallest_size_changes_nothing() -> None:
    proxy = Strict(batch_size=8, allowed=(4, 8), pad_item=0)
    with pytest.raises(ValueError, match="below the smallest"):
        proxy.configure(batch_size=2)
    assert proxy.options.batch_size == 8


# -- cut (no filler) -------------------------------------------------------------------


async def test_cut_batches_leave_at_allowed_sizes_and_the_rest_is_not_lost() -> None:
    async with Strict(batch_size=8) as proxy:
        results = await asyncio.gather(*(proxy.inference(i) for i in range(13)))
        assert results == [2 * i for i in range(13)]
        assert proxy.sizes == [8, 4, 1]
        assert [x for call in proxy.calls for x in call] == list(range(13))  # in order
        stats = proxy.stats
        assert (stats.items, stats.succeeded, stats.padded_rows) == (13, 13, 0)
        assert dict(stats.batch_sizes) == {8: 1, 4: 1, 1: 1}


async def test_cut_batches_drain_on_close() -> None:
    proxy = Strict(batch_size=8)
    calls = [asyncio.create_task(proxy.inference(i)) for i in range(7)]
    await asyncio.sleep(0)
    await proxy.aclose()
    assert proxy.stats.succeeded == 7  # every one answered by the time aclose returns
    assert await asyncio.gather(*calls) == [2 * i for i in range(7)]
    assert proxy.sizes == [4, 2, 1]


async def test_sizes_above_batch_size_are_not_used() -> None:
    async with Strict(batch_size=6) as proxy:
        await asyncio.gather(*(proxy.inference(i) for i in range(11)))
        assert proxy.sizes == [4, 4, 2, 1]


async def test_configure_batch_size_rounds_down_to_an_allowed_size() -> None:
    async with Strict(batch_size=8) as proxy:
        proxy.configure(batch_size=7)
        await asyncio.gather(*(proxy.inference(i) for i in range(9)))
        assert proxy.sizes == [4, 4, 1]


async def test_a_cut_leftover_cancelled_while_queued_never_reaches_the_model() -> None:
    async with Strict(batch_size=8, delay=0.01) as proxy:
        calls = [asyncio.create_task(proxy.inference(i)) for i in range(6)]
        await wait_until(lambda: proxy.sizes != [])  # the first 4 run; 4 and 5 wait
        assert proxy.sizes == [4]
        calls[5].cancel()
        assert await asyncio.gather(*calls[:5]) == [0, 2, 4, 6, 8]
        assert calls[5].cancelled()
        assert proxy.sizes == [4, 1]
        assert proxy.stats.cancelled == 1


async def test_a_caller_cancelled_in_a_running_cut_batch_loses_only_its_result() -> None:
    async with Strict(batch_size=8, delay=0.01) as proxy:
        calls = [asyncio.create_task(proxy.inference(i)) for i in range(5)]
        await wait_until(lambda: proxy.sizes != [])  # the first 4 run (a fixed 1 ms was
        calls[1].cancel()  # not always enough on a loaded machine)
        results = await asyncio.gather(*calls, return_exceptions=True)
        assert isinstance(results[1], asyncio.CancelledError)
        assert [r for i, r in enumerate(results) if i != 1] == [0, 4, 6, 8]
        assert proxy.sizes == [4, 1]


async def test_a_batch_left_short_by_its_cancelled_callers_still_runs_at_allowed_sizes() -> None:
    async with Strict(batch_size=8) as proxy:
        calls = [asyncio.create_task(proxy.inference(i)) for i in range(8)]
        await asyncio.sleep(0)  # all queued; the batch task has not taken them yet
        calls[3].cancel()  # its future is done; the queue drops it at the pop
        results = await asyncio.gather(*calls, return_exceptions=True)
        assert results[:3] + results[4:] == [0, 2, 4, 8, 10, 12, 14]
        assert all(size in ALLOWED for size in proxy.sizes)
        assert sum(proxy.sizes) == 7


# -- pad (pad_item) --------------------------------------------------------------------


async def test_padded_batches_run_at_the_next_allowed_size_and_drop_the_filler() -> None:
    async with Strict(batch_size=8, allowed=(2, 4, 8), pad_item=None) as proxy:
        results = await asyncio.gather(*(proxy.inference(i) for i in range(13)))
        assert results == [2 * i for i in range(13)]
        assert proxy.sizes == [8, 8]
        assert proxy.calls[1] == [8, 9, 10, 11, 12, None, None, None]
        stats = proxy.stats
        assert (stats.items, stats.succeeded, stats.padded_rows) == (13, 13, 3)
        assert dict(stats.batch_sizes) == {5: 1, 8: 1}  # the real items only


async def test_a_lone_request_is_padded_to_the_smallest_size() -> None:
    async with Strict(batch_size=8, allowed=(4, 8), pad_item=0) as proxy:
        assert await proxy.inference(21) == 42
        assert proxy.calls == [[21, 0, 0, 0]]
        assert proxy.stats.padded_rows == 3


async def test_padding_wins_over_cutting_when_both_are_possible() -> None:
    async with Strict(batch_size=8, pad_item=0) as proxy:  # 1 is allowed: cutting could work
        await asyncio.gather(*(proxy.inference(i) for i in range(5)))
        assert proxy.sizes == [8]


async def test_a_caller_cancelled_in_a_running_padded_batch_loses_only_its_result() -> None:
    async with Strict(batch_size=8, allowed=(4, 8), pad_item=0, delay=0.01) as proxy:
        calls = [asyncio.create_task(proxy.inference(i)) for i in range(1, 4)]
        await asyncio.sleep(0.001)
        calls[0].cancel()
        results = await asyncio.gather(*calls, return_exceptions=True)
        assert isinstance(results[0], asyncio.CancelledError)
        assert results[1:] == [4, 6]
        assert proxy.calls == [[1, 2, 3, 0]]
        assert proxy.stats.cancelled == 1


async def test_padded_array_results_are_cut_back_to_the_callers() -> None:
    class Rows(Proxy[int, Any]):
        async def _inference(self, items: list[int]) -> Any:
            check(len(items))
            return np.arange(len(items)) + 100  # an array, one row per item

    async with Rows(batch_size=8, batch_sizes=batchproxy.BatchSizes(ALLOWED, pad_item=0)) as proxy:
        results = await asyncio.gather(*(proxy.inference(i) for i in range(3)))
        assert results == [100, 101, 102]


@pytest.mark.parametrize(("options", "n"), [({"pad_item": 0}, 3), ({}, 5)])
async def test_a_wrong_result_count_for_a_padded_or_split_call_fails_its_callers(
    options: dict[str, Any], n: int
) -> None:
    class OneShort(Proxy[int, int]):
        async def _inference(self, items: list[int]) -> list[int]:
            return items[:-1]

    async with OneShort(
        batch_size=16, batch_sizes=batchproxy.BatchSizes((1, 4, 8), **options)
    ) as proxy:
        results = await asyncio.gather(
            *(proxy.inference(i) for i in range(n)), return_exceptions=True
        )
        assert all(isinstance(r, batchproxy.BatchSizeMismatch) for r in results), results


async def test_per_item_errors_of_filler_rows_are_dropped() -> None:
    class FailsZero(Proxy[int, Any]):
        async def _inference(self, items: list[int]) -> list[Any]:
            check(len(items))
            return [ValueError("zero") if i == 0 else i for i in items]

    async with FailsZero(
        batch_size=8, batch_sizes=batchproxy.BatchSizes(ALLOWED, pad_item=0)
    ) as proxy:
        assert await asyncio.gather(*(proxy.inference(i) for i in (5, 6, 7))) == [5, 6, 7]
        assert proxy.stats.errors == 0


# -- every path that calls the model ---------------------------------------------------


@pytest.mark.parametrize("pad_item", [NO_ITEM, 0])
async def test_isolate_errors_reruns_at_allowed_sizes(pad_item: object) -> None:
    allowed = (1, 2, 8) if pad_item is NO_ITEM else (4, 8)
    options: dict[str, Any] = {} if pad_item is NO_ITEM else {"pad_item": 0}
    async with Strict(batch_size=8, allowed=allowed, isolate_errors=True, **options) as proxy:
        items: list[Any] = [1, 2, 3, "bad", 5, 6, 7, 8]
        results = await asyncio.gather(*map(proxy.inference, items), return_exceptions=True)
        assert isinstance(results[3], ValueError)
        assert [r for i, r in enumerate(results) if i != 3] == [2, 4, 6, 10, 12, 14, 16]
        assert all(size in allowed for size in proxy.sizes), proxy.sizes


async def test_oom_backoff_reruns_and_caps_at_allowed_sizes() -> None:
    async with Strict(batch_size=8, allowed=(2, 4, 8), pad_item=0, memory=4, oom_backoff=True) as p:
        assert await asyncio.gather(*(p.inference(i) for i in range(8))) == [
            2 * i for i in range(8)
        ]
        assert p.sizes == [8, 4, 4]
        await asyncio.gather(*(p.inference(i) for i in range(5)))  # the cap: 4
        assert p.sizes[3:] == [4, 2]  # 4, then 1 padded to 2
        assert all(size in (2, 4, 8) for size in p.sizes)
        assert p.stats.oom_splits == 1


async def test_oom_cap_rounds_down_to_an_allowed_size_when_cutting() -> None:
    async with Strict(batch_size=8, allowed=(1, 3, 8), memory=6, oom_backoff=True) as p:
        assert await asyncio.gather(*(p.inference(i) for i in range(8))) == [
            2 * i for i in range(8)
        ]
        # 8 ran out of memory: the cap is 4, so chunks of 4, each run as 3 + 1
        assert p.sizes == [8, 3, 1, 3, 1]
        await asyncio.gather(*(p.inference(i) for i in range(5)))
        assert p.sizes[5:] == [3, 1, 1]  # batches of the cap rounded down: 3


async def test_a_token_budget_batch_of_a_size_not_allowed_runs_as_allowed_calls() -> None:
    async with Strict(batch_size=8, length=len, max_batch_tokens=9) as proxy:
        results = await asyncio.gather(*(proxy.inference("abc") for _ in range(4)))
        assert results == ["abcabc"] * 4
        # 4 leave (an allowed size) but the budget keeps 3 of them: 2 + 1 model calls
        assert proxy.stats.batch_sizes == {3: 1, 1: 1}
        assert proxy.sizes == [2, 1, 1]


async def test_plain_def_model_on_its_worker_thread() -> None:
    class Threaded(Proxy[int, int]):
        def _inference(self, items: list[int]) -> list[int]:
            return strict()(items)

    async with Threaded(
        batch_size=8, batch_sizes=batchproxy.BatchSizes(ALLOWED, pad_item=0)
    ) as proxy:
        assert await asyncio.gather(*(proxy.inference(i) for i in range(7))) == [
            2 * i for i in range(7)
        ]


@pytest.mark.parametrize("options", [{}, {"pad_item": 0}])
async def test_process_workers_run_the_same_allowed_batches(options: dict[str, Any]) -> None:
    async with (
        batchproxy.ProcessWorkers(strict, 1) as workers,
        Proxy(
            batch_size=8, batch_sizes=batchproxy.BatchSizes(ALLOWED, **options), offload=workers
        ) as proxy,
    ):
        results = await asyncio.gather(*(proxy.inference(i) for i in range(13)))
        assert results == [2 * i for i in range(13)]


def test_the_strict_model_rejects_other_sizes() -> None:  # the tests above can fail
    with pytest.raises(WrongSize):
        strict()([1, 2, 3])


# -- the pieces ------------------------------------------------------------------------


def test_allowed_size_arithmetic() -> None:
    sizes = AllowedSizes((1, 2, 4, 8), pads=False)
    assert [sizes.fit(n) for n in (0, 1, 3, 7, 8, 20)] == [0, 1, 2, 4, 8, 8]
    assert [sizes.cover(n) for n in (1, 3, 5, 8, 9)] == [1, 4, 8, 8, 9]
    assert [sizes.top(cap) for cap in (1, 3, 8, 64)] == [1, 2, 8, 8]
    assert sizes.pieces(7) == [(4, 4), (2, 2), (1, 1)]
    padded = AllowedSizes((4, 8), pads=True)
    assert padded.top(2) == 4  # never below the smallest size
    assert padded.pieces(3) == [(3, 4)]
    assert padded.pieces(11) == [(8, 8), (3, 4)]


def test_waiting_for_the_next_size_is_bounded_by_the_window_and_the_deadline() -> None:
    sizes = AllowedSizes((1, 2, 4, 8), pads=False)
    wait = functools.partial(sizes.wait_until, last_arrival=1.0, gap=0.01)
    assert wait(5, closes=1.05, deadline_start=None) == pytest.approx(1.03)  # 3 more by 1.03
    assert wait(5, closes=1.03, deadline_start=None) is None  # the window closes first
    assert wait(5, closes=1.05, deadline_start=1.02) is None  # the deadline rule first
    assert wait(4, closes=1.05, deadline_start=None) is None  # an allowed size: no wait
    assert (
        sizes.wait_until(5, last_arrival=1.0, gap=math.inf, closes=9, deadline_start=None) is None
    )
    assert (
        AllowedSizes((1, 8), pads=True).wait_until(
            5, last_arrival=1.0, gap=0.01, closes=9, deadline_start=None
        )
        is None
    )  # padding never waits for a size


@pytest.mark.parametrize(
    ("pads", "n", "returned", "failed"),
    [
        (False, 7, [4, 2, 1], 0),
        (False, 7, [4, 1, 2], 3),  # the 2- and 1-pieces answered 1 and 2: even if the sum fits
        (True, 11, [8, 4], 0),
        (True, 11, [8, 3], 3),  # the 3 items padded to 4 got 3 results
    ],
)
async def test_sized_executor_checks_each_piece(
    pads: bool, n: int, returned: list[int], failed: int
) -> None:
    answers = iter(returned)
    seen: list[int] = []

    async def model(items: list[Any]) -> list[Any]:
        seen.append(len(items))
        return list(range(next(answers)))

    allowed = (4, 8) if pads else (1, 2, 4)
    executor = SizedExecutor(
        LoopExecutor(),
        AllowedSizes(allowed, pads=pads),
        Events(StatsRecorder("p"), Listeners("p")),
        name="p",
        filler=0,
    )
    results = await executor.run(model, list(range(n)))
    assert len(results) == n
    # a piece's mismatch fails that piece's callers alone (no telling whose result is
    # whose in it): the first piece, answered right, is served
    mismatched = [i for i, r in enumerate(results) if isinstance(r, batchproxy.BatchSizeMismatch)]
    assert mismatched == list(range(n - failed, n))
    assert all(size in allowed for size in seen)


async def test_the_decorator_takes_batch_sizes_and_pad_item() -> None:
    seen: list[int] = []

    @batchproxy.batch(batch_size=8, batch_sizes=batchproxy.BatchSizes((4, 8), pad_item=0))
    async def double(items: list[int]) -> list[int]:
        seen.append(len(items))
        check(len(items), (4, 8))
        return [2 * i for i in items]

    assert await double.inference_many([1, 2, 3]) == [2, 4, 6]
    assert seen == [4]
    assert double.stats.padded_rows == 1


@pytest.mark.looptime
async def test_an_error_in_one_cut_fails_only_that_cuts_callers() -> None:
    """A batch run as several model calls of allowed sizes: the call that raised fails
    its own callers; the other calls run and answer theirs (found by
    tests/failures/test_combinations.py: a caller got another call's error, and the calls
    after the one that raised never ran)."""
    calls: list[list[Any]] = []

    async def model(items: list[str]) -> list[str]:
        calls.append(list(items))
        if "boom" in items:
            raise RuntimeError("boom")
        return [f"out {item}" for item in items]

    executor = SizedExecutor(
        LoopExecutor(),
        AllowedSizes((1, 2, 4), pads=False),
        Events(StatsRecorder("p"), Listeners("p")),
        name="p",
    )
    results = await executor.run(model, ["a", "b", "c", "d", "boom", "e", "f"])
    assert [len(call) for call in calls] == [4, 2, 1]
    assert results[:4] == ["out a", "out b", "out c", "out d"]
    assert isinstance(results[4], RuntimeError)
    assert results[5] is results[4]  # in the call that raised
    assert results[6] == "out f"
