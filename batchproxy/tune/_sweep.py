"""The settings x loads, simulated: the real scheduler, the measured cost, a virtual clock.

Each run builds a fresh proxy with one `Setting` in front of a simulated model (an
`asyncio.sleep` of the cost curve's time for the batch, times a factor drawn from
the measured batches' spread around it, on `lanes` parallel lanes:
the executor's capacity, 1 for a thread; batches beyond it wait for a lane, as they
wait for a busy thread) and drives it with `batchproxy.simulation`: open loop
(Poisson arrivals at a rate, whether or not earlier calls were answered) or closed
loop (N callers, each calling again once answered). With lengths, each call's item
is a sample item's length, drawn at random, and the proxy batches by it as the real
one does. The proxy's own CPU time costs no virtual time: the predictions are for
the model's time; a model whose time is small next to the proxy's (tens of
microseconds a request) is predicted optimistic.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from .. import simulation
from .._decorator import batch
from .._option_values import BatchSizes
from .._stats import nearest_rank
from ._fit import CostCurve
from ._measure import Measurement

__all__ = ["Load", "Outcome", "Setting", "Simulator", "outcome_of", "settings_for", "sweep"]

SUSTAINED = 0.97
"""An open-loop load is sustained when answers keep up with this share of the calls."""


@dataclass(frozen=True, order=True)
class Setting:
    """The options a run tries (the keywords of `Proxy(...)`)."""

    batch_size: int
    max_concurrent_batches: int
    max_delay_ms: float = 5.0
    window: Literal["adaptive", "fixed"] = "adaptive"
    max_batch_tokens: int | None = None

    def keywords(self) -> dict[str, Any]:
        words: dict[str, Any] = {
            "batch_size": self.batch_size,
            "max_concurrent_batches": self.max_concurrent_batches,
            "max_delay_ms": self.max_delay_ms,
            "window": self.window,
        }
        if self.max_batch_tokens is not None:
            words["max_batch_tokens"] = self.max_batch_tokens
        return words

    def label(self) -> str:
        text = (
            f"batch_size={self.batch_size} slots={self.max_concurrent_batches} "
            f"{self.window} {self.max_delay_ms:g} ms"
        )
        return text if self.max_batch_tokens is None else f"{text} tokens={self.max_batch_tokens}"


@dataclass(frozen=True)
class Load:
    """Open loop: `value` arrivals a second (Poisson); closed loop: `value` callers."""

    kind: Literal["open", "closed"]
    value: float

    def label(self) -> str:
        return f"{self.value:.0f}/s" if self.kind == "open" else f"{self.value:.0f} callers"


@dataclass(frozen=True)
class Outcome:
    """One simulated run: what the callers saw (seconds, calls a second)."""

    setting: Setting
    load: Load
    throughput: float
    """Answers a second, from the first call to the last answer."""
    p50: float
    p99: float
    lanes: int = 1
    kept_up: bool = True
    """Open loop: the rate is within the setting's capacity (full batches back to back)
    and, past the first tenth of the run, answers came as fast as calls (`_kept_up`)."""
    paths: int = 1
    """Simulated runs behind it: more than one, each figure is their median
    (`Simulator.typical`) and `p99_range` the lowest and highest p99 among them."""
    p99_range: tuple[float, float] | None = None

    @property
    def sustained(self) -> bool:
        return self.kept_up


@dataclass(frozen=True)
class Simulator:
    """Runs one setting under one load on the virtual clock, with the measured cost."""

    curve: CostCurve
    lanes: int
    lengths: tuple[int, ...] | None = None
    batch_sizes: tuple[int, ...] | None = None
    pads: bool = False
    requests: int = 2000
    seed: int = 0
    spread: tuple[float, ...] = (1.0,)
    """Factors each batch's time is drawn from (`Measurement.spread`)."""
    handoff: float = 0.0
    """Seconds each call takes beyond its batch (`Measurement.handoff`)."""

    @classmethod
    def of(cls, measurement: Measurement, curve: CostCurve, **kw: Any) -> Simulator:
        sizes = measurement.options.batch_sizes
        return cls(
            curve,
            measurement.lanes,
            measurement.lengths,
            None if sizes is None else tuple(sizes.sizes),
            measurement.pads,
            spread=measurement.spread,
            handoff=measurement.handoff,
            **kw,
        )

    def with_lanes(self, lanes: int) -> Simulator:
        return replace(self, lanes=lanes)

    def capacity(self, setting: Setting) -> float:
        """Calls a second with full batches back to back on every usable lane."""
        lanes = min(self.lanes, setting.max_concurrent_batches)
        length = None if self.lengths is None else sorted(self.lengths)[len(self.lengths) // 2]
        return lanes * setting.batch_size / self.curve(setting.batch_size, length)

    def run(self, setting: Setting, load: Load) -> Outcome:
        rng = random.Random(self.seed)
        lengths = self.lengths
        items: list[int] = (
            list(range(self.requests))
            if lengths is None
            else [rng.choice(lengths) for _ in range(self.requests)]
        )
        # one generator per run, drawn in turn: the lengths, the arrivals' own seed, then
        # the batches' factors (a second generator seeded with `seed` would repeat the
        # lengths' draws: each arrival's gap and each batch's factor tied to an item's
        # length)
        arrivals_seed = rng.getrandbits(64)
        calls = simulation.run(self._drive(setting, load, items, arrivals_seed, rng))
        outcome = outcome_of(setting, load, calls, self.lanes)
        if load.kind == "open" and load.value > self.capacity(setting):
            outcome = replace(outcome, kept_up=False)  # beyond full batches back to back
        return outcome

    def typical(self, setting: Setting, load: Load, paths: int) -> Outcome:
        """A typical run of `requests` calls: the median throughput, p50 and p99 of
        `paths` runs (seeds `seed`, `seed + 1`, ...), kept up if most of them kept up.
        One run is one path: near capacity its p99 rests on a few bursts of arrivals,
        and another seed's can be half again as high."""
        if paths < 1:
            raise ValueError(f"paths must be >= 1, got {paths}")
        runs = [replace(self, seed=self.seed + k).run(setting, load) for k in range(paths)]
        if paths == 1:
            return runs[0]
        p99s = [o.p99 for o in runs]
        return replace(
            runs[0],
            throughput=statistics.median(o.throughput for o in runs),
            p50=statistics.median(o.p50 for o in runs),
            p99=statistics.median(p99s),
            kept_up=2 * sum(o.kept_up for o in runs) > paths,
            paths=paths,
            p99_range=(min(p99s), max(p99s)),
        )

    async def _drive(
        self,
        setting: Setting,
        load: Load,
        items: list[int],
        arrivals_seed: int,
        rng: random.Random,
    ) -> list[tuple[float, float | None]]:
        proxy = batch(**self._options(setting))(self._model(rng))
        loop = asyncio.get_running_loop()
        calls: list[tuple[float, float | None]] = []

        async def call(index: int) -> None:
            started = loop.time()
            try:
                await proxy(items[index % len(items)])
            except Exception:
                calls.append((started, None))
            else:
                calls.append((started, loop.time() + self.handoff))

        async with proxy:
            if load.kind == "open":
                duration = len(items) / load.value
                arrivals = simulation.poisson(load.value, duration, seed=arrivals_seed)
                await simulation.open_loop(call, arrivals)
            else:
                served = min(self.capacity(setting), load.value / self.curve(1, self._typical()))
                counter = itertools.count()
                await simulation.closed_loop(
                    lambda _who: call(next(counter)), int(load.value), len(items) / served
                )
        return calls

    def _typical(self) -> int | None:
        return None if self.lengths is None else sorted(self.lengths)[len(self.lengths) // 2]

    def _options(self, setting: Setting) -> dict[str, Any]:
        options = setting.keywords()
        if self.lengths is not None:
            options["length"] = _own_length
        if self.batch_sizes is not None:
            options["batch_sizes"] = (
                BatchSizes(self.batch_sizes, pad_item=0) if self.pads else self.batch_sizes
            )
        return options

    def _model(self, rng: random.Random) -> Callable[[list[int]], Any]:
        """The simulated model: each batch takes the curve's time times a factor drawn
        from `spread` (with `rng`: the same seed, the same run)."""
        lanes = asyncio.Semaphore(self.lanes)
        curve, by_length, spread = self.curve, self.lengths is not None, self.spread

        async def model(items: list[int]) -> list[int]:
            seconds = curve(len(items), max(items) if by_length else None)
            if len(spread) > 1:
                seconds *= rng.choice(spread)
            async with lanes:
                await asyncio.sleep(seconds)
            return items

        return model


def outcome_of(
    setting: Setting, load: Load, calls: Sequence[tuple[float, float | None]], lanes: int = 1
) -> Outcome:
    """What `calls` (each call's start and end, None for a failure) show: throughput from
    the first start to the last end, p50 and p99 of the answered, and (open loop) whether
    the answers kept up with the calls. For simulated and real runs alike."""
    answered = [(start, end) for start, end in calls if end is not None]
    latencies = sorted(end - start for start, end in answered)
    span = max((end for _, end in answered), default=0.0) - min(start for start, _ in calls)
    return Outcome(
        setting,
        load,
        len(answered) / span if span > 0 else 0.0,
        nearest_rank(latencies, 0.5) if latencies else 0.0,
        nearest_rank(latencies, 0.99) if latencies else 0.0,
        lanes,
        load.kind == "closed" or (len(answered) == len(calls) and _kept_up(calls)),
    )


def _kept_up(calls: Sequence[tuple[float, float | None]]) -> bool:
    """Past the first tenth of the arrivals and up to the last, as many calls ended as
    began: in a steady state both counts are the same, shifted by the latency; in
    overload the answers come at the model's pace, behind. Within `SUSTAINED`, or three
    standard deviations of the count (a short run's arrivals are noisy)."""
    starts = sorted(start for start, _ in calls)
    if len(starts) < 30:
        return True
    begin, end = starts[len(starts) // 10], starts[-1]
    began = sum(1 for start in starts if begin <= start <= end)
    ended = sum(1 for _, stop in calls if stop is not None and begin <= stop <= end)
    return ended >= began - max((1 - SUSTAINED) * began, 3 * math.sqrt(began))


def _own_length(item: int) -> int:
    return item


def settings_for(
    measurement: Measurement,
    *,
    sizes: Sequence[int] | None = None,
    slots: Sequence[int] | None = None,
    delays_ms: Sequence[float] = (2.0, 5.0, 20.0),
    windows: Sequence[Literal["adaptive", "fixed"]] = ("adaptive",),
) -> list[Setting]:
    """The settings worth trying: each measured batch size (but 1, when there are
    others), one slot per lane and one more, each window and delay; with lengths, no
    token budget and one of `batch_size x` the sample's median length."""
    measured = sorted({p.size for p in measurement.points})
    sizes = list(sizes or ([s for s in measured if s > 1] or measured))
    slots = list(slots or sorted({measurement.lanes, measurement.lanes + 1}))
    budgets: list[Callable[[int], int | None]] = [lambda size: None]
    if measurement.lengths is not None:
        median = sorted(measurement.lengths)[len(measurement.lengths) // 2]
        budgets.append(lambda size: max(1, size * median))
    return sorted(
        {
            Setting(size, slot, float(delay), window, budget(size))
            for size in sizes
            for slot in slots
            for delay in delays_ms
            for window in windows
            for budget in budgets
        },
        key=lambda s: (
            s.batch_size,
            s.max_concurrent_batches,
            s.window,
            s.max_delay_ms,
            s.max_batch_tokens or 0,
        ),
    )


def open_rates(simulator: Simulator, settings: Sequence[Setting], points: int = 12) -> list[float]:
    """Arrival rates from 5 % to 105 % of the best setting's capacity."""
    ceiling = max(simulator.capacity(s) for s in settings)
    shares = [0.05 + 1.0 * k / (points - 1) for k in range(points)]
    return [ceiling * share for share in shares]


def closed_callers(settings: Sequence[Setting], lanes: int) -> list[int]:
    """1, 2, 4, ... callers, up to twice the most a full round of batches holds."""
    top = 2 * max(s.batch_size * max(s.max_concurrent_batches, lanes) for s in settings)
    return [1 << k for k in range(top.bit_length()) if 1 << k <= top]


Progress = Callable[[int, int], None]


def sweep(
    simulator: Simulator,
    settings: Sequence[Setting],
    loads: Sequence[Load],
    *,
    give_up_at: float | None = None,
    progress: Progress | None = None,
    paths: int = 1,
) -> list[Outcome]:
    """Each setting under each load, lightest first (with `paths` > 1, typical runs:
    `Simulator.typical`). An open-loop setting that no longer keeps up (or whose p99
    passes `give_up_at` seconds) is not run at heavier loads."""
    ordered = sorted(loads, key=lambda load: (load.kind, load.value))
    outcomes: list[Outcome] = []
    total, done = len(settings) * len(ordered), 0
    for setting in settings:
        stopped = False
        for load in ordered:
            done += 1
            if not (stopped and load.kind == "open"):
                outcome = simulator.typical(setting, load, paths)
                outcomes.append(outcome)
                over = give_up_at is not None and outcome.p99 > give_up_at
                stopped = load.kind == "open" and (not outcome.sustained or over)
            if progress is not None:
                progress(done, total)
    return outcomes
