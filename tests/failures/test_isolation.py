"""Error isolation (`isolate_errors=True`): a batch that raises is re-run in halves so
only the items that make the model raise fail; the rest get their results."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterable
from typing import Any

import pytest
from _support import Recorder, assert_settled, outcome

import batchproxy


class Poison(ValueError):
    pass


def poisoned(bad: Iterable[Any]) -> Any:
    """A model that raises for a whole batch when any of `bad` is in it."""
    bad = set(bad)

    def respond(items: list[Any]) -> list[Any]:
        found = [item for item in items if item in bad]
        if found:
            raise Poison(f"cannot take {found}")
        return [("out", item) for item in items]

    return respond


async def burst(proxy: batchproxy.Proxy[Any, Any], items: Iterable[Any]) -> list[Any]:
    return list(await asyncio.gather(*(proxy.inference(i) for i in items), return_exceptions=True))


@pytest.mark.looptime
async def test_only_the_poison_item_fails_and_the_rest_get_their_results() -> None:
    async with Recorder(poisoned({5}), isolate_errors=True, batch_size=16) as proxy:
        answers = await burst(proxy, range(16))
        for i, answer in enumerate(answers):
            if i == 5:
                assert isinstance(answer, Poison)
                assert "cannot take [5]" in str(answer)  # what the model said of it alone
            else:
                assert answer == ("out", i)
        stats = proxy.stats
        assert stats.succeeded == 15
        assert stats.errors == 1
        assert stats.failed_batches == 0
        # 16 -> 8 -> 4 -> 2 -> 1: one split per level, two calls per split
        assert stats.isolation_splits == 4
        assert len(proxy.batches) == 1 + 2 * 4
        assert_settled(stats)


@pytest.mark.parametrize("bad", [set(), {0}, {15}, {3, 12}, {0, 1, 2, 3}, set(range(16))])
@pytest.mark.looptime
async def test_extra_calls_stay_within_the_bound(bad: set[int]) -> None:
    async with Recorder(poisoned(bad), isolate_errors=True, batch_size=16) as proxy:
        answers = await burst(proxy, range(16))
        assert [isinstance(a, Poison) for a in answers] == [i in bad for i in range(16)]
        extra = len(proxy.batches) - 1
        assert extra <= 2 * 16 - 2
        if len(bad) == 1:
            assert extra == 2 * math.ceil(math.log2(16))


@pytest.mark.looptime
async def test_without_isolation_a_raise_fails_the_whole_batch() -> None:
    async with Recorder(poisoned({5}), batch_size=16) as proxy:
        answers = await burst(proxy, range(16))
        assert all(isinstance(a, Poison) for a in answers)
        assert len(proxy.batches) == 1
        assert proxy.stats.isolation_splits == 0
        assert proxy.stats.failed_batches == 1


@pytest.mark.looptime
async def test_an_odd_batch_splits_unevenly_and_keeps_every_caller_in_place() -> None:
    async with Recorder(poisoned({"c"}), isolate_errors=True, batch_size=5) as proxy:
        answers = await burst(proxy, "abcde")
        assert [outcome_of(a) for a in answers] == ["a", "b", "Poison", "d", "e"]
        # abcde -> abc (raises) + de; abc -> ab + c (raises alone)
        assert [len(b) for b in proxy.batches] == [5, 3, 2, 1, 2]


def outcome_of(answer: Any) -> str:
    return type(answer).__name__ if isinstance(answer, BaseException) else answer[1]


@pytest.mark.looptime
async def test_a_base_exception_is_not_isolated() -> None:
    def respond(items: list[Any]) -> list[Any]:
        raise KeyboardInterrupt

    async with Recorder(respond, isolate_errors=True, batch_size=4) as proxy:
        answers = await burst(proxy, range(4))
        assert all(isinstance(a, batchproxy.InferenceError) for a in answers)
        assert len(proxy.batches) == 1


@pytest.mark.looptime
async def test_a_piece_answered_with_a_wrong_count_fails_the_batch_clearly() -> None:
    def respond(items: list[Any]) -> list[Any]:
        if len(items) == 4:
            raise Poison("too many")
        return [("out", item) for item in items] + [("extra", None)]

    async with Recorder(respond, isolate_errors=True, batch_size=4) as proxy:
        answers = await burst(proxy, range(4))
        assert all(isinstance(a, batchproxy.BatchSizeMismatch) for a in answers)
        assert proxy.stats.failed_batches == 1
        assert_settled(proxy.stats)


@pytest.mark.looptime
async def test_a_piece_answered_with_no_sequence_fails_the_batch_with_a_type_error() -> None:
    def respond(items: list[Any]) -> Any:
        if len(items) == 4:
            raise Poison("too many")
        return None

    async with Recorder(respond, isolate_errors=True, batch_size=4) as proxy:
        answers = await burst(proxy, range(4))
        assert all(isinstance(a, TypeError) for a in answers)
        assert "must return a sequence" in str(answers[0])


@pytest.mark.looptime
async def test_isolation_runs_do_not_feed_the_cost_model() -> None:
    async with Recorder(poisoned({"x"}), isolate_errors=True, batch_size=4, delay=0.01) as proxy:
        for _ in range(3):  # the warm-up, then one batch on the line
            await burst(proxy, range(4))
        await burst(proxy, range(5))  # 4 in one piece, then the fifth
        before = proxy.stats.cost_model
        assert before is not None
        await burst(proxy, [0, 1, 2, "x"])
        assert proxy.stats.cost_model == before  # the pieces were not one clean batch


@pytest.mark.looptime
async def test_a_cancelled_caller_in_an_isolated_batch_changes_nothing_for_the_others() -> None:
    async with Recorder(poisoned({1}), isolate_errors=True, batch_size=4, delay=0.1) as proxy:
        tasks = [asyncio.create_task(proxy.inference(i)) for i in range(4)]
        await asyncio.sleep(0.15)  # the whole batch raised; the halves are running
        tasks[3].cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert [outcome(t) for t in tasks] == ["ok", "Poison", "ok", "cancelled"]
        assert_settled(proxy.stats)


def test_isolate_errors_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="isolate_errors must be a bool"):
        Recorder(isolate_errors=1)
