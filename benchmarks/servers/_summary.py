"""The rounds read: rows (the median over the rounds, as fractions of the ceiling and the
floor), the targets' verdicts, the Markdown table and the plot.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from demo import client_axes

from benchmarks.servers._common import BATCH_SIZE
from benchmarks.servers._stacks import STACKS

# ---------------------------------------------------------------------------- summary


def spread(values: Sequence[float | None]) -> dict[str, Any] | None:
    present = [v for v in values if v is not None]
    if not present:
        return None
    return {
        "median": statistics.median(present),
        "min": min(present),
        "max": max(present),
        "rounds": list(values),
    }


def summarize(
    measured: dict[str, list[dict[str, Any]]], ceilings: list[float], levels: Sequence[int]
) -> list[dict[str, Any]]:
    """One row per stack and level: medians over the rounds, min and max, fractions (of
    the floor with as many web workers as the stack, where measured, else of the floor)."""
    ceiling = statistics.median(ceilings) if ceilings else None
    rows: list[dict[str, Any]] = []
    floors: dict[tuple[int, int], float] = {}  # (workers, level): the floor's median
    floors_first = sorted(measured, key=lambda n: STACKS[n].model)
    for name in floors_first:
        workers = STACKS[name].workers
        for level in levels:
            runs = [r["levels"][level] for r in measured[name] if level in r["levels"]]
            if not runs:
                continue
            throughput = spread([r["throughput"] for r in runs])
            assert throughput is not None
            if not STACKS[name].model:
                floors[workers, level] = throughput["median"]
            floor = floors.get((workers, level), floors.get((1, level)))
            rows.append(
                {
                    "stack": name,
                    "clients": level,
                    "throughput": throughput,
                    "p50_ms": spread([r["p50_ms"] for r in runs]),
                    "p99_ms": spread([r["p99_ms"] for r in runs]),
                    "of_ceiling": throughput["median"] / ceiling if ceiling else None,
                    "of_floor": throughput["median"] / floor if floor else None,
                    "errors": sum(r["errors"] for r in runs),
                    "checks": [r["check"] for r in measured[name]],
                }
            )
    return rows


def row(rows: Sequence[dict[str, Any]], stack: str, level: int) -> dict[str, Any] | None:
    return next((r for r in rows if r["stack"] == stack and r["clients"] == level), None)


def verdicts(rows: Sequence[dict[str, Any]], ceiling: float | None) -> list[dict[str, Any]]:
    """Issue 30's targets for batchproxy, each with the figures it compares."""

    def median(r: dict[str, Any] | None, key: str) -> float | None:
        value = None if r is None or r[key] is None else r[key]["median"]
        return None if value is None else float(value)

    def best(level: int, key: str, pick: Any) -> float | None:
        found = [median(row(rows, p, level), key) for p in STACKS if STACKS[p].peer]
        present = [v for v in found if v is not None]
        return pick(present) if present else None

    checks = []
    for level, what, key, other, factor, at_most in (
        (1, "p99 <= 1.1x regular's", "p99_ms", ("regular", None), 1.1, True),
        (1, "throughput >= 0.97x regular's", "throughput", ("regular", None), 0.97, False),
        (32, "p99 <= the best peer's", "p99_ms", ("peers", min), 1.0, True),
        (32, "throughput >= the best peer's", "throughput", ("peers", max), 1.0, False),
        (150, "throughput >= 1.2x the best peer's", "throughput", ("peers", max), 1.2, False),
        (150, "throughput >= 80 % of the ceiling", "throughput", ("ceiling", None), 0.8, False),
    ):
        mine = median(row(rows, "batchproxy", level), key)
        kind, pick = other
        if kind == "regular":
            theirs = median(row(rows, "regular", level), key)
        elif kind == "peers":
            theirs = best(level, key, pick)
        else:
            theirs = ceiling
        met = None
        if mine is not None and theirs is not None:
            met = mine <= factor * theirs if at_most else mine >= factor * theirs
        checks.append(
            {"clients": level, "target": what, "batchproxy": mine, "against": theirs, "met": met}
        )
    return checks


def fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def fmt_spread(s: dict[str, Any] | None, digits: int = 1) -> str:
    if s is None:
        return "-"
    return f"{fmt(s['median'], digits)} ({fmt(s['min'], digits)}-{fmt(s['max'], digits)})"


def table(rows: Sequence[dict[str, Any]], ceiling: dict[str, Any] | None) -> str:
    lines = [
        "| stack | clients | throughput (req/s) | of ceiling | of floor "
        "| p50 (ms) | p99 (ms) | errors |",
        "|:--|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in sorted(rows, key=lambda r: (r["clients"], list(STACKS).index(r["stack"]))):
        lines.append(
            f"| {STACKS[r['stack']].label} | {r['clients']} | {fmt_spread(r['throughput'])} "
            f"| {fmt(r['of_ceiling'], 2)} | {fmt(r['of_floor'], 2)} "
            f"| {fmt_spread(r['p50_ms'])} | {fmt_spread(r['p99_ms'])} | {r['errors']} |"
        )
    if ceiling is not None:
        lines.append(
            f"| ceiling (in process, full batches of {BATCH_SIZE}) | - | {fmt_spread(ceiling)} "
            "| 1.00 | - | - | - | - |"
        )
    return "\n".join(lines)


def plot(rows: Sequence[dict[str, Any]], ceiling: float | None, output: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8), dpi=110)
    styles = {
        "batchproxy": ("tab:blue", "s"),
        "host": ("tab:cyan", "P"),
        "regular": ("tab:red", "o"),
        "litserve": ("tab:purple", "D"),
        "mosec": ("tab:green", "v"),
        "floor": ("gray", "^"),
        "floor2": ("black", "^"),
    }
    levels = sorted({r["clients"] for r in rows})
    floor = [r["throughput"]["median"] for r in rows if not STACKS[r["stack"]].model]
    served = [r["throughput"]["median"] for r in rows if STACKS[r["stack"]].model]
    # (a floor tens of times the model's throughput, as MiniLM's on the CPU, would flatten
    # the others: it is then given in the left panel's title instead)
    off_scale = bool(floor and served and max(floor) > 5 * max(served))
    for name, stack in STACKS.items():
        mine = sorted((r for r in rows if r["stack"] == name), key=lambda r: r["clients"])
        if not mine:
            continue
        color, marker = styles[name]
        x = [r["clients"] for r in mine]
        panels = (
            ((right, "p99_ms"),)
            if off_scale and not stack.model
            else ((left, "throughput"), (right, "p99_ms"))
        )
        for axis, key in panels:
            points = [(xi, r[key]) for xi, r in zip(x, mine, strict=True) if r[key] is not None]
            if not points:
                continue
            medians = [s["median"] for _, s in points]
            below = [s["median"] - s["min"] for _, s in points]
            above = [s["max"] - s["median"] for _, s in points]
            axis.errorbar(
                [p[0] for p in points],
                medians,
                yerr=[below, above],
                marker=marker,
                color=color,
                capsize=3,
                label=stack.label,
                linestyle="-" if stack.model else "--",
            )
    if ceiling is not None:
        left.axhline(ceiling, color="black", linestyle=":", label="ceiling (in process)")
    heading = "Throughput (median, min-max over rounds)"
    if off_scale:
        heading += f"\nthe HTTP floor: {min(floor):.0f}-{max(floor):.0f} req/s, off the scale"
    client_axes(
        levels,
        (left, "throughput (requests/s)", heading),
        (right, "p99 latency (ms)", "p99 latency"),
        xlabel="concurrent clients (closed loop)",
    )
    left.set_ylim(bottom=0)
    right.set_yscale("log")
    left.legend(loc="best", fontsize=8)
    right.legend(loc="upper left", fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output)
    plt.close(figure)
