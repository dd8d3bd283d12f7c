"""The online cost model: `seconds = fixed + per_unit x units`, robust to warm-up and
outliers, and visible in `proxy.stats`."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
from _support import Recorder

from batchproxy._scheduling.cost_model import WARMUP, CostModel


def test_warm_up_batches_are_ignored() -> None:
    model = CostModel()
    for _ in range(3):
        model.add(8, 99.0)  # compiling, allocating: however slow, ignored
    assert model.estimate() is None
    model.add(8, 0.010)
    estimate = model.estimate()
    assert estimate is not None
    assert estimate.samples == 1
    assert estimate.predict(8) == pytest.approx(0.010)


def test_recovers_a_line_from_varied_batch_sizes() -> None:
    model = CostModel()
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 64)
        model.add(n, 0.010 + 0.0002 * n)
    estimate = model.estimate()
    assert estimate is not None
    assert estimate.fixed == pytest.approx(0.010, rel=1e-6)
    assert estimate.per_unit == pytest.approx(0.0002, rel=1e-6)


def test_one_batch_size_reports_the_time_as_fixed() -> None:
    model = CostModel()
    for _ in range(20):
        model.add(32, 0.05)
    estimate = model.estimate()
    assert estimate is not None
    assert (estimate.fixed, estimate.per_unit) == pytest.approx((0.05, 0.0))


def test_outliers_barely_move_the_line() -> None:
    model = CostModel()
    rng = random.Random(1)
    for i in range(300):
        n = rng.randint(1, 64)
        seconds = 0.010 + 0.0002 * n + rng.gauss(0, 0.0002)
        if i % 50 == 25:
            seconds += 2.0  # a pause: garbage collection, a context switch
        model.add(n, seconds)
    estimate = model.estimate()
    assert estimate is not None
    assert estimate.fixed == pytest.approx(0.010, abs=0.002)
    assert estimate.per_unit == pytest.approx(0.0002, rel=0.1)


def test_follows_a_model_whose_speed_changes() -> None:
    model = CostModel()
    rng = random.Random(2)
    for per_unit in (0.001, 0.0002):
        for _ in range(400):
            n = rng.randint(1, 64)
            model.add(n, 0.005 + per_unit * n)
    estimate = model.estimate()
    assert estimate is not None
    assert estimate.per_unit == pytest.approx(0.0002, rel=0.05)


@pytest.mark.looptime
async def test_proxy_stats_show_the_fitted_model_time() -> None:
    class Accelerator(Recorder):
        async def _inference(self, items: list[Any]) -> list[Any]:
            self.batches.append(list(items))
            await asyncio.sleep(0.010 + 0.0005 * len(items))
            return [("out", i) for i in items]

    async with Accelerator(batch_size=16, max_delay_ms=1) as proxy:
        assert proxy.stats.cost_model is None
        rng = random.Random(3)
        for _ in range(30):
            await asyncio.gather(*(proxy.inference(i) for i in range(rng.randint(1, 16))))
        estimate = proxy.stats.cost_model
        assert estimate is not None
        assert estimate.unit == "item"
        assert estimate.fixed == pytest.approx(0.010, abs=1e-5)
        assert estimate.per_unit == pytest.approx(0.0005, abs=1e-6)


@pytest.mark.looptime
async def test_with_a_length_the_unit_is_padded_tokens() -> None:
    async with Recorder(length=len, batch_size=4, max_delay_ms=1, delay=0.01) as proxy:
        for _ in range(WARMUP + 1):
            await proxy.inference("abc")
        estimate = proxy.stats.cost_model
        assert estimate is not None
        assert estimate.unit == "token"
