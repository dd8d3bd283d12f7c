"""Fair sharing between tenants (`tenant=`, `FairQueue`): weighted fair queuing across
tenants, their own order within each, per-tenant queue limits, and how it composes
with priority, deadlines, cancellation, `inference_many`, streams and generation.
Scheduling runs on looptime; the flood runs in `batchproxy.simulation`."""

from __future__ import annotations

import asyncio
import functools
import math
import sys
from collections.abc import AsyncIterator, Hashable, Sequence
from pathlib import Path
from typing import Any

import pytest
from _support import Recorder, scheduler_of
from typing_extensions import override

import batchproxy
from batchproxy import END, GenerationProxy, Last, QueueFull, Step, simulation
from batchproxy._scheduling.fair_queue import FairQueue
from batchproxy._scheduling.placement import queued_by
from batchproxy._scheduling.queue import Request, RequestQueue

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # (the benchmarks package)
from benchmarks.scheduling import fairness


def request(
    item: Any,
    tenant: Hashable | None,
    *,
    priority: int = 0,
    deadline: float = math.inf,
    cost: int = 1,
    at: float = 0.0,
) -> Request[Any]:
    loop = asyncio.new_event_loop()
    future: asyncio.Future[Any] = loop.create_future()
    loop.close()
    made: Request[Any] = Request(item, future, priority, at, cost, deadline)
    made.tenant = tenant
    return made


def fill(queue: FairQueue[Any], tenant: Hashable | None, count: int, **kwargs: Any) -> None:
    for i in range(count):
        queue.push(request(f"{tenant}{i}", tenant, **kwargs))


def tenants_of(batch: Sequence[Request[Any]]) -> list[Hashable | None]:
    return [r.tenant for r in batch]


# -- the queue ----------------------------------------------------------------------------


def test_backlogged_tenants_share_each_batch_equally_by_default() -> None:
    queue: FairQueue[Any] = FairQueue()
    fill(queue, "flood", 100)
    fill(queue, "a", 3)
    fill(queue, "b", 3)
    batch = queue.pop_batch(6)
    assert sorted(map(str, tenants_of(batch))) == ["a", "a", "b", "b", "flood", "flood"]
    # each tenant's share in its own order
    assert [r.item for r in batch if r.tenant == "flood"] == ["flood0", "flood1"]
    assert (queue.live, queue.live_cost) == (100 - 2 + 2, 100 - 2 + 2)


def test_shares_follow_the_weights() -> None:
    weights = {"gold": 3.0, "free": 1.0}
    queue: FairQueue[Any] = FairQueue(weight=weights.__getitem__)
    fill(queue, "gold", 100)
    fill(queue, "free", 100)
    taken = [r.tenant for _ in range(10) for r in queue.pop_batch(8)]
    assert taken.count("gold") == 60
    assert taken.count("free") == 20


def test_a_tenant_alone_gets_every_place() -> None:
    queue: FairQueue[Any] = FairQueue()
    fill(queue, "only", 10)
    assert [r.item for r in queue.pop_batch(8)] == [f"only{i}" for i in range(8)]


def test_a_tenant_that_starts_waiting_banks_no_credit_for_its_idle_time() -> None:
    queue: FairQueue[Any] = FairQueue()
    fill(queue, "busy", 1000)
    for _ in range(50):  # "busy" alone for 50 batches
        queue.pop_batch(8)
    fill(queue, "late", 100)
    # the newcomer gets half of each batch, not every place until it has caught up
    for _ in range(3):
        assert tenants_of(queue.pop_batch(8)).count("late") == 4


def test_emptied_tenants_are_dropped() -> None:
    queue: FairQueue[Any] = FairQueue()
    for tenant in range(1000):
        fill(queue, tenant, 1)
    assert len(queue.by_tenant()) == 1000
    while queue.live:
        queue.pop_batch(64)
    assert queue.by_tenant() == {}
    assert queue._tenants == {}  # memory does not grow with the tenants ever seen


def test_fairness_comes_before_priority_and_deadlines_order_each_tenant() -> None:
    queue: FairQueue[Any] = FairQueue()
    fill(queue, "vip", 10, priority=5)
    queue.push(request("plain", "b"))
    queue.push(request("urgent", "b", deadline=1.0))
    queue.push(request("high", "b", priority=1))
    batch = queue.pop_batch(4)
    # "b" gets half the batch despite "vip"'s priority; within "b": priority, then deadline
    assert [r.item for r in batch if r.tenant == "b"] == ["high", "urgent"]
    assert queue.pop_batch(2)[-1].item == "plain"


def test_discard_drain_and_the_totals_stay_consistent() -> None:
    queue: FairQueue[Any] = FairQueue()
    gone = request("gone", "a", cost=5)
    queue.push(gone)
    fill(queue, "b", 2, cost=2)
    assert (queue.live, queue.live_cost) == (3, 9)
    assert queue.discard(gone) is True
    assert queue.discard(gone) is False
    assert queue.queued("a") == 0
    assert "a" not in queue.by_tenant()
    assert (queue.live, queue.live_cost) == (2, 4)
    assert [r.item for r in queue.drain()] == ["b0", "b1"]
    assert (queue.live, queue.live_cost, queue.by_tenant()) == (0, 0, {})


def test_callers_that_left_are_skipped_and_their_places_refilled() -> None:
    queue: FairQueue[Any] = FairQueue()
    fill(queue, "a", 4)
    fill(queue, "b", 4)
    for r in list(queue.in_pop_order(0.0))[:4]:
        r.future.cancel()  # two of a's and two of b's callers left
    batch = queue.pop_batch(4)
    assert len(batch) == 4
    assert not any(r.future.done() for r in batch)
    assert queue.live == 0


def test_oldest_and_earliest_deadline_look_across_tenants() -> None:
    queue: FairQueue[Any] = FairQueue()
    queue.push(request("x", "a", at=2.0, deadline=9.0))
    queue.push(request("y", "b", at=1.0, deadline=5.0))
    assert queue.oldest_enqueued_at() == 1.0
    assert queue.earliest_deadline() == 5.0
    assert FairQueue().oldest_enqueued_at() is None


def test_count_ahead_counts_the_others_fair_share_not_their_backlog() -> None:
    fair: FairQueue[Any] = FairQueue()
    plain: RequestQueue[Any] = RequestQueue()
    for queue in (fair, plain):
        for i in range(1000):
            queue.push(request(i, "flood", deadline=10.0))
    probe = request("new", "light", deadline=20.0)  # (shed_late asks with a deadline)
    assert plain.count_ahead(probe) == 1000
    assert fair.count_ahead(probe) == 0  # it would be the next one served
    fill(fair, "light", 3, deadline=5.0)
    assert fair.count_ahead(probe) == 6  # its own 3, and 3 of the flood's in between


def test_peek_and_take_advance_the_tenant_served() -> None:
    queue: FairQueue[Any] = FairQueue()
    fill(queue, "a", 3)
    fill(queue, "b", 3)
    order = []
    while (head := queue.peek()) is not None:
        queue.take([head])
        order.append(head.tenant)
    assert order == ["a", "b", "a", "b", "a", "b"]


def test_length_aware_batches_pick_in_fair_order() -> None:
    queue: FairQueue[Any] = FairQueue()
    fill(queue, "long", 20, cost=100)
    fill(queue, "short", 4, cost=10)
    batch = queue.pop_similar(4, None, 64)
    # the first in fair order is "long"'s (it started waiting first); the rest are the
    # closest in cost to it, and the "short" ones passed over wait at most 3 batches
    assert tenants_of(batch) == ["long"] * 4
    served = [tenants_of(queue.pop_similar(4, None, 64)) for _ in range(3)]
    assert "short" in [t for batch in served for t in batch]
    assert queue.live == 24 - 16


def test_aging_reaches_every_tenants_queue() -> None:
    queue: FairQueue[Any] = FairQueue(aging=1.0)
    fill(queue, "a", 1)
    fill(queue, "b", 1)
    queue.aging = 0.5
    assert all(t.queue.aging == 0.5 for t in queue._tenants.values())


def test_composites_nest_through_the_factory() -> None:
    """A FairQueue whose tenants' queues are FairQueues (by region, then user):
    what a keyed queue of fair queues, or the reverse, relies on."""

    def user_of(r: Request[Any]) -> Any:
        return r.item[1]

    class ByRegion(FairQueue[Any]):
        """Tenants are regions; within a region, users share fairly."""

    inner = functools.partial(FairQueue, weight=lambda tenant: 1.0)
    queue: FairQueue[Any] = ByRegion(factory=inner)
    for i in range(8):
        queue.push(request(("eu", i), "eu"))
    queue.push(request(("us", 0), "us"))
    batch = queue.pop_batch(2)
    assert sorted(r.tenant for r in batch) == ["eu", "us"]
    assert isinstance(next(iter(queue._tenants.values())).queue, FairQueue)
    assert queue.live == 7
    assert sum(map(user_of, queue.drain())) == sum(range(1, 8))


def test_a_tiny_weight_does_not_swallow_the_others_steps() -> None:
    """Issue 27 item 4: a weight of 1e-300 moved the virtual time to about 1e300, where
    a weight-1 tenant's step of 1 was lost to rounding: two equal tenants then took
    whole batches in turn, for the queue's lifetime. Passes are exact now."""
    weights = {"tiny": 1e-300, "tinier": 5e-324}
    queue: FairQueue[Any] = FairQueue(weight=lambda tenant: weights.get(tenant, 1.0))
    fill(queue, "tiny", 2)
    assert tenants_of(queue.pop_batch(1)) == ["tiny"]  # its pass jumps by 1e300
    fill(queue, "a", 100)
    fill(queue, "b", 100)
    # the newcomers start at its pass, where it is first on the tie; then its next
    # turn is 1e300 steps away, and a and b share every batch
    assert sorted(map(str, tenants_of(queue.pop_batch(9)))) == ["a"] * 4 + ["b"] * 4 + ["tiny"]
    for _ in range(3):
        assert sorted(map(str, tenants_of(queue.pop_batch(8)))) == ["a"] * 4 + ["b"] * 4
    queue.drain()
    fill(queue, "tinier", 1)  # the smallest float weight works as well
    queue.pop_batch(1)
    fill(queue, "c", 10)  # after the tiny ones have gone, newcomers still share
    fill(queue, "d", 10)
    assert sorted(map(str, tenants_of(queue.pop_batch(4)))) == ["c", "c", "d", "d"]


def test_a_huge_weight_takes_its_share_and_no_more() -> None:
    queue: FairQueue[Any] = FairQueue(weight=lambda tenant: 1e300 if tenant == "big" else 1.0)
    fill(queue, "big", 50)
    fill(queue, "small", 50)
    taken = tenants_of(queue.pop_batch(40))
    assert taken.count("small") == 1  # its first turn (a tie at the start), then none
    assert taken.count("big") == 39


def test_a_newcomer_starts_at_the_lowest_pass_after_a_cancellation() -> None:
    """Issue 27 item 10: the virtual time moved only on pops, so after the tenant with
    the lowest pass left by cancellation a newcomer started below every waiting pass
    and took every place until it caught up."""
    queue: FairQueue[Any] = FairQueue(weight=lambda tenant: 0.01 if tenant == "y" else 1.0)
    fill(queue, "x", 2)
    fill(queue, "y", 2)
    assert tenants_of(queue.pop_batch(2)) == ["x", "y"]  # passes: x 1, y 100
    (left,) = [r for r in queue.in_pop_order(0.0) if r.tenant == "x"]
    assert queue.discard(left)  # x leaves: the lowest waiting pass is y's 100
    fill(queue, "new", 10)
    # the newcomer starts at 100, tied with y who has waited longer: not at 1
    assert tenants_of(queue.pop_batch(2)) == ["y", "new"]


def test_a_pop_costs_a_heap_step_per_place_at_100000_tenants() -> None:
    """Issue 27 item 5: every batch rebuilt a heap over all the waiting tenants (reading
    each one's weight), so a burst from n distinct tenants cost O(n) per batch. Now a
    place reads one weight and costs one step of a heap kept between batches."""
    tenants, places = 100_000, 0
    reads = 0

    def weight(tenant: Hashable | None) -> float:
        nonlocal reads
        reads += 1
        if reads > 2 * tenants + 1000:
            raise AssertionError(f"{reads} weights read for {places} places")
        return 1.0

    loop = asyncio.new_event_loop()
    try:
        queue: FairQueue[Any] = FairQueue(weight=weight)
        for tenant in range(tenants):
            made: Request[Any] = Request(tenant, loop.create_future(), 0, 0.0)
            made.tenant = tenant
            queue.push(made)
        served = []
        while queue.live:
            batch = queue.pop_batch(32)
            places += len(batch)
            served += [r.tenant for r in batch]
        assert served == list(range(tenants))  # all tied: in the order they came
        assert queue._tenants == {}
        assert len(queue._heap) == 0
    finally:
        loop.close()


def test_a_plain_queue_holds_tenant_nones_requests_only() -> None:
    plain: RequestQueue[Any] = RequestQueue()
    plain.push(request(1, None))
    assert (queued_by(plain, None), queued_by(plain, "x")) == (1, 0)
    fair = FairQueue.around(plain)
    assert (fair.queued(None), fair.live) == (1, 1)


# -- the proxy ------------------------------------------------------------------------------

pytestmark_looptime = pytest.mark.looptime


@pytestmark_looptime
async def test_a_proxy_whose_calls_name_no_tenant_keeps_its_plain_queue() -> None:
    async with Recorder(batch_size=4, delay=1.0) as proxy:
        await proxy.inference(1)
        assert type(scheduler_of(proxy).queue) is RequestQueue
        assert proxy.stats.queued_by_tenant == {}


@pytestmark_looptime
async def test_the_first_call_naming_a_tenant_makes_the_queue_fair_keeping_what_waits() -> None:
    async with Recorder(batch_size=2, delay=1.0) as proxy:
        first = asyncio.create_task(proxy.inference("running"))
        await asyncio.sleep(0.1)  # its batch runs; the next ones wait
        anon = [asyncio.create_task(proxy.inference(f"anon{i}")) for i in range(4)]
        await asyncio.sleep(0)
        assert type(scheduler_of(proxy).queue) is RequestQueue
        named = asyncio.create_task(proxy.inference("named", tenant="t"))
        await asyncio.sleep(0)
        assert isinstance(scheduler_of(proxy).queue, FairQueue)
        assert proxy.stats.queued_by_tenant == {None: 4, "t": 1}
        await asyncio.gather(first, named, *anon)
        # the named tenant's call shared the next batch with tenant None's first
        assert proxy.batches[1] == ["anon0", "named"]
        assert proxy.stats.queued_by_tenant == {}


@pytestmark_looptime
async def test_a_light_tenant_is_not_stuck_behind_a_flood() -> None:
    async with Recorder(batch_size=4, delay=1.0) as proxy:
        loop = asyncio.get_running_loop()
        start = loop.time()
        flood = [asyncio.create_task(proxy.inference(f"f{i}", tenant="flood")) for i in range(40)]
        await asyncio.sleep(0.5)
        light = asyncio.create_task(proxy.inference("light", tenant="light"))
        await light
        assert loop.time() - start == pytest.approx(2.0)  # the second batch: its own share
        assert "light" in proxy.batches[1]
        await asyncio.gather(*flood)


@pytestmark_looptime
async def test_weights_set_the_shares_and_configure_changes_them() -> None:
    async with Recorder(batch_size=4, delay=1.0, tenant_weights={"gold": 3}) as proxy:
        calls = [
            asyncio.create_task(proxy.inference((tenant, i), tenant=tenant))
            for i in range(12)
            for tenant in ("gold", "free")
        ]
        await asyncio.sleep(1.5)  # the first batch runs; the rest wait
        proxy.configure(tenant_weights={"gold": 1, "free": 1})
        await asyncio.gather(*calls)

        def golds(batch: list[Any]) -> int:
            return sum(1 for tenant, _ in batch if tenant == "gold")

        assert golds(proxy.batches[1]) == 3  # 3:1 while the first batch ran
        assert golds(proxy.batches[3]) == 2  # 1:1 once configured
    assert proxy.options.tenant_weights == {"gold": 1.0, "free": 1.0}


@pytestmark_looptime
async def test_the_per_tenant_limit_refuses_the_flooding_tenant_only() -> None:
    async with Recorder(batch_size=2, delay=1.0, max_queue_size_per_tenant=3) as proxy:
        running = asyncio.create_task(proxy.inference("r", tenant="flood"))
        await asyncio.sleep(0.1)
        flood = [asyncio.create_task(proxy.inference(i, tenant="flood")) for i in range(3)]
        await asyncio.sleep(0)
        with pytest.raises(QueueFull) as refused:
            await proxy.inference("one too many", tenant="flood")
        error = refused.value
        assert "max_queue_size_per_tenant: 3" in str(error)
        assert "flood" not in str(error)  # a tenant may be a user's id: not in the message
        assert (error.tenant, error.per_tenant, error.max_queue_size) == ("flood", True, 3)
        others = [asyncio.create_task(proxy.inference(i, tenant="other")) for i in range(3)]
        await asyncio.gather(running, *flood, *others)
        stats = proxy.stats
        assert (stats.rejected, stats.tenant_rejected, stats.succeeded) == (1, 1, 7)


@pytestmark_looptime
async def test_the_per_tenant_limit_counts_calls_without_a_tenant_as_tenant_none() -> None:
    async with Recorder(batch_size=2, delay=1.0, max_queue_size_per_tenant=1) as proxy:
        running = asyncio.create_task(proxy.inference("r"))
        await asyncio.sleep(0.1)
        waiting = asyncio.create_task(proxy.inference("w"))
        await asyncio.sleep(0)
        with pytest.raises(QueueFull, match="max_queue_size_per_tenant"):
            await proxy.inference("x")
        assert type(scheduler_of(proxy).queue) is RequestQueue  # still no tenant named
        named = asyncio.create_task(proxy.inference("n", tenant="t"))
        assert await asyncio.gather(running, waiting, named)


@pytestmark_looptime
async def test_max_queue_size_still_bounds_the_total() -> None:
    async with Recorder(
        batch_size=2, delay=1.0, max_queue_size=2, max_queue_size_per_tenant=5
    ) as proxy:
        running = asyncio.create_task(proxy.inference("r", tenant="a"))
        await asyncio.sleep(0.1)
        waiting = [asyncio.create_task(proxy.inference(i, tenant=i)) for i in range(2)]
        await asyncio.sleep(0)
        with pytest.raises(QueueFull) as refused:
            await proxy.inference("x", tenant="b")
        assert not refused.value.per_tenant
        assert "queue is full (2 " in str(refused.value)
        await asyncio.gather(running, *waiting)
        assert proxy.stats.tenant_rejected == 0


@pytestmark_looptime
async def test_inference_many_names_one_tenant_for_all_its_items() -> None:
    async with Recorder(batch_size=4, delay=1.0, max_queue_size_per_tenant=4) as proxy:
        running = asyncio.create_task(proxy.inference("r", tenant="b"))
        await asyncio.sleep(0.1)
        with pytest.raises(QueueFull):  # five items for a tenant with room for four: none
            await proxy.inference_many(list(range(5)), tenant="a")
        assert proxy.stats.tenant_rejected == 5
        assert proxy.stats.queue_depth == 0
        many = asyncio.create_task(proxy.inference_many(list(range(4)), tenant="a"))
        await asyncio.sleep(0)
        b = [asyncio.create_task(proxy.inference(f"b{i}", tenant="b")) for i in range(2)]
        results = await many
        await asyncio.gather(running, *b)
        assert results == [("out", i) for i in range(4)]
        assert sorted(map(str, proxy.batches[1])) == ["0", "1", "b0", "b1"]


@pytestmark_looptime
async def test_a_cancelled_caller_leaves_its_tenants_queue_and_running_batch() -> None:
    async with Recorder(batch_size=2, delay=1.0) as proxy:
        running = asyncio.create_task(proxy.inference("r", tenant="a"))
        await asyncio.sleep(0.1)
        queued = asyncio.create_task(proxy.inference("q", tenant="b"))
        await asyncio.sleep(0)
        assert proxy.stats.queued_by_tenant == {"b": 1}
        queued.cancel()
        running.cancel()  # while its batch runs: its result is dropped
        await asyncio.gather(queued, running, return_exceptions=True)
        await asyncio.sleep(0)
        stats = proxy.stats
        assert (stats.queue_depth, dict(stats.queued_by_tenant), stats.cancelled) == (0, {}, 2)
        assert await proxy.inference("next", tenant="b") == ("out", "next")
        assert "q" not in [item for batch in proxy.batches for item in batch]


@pytestmark_looptime
async def test_a_deadline_passing_in_the_queue_fails_only_that_call() -> None:
    async with Recorder(batch_size=2, delay=1.0) as proxy:
        running = asyncio.create_task(proxy.inference("r", tenant="a"))
        await asyncio.sleep(0.1)
        late = asyncio.create_task(proxy.inference("late", tenant="b", timeout=0.5))
        kept = asyncio.create_task(proxy.inference("kept", tenant="b"))
        with pytest.raises(batchproxy.DeadlineExceeded):
            await late
        assert proxy.stats.queued_by_tenant == {"b": 1}
        assert await kept == ("out", "kept")
        await running
        assert proxy.stats.timed_out == 1


@pytestmark_looptime
async def test_shed_late_predicts_by_the_tenants_share_not_the_flood() -> None:
    async with Recorder(batch_size=4, delay=1.0, shed_late=True) as proxy:
        for _ in range(3):  # teach the cost model: a batch takes 1 s
            await asyncio.gather(*(proxy.inference(i) for i in range(4)))
        flood = [
            asyncio.create_task(proxy.inference(i, tenant="flood", priority=1)) for i in range(40)
        ]
        await asyncio.sleep(0.1)
        # ten batches of flood ahead (of a higher priority, even), but a light tenant
        # rides the next one; the flooder's own call would wait behind its flood
        assert await proxy.inference("light", tenant="light", timeout=3.0) == ("out", "light")
        with pytest.raises(batchproxy.DeadlineExceeded):
            await proxy.inference("more", tenant="flood", timeout=3.0)
        assert proxy.stats.shed == 1
        await asyncio.gather(*flood)


class Streams(batchproxy.Proxy[str, str]):
    @override
    async def _inference(self, items: list[str]) -> AsyncIterator[list[Any]]:
        await asyncio.sleep(1.0)
        yield [Last(f"{item}!") for item in items]


class Echo(GenerationProxy[str, str]):
    @override
    async def _step(self, step: Step[str]) -> Sequence[Any]:
        await asyncio.sleep(1.0)
        return [END if slot.state else self._first(slot) for slot in step.active]

    @staticmethod
    def _first(slot: batchproxy.Slot[str]) -> str:
        slot.state = True
        return slot.item


@pytestmark_looptime
@pytest.mark.parametrize(
    ("kind", "light_ends"),
    [
        # a batch of 2 takes 1 s: light rides the second batch
        (Streams, 2.0),
        # f0 and f1 ran two steps; then the two free places went to f2 and light (the
        # flood's tenant came first, so wins the tie), before f3..f5: light's two
        # steps end at 4 s (in arrival order, at 8 s)
        (Echo, 4.0),
    ],
)
async def test_streams_and_generation_share_fairly(
    kind: type[batchproxy.Proxy[str, str]], light_ends: float
) -> None:
    async with kind(batch_size=2) as proxy:

        async def read(item: str, tenant: str) -> list[str]:
            return [chunk async for chunk in proxy.stream(item, tenant=tenant)]

        calls = [asyncio.create_task(read(f"f{i}", "flood")) for i in range(6)]
        await asyncio.sleep(0.1)
        assert len(await read("light", "light")) == 1
        assert asyncio.get_running_loop().time() == pytest.approx(light_ends)
        await asyncio.gather(*calls)


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"tenant_weights": [("a", 1)]}, TypeError, "tenant_weights must be a mapping"),
        ({"tenant_weights": {"a": 0}}, ValueError, r"tenant_weights\['a'\] must be a finite"),
        ({"tenant_weights": {"a": -1}}, ValueError, "must be a finite number > 0"),
        ({"tenant_weights": {"a": math.inf}}, ValueError, "must be a finite number > 0"),
        ({"tenant_weights": {"a": math.nan}}, ValueError, "must be a finite number > 0"),
        ({"tenant_weights": {"a": True}}, TypeError, "must be a number"),
        ({"tenant_weights": {"a": "2"}}, TypeError, "must be a number"),
        ({"tenant_weights": {"a": 10**400}}, ValueError, "must be a finite number > 0"),
        ({"tenant_weights": {"a": -(10**400)}}, ValueError, "must be a finite number > 0"),
        ({"max_queue_size_per_tenant": 0}, ValueError, "max_queue_size_per_tenant"),
        ({"max_queue_size_per_tenant": 1.5}, TypeError, "max_queue_size_per_tenant"),
    ],
)
def test_bad_tenant_options_are_refused_at_construction_and_by_configure(
    options: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        Recorder(**options)
    proxy = Recorder()
    with pytest.raises(error, match=message):
        proxy.configure(**options)
    assert proxy.options.tenant_weights is None


def test_any_positive_float_weight_is_accepted() -> None:
    proxy = Recorder(tenant_weights={"tiny": 5e-324, "huge": 1.7e308})
    assert proxy.options.tenant_weights == {"tiny": 5e-324, "huge": 1.7e308}


def test_weights_are_copied_so_a_later_change_bypasses_no_check() -> None:
    weights = {"a": 2.0}
    proxy = Recorder(tenant_weights=weights)
    weights["a"] = -1.0
    assert proxy.options.tenant_weights == {"a": 2.0}
    with pytest.raises(TypeError):
        proxy.options.tenant_weights["a"] = 3.0  # type: ignore[index]


@pytestmark_looptime
async def test_an_unhashable_tenant_is_refused_with_a_clear_error() -> None:
    async with Recorder() as proxy:
        with pytest.raises(TypeError, match="tenant must be hashable"):
            await proxy.inference(1, tenant=["a"])
        with pytest.raises(TypeError, match="tenant must be hashable"):
            await proxy.inference_many([1], tenant={})
        assert proxy.stats.requests == 0


# -- the flood, on the virtual clock --------------------------------------------------------


@pytest.mark.parametrize("cost", ["20 ms + 0.1 ms/item"])
def test_a_10x_flood_leaves_the_others_p99_within_20_percent(cost: str) -> None:
    """benchmarks/scheduling/fairness.py's scenario: four tenants at 150 calls/s, one of them at
    10x, against a model the flood overloads. FIFO: the others wait behind the flood;
    fair sharing: their p99 stays within 20 % of their p99 with no flood, and only the
    flooder is refused."""
    line = fairness.COSTS[cost]

    def side(name: str) -> fairness.Outcome:
        return simulation.run(fairness.scenario(line, name, duration=4.0))

    unloaded, fifo, fair = side("unloaded"), side("FIFO"), side("fair")
    assert fair.others_p99_ms <= 1.2 * unloaded.others_p99_ms
    assert fifo.others_p99_ms > 3 * unloaded.others_p99_ms  # what fairness is for
    assert fair.others_refused == 0
    assert fair.flooder_refused > 0.1
