"""The recommendation: the setting that serves the most within the target, the knee of
its latency curve, and what one more batch slot or another replica would add.

A setting's capacity is the highest open-loop arrival rate it sustains (serves 95 %
of) with p99 latency within the target; between the last simulated rate that meets
the target and the first that does not, the p99 is taken as a straight line to
place the crossing. Settings within 3 % of the best capacity count as equal; among
them the lowest p99 at the heaviest load they all meet wins, then the smaller batch,
then fewer slots.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from ._errors import TuneError
from ._sweep import Load, Outcome, Setting, Simulator, open_rates, sweep

__all__ = ["Choice", "Extra", "Recommendation", "capacity", "knee", "rank", "recommend"]

EQUAL = 0.97
"""Capacities within this ratio of the best count as equal."""


@dataclass(frozen=True)
class Choice:
    """A setting, the load it serves within the target, and its open-loop runs."""

    setting: Setting
    capacity: float
    """Calls a second it serves within the target (0.0: none)."""
    outcomes: tuple[Outcome, ...]
    """Its open-loop runs, lightest load first."""


@dataclass(frozen=True)
class Extra:
    """What more hardware or concurrency buys: the recommended setting changed so."""

    what: str
    setting: Setting
    lanes: int
    capacity: float


@dataclass(frozen=True)
class Recommendation:
    target: float | None
    """The p99 target in seconds; None: the most throughput."""
    choice: Choice
    ranking: tuple[Choice, ...]
    """Every setting, best first (on one run each, the same arrivals for every one)."""
    expected: tuple[Outcome, ...]
    """What to expect of the recommended setting at each open-loop load of its choice:
    typical runs (`Simulator.typical`: the median of `paths` runs), lightest first."""
    capacity: float
    """Calls a second the recommended setting serves within the target, by `expected`
    (its `choice.capacity` is by the one run it was ranked on)."""
    knee: Outcome | None
    """The heaviest load of `expected` before the p99 passes twice its value at the
    lightest."""
    closed: tuple[Outcome, ...]
    """The recommended setting under closed-loop loads (N callers), typical runs."""
    extras: tuple[Extra, ...]


def _meets(outcome: Outcome, target: float | None) -> bool:
    return outcome.sustained and (target is None or outcome.p99 <= target)


def capacity(runs: Sequence[Outcome], target: float | None) -> float:
    """The highest open-loop rate `runs` (one setting's) serve within `target`."""
    best, previous = 0.0, None
    for outcome in sorted((o for o in runs if o.load.kind == "open"), key=lambda o: o.load.value):
        if _meets(outcome, target):
            best, previous = outcome.load.value, outcome
            continue
        if target is not None and previous is not None and outcome.sustained:
            span = outcome.p99 - previous.p99
            share = (target - previous.p99) / span if span > 0 else 0.0
            best = previous.load.value + share * (outcome.load.value - previous.load.value)
        break
    return best


def knee(runs: Sequence[Outcome]) -> Outcome | None:
    """The heaviest open-loop run before p99 passes twice its lightest-load value."""
    ordered = sorted((o for o in runs if o.load.kind == "open"), key=lambda o: o.load.value)
    if not ordered:
        return None
    found = None
    for outcome in ordered:
        if not outcome.sustained or outcome.p99 > 2 * ordered[0].p99:
            break
        found = outcome
    return found


def rank(outcomes: Sequence[Outcome], target: float | None) -> list[Choice]:
    """Every setting of `outcomes`, best first; a `TuneError` if none meets `target`."""
    runs: dict[Setting, list[Outcome]] = {}
    for outcome in outcomes:
        if outcome.load.kind == "open":
            runs.setdefault(outcome.setting, []).append(outcome)
    if not runs:
        raise TuneError("no open-loop run to choose from")
    choices = [
        Choice(s, capacity(r, target), tuple(sorted(r, key=lambda o: o.load.value)))
        for s, r in runs.items()
    ]
    best = max(c.capacity for c in choices)
    if best <= 0:
        lowest = min(outcomes, key=lambda o: o.p99)
        wanted = "" if target is None else f" with p99 within {target * 1e3:g} ms"
        raise TuneError(
            f"no setting serves even the lightest load ({lowest.load.label()}){wanted}: the "
            f"lowest p99 simulated was {lowest.p99 * 1e3:.1f} ms ({lowest.setting.label()}); "
            f"the model itself takes that long: raise the target or speed up the model"
        )
    equal = [c for c in choices if c.capacity >= EQUAL * best]
    common = min(c.capacity for c in equal)

    def at_common(choice: Choice) -> float:
        met = [o for o in choice.outcomes if o.load.value <= common and _meets(o, target)]
        return met[-1].p99 if met else float("inf")

    lead = min(
        equal,
        key=lambda c: (at_common(c), c.setting.batch_size, c.setting.max_concurrent_batches),
    )
    rest = sorted((c for c in choices if c is not lead), key=lambda c: -c.capacity)
    return [lead, *rest]


def recommend(
    simulator: Simulator,
    outcomes: Sequence[Outcome],
    target: float | None,
    *,
    callers: Sequence[int] = (),
    paths: int = 1,
) -> Recommendation:
    """The best setting of `outcomes`, what to expect of it (each of its open-loop loads
    and `callers`, the median of `paths` runs), the capacity and knee those show, and
    its capacity with one more batch slot and with another replica (twice the lanes),
    by `paths` runs too."""
    ranking = rank(outcomes, target)
    chosen = ranking[0]
    setting = chosen.setting
    expected = sweep(simulator, [setting], [o.load for o in chosen.outcomes], paths=paths)
    closed = sweep(simulator, [setting], [Load("closed", n) for n in callers], paths=paths)
    more_slots = replace(setting, max_concurrent_batches=setting.max_concurrent_batches + 1)
    replica = replace(setting, max_concurrent_batches=2 * setting.max_concurrent_batches)
    extras = []
    for what, changed, sim in (
        ("one more batch slot", more_slots, simulator),
        ("another replica", replica, simulator.with_lanes(2 * simulator.lanes)),
    ):
        rates = open_rates(sim, [changed])
        loads = [Load("open", r) for r in rates]
        runs = sweep(sim, [changed], loads, give_up_at=_give_up(target), paths=paths)
        extras.append(Extra(what, changed, sim.lanes, capacity(runs, target)))
    return Recommendation(
        target,
        chosen,
        tuple(ranking),
        tuple(expected),
        capacity(expected, target),
        knee(expected),
        tuple(closed),
        tuple(extras),
    )


def _give_up(target: float | None) -> float | None:
    return None if target is None else 4 * target
