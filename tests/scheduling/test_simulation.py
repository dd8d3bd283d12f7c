"""The virtual-clock simulator: its clock, its arrival processes, its traffic drivers."""

from __future__ import annotations

import asyncio
import time

import pytest

from batchproxy import batch, simulation


def test_the_clock_jumps_to_the_next_timer() -> None:
    async def main() -> float:
        loop = asyncio.get_running_loop()
        await asyncio.sleep(3600)
        return loop.time()

    started = time.perf_counter()
    assert simulation.run(main(), start=10.0) == pytest.approx(3610.0)
    assert time.perf_counter() - started < 1.0


def test_run_cancels_what_is_left_and_closes_its_loop() -> None:
    leftovers: list[asyncio.Task[None]] = []

    async def main() -> asyncio.AbstractEventLoop:
        leftovers.append(asyncio.create_task(asyncio.sleep(10)))
        return asyncio.get_running_loop()

    loop = simulation.run(main())
    assert loop.is_closed()
    assert leftovers[0].cancelled()


def test_poisson_arrivals_have_the_asked_rate_and_repeat_with_the_seed() -> None:
    times = simulation.poisson(1000, duration=10, seed=3)
    assert times == sorted(times)
    assert times[0] > 0
    assert times[-1] < 10
    assert len(times) == pytest.approx(10_000, rel=0.03)
    assert simulation.poisson(1000, duration=10, seed=3) == times
    assert simulation.poisson(1000, duration=10, seed=4) != times


def test_bursts_and_idle_gaps() -> None:
    assert simulation.bursts(3, every=1.0, duration=2.5) == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    spread = simulation.bursts(50, every=1.0, duration=1.0, spread=0.1, seed=1)
    assert len(spread) == 50
    assert all(0 <= t <= 0.1 for t in spread)
    on_off = simulation.on_off(500, on=0.1, off=0.9, duration=5, seed=2)
    assert all(t % 1.0 < 0.1 for t in on_off)  # nothing during the idle gaps
    assert len({int(t) for t in on_off}) == 5


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: simulation.poisson(0, duration=1), "rate must be"),
        (lambda: simulation.bursts(1, every=0, duration=1), "every must be"),
        (lambda: simulation.on_off(1, on=float("inf"), off=1, duration=1), "on must be"),
    ],
)
def test_bad_arguments_are_refused(call: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()  # type: ignore[operator]


def test_open_loop_traces_every_call() -> None:
    async def main() -> simulation.Trace:
        model = simulation.simulated_model(lambda n: 0.010)
        proxy = batch(batch_size=8)(model)
        try:
            return await simulation.open_loop(proxy, [0.0, 0.001, 0.002, 0.5])
        finally:
            await proxy.aclose()

    trace = simulation.run(main())
    assert (trace.issued, trace.succeeded, trace.failed) == (4, 4, 0)
    # the first goes alone; the next two wait for it and share a batch; the last is alone
    assert trace.latencies == pytest.approx([0.010, 0.019, 0.018, 0.010])
    assert trace.duration == pytest.approx(0.510)
    assert trace.latency(0.5) == pytest.approx(0.010)
    assert trace.throughput == pytest.approx(4 / 0.510)


def test_open_loop_times_a_late_call_from_when_it_was_due() -> None:
    """On a real clock, a loop something holds (here a blocking sleep of 60 ms, as a
    GIL-bound launch holds it) starts the overdue arrival late: its latency counts the
    wait from its arrival time, as a client's would, not from its late start."""

    async def instant(index: int) -> None:
        return None

    async def main() -> simulation.Trace:
        asyncio.get_running_loop().call_soon(time.sleep, 0.06)  # from 0, before 0.01
        return await simulation.open_loop(instant, [0.0, 0.01])

    trace = asyncio.run(main())
    assert trace.succeeded == 2
    assert max(trace.latencies) >= 0.045  # due at 0.01, started after 0.06


def test_a_serial_model_runs_one_batch_at_a_time() -> None:
    async def main(serial: bool) -> float:
        model = simulation.simulated_model(lambda n: 0.010, serial=serial)
        loop = asyncio.get_running_loop()
        await asyncio.gather(model([1]), model([2]))
        return loop.time()

    assert simulation.run(main(True)) == pytest.approx(0.020)
    assert simulation.run(main(False)) == pytest.approx(0.010)


def test_closed_loop_callers_call_again_when_answered() -> None:
    async def main() -> simulation.Trace:
        async def failing_sometimes(who: object) -> object:
            await asyncio.sleep(0.010)
            if who == 0:
                raise ValueError("caller 0 always fails")
            return who

        return await simulation.closed_loop(failing_sometimes, callers=3, duration=0.095)

    trace = simulation.run(main())
    assert (trace.issued, trace.succeeded, trace.failed) == (30, 20, 10)
    assert trace.duration == pytest.approx(0.1)
