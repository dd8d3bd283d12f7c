"""`batchproxy.tune`'s measurement and fit: a toy model of known cost is measured as it
costs (exactly, on the simulation's virtual clock; within a loaded machine's noise on a
real thread), through the proxy and its executor."""

from __future__ import annotations

import asyncio
import statistics
from typing import Any

import pytest
from _toy import FIXED, PER_ITEM, cost, on_a_thread, sleeping

import batchproxy
from batchproxy import simulation
from batchproxy.tune import Measurement, TuneError, fit, measure


def _measure_virtually(made: Any, sample: list[Any], **kw: Any) -> Measurement:
    async def main() -> Measurement:
        async with made:
            return await measure(made, sample, **kw)

    return simulation.run(main())


def test_the_measured_curve_is_the_models_cost() -> None:
    calls: list[tuple[int, int]] = []
    measured = _measure_virtually(
        sleeping(),
        list(range(10)),
        sizes=[1, 2, 4, 8, 16],
        repeats=3,
        warmup=1,
        progress=lambda done, total: calls.append((done, total)),
    )
    assert [p.size for p in measured.points] == [1, 2, 4, 8, 16]
    for point in measured.points:
        assert len(point.seconds) == 3  # the warm-up left out
        assert point.median == pytest.approx(cost(point.size))
    assert calls[-1] == (20, 20)
    assert len(calls) == 20
    curve = fit(measured)
    assert curve.fixed == pytest.approx(FIXED)
    assert curve.per_item == pytest.approx(PER_ITEM)
    for size in (1, 3, 8, 12, 16, 40):
        assert curve(size) == pytest.approx(cost(size))
    assert measured.lanes == 1
    assert measured.lengths is None


def test_the_proxy_is_left_as_it_was_built() -> None:
    made = sleeping(batch_size=16, max_delay_ms=3.0)
    _measure_virtually(made, ["a"], sizes=[1, 32], repeats=1, warmup=0)
    assert made.proxy.options.batch_size == 16
    assert made.proxy.options.max_delay_ms == 3.0


def test_a_model_on_a_thread_is_measured_on_its_thread() -> None:
    """Real time on a loaded machine: a batch takes at least its sleep, and 16 items
    (34 ms) clearly more than one (4 ms)."""

    async def main() -> Measurement:
        async with on_a_thread() as made:
            return await measure(made, list(range(16)), sizes=[1, 16], repeats=5, warmup=1)

    measured = asyncio.run(main())
    one, sixteen = measured.points
    assert one.median >= 0.004 - 1e-4
    assert sixteen.median >= 0.034 - 1e-4
    assert sixteen.median - one.median > 0.015


def test_with_lengths_the_cost_is_fitted_per_item_and_per_token() -> None:
    """cost = 1 ms + 0.2 ms/item + 0.01 ms/padded token, items of lengths 1 to 40."""

    @batchproxy.batch(batch_size=16, length=len)
    async def model(items: list[str]) -> list[str]:
        longest = max(len(item) for item in items)
        await asyncio.sleep(0.001 + 0.0002 * len(items) + 0.00001 * len(items) * longest)
        return items

    sample = ["x" * (1 + i % 40) for i in range(200)]
    measured = _measure_virtually(model, sample, sizes=[1, 4, 16], repeats=2, warmup=1)
    assert measured.lengths is not None
    assert len(measured.lengths) == 200
    lengths = sorted({p.length or 0 for p in measured.points})
    assert lengths[0] < 8
    assert lengths[-1] > 32
    assert {p.size for p in measured.points} == {1, 4, 16}
    curve = fit(measured)
    assert curve.by_length
    assert curve.fixed == pytest.approx(0.001, rel=1e-6)
    assert curve.per_item == pytest.approx(0.0002, rel=1e-6)
    assert curve.per_token == pytest.approx(0.00001, rel=1e-6)
    assert curve(8, 30) == pytest.approx(0.001 + 0.0016 + 0.0024)


def test_allowed_batch_sizes_are_measured_and_nothing_else() -> None:
    made = sleeping(batch_size=8, batch_sizes=(1, 3, 8))
    measured = _measure_virtually(made, list(range(20)), repeats=1, warmup=0)
    assert [p.size for p in measured.points] == [1, 3, 8]


def test_a_slow_outlier_is_averaged_not_carried_up() -> None:
    from batchproxy.tune import Point

    points = (
        Point(1, None, (0.009,)),  # one slow batch
        Point(2, None, (0.005,)),
        Point(4, None, (0.006,)),
        Point(8, None, (0.008,)),
    )
    curve = fit(Measurement("m", points, batchproxy.Options(), 1, None, False))
    pooled = (0.009 + 0.005 + 0.006) / 3
    assert list(curve.seconds) == pytest.approx([pooled, pooled, pooled, 0.008])
    assert curve.seconds == tuple(sorted(curve.seconds))


def test_what_cannot_be_measured_is_said() -> None:
    with pytest.raises(TuneError, match="not a Proxy, TensorProxy or @batch"):
        _measure_virtually(_Closeable(), [1])
    with pytest.raises(TuneError, match="sample is empty"):
        _measure_virtually(sleeping(), [])

    @batchproxy.batch(batch_size=4)
    async def broken(items: list[int]) -> list[int]:
        raise ValueError("no such input")

    with pytest.raises(TuneError, match="failed on a batch of 1 sample items: ValueError: no such"):
        _measure_virtually(broken, [1, 2], sizes=[1, 2])


class _Closeable:
    async def __aenter__(self) -> _Closeable:
        return self

    async def __aexit__(self, *exc: object) -> None:
        pass


def test_the_median_is_of_the_kept_batches() -> None:
    measured = _measure_virtually(sleeping(), [0], sizes=[2], repeats=4, warmup=2)
    (point,) = measured.points
    assert point.median == statistics.median(point.seconds)
    assert point.units == 2


def test_importing_the_tuner_loads_nothing_heavy() -> None:
    """NumPy and matplotlib load only to draw the plots, in the report's last step."""
    from _support import modules_after

    loaded = modules_after("import batchproxy.tune")
    assert not loaded & {"numpy", "matplotlib", "torch"}


def test_with_lengths_the_curve_goes_through_what_was_measured() -> None:
    """A cost that is not a line (per token cheaper in bigger batches, as on a CPU): the
    curve is the measured medians at the measured shapes, and between them in between."""

    def shaped(size: int, longest: int) -> float:
        return 0.002 + 0.0004 * size**0.5 * longest

    @batchproxy.batch(batch_size=16, length=len)
    async def model(items: list[str]) -> list[str]:
        await asyncio.sleep(shaped(len(items), max(len(item) for item in items)))
        return items

    sample = ["x" * (1 + i % 40) for i in range(200)]
    measured = _measure_virtually(model, sample, sizes=[1, 4, 16], repeats=1, warmup=0)
    curve = fit(measured)
    for point in measured.points:
        assert point.length is not None
        assert curve(point.size, point.length) == pytest.approx(shaped(point.size, point.length))
    assert shaped(4, 20) < curve(8, 20) < shaped(16, 20)


def test_with_lengths_the_longest_item_is_measured_too() -> None:
    """Found by `make bench-tune` on MiniLM: the p99 of lone calls is the longest items'
    time, and a model's time may grow faster than the length (attention's square);
    measured only up to the 90th percentile, the curve went on along a line and
    predicted those calls 30 % short. The sample's longest length is measured."""

    def quadratic(size: int, longest: int) -> float:
        return 0.001 + 0.00001 * size * longest**2

    @batchproxy.batch(batch_size=4, length=len)
    async def model(items: list[str]) -> list[str]:
        await asyncio.sleep(quadratic(len(items), max(len(item) for item in items)))
        return items

    sample = ["x" * (1 + i % 20) for i in range(199)] + ["x" * 100]  # one long outlier
    measured = _measure_virtually(model, sample, sizes=[1, 4], repeats=1, warmup=0)
    assert max(p.length or 0 for p in measured.points) == 100
    curve = fit(measured)
    assert curve(1, 100) == pytest.approx(quadratic(1, 100))


def test_the_spread_is_each_batch_over_its_shapes_median() -> None:
    from batchproxy.tune import Point

    points = (
        Point(1, None, (0.004, 0.005, 0.010)),
        Point(8, None, (0.020, 0.020)),
    )
    measured = Measurement("m", points, batchproxy.Options(), 1, None, False)
    assert measured.spread == pytest.approx((0.8, 1.0, 1.0, 1.0, 2.0))
    steady = Measurement("m", (Point(1, None, (0.004,)),), batchproxy.Options(), 1, None, False)
    assert steady.spread == (1.0,)


def test_a_lone_calls_handoff_is_measured_and_simulated() -> None:
    """Found by `make bench-tune` on the GPU-shaped model: a lone call took 5 ms where
    its batch's model time was 4 (the hand-offs to the model's thread and back), and
    the prediction missed it at every load. A real thread's hand-off costs something;
    on the virtual clock, where the model's 4.5 ms are all a lone call takes, it is
    nothing (the model's time is not counted in it); each simulated call pays it."""
    from batchproxy.tune import analyse

    async def main() -> Measurement:
        async with on_a_thread() as made:
            return await measure(made, list(range(16)), sizes=[1, 4], repeats=3, warmup=1)

    # (on asyncio's own loop, as `python -m batchproxy.tune` runs: uvloop's clock
    # counts milliseconds, and a hand-off of a tenth of one reads as nothing there)
    loop = asyncio.SelectorEventLoop()
    try:
        real = loop.run_until_complete(main())
    finally:
        loop.close()
    assert 0.0 < real.handoff < 1.0
    virtual = _measure_virtually(sleeping(), list(range(16)), sizes=[1, 4], repeats=2, warmup=1)
    assert virtual.handoff == 0.0
    handed = Measurement("m", virtual.points, virtual.options, 1, None, False, handoff=0.003)
    fast = {"requests": 200, "sizes": (4,), "delays_ms": (5.0,), "slots": (1,)}
    plain = analyse(virtual, rates=2, **fast)  # type: ignore[arg-type]
    slower = analyse(handed, rates=2, **fast)  # type: ignore[arg-type]
    for a, b in zip(plain.outcomes, slower.outcomes, strict=True):
        assert b.p50 == pytest.approx(a.p50 + 0.003)
        assert b.p99 == pytest.approx(a.p99 + 0.003)
