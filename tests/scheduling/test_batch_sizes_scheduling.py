"""`batch_sizes` without a filler, on the virtual clock: a batch due to leave at a size
not allowed waits for the next allowed size when the missing requests are expected
before its window closes (and its deadline rule), else it leaves cut."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from test_batch_sizes import Strict

import batchproxy

pytestmark = pytest.mark.looptime

MS = 1e-3


async def arrivals(proxy: Strict, at: list[float], **kwargs: Any) -> list[asyncio.Task[Any]]:
    """Callers of items 1, 2, ... arriving at the given times (ms from now)."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    tasks = []
    for item, when in enumerate(at, start=1):
        await asyncio.sleep(max(0.0, start + when * MS - loop.time()))
        tasks.append(asyncio.create_task(proxy.inference(item, **kwargs)))
    return tasks


def ms_since(proxy: Strict, start: float) -> list[float]:
    return [round((t - start) / MS, 3) for t in proxy.started_at]


async def test_waits_for_the_next_size_when_the_arrivals_are_expected_in_time() -> None:
    loop = asyncio.get_running_loop()
    async with Strict(batch_size=8, max_delay_ms=50, delay=30 * MS) as proxy:
        start = loop.time()
        first = asyncio.create_task(proxy.inference(0))  # the model is busy until 30 ms
        await asyncio.sleep(0)
        tasks = await arrivals(proxy, [5, 10, 15, 20, 25, 30, 35, 40])
        # at 30 ms five wait (a size not allowed) and one arrives every 5 ms: three more
        # are expected by 40 ms, before the window of the oldest closes (55 ms)
        assert await asyncio.gather(first, *tasks) == [2 * i for i in range(9)]
        assert proxy.sizes == [1, 8]
        assert ms_since(proxy, start) == [0, 40]


async def test_the_wait_ends_when_the_expected_arrivals_do_not_come() -> None:
    loop = asyncio.get_running_loop()
    async with Strict(batch_size=8, max_delay_ms=50, delay=30 * MS) as proxy:
        start = loop.time()
        first = asyncio.create_task(proxy.inference(0))
        await asyncio.sleep(0)
        tasks = await arrivals(proxy, [5, 10, 15, 20, 25])  # then nobody
        # at 30 ms: 5 wait, 3 more expected by 40 ms; none comes: 4 leave at 40 ms, cut
        assert await asyncio.gather(first, *tasks) == [2 * i for i in range(6)]
        assert proxy.sizes == [1, 4, 1]
        assert ms_since(proxy, start)[:2] == [0, 40]
        assert proxy.calls[1] == [1, 2, 3, 4]  # the oldest go; the newest waits


async def test_a_batch_whose_window_has_closed_leaves_cut_at_once() -> None:
    loop = asyncio.get_running_loop()
    async with Strict(batch_size=8, max_delay_ms=50, delay=100 * MS) as proxy:
        start = loop.time()
        first = asyncio.create_task(proxy.inference(0))
        await asyncio.sleep(0)
        tasks = await arrivals(proxy, [10, 20, 30, 40, 50])
        # at 100 ms the oldest has waited past its window: 4 go now, not 8 later
        assert await asyncio.gather(first, *tasks) == [2 * i for i in range(6)]
        assert proxy.sizes == [1, 4, 1]
        assert ms_since(proxy, start) == [0, 100, 200]


async def test_padding_never_waits_for_a_size() -> None:
    loop = asyncio.get_running_loop()
    async with Strict(batch_size=8, max_delay_ms=50, delay=30 * MS, pad_item=0) as proxy:
        start = loop.time()
        first = asyncio.create_task(proxy.inference(0))
        await asyncio.sleep(0)
        tasks = await arrivals(proxy, [5, 10, 15, 20, 25, 30, 35, 40])
        await asyncio.gather(first, *tasks)
        # the six at 30 ms (the one arriving as the first batch ends too) go at once,
        # padded to 8; the rest after them
        assert proxy.calls == [[0], [1, 2, 3, 4, 5, 6, 0, 0], [7, 8]]
        assert ms_since(proxy, start) == [0, 30, 60]
        assert proxy.stats.padded_rows == 2


async def test_no_wait_past_the_deadline_rule() -> None:
    loop = asyncio.get_running_loop()
    async with Strict(batch_size=8, max_delay_ms=50, delay=30 * MS) as proxy:
        for _ in range(6):  # teach the cost model: a batch takes 30 ms
            await proxy.inference(0)
        assert proxy.stats.cost_model is not None
        proxy.calls.clear()
        proxy.started_at.clear()
        start = loop.time()
        first = asyncio.create_task(proxy.inference(0))
        await asyncio.sleep(0)
        # the first waiting caller's deadline is at 95 ms: its batch must start by
        # 95 - 2 x 30 = 35 ms, so the wait until 40 ms for 8 does not pay
        tasks = await arrivals(proxy, [5], timeout=90 * MS)
        tasks += await arrivals(proxy, [5, 10, 15, 20, 25, 30, 35])
        await asyncio.gather(first, *tasks)
        assert ms_since(proxy, start)[:2] == [0, 30]
        assert proxy.sizes[:2] == [1, 4]


async def test_a_cut_leftover_whose_deadline_passes_fails_and_never_runs() -> None:
    async with Strict(batch_size=8, delay=100 * MS) as proxy:
        calls = [asyncio.create_task(proxy.inference(i)) for i in range(4)]
        await asyncio.sleep(0)
        late = asyncio.create_task(proxy.inference(9, timeout=50 * MS))
        more = [asyncio.create_task(proxy.inference(i)) for i in range(5, 7)]
        await asyncio.sleep(0)
        with pytest.raises(batchproxy.DeadlineExceeded):
            await late
        assert await asyncio.gather(*calls, *more) == [0, 2, 4, 6, 10, 12]
        assert all(9 not in call for call in proxy.calls)
        assert proxy.sizes == [4, 2]
        assert proxy.stats.timed_out == 1


# -- with batch keys: a key's batch is sized from that key's own waiting requests ------


async def test_a_keys_cut_batch_is_sized_from_its_own_waiting_requests() -> None:
    async with Strict(batch_size=8, key=lambda item: item % 2) as proxy:
        # 3 of key 1 and 5 of key 0: 8 wait in all, but each batch holds one key's
        items = [1, 3, 5, 0, 2, 4, 6, 8]
        assert await asyncio.gather(*map(proxy.inference, items)) == [2 * i for i in items]
        # each batch left at an allowed size of its own key's requests: one model call
        assert proxy.stats.batches == len(proxy.calls)
        assert sorted(map(tuple, proxy.calls)) == [(0, 2, 4, 6), (1, 3), (5,), (8,)]


async def test_a_keys_partial_batch_waits_for_its_own_next_size() -> None:
    loop = asyncio.get_running_loop()
    async with Strict(batch_size=4, max_delay_ms=50, delay=30 * MS) as proxy:
        start = loop.time()
        tasks = []
        for item, key, at in [(0, "b", 0), (1, "a", 5), (2, "a", 10), (3, "a", 15), (4, "b", 25)]:
            await asyncio.sleep(max(0.0, start + at * MS - loop.time()))
            tasks.append(asyncio.create_task(proxy.inference(item, key=key)))
        # at 30 ms 4 wait in all (an allowed size) but key "a"'s batch would be 3: its
        # fourth is expected by 35 ms, inside its window, so it waits for it
        await asyncio.sleep(start + 33 * MS - loop.time())
        tasks.append(asyncio.create_task(proxy.inference(5, key="a")))
        assert await asyncio.gather(*tasks) == [2 * i for i in range(6)]
        assert proxy.calls == [[0], [1, 2, 3, 5], [4]]
        assert ms_since(proxy, start) == [0, 33, 63]


@pytest.mark.parametrize("tenants", [False, True])  # with tenants: a fair queue per key
async def test_a_keys_cut_batch_under_a_token_budget_is_the_key_it_was_sized_for(
    tenants: bool,
) -> None:
    """The key a batch is sized for is the key it is taken from: key "b" fills the token
    budget (a full batch does not wait behind "a"'s partial one), so "b" goes, sized by
    its own 2 waiting; "a" was not sent a batch of 2 sized by "b"'s count."""

    def call(item: str, key: str, i: int) -> asyncio.Task[Any]:
        tenant = {"tenant": f"t{i % 2}"} if tenants else {}
        return asyncio.create_task(proxy.inference(item, key=key, **tenant))

    async with Strict(
        batch_size=8, max_delay_ms=1000, max_batch_tokens=100, length=len, delay=10 * MS
    ) as proxy:
        first = asyncio.create_task(proxy.inference("x"))  # the model is busy for 10 ms
        await asyncio.sleep(0)
        cheap = [call(f"a{i}", "a", i) for i in range(7)]
        await asyncio.sleep(0)  # "a" waits first: the front of the rotation
        costly = [call("b" * 50, "b", i) for i in range(2)]
        await asyncio.gather(first, *cheap, *costly)
        assert [batch[0][0] for batch in proxy.calls] == ["x", "b", "a", "a", "a"]
        assert proxy.sizes == [1, 2, 4, 2, 1]
