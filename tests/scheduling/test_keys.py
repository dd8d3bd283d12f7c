"""Batches by key (`key=`): each batch holds one key's requests, the keys take turns,
a full batch overtakes a partial one only inside its window, and the model reads
its batch's key with `batch_key()`. On the virtual clock."""

from __future__ import annotations

import asyncio
import random
import sys
from collections.abc import AsyncIterator, Hashable, Sequence
from typing import Any

import pytest
from _support import Recorder, scheduler_of
from typing_extensions import override

import batchproxy
from batchproxy import GenerationProxy, Step, batch_key
from batchproxy._scheduling.fair_queue import FairQueue
from batchproxy._scheduling.keyed_queue import _NOBODY, KeyedQueue
from batchproxy._scheduling.queue import Request, RequestQueue

pytestmark = pytest.mark.looptime


class Keyed(Recorder):
    """Records each batch's key as the model reads it."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.keys: list[object] = []

    @override
    async def _inference(self, items: list[Any]) -> Sequence[Any]:
        self.keys.append(batch_key())
        return await super()._inference(items)


async def queue_behind_a_running_batch(proxy: Recorder) -> asyncio.Task[Any]:
    """Occupy the proxy's one slot with a batch (of key None) for `proxy.delay`."""
    busy = asyncio.create_task(proxy.inference("busy"))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert proxy.batches == [["busy"]]
    return busy


async def test_calls_are_batched_only_with_calls_of_their_own_key() -> None:
    async with Keyed(batch_size=8, delay=1.0, max_delay_ms=10) as proxy:
        busy = await queue_behind_a_running_batch(proxy)
        calls = [proxy.inference(f"{key}{i}", key=key) for i in range(3) for key in "ab"]
        results = await asyncio.gather(busy, *calls)
        assert results[1:] == [("out", f"{key}{i}") for i in range(3) for key in "ab"]
        assert proxy.batches == [["busy"], ["a0", "a1", "a2"], ["b0", "b1", "b2"]]
        assert proxy.keys == [None, "a", "b"]


async def test_the_key_option_is_a_function_of_the_item_and_a_calls_own_key_wins() -> None:
    async with Keyed(batch_size=8, delay=1.0, key=lambda item: item[0]) as proxy:
        busy = await queue_behind_a_running_batch(proxy)
        calls = [proxy.inference(x) for x in ("a1", "b1", "a2")]
        calls.append(proxy.inference("b2", key="a"))  # its own key: it goes with the a's
        await asyncio.gather(busy, *calls)
        assert proxy.batches[1:] == [["a1", "a2", "b2"], ["b1"]]
        assert proxy.keys == ["b", "a", "b"]  # "busy"'s key is its first letter


async def test_keys_take_turns_in_the_order_their_waiting_began() -> None:
    async with Keyed(batch_size=2, delay=1.0, max_delay_ms=0) as proxy:
        busy = await queue_behind_a_running_batch(proxy)
        calls = [proxy.inference(f"a{i}", key="a") for i in range(6)]
        calls += [proxy.inference("b0", key="b"), proxy.inference("c0", key="c")]
        await asyncio.gather(busy, *calls)
        # a, b and c in turn; a full batch of a never waits behind a partial b past its
        # window (0 here), so b and c each get their turn between a's batches
        assert proxy.batches[1:] == [["a0", "a1"], ["b0"], ["c0"], ["a2", "a3"], ["a4", "a5"]]


async def test_a_full_batch_overtakes_a_partial_one_inside_its_window() -> None:
    loop = asyncio.get_running_loop()
    async with Keyed(batch_size=2, delay=1.0, max_delay_ms=5000, window="fixed") as proxy:
        busy = await queue_behind_a_running_batch(proxy)
        b = asyncio.create_task(proxy.inference("b0", key="b"))  # b's waiting begins first
        await asyncio.sleep(0)
        calls = [proxy.inference(f"a{i}", key="a") for i in range(4)]
        start = loop.time()
        await asyncio.gather(busy, b, *calls)
        # b is partial and within its 5 s window: a's full batches go before it, and b
        # keeps its place (it goes next when its window ends, or when nobody is full)
        assert proxy.batches[1:] == [["a0", "a1"], ["a2", "a3"], ["b0"]]
        assert proxy.started_at[-1] - start == pytest.approx(3.0)


@pytest.mark.parametrize("tenant", [None, "t"])
@pytest.mark.parametrize(("first", "then"), [(8, 4), (2, 4)], ids=["lowered", "raised"])
async def test_a_batch_size_change_finds_the_keys_it_makes_full(
    first: int, then: int, tenant: str | None
) -> None:
    """Lowered to 4, "a"'s 4 waiting fill a batch: it overtakes "b" (partial, inside its
    window). Raised from 2, "a" fills one of 4 as it did one of 2; "b" waits still."""
    async with Keyed(batch_size=first, delay=1.0, max_delay_ms=5000, window="fixed") as proxy:
        # a keyed batch runs (its pop asked for the full keys at the first size)
        busy = asyncio.create_task(proxy.inference("c0", key="c", tenant=tenant))
        await asyncio.sleep(0.1)
        assert proxy.batches == [["c0"]]
        b = asyncio.create_task(proxy.inference("b0", key="b", tenant=tenant))
        await asyncio.sleep(0)
        calls = [proxy.inference(f"a{i}", key="a", tenant=tenant) for i in range(4)]
        tasks = [asyncio.create_task(call) for call in calls]
        await asyncio.sleep(0.1)
        assert scheduler_of(proxy).queue.waiting_per_key() == {"b": 1, "a": 4}
        proxy.configure(batch_size=then)
        await asyncio.gather(busy, b, *tasks)
        assert proxy.batches[1:] == [["a0", "a1", "a2", "a3"], ["b0"]]


async def test_a_flooding_key_does_not_starve_a_partial_one_past_its_window() -> None:
    loop = asyncio.get_running_loop()
    async with Keyed(batch_size=2, delay=1.0, max_delay_ms=2500, window="fixed") as proxy:
        stop = False

        async def flood() -> None:
            i = 0
            while not stop:  # always a full batch of a waiting
                await asyncio.gather(*(proxy.inference(f"a{i + j}", key="a") for j in range(4)))
                i += 4

        flooders = [asyncio.create_task(flood()) for _ in range(3)]
        await asyncio.sleep(3.5)
        asked = loop.time()
        assert await proxy.inference("b", key="b") == ("out", "b")
        waited = loop.time() - asked
        stop = True
        await asyncio.gather(*flooders)
        # its window (2.5 s), then the batch running when it ended (1 s), then its own
        assert 2.5 <= waited <= 4.5 + 1e-6
        assert ["b"] in proxy.batches


async def test_batch_key_is_readable_on_a_worker_thread_and_none_without_a_key() -> None:
    seen: list[object] = []

    class Threaded(batchproxy.Proxy[str, str]):
        @override
        def _inference(self, items: list[str]) -> list[str]:
            seen.append(batch_key())
            return items

    async with Threaded(batch_size=4, offload=True) as proxy:
        assert await proxy.inference("x") == "x"
        assert await proxy.inference("y", key=("lora", 7)) == "y"
        assert seen == [None, ("lora", 7)]


def test_batch_key_outside_a_model_call_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="batch_key"):
        batch_key()


async def test_a_proxy_whose_calls_have_no_key_keeps_its_plain_queue() -> None:
    async with Keyed(batch_size=4) as proxy:
        await proxy.inference("x")
        assert type(scheduler_of(proxy).queue) is RequestQueue
        await proxy.inference("y", key="k")
        assert type(scheduler_of(proxy).queue) is KeyedQueue


async def test_requests_queued_before_the_first_key_keep_their_place_as_key_none() -> None:
    async with Keyed(batch_size=8, delay=1.0) as proxy:
        busy = await queue_behind_a_running_batch(proxy)
        plain = [proxy.inference(f"n{i}") for i in range(2)]
        keyed = proxy.inference("k0", key="k")
        await asyncio.gather(busy, *plain, keyed)
        assert proxy.batches[1:] == [["n0", "n1"], ["k0"]]
        assert proxy.keys[1:] == [None, "k"]


async def test_priority_and_deadlines_apply_within_a_key() -> None:
    async with Keyed(batch_size=2, delay=1.0, max_delay_ms=0) as proxy:
        busy = await queue_behind_a_running_batch(proxy)
        low = proxy.inference("low", key="a")
        late = asyncio.ensure_future(proxy.inference("late", key="a", timeout=0.5))
        high = proxy.inference("high", key="a", priority=5)
        mid = proxy.inference("mid", key="a", priority=1)
        results = await asyncio.gather(busy, low, high, mid, late, return_exceptions=True)
        assert isinstance(results[-1], TimeoutError)  # expired while queued
        assert proxy.batches[1:] == [["high", "mid"], ["low"]]
        assert "late" not in [item for batch in proxy.batches for item in batch]


async def test_a_cancelled_caller_leaves_its_key_and_an_emptied_key_goes() -> None:
    async with Keyed(batch_size=4, delay=1.0) as proxy:
        busy = await queue_behind_a_running_batch(proxy)
        gone = asyncio.create_task(proxy.inference("gone", key="g"))
        kept = asyncio.create_task(proxy.inference("kept", key="k"))
        await asyncio.sleep(0)
        queue = scheduler_of(proxy).queue
        assert queue.waiting_per_key() == {"g": 1, "k": 1}
        gone.cancel()
        await asyncio.sleep(0)
        assert queue.waiting_per_key() == {"k": 1}
        assert queue.live == 1
        await asyncio.gather(busy, kept)
        assert proxy.batches[1:] == [["kept"]]
        assert proxy.stats.cancelled == 1


async def test_a_caller_cancelled_while_its_keyed_batch_runs_is_dropped() -> None:
    async with Keyed(batch_size=4, delay=1.0) as proxy:
        calls = [asyncio.create_task(proxy.inference(i, key="k")) for i in range(3)]
        await asyncio.sleep(0.5)
        calls[1].cancel()
        done = await asyncio.gather(*calls, return_exceptions=True)
        assert done[0] == ("out", 0)
        assert done[2] == ("out", 2)
        assert isinstance(done[1], asyncio.CancelledError)
        assert proxy.stats.cancelled == 1


async def test_length_aware_batches_form_within_a_key() -> None:
    async with Keyed(
        batch_size=8, delay=1.0, length=len, max_batch_tokens=8, key=lambda s: s[0]
    ) as proxy:
        busy = await queue_behind_a_running_batch(proxy)
        items = ["a1234567", "b1", "a1", "b1234567", "a2", "b2"]
        await asyncio.gather(busy, *(proxy.inference(x) for x in items))
        for batch in proxy.batches[1:]:
            assert len({x[0] for x in batch}) == 1  # one key
            assert len(batch) * max(map(len, batch)) <= 8 or len(batch) == 1
        assert sorted(x for batch in proxy.batches[1:] for x in batch) == sorted(items)


async def test_max_queue_size_bounds_every_key_together() -> None:
    async with Keyed(batch_size=4, delay=1.0, max_queue_size=2) as proxy:
        busy = await queue_behind_a_running_batch(proxy)
        a = asyncio.create_task(proxy.inference("a", key="a"))
        b = asyncio.create_task(proxy.inference("b", key="b"))
        await asyncio.sleep(0)
        with pytest.raises(batchproxy.QueueFull):
            await proxy.inference("c", key="c")
        await asyncio.gather(busy, a, b)


async def test_inference_many_with_a_key() -> None:
    async with Keyed(batch_size=8, delay=1.0) as proxy:
        busy = await queue_behind_a_running_batch(proxy)
        many = proxy.inference_many([1, 2, 3], key="m")
        one = proxy.inference(4, key="o")
        assert (await asyncio.gather(busy, many, one))[1] == [("out", i) for i in (1, 2, 3)]
        assert proxy.batches[1:] == [[1, 2, 3], [4]]


async def test_a_streaming_proxy_batches_by_key() -> None:
    class Echo(batchproxy.Proxy[str, str]):
        def __init__(self) -> None:
            super().__init__(batch_size=8)
            self.batches: list[tuple[object, list[str]]] = []

        @override
        async def _inference(self, items: list[str]) -> AsyncIterator[list[str]]:
            self.batches.append((batch_key(), list(items)))
            await asyncio.sleep(1.0)
            yield [item.upper() for item in items]

    async def read(stream: AsyncIterator[str]) -> list[str]:
        return [chunk async for chunk in stream]

    async with Echo() as proxy:
        first = asyncio.create_task(read(proxy.stream("x")))
        await asyncio.sleep(0.1)
        streams = [read(proxy.stream(s, key=s[0])) for s in ("a1", "b1", "a2")]
        assert await asyncio.gather(first, *streams) == [["X"], ["A1"], ["B1"], ["A2"]]
        assert proxy.batches == [(None, ["x"]), ("a", ["a1", "a2"]), ("b", ["b1"])]


async def test_a_generation_proxy_refuses_keys() -> None:
    class Gen(GenerationProxy[str, str]):
        @override
        async def _step(self, step: Step[str]) -> list[Any]:
            return [batchproxy.Last(slot.item) for slot in step.active]

    async with Gen(timeout=1.0) as proxy:
        with pytest.raises(TypeError, match="GenerationProxy does not batch by key"):
            await proxy.stream("x", key="k").__anext__()
        await asyncio.sleep(2.0)  # past the refused call's deadline: it had none left
        assert proxy.stats.timed_out == 0
        assert [chunk async for chunk in proxy.stream("y")] == ["y"]


async def test_bad_keys_are_refused_before_queueing() -> None:
    with pytest.raises(TypeError, match="key must be a callable"):
        Keyed(key="not callable")
    async with Keyed(batch_size=4, key=lambda item: [item]) as proxy:
        with pytest.raises(TypeError, match="key must be hashable"):
            await proxy.inference("x")
        with pytest.raises(TypeError, match="key must be hashable"):
            await proxy.inference("x", key={})
        assert proxy.stats.requests == 0
        assert proxy.batches == []


async def test_a_refused_key_or_tenant_leaves_no_deadline_timer() -> None:
    """The checks come before the call's deadline timer is armed (a refused call with a
    `timeout` used to leave its timer, which then fired into a call nobody made)."""
    loop = asyncio.get_running_loop()
    async with Keyed(batch_size=4) as proxy:
        before = len(loop._scheduled)  # type: ignore[attr-defined]
        for bad in ({"key": []}, {"tenant": []}):
            with pytest.raises(TypeError, match="must be hashable"):
                await proxy.inference("x", timeout=5.0, **bad)  # type: ignore[arg-type]
        assert len(loop._scheduled) == before  # type: ignore[attr-defined]
        await asyncio.sleep(10.0)
        assert proxy.stats.timed_out == proxy.stats.requests == 0


async def test_identical_calls_share_a_slot_only_within_their_key() -> None:
    async with Keyed(batch_size=4, key=lambda item: item[0], dedup=True) as proxy:
        results = await asyncio.gather(*(proxy.inference(x) for x in ["a1", "a1", "b1", "a2"]))
        assert results == [("out", x) for x in ["a1", "a1", "b1", "a2"]]
        assert sorted(map(sorted, proxy.batches)) == [["a1", "a2"], ["b1"]]
        assert proxy.stats.deduplicated == 1


async def test_the_batch_decorator_takes_the_key_option() -> None:
    seen: list[tuple[object, list[str]]] = []

    @batchproxy.batch(batch_size=8, key=len)
    async def words(items: list[str]) -> list[str]:
        seen.append((batch_key(), list(items)))
        return items

    assert await asyncio.gather(words("ab"), words("c"), words("de")) == ["ab", "c", "de"]
    assert sorted(seen, key=lambda entry: str(entry[0])) == [(1, ["c"]), (2, ["ab", "de"])]
    await words.aclose()


# -- the queue on its own ------------------------------------------------------------------


def new_request(key: object, item: object = None, priority: int = 0) -> Request[Any]:
    future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    request: Request[Any] = Request(item, future, priority, 0.0)
    request.key = key  # type: ignore[assignment]
    return request


async def test_the_queue_counts_drains_and_drops_emptied_keys() -> None:
    queue: KeyedQueue[Any] = KeyedQueue(lambda: 0.0, lambda: 0.0, aging=0.5)
    requests = [new_request(key, i) for i, key in enumerate("abab")]
    for request in requests:
        queue.push(request)
    assert (queue.live, queue.live_cost) == (4, 4)
    assert queue.waiting_per_key() == {"a": 2, "b": 2}
    assert queue.full_reason(2, None) == "full"
    assert queue.full_reason(3, None) is None
    queue.aging = 1.0
    assert queue.aging == 1.0
    assert queue.discard(requests[0])
    assert not queue.discard(requests[0])
    assert [r.item for r in queue.pop_batch(4)] == [2]
    assert queue.waiting_per_key() == {"b": 2}
    assert queue.count_ahead(new_request("c", priority=-1)) == 2  # both b's: higher level
    assert queue.peek() is requests[1]
    requests[1].future.cancel()  # its caller left: retired, not sent
    assert [r.item for r in queue.drain()] == [3]
    assert (queue.live, queue.live_cost, queue.waiting_per_key()) == (0, 0, {})
    assert queue.pop_batch(4) == []
    assert queue.oldest_enqueued_at() is None


async def test_the_queue_pops_nothing_when_every_caller_left() -> None:
    queue: KeyedQueue[Any] = KeyedQueue(lambda: 0.0, lambda: 0.0)
    requests = [new_request(key) for key in "ab"]
    for request in requests:
        queue.push(request)
        request.future.cancel()
    assert queue.pop_similar(4, None, 64) == []
    assert queue.live == 0


def test_a_batch_costs_o_log_n_per_place_at_100000_keys() -> None:
    """Issue 27 item 5: the keyed queue asked every key whether it could fill a batch,
    and the scheduler's window and deadline rules read every key's oldest arrival and
    earliest deadline, for each batch: O(keys) per batch. Now each reads a heap kept
    between batches, and a key's sub-queue is asked only when it changed."""
    keys, budget = 100_000, 20 * 100_000
    asked = 0

    class Counted(RequestQueue[Any]):
        def _ask(self) -> None:
            nonlocal asked
            asked += 1
            if asked > budget:
                raise AssertionError(f"the sub-queues were asked {asked} times")

        @override
        def full_reason(self, limit: int, budget: int | None) -> str | None:
            self._ask()
            return super().full_reason(limit, budget)

        @override
        def oldest_enqueued_at(self) -> float | None:
            self._ask()
            return super().oldest_enqueued_at()

        @override
        def earliest_deadline(self) -> float:
            self._ask()
            return super().earliest_deadline()

    loop = asyncio.new_event_loop()
    try:
        queue: KeyedQueue[Any] = KeyedQueue(lambda: 0.0, lambda: 1.0, new=Counted)
        for key in range(keys):
            made: Request[Any] = Request(key, loop.create_future(), 0, float(key), 1, key + 5.0)
            made.key = key
            queue.push(made)
        served = []
        while queue.live:  # what the scheduler asks for each batch
            assert queue.full_reason(32, None) is None  # no key fills a batch
            assert queue.oldest_enqueued_at() == (served[-1] + 1 if served else 0.0)
            assert queue.earliest_deadline() == queue.oldest_enqueued_at() + 5.0
            batch = queue.pop_batch(32)
            assert len(batch) == 1
            served += [r.item for r in batch]
        assert served == list(range(keys))  # the keys took turns in the order they came
        assert queue.oldest_enqueued_at() is None
        assert queue.earliest_deadline() == float("inf")
    finally:
        loop.close()


async def test_a_drained_queue_keeps_no_key_and_not_its_peak_table() -> None:
    """The scale benchmark's keys row: after 100,000 distinct keys drain, the memory
    left is asyncio's set of all tasks, not this queue's. The queue drops each emptied
    key; once it is empty it also drops the stale heap entries (each holds a key) and
    the table its rotation grew to for the peak number of keys."""
    queue: KeyedQueue[Any] = KeyedQueue(lambda: 0.0, lambda: 0.0)
    empty_table = sys.getsizeof(queue._subs)
    keys = 5_000
    for key in range(keys):
        queue.push(new_request(key, key))
    served = 0
    while queue.live:
        assert queue.oldest_enqueued_at() is not None  # what the scheduler asks
        served += len(queue.pop_batch(64))
    assert served == keys
    assert queue.waiting_per_key() == {}
    assert (queue._full, queue._arrivals, queue._deadlines) == ([], [], [])
    assert sys.getsizeof(queue._subs) == empty_table  # not the table of 5,000 keys


async def test_the_oldest_arrival_survives_the_last_key_leaving_during_a_compaction() -> None:
    """A key whose callers all left is found by `oldest_enqueued_at`, and dropping it
    rebuilt the heap it was reading (stale entries outnumbered the keys): the entry it
    then popped was another's, or none (IndexError)."""
    queue: KeyedQueue[Any] = KeyedQueue(lambda: 0.0, lambda: 0.0)
    last = new_request("last")
    queue.push(last)
    for key in range(65):  # keys that come and go: 65 stale entries, just below a rebuild
        other = new_request(key)
        queue.push(other)
        queue.take([other])
    last.future.cancel()
    assert queue.oldest_enqueued_at() is None
    assert queue.live == 0


@pytest.mark.parametrize("fair", [False, True], ids=["plain", "tenants"])
def test_a_limit_change_asks_only_the_keys_whose_answer_can_change(fair: bool) -> None:
    """Issue 38: a change of the batch limit (`configure(batch_size=...)`, the OOM cap)
    asked every waiting key whether it filled a batch: O(keys). A lower limit can only
    make full the keys with as many waiting as it and fewer than the old one; a higher
    one makes none full (a key that stops being full is dropped when it reaches the top
    of the full keys)."""
    asked: list[Hashable] = []
    base: type[Any] = FairQueue if fair else RequestQueue

    class Counted(base):  # type: ignore[misc, valid-type]
        name: Hashable = None

        @override
        def full_reason(self, limit: int, budget: int | None) -> str | None:
            asked.append(self.name)
            return super().full_reason(limit, budget)  # type: ignore[no-any-return]

    loop = asyncio.new_event_loop()
    try:
        queue: KeyedQueue[Any] = KeyedQueue(lambda: 0.0, lambda: 1.0, new=Counted)
        waiting: dict[Hashable, int] = {key: 1 for key in range(100_000)}
        waiting |= {"five": 5, "nine": 9}
        for key, count in waiting.items():
            for _ in range(count):
                request: Request[Any] = Request(key, loop.create_future(), 0, 0.0)
                request.key = request.tenant = key
                queue.push(request)
            queue._subs[key].sub.name = key
        assert queue.full_reason(32, None) is None  # the first limits: every key, once
        asked.clear()
        assert queue.full_reason(64, None) is None  # higher: no key can become full
        assert asked == []
        assert queue.full_reason(8, None) == "full"  # lower: only keys with 8 to 63 waiting
        assert set(asked) == {"nine"}
        assert len(asked) <= 3
        asked.clear()
        assert queue.full_reason(4, None) == "full"  # 4 to 7: "five", first by turn
        assert set(asked) == {"five"}
        assert len(asked) <= 3
        asked.clear()
        assert len(queue.pop_batch(4)) == 4  # "five"'s, at the front of the full keys
        assert queue.full_reason(1000, None) is None  # higher: the full keys, at the top
        assert set(asked) <= {0, "five", "nine"}
        assert len(asked) <= 6
    finally:
        loop.close()


@pytest.mark.parametrize("seed", range(5))
def test_the_full_keys_stay_exact_through_changing_limits(seed: int) -> None:
    """Pushes, pops and cancellations under limits that rise and fall at random: the
    first full key (by turn) is always the one a scan of every key finds."""
    rng = random.Random(seed)
    loop = asyncio.new_event_loop()
    try:
        queue: KeyedQueue[Any] = KeyedQueue(lambda: 0.0, lambda: 1.0)
        queued: list[Request[Any]] = []
        for _ in range(3000):
            roll = rng.random()
            if roll < 0.6:
                request: Request[Any] = Request(None, loop.create_future(), 0, 0.0)
                request.key = rng.randrange(12)
                queue.push(request)
                queued.append(request)
            elif roll < 0.75 and queued:
                queue.discard(queued.pop(rng.randrange(len(queued))))
            elif roll < 0.85:
                queue.pop_batch(rng.choice([1, 2, 3, 5, 8, 13]))
            limit = rng.choice([1, 2, 3, 4, 6, 9, 16])
            full = [key for key, count in queue.waiting_per_key().items() if count >= limit]
            assert queue._first_full(limit, None) == (full[0] if full else _NOBODY)
            queued = [r for r in queued if r.queued]
    finally:
        loop.close()
