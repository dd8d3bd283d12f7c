"""From a measurement to a recommendation: fit, simulate every setting, choose.

Runs its simulations on virtual-clock loops of its own: call it outside a running
event loop (after `asyncio.run(measure(...))`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from ._choose import Recommendation, recommend
from ._fit import CostCurve, fit
from ._measure import Measurement
from ._sweep import (
    Load,
    Outcome,
    Setting,
    Simulator,
    closed_callers,
    open_rates,
    settings_for,
    sweep,
)

__all__ = ["Analysis", "analyse"]


@dataclass(frozen=True)
class Analysis:
    """Everything the report shows."""

    measurement: Measurement
    curve: CostCurve
    simulator: Simulator
    settings: tuple[Setting, ...]
    outcomes: tuple[Outcome, ...]
    """Every setting under the open-loop loads (lightest first; a setting stops at the
    first load it cannot keep up with)."""
    recommendation: Recommendation


def analyse(
    measurement: Measurement,
    *,
    target: float | None = None,
    requests: int = 2000,
    seed: int = 0,
    sizes: Sequence[int] | None = None,
    slots: Sequence[int] | None = None,
    delays_ms: Sequence[float] = (2.0, 5.0, 20.0),
    windows: Sequence[Literal["adaptive", "fixed"]] = ("adaptive",),
    rates: int = 12,
    paths: int = 10,
    progress: Callable[[int, int], None] | None = None,
) -> Analysis:
    """Fit the measured cost, simulate each setting over `rates` open-loop loads (each
    run `requests` calls, one path each), and recommend for the p99 `target` (seconds;
    None: the most throughput); what to expect of the recommendation is the median of
    `paths` runs at each load."""
    curve = fit(measurement)
    simulator = Simulator.of(measurement, curve, requests=requests, seed=seed)
    settings = settings_for(
        measurement, sizes=sizes, slots=slots, delays_ms=delays_ms, windows=windows
    )
    loads = [Load("open", rate) for rate in open_rates(simulator, settings, rates)]
    give_up = None if target is None else 4 * target
    outcomes = sweep(simulator, settings, loads, give_up_at=give_up, progress=progress)
    callers = closed_callers(settings, measurement.lanes)
    recommendation = recommend(simulator, outcomes, target, callers=callers, paths=paths)
    return Analysis(measurement, curve, simulator, tuple(settings), tuple(outcomes), recommendation)
