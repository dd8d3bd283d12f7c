"""The window policies: exact departures on a virtual clock, and the claims the
scheduling benchmark makes, as deterministic simulations."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from _support import Recorder

from batchproxy import Batched, batch, simulation


def cost(n: int) -> float:
    """The simulated accelerator of the scheduling benchmark."""
    return 0.010 + 0.0002 * n


def simulate(
    drive: Callable[[Batched[Any, Any]], Awaitable[simulation.Trace]],
    *,
    serial: bool = True,
    **options: Any,
) -> simulation.Trace:
    """`drive` traffic through the simulated accelerator batched with `options`."""

    async def main() -> simulation.Trace:
        model: Batched[Any, Any] = batch(**options)(simulation.simulated_model(cost, serial=serial))
        try:
            return await drive(model)
        finally:
            await model.aclose()

    return simulation.run(main())


async def departures(window: str, arrivals: list[float], **options: Any) -> list[float]:
    """When each batch started, for requests arriving at `arrivals` (seconds from now),
    on a model taking 100 ms, with room for 4 batches at once."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    proxy = Recorder(delay=0.1, max_concurrent_batches=4, window=window, **options)
    async with proxy:
        await simulation.open_loop(proxy.inference, arrivals)
    return [round(t - start, 6) for t in proxy.started_at]


@pytest.mark.looptime
async def test_fixed_window_waits_out_the_delay_for_a_partial_batch() -> None:
    # the first finds the proxy idle and goes; the next two wait 5 ms from the first of them
    assert await departures("fixed", [0.0, 0.001, 0.002], max_delay_ms=5) == [0.0, 0.006]


@pytest.mark.looptime
async def test_adaptive_window_leaves_once_the_stream_goes_quiet() -> None:
    # gaps of 1 ms: quiet for 2 ms after the last arrival (at 2 ms) means the stream paused
    assert await departures("adaptive", [0.0, 0.001, 0.002], max_delay_ms=5) == [0.0, 0.004]


@pytest.mark.looptime
@pytest.mark.parametrize("window", ["adaptive", "fixed"])
async def test_either_window_sends_a_request_to_an_idle_proxy_at_once(window: str) -> None:
    assert await departures(window, [0.0, 1.0, 2.0], max_delay_ms=50) == [0.0, 1.0, 2.0]


@pytest.mark.looptime
async def test_adaptive_window_staggers_batches_by_the_cost_model() -> None:
    loop = asyncio.get_running_loop()
    async with Recorder(delay=0.1, max_concurrent_batches=2, max_delay_ms=500) as proxy:
        for i in range(6):  # one at a time: the cost model learns 100 ms per batch
            await proxy.inference(i)
        assert proxy.stats.cost_model is not None
        start = loop.time()
        first = asyncio.create_task(proxy.inference("a"))
        await asyncio.sleep(0.001)
        # more arrive 1 ms apart: without a cost model the batch would leave once they
        # stop (2 ms quiet); with it, it waits until the running batch is half done
        rest = [asyncio.create_task(proxy.inference(i)) for i in range(3)]
        await asyncio.sleep(0.001)
        rest += [asyncio.create_task(proxy.inference(i)) for i in range(3)]
        await asyncio.gather(first, *rest)
        second = proxy.started_at[7] - start
        assert second == pytest.approx(0.05)  # half the predicted 100 ms: two slots


def sweep(slots: int, serial: bool, load: float, **options: Any) -> simulation.Trace:
    capacity = 32 / cost(32) * (1 if serial else slots)
    arrivals = simulation.poisson(load * capacity, duration=5.0, seed=1)
    return simulate(
        lambda model: simulation.open_loop(model, arrivals),
        serial=serial,
        batch_size=32,
        max_concurrent_batches=slots,
        **options,
    )


@pytest.mark.parametrize("load", [0.3, 0.6, 0.9])
def test_with_one_slot_the_window_does_not_change_anything(load: float) -> None:
    baseline = sweep(1, True, load, window="fixed", max_delay_ms=0)
    for window, delay in [("fixed", 10), ("adaptive", 5), ("adaptive", 10)]:
        trace = sweep(1, True, load, window=window, max_delay_ms=delay)
        assert trace.latencies == baseline.latencies


@pytest.mark.parametrize("load", [0.3, 0.6, 0.9])
def test_adaptive_is_within_a_percent_of_the_best_fixed_delay_on_two_replicas(
    load: float,
) -> None:
    fixed = [sweep(2, False, load, window="fixed", max_delay_ms=d) for d in (0, 1, 2, 5, 10)]
    adaptive = sweep(2, False, load, window="adaptive", max_delay_ms=10)
    best = max(t.throughput for t in fixed)
    assert adaptive.throughput >= 0.98 * best
    assert adaptive.latency(0.99) <= 1.01 * min(t.latency(0.99) for t in fixed)


def test_closed_loop_keeps_the_model_busy() -> None:
    trace = simulate(
        lambda model: simulation.closed_loop(model, callers=150, duration=5.0), batch_size=64
    )
    assert trace.throughput >= 0.97 * 64 / cost(64)
