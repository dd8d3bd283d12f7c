"""Length-aware batch formation: similar costs batched together, the token budget,
padding waste, and no starvation (a property test on a virtual clock)."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from typing import Any

import looptime
import pytest
from _support import Recorder
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

EPS = 2e-6  # looptime's clock resolution


def cost(item: Any) -> int:
    """Test items are (name, cost) pairs."""
    return int(item[1])


async def queue_behind_a_busy_model(proxy: Recorder, items: list[Any]) -> list[Any]:
    """Occupy the only slot, queue `items` (one per loop iteration, in order), return all."""
    blocker = asyncio.create_task(proxy.inference(("blocker", 1)))
    await asyncio.sleep(0.001)
    tasks = []
    for item in items:
        tasks.append(asyncio.create_task(proxy.inference(item)))
        await asyncio.sleep(0)
    return list(await asyncio.gather(blocker, *tasks))


@pytest.mark.looptime
async def test_batches_group_items_of_similar_length() -> None:
    items = [("a", 2), ("b", 50), ("c", 3), ("d", 51), ("e", 1), ("f", 52)]
    async with Recorder(batch_size=3, max_delay_ms=1, delay=1.0, length=cost) as proxy:
        results = await queue_behind_a_busy_model(proxy, items)
        assert results[1:] == [("out", item) for item in items]
        assert [sorted(name for name, _ in b) for b in proxy.batches[1:]] == [
            ["a", "c", "e"],
            ["b", "d", "f"],
        ]
        # the same items in FIFO order: every batch mixes short and long
        waste = proxy.stats.padding_waste
        assert waste is not None
        assert waste < 0.05


@pytest.mark.looptime
async def test_fifo_without_a_length_function_and_no_padding_stat() -> None:
    items = [("a", 2), ("b", 50), ("c", 3), ("d", 51)]
    async with Recorder(batch_size=2, max_delay_ms=1, delay=1.0) as proxy:
        await queue_behind_a_busy_model(proxy, items)
        assert proxy.batches[1:] == [[("a", 2), ("b", 50)], [("c", 3), ("d", 51)]]
        assert proxy.stats.padding_waste is None


@pytest.mark.looptime
async def test_padding_waste_is_padded_over_total() -> None:
    async with Recorder(batch_size=2, max_delay_ms=1, delay=1.0, length=cost) as proxy:
        await queue_behind_a_busy_model(proxy, [("a", 1), ("b", 3)])
        # batches: [blocker(1)] -> 1 of 1; [a(1), b(3)] -> 4 of 6 real
        assert proxy.stats.padding_waste == pytest.approx(2 / 7)


@pytest.mark.looptime
async def test_token_budget_caps_padded_size_and_a_huge_item_goes_alone() -> None:
    items = [("a", 10), ("b", 10), ("c", 10), ("huge", 500), ("d", 10)]
    options = {"batch_size": 8, "max_delay_ms": 1, "delay": 1.0, "length": cost}
    async with Recorder(max_batch_tokens=25, **options) as proxy:
        results = await queue_behind_a_busy_model(proxy, items)
        assert results[1:] == [("out", item) for item in items]
        for batch in proxy.batches:
            costs = [c for _, c in batch]
            assert len(batch) == 1 or len(batch) * max(costs) <= 25
        assert [("huge", 500)] in proxy.batches  # over the budget: alone, not refused


@pytest.mark.looptime
async def test_full_token_budget_leaves_without_waiting_for_the_window() -> None:
    loop = asyncio.get_running_loop()
    options = {"max_delay_ms": 1000, "max_concurrent_batches": 2, "length": cost}
    async with Recorder(batch_size=64, max_batch_tokens=30, delay=1.0, **options) as proxy:
        first = asyncio.create_task(proxy.inference(("first", 1)))
        await asyncio.sleep(0.001)
        start = loop.time()
        rest = [asyncio.create_task(proxy.inference((i, 10))) for i in range(3)]
        await asyncio.gather(first, *rest)
        assert proxy.started_at[1] - start < 0.01  # 30 tokens queued: the budget is full


@pytest.mark.looptime
async def test_oldest_goes_first_even_when_others_match_better() -> None:
    items = [("odd", 99), ("a", 1), ("b", 1), ("c", 1)]
    async with Recorder(batch_size=2, max_delay_ms=1, delay=1.0, length=cost) as proxy:
        await queue_behind_a_busy_model(proxy, items)
        assert proxy.batches[1][0] == ("odd", 99)


@pytest.mark.looptime
async def test_a_request_passed_over_three_times_goes_next() -> None:
    """y is among the 5 oldest but far in length from the oldest for three batches in
    a row: it then goes in the fourth, ahead of its turn as the oldest."""
    head = [("a", 10), ("b", 50), ("c", 20), ("d", 70), ("y", 90)]
    fillers = [(f"{n}-{i}", n) for n in (10, 50, 20, 70) for i in range(4)]
    async with Recorder(batch_size=5, max_delay_ms=1, delay=1.0, length=cost) as proxy:
        await queue_behind_a_busy_model(proxy, head + fillers)
        batches = [[name for name, _ in b] for b in proxy.batches[1:]]
        assert [b[0] for b in batches[:4]] == ["a", "b", "c", "d"]  # the oldest each time
        assert "y" in batches[3]  # forced after 3 passes, not left for a 5th batch


@pytest.mark.looptime
async def test_bad_length_results_fail_the_call_at_once() -> None:
    async with Recorder(length=lambda item: -1) as proxy:
        with pytest.raises(TypeError, match="length"):
            await proxy.inference("x")
    async with Recorder(length=lambda item: 1 / 0) as proxy:
        with pytest.raises(ZeroDivisionError):
            await proxy.inference("x")
        assert proxy.stats.requests == 0


@pytest.mark.looptime
async def test_budget_without_length_on_items_it_cannot_measure_says_what_to_do() -> None:
    async with Recorder(max_batch_tokens=100) as proxy:
        with pytest.raises(TypeError, match=r"pass length=\.\.\."):
            await proxy.inference("a string")
    async with Recorder(max_batch_tokens=100, length=len) as proxy:
        assert await proxy.inference("a string") == ("out", "a string")


def test_length_must_be_callable() -> None:
    with pytest.raises(TypeError, match="length"):
        Recorder(length=5)
    with pytest.raises(ValueError, match="max_batch_tokens"):
        Recorder(max_batch_tokens=0)


@dataclass(frozen=True)
class Arrival:
    id: int
    at: float
    cost: int


@settings(
    max_examples=int(os.environ.get("LENGTH_EXAMPLES", "150")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    raw=st.lists(
        st.tuples(
            st.integers(0, 20).map(lambda k: k * 0.01),  # bursts at shared instants
            st.sampled_from([1, 2, 16, 17, 40, 64]),  # clusters of similar length
        ),
        min_size=1,
        max_size=80,
    ),
    batch_size=st.integers(1, 8),
    max_delay_ms=st.sampled_from([0.0, 2.0, 10.0, 50.0]),
    budget=st.none() | st.integers(16, 256),
    model_delay=st.sampled_from([0.001, 0.01, 0.03]),
)
@pytest.mark.virtual_clock
def test_no_request_starves(
    raw: list[tuple[float, int]],
    batch_size: int,
    max_delay_ms: float,
    budget: int | None,
    model_delay: float,
) -> None:
    """At every dispatch the oldest waiting request is in the batch; every batch keeps
    to batch_size and the token budget; and (without a budget) no request is left out
    more than 3 times while among the batch_size oldest: it waits at most 3 batches
    longer than in FIFO order."""
    arrivals = [Arrival(i, at, c) for i, (at, c) in enumerate(raw)]
    proxy = Recorder(
        delay=model_delay,
        batch_size=batch_size,
        max_delay_ms=max_delay_ms,
        max_batch_tokens=budget,
        length=lambda a: a.cost,
    )

    queued_order: list[int] = []  # the real enqueue order (timers at equal times may swap)

    async def scenario() -> None:
        async def arrive(a: Arrival) -> None:
            await asyncio.sleep(a.at)
            queued_order.append(a.id)  # inference() queues synchronously, right after this
            assert await proxy.inference(a) == ("out", a)

        await asyncio.gather(*(arrive(a) for a in arrivals))
        await proxy.aclose()

    loop = looptime.new_event_loop(start=0.0)
    try:
        loop.run_until_complete(asyncio.wait_for(scenario(), timeout=3600))
    finally:
        loop.close()

    batch_index = {a.id: k for k, b in enumerate(proxy.batches) for a in b}
    passes: dict[int, int] = {}  # times left out while among the batch_size oldest
    assert sorted(batch_index) == [a.id for a in arrivals]
    for k, (batch, t) in enumerate(zip(proxy.batches, proxy.started_at, strict=True)):
        costs = [a.cost for a in batch]
        assert len(batch) <= batch_size
        if budget is not None and len(batch) > 1:
            assert len(batch) * max(costs) <= budget
        rank = {i: r for r, i in enumerate(queued_order)}
        waiting = sorted(
            (a for a in arrivals if a.at < t - EPS and batch_index[a.id] >= k),
            key=lambda a: rank[a.id],
        )
        if not waiting:
            continue
        assert min(a.at for a in batch) <= waiting[0].at + EPS, "the oldest was passed over"
        if budget is None:
            for left_out in waiting[:batch_size]:
                if batch_index[left_out.id] != k:
                    passes[left_out.id] = passes.get(left_out.id, 0) + 1
                    assert passes[left_out.id] <= 3, f"{left_out} passed over 4 times"


@pytest.mark.looptime
@pytest.mark.timeout(60)
async def test_a_caller_that_leaves_as_the_drain_begins_does_not_spin_the_loop() -> None:
    """Found by the combination walk (issue 38 item 3): a length-aware proxy (`length=`)
    with a tenant's call whose caller is cancelled in the iteration `aclose()` begins:
    the request, dead but counted until its cancellation's callback runs, was all the
    drain could send; `pop_similar` picks only live requests, found none, and the
    scheduler asked again, for ever, so that callback never ran (the loop spun)."""
    async with Recorder(batch_size=1, length=cost) as proxy:

        async def call() -> Any:
            await asyncio.sleep(0)
            return await proxy.inference(("a", 1), tenant="b")

        task = asyncio.create_task(call())

        async def leave() -> None:
            await asyncio.sleep(0)
            task.cancel()

        async def close() -> None:
            await asyncio.sleep(0)
            await proxy.aclose()

        await asyncio.gather(leave(), close())
        with pytest.raises(asyncio.CancelledError):
            await task
    stats = proxy.stats
    assert (stats.requests, stats.cancelled, stats.queue_depth, stats.batches) == (1, 1, 0, 0)
