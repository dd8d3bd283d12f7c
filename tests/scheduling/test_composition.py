"""Tenants, batch keys and dedup together: the queue's shape (`_placement`) and the
rules of each feature within the others'. On looptime's virtual clock."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from _support import Recorder, assert_settled, scheduler_of

import batchproxy
from batchproxy._scheduling.fair_queue import FairQueue
from batchproxy._scheduling.keyed_queue import KeyedQueue
from batchproxy._scheduling.queue import RequestQueue

pytestmark = pytest.mark.looptime


async def hold(p: Recorder) -> asyncio.Task[Any]:
    """Occupy the proxy's one slot with a first call (its batch runs `p.delay`)."""
    first = asyncio.create_task(p.inference("first"))
    for _ in range(5):
        await asyncio.sleep(0)
    assert p.batches == [["first"]]
    return first


def shape(p: Recorder) -> tuple[type, ...]:
    queue = scheduler_of(p).queue
    if isinstance(queue, KeyedQueue):
        return (KeyedQueue, *{type(sub) for sub in queue.subqueues()})
    return (type(queue),)


@pytest.mark.parametrize("first", ["tenant", "key"])
async def test_keys_on_top_each_keys_batches_shared_fairly(first: str) -> None:
    """Whichever comes first, a keyed queue of fair queues: a batch has one key, and
    within a key the tenants share it."""
    p = Recorder(delay=10.0, batch_size=4, max_concurrent_batches=1)
    running = await hold(p)
    assert shape(p) == (RequestQueue,)
    calls = []
    if first == "tenant":
        calls.append(asyncio.create_task(p.inference("early", tenant="quiet")))
        await asyncio.sleep(0)
        assert shape(p) == (FairQueue,)
    calls += [asyncio.create_task(p.inference(f"f{i}", tenant="flood", key="a")) for i in range(8)]
    calls += [asyncio.create_task(p.inference(f"q{i}", tenant="quiet", key="a")) for i in range(2)]
    calls += [asyncio.create_task(p.inference(f"b{i}", key="b")) for i in range(2)]
    await asyncio.sleep(0)
    assert shape(p) == (KeyedQueue, FairQueue)
    await asyncio.gather(running, *calls)
    keyed = [batch for batch in p.batches[1:] if any(x.startswith(("f", "q")) for x in batch)]
    # key "a"'s first batch: two of the flood's, both of the quiet tenant's
    assert sorted(keyed[0]) == ["f0", "f1", "q0", "q1"]
    for batch in p.batches[1:]:  # one key per batch
        kinds = {x[0] for x in batch}
        assert kinds <= {"f", "q"} or kinds <= {"b"} or kinds <= {"e"}
    assert_settled(p.stats)
    await p.aclose()


async def test_queued_by_tenant_and_per_tenant_limits_count_every_key() -> None:
    p = Recorder(delay=10.0, batch_size=4, max_concurrent_batches=1, max_queue_size_per_tenant=3)
    running = await hold(p)
    calls = [
        asyncio.create_task(p.inference(f"{key}{i}", tenant="t", key=key))
        for key, i in [("a", 0), ("a", 1), ("b", 0)]
    ]
    await asyncio.sleep(0)
    assert dict(p.stats.queued_by_tenant) == {"t": 3}
    with pytest.raises(batchproxy.QueueFull) as refused:
        await p.inference("c0", tenant="t", key="c")  # its fourth, whatever the key
    assert refused.value.per_tenant
    other = asyncio.create_task(p.inference("c1", tenant="u", key="c"))
    await asyncio.gather(running, *calls, other)
    assert p.stats.tenant_rejected == 1
    await p.aclose()


async def test_a_dedup_slot_counts_for_the_tenant_that_made_it() -> None:
    p = Recorder(
        delay=10.0, batch_size=4, max_concurrent_batches=1, max_queue_size_per_tenant=1, dedup=True
    )
    running = await hold(p)
    made = asyncio.create_task(p.inference("x", tenant="t"))
    await asyncio.sleep(0)
    with pytest.raises(batchproxy.QueueFull):
        await p.inference("y", tenant="t")  # a new slot: over t's limit
    joined = asyncio.create_task(p.inference("x", tenant="u"))  # no new slot: accepted
    also = asyncio.create_task(p.inference("x", tenant="t"))  # nor for t itself
    assert await asyncio.gather(made, joined, also) == [("out", "x")] * 3
    await running
    assert p.stats.deduplicated == 2
    assert_settled(p.stats)
    await p.aclose()


async def test_a_fair_queue_is_full_when_its_tenants_together_fill_a_batch() -> None:
    p = Recorder(delay=10.0, batch_size=4, max_concurrent_batches=2)
    running = await hold(p)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    calls = [asyncio.create_task(p.inference(i, tenant=i % 2)) for i in range(4)]
    for _ in range(5):  # a free slot and a full batch over two tenants: it goes now
        await asyncio.sleep(0)
    assert loop.time() == t0
    assert sorted(p.batches[1]) == [0, 1, 2, 3]
    await asyncio.gather(running, *calls)
    await p.aclose()
