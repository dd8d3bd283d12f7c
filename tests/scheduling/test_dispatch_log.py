"""Why each batch left: one DEBUG line per batch on the `batchproxy` logger, nothing at
INFO or above on the normal path; and the deadline rule, on a virtual clock."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Sequence
from typing import Any

import pytest
from _support import Recorder
from typing_extensions import override

from batchproxy import DeadlineExceeded, simulation

pytestmark = pytest.mark.looptime

LINE = re.compile(
    r"(?P<proxy>\S+): batch of (?P<size>\d+) left \((?P<why>[a-z ]+)\); "
    r"its oldest request waited (?P<waited>[0-9.]+) ms"
)


def departures(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str, float]]:
    """(size, why, oldest wait in ms) of each logged batch, in order."""
    found = []
    for record in caplog.records:
        if record.name == "batchproxy" and (match := LINE.fullmatch(record.getMessage())):
            assert record.levelno == logging.DEBUG
            found.append((int(match["size"]), match["why"], float(match["waited"])))
    return found


@pytest.fixture
def debug(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.DEBUG, logger="batchproxy")
    return caplog


async def test_a_lone_request_goes_as_idle_having_waited_nothing(debug: Any) -> None:
    async with Recorder(name="lone") as proxy:
        await proxy.inference(1)
    assert departures(debug) == [(1, "idle", 0.0)]
    assert debug.records[0].getMessage().startswith("lone: batch of 1 left (idle)")


async def test_full_batches_and_the_rest_after_a_freed_slot(debug: Any) -> None:
    async with Recorder(batch_size=4, delay=0.01) as proxy:
        await asyncio.gather(*(proxy.inference(i) for i in range(11)))
    # the first arrival finds the proxy idle and its batch takes 4; 4 more make a full
    # batch, sent as the first ends; the last 3 go when the slot frees
    assert [(size, why) for size, why, _ in departures(debug)] == [
        (4, "idle"),
        (4, "full"),
        (3, "slot freed"),
    ]
    assert [waited for _, _, waited in departures(debug)] == [0.0, 10.0, 20.0]


async def test_a_token_budget_fills_before_the_batch_size(debug: Any) -> None:
    async with Recorder(
        batch_size=10, max_concurrent_batches=2, length=len, max_batch_tokens=8, delay=0.01
    ) as proxy:
        first = asyncio.create_task(proxy.inference("x"))
        await asyncio.sleep(0.001)
        await asyncio.gather(first, *(proxy.inference("abcd") for _ in range(2)))
    assert [why for _, why, _ in departures(debug)] == ["idle", "token budget"]


@pytest.mark.parametrize(
    ("window", "why", "waited"),
    [("fixed", "window", 5.0), ("adaptive", "quiet", 3.0)],
)
async def test_a_partial_batch_leaves_by_its_window(
    debug: Any, window: str, why: str, waited: float
) -> None:
    proxy = Recorder(delay=0.1, max_concurrent_batches=2, window=window, max_delay_ms=5)
    async with proxy:
        await simulation.open_loop(proxy.inference, [0.0, 0.001, 0.002])
    assert departures(debug) == [(1, "idle", 0.0), (2, why, waited)]


async def test_the_adaptive_window_leaves_when_no_company_comes_in_time(debug: Any) -> None:
    async with Recorder(delay=0.1, max_concurrent_batches=2, max_delay_ms=5) as proxy:
        # arrivals 2 ms apart: the next is not expected before the window closes at 5 ms
        await simulation.open_loop(proxy.inference, [0.0, 0.002, 0.004])
    assert departures(debug)[-1][1] == "no company in time"


async def test_a_draining_proxy_sends_what_waits(debug: Any) -> None:
    proxy = Recorder(delay=0.1, max_concurrent_batches=2, window="fixed", max_delay_ms=1_000)
    first = asyncio.create_task(proxy.inference(0))
    await asyncio.sleep(0)
    second = asyncio.create_task(proxy.inference(1))
    await asyncio.sleep(0.01)  # waiting for company, up to 1 s
    await proxy.aclose()
    assert [await first, await second] == [("out", 0), ("out", 1)]
    assert [why for _, why, _ in departures(debug)] == ["idle", "drain"]


async def test_nothing_is_logged_at_info_or_above_on_the_normal_path(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="batchproxy")
    async with Recorder(batch_size=8, delay=0.001, max_concurrent_batches=2) as proxy:
        await asyncio.gather(*(proxy.inference(i) for i in range(100)))
        await simulation.open_loop(proxy.inference, [0.001 * i for i in range(50)])
    assert departures(caplog)
    assert [r for r in caplog.records if r.levelno >= logging.INFO] == []


async def test_no_line_is_built_unless_debug_is_on(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="batchproxy")
    async with Recorder() as proxy:
        await asyncio.gather(*(proxy.inference(i) for i in range(10)))
    assert caplog.records == []


class SlowFirst(Recorder):
    """10 ms a batch, but 100 ms for a batch with "slow" in it."""

    @override
    async def _inference(self, items: list[Any]) -> Sequence[Any]:
        self.delay = 0.1 if "slow" in items else 0.01
        return await super()._inference(items)


async def test_a_deadline_sends_a_partial_batch_before_its_window_closes(debug: Any) -> None:
    """With a fixed window of 50 ms, a call with 30 ms left would wait 50 ms and miss;
    the cost model says a batch takes 10 ms, so it leaves 20 ms before its deadline
    (twice that, a margin) and is answered 10 ms before it."""
    loop = asyncio.get_running_loop()
    async with SlowFirst(max_concurrent_batches=2, window="fixed", max_delay_ms=50) as proxy:
        for i in range(5):  # one at a time: the cost model learns 10 ms a batch
            await proxy.inference(i)
        assert proxy.stats.cost_model is not None
        start = loop.time()
        slow = asyncio.create_task(proxy.inference("slow"))  # idle: goes at once
        await asyncio.sleep(0.001)
        tight = asyncio.create_task(proxy.inference("tight", timeout=0.03))
        assert await tight == ("out", "tight")
        assert proxy.started_at[-1] - start == pytest.approx(0.011, abs=1e-6)
        await slow
    assert departures(debug)[-1][:2] == (1, "deadline")


async def test_without_a_prediction_a_deadline_changes_nothing(debug: Any) -> None:
    """Before the cost model has a line, the window alone decides (and the call that
    cannot wait it out fails with its deadline, as before)."""
    async with SlowFirst(max_concurrent_batches=2, window="fixed", max_delay_ms=50) as proxy:
        slow = asyncio.create_task(proxy.inference("slow"))
        await asyncio.sleep(0.001)
        tight = asyncio.create_task(proxy.inference("tight", timeout=0.03))
        with pytest.raises(DeadlineExceeded):
            await tight
        await slow
    assert [why for _, why, _ in departures(debug)] == ["idle"]
