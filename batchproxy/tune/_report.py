"""The report: `report.md` (always), `options.py` (the settings to paste), and, when
matplotlib is installed, `cost.png` and `latency.png` (imported only to draw them).
`summary` is the few lines the command line prints."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ._analysis import Analysis
from ._choose import Recommendation
from ._sweep import Outcome

__all__ = ["options_code", "summary", "write_report"]

SHOWN = 6
"""Settings drawn in the latency plot (the best ones)."""


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def _target(analysis: Analysis) -> str:
    target = analysis.recommendation.target
    return "the most throughput" if target is None else f"p99 ≤ {target * 1e3:g} ms"


def recommended_options(analysis: Analysis) -> dict[str, Any]:
    """The recommended keywords, with the proxy's `batch_sizes` cut to the batch size."""
    setting = analysis.recommendation.choice.setting
    words = setting.keywords()
    sizes = analysis.measurement.options.batch_sizes
    if sizes is not None:
        words["batch_sizes"] = tuple(s for s in sizes.sizes if s <= setting.batch_size)
    return words


def options_code(analysis: Analysis) -> str:
    """The recommended options as Python to paste."""
    words = recommended_options(analysis)
    body = "".join(f"    {name}={_literal(value)},\n" for name, value in words.items())
    fixed = [n for n in ("batch_sizes", "max_batch_tokens") if n in words]
    note = (
        f"# ({' and '.join(fixed)}: constructor only; leave them out of configure())\n"
        if fixed
        else ""
    )
    return (
        f"# {analysis.measurement.name}, tuned for {_target(analysis)} "
        f"by python -m batchproxy.tune\n"
        f"# pass to the constructor (Proxy(...), TensorProxy(...), @batch(...)), or on a\n"
        f"# running proxy: proxy.configure(**TUNED)\n{note}"
        f"TUNED = dict(\n{body})\n"
    )


def _literal(value: object) -> str:
    """Python source for `value`, strings in double quotes (as ruff and black write them)."""
    return json.dumps(value) if isinstance(value, str) else repr(value)


def summary(analysis: Analysis) -> str:
    """What the command line prints: the settings and what to expect."""
    rec = analysis.recommendation
    choice = rec.choice
    lines = [
        f"{analysis.measurement.name}: model time {analysis.curve.describe()} "
        f"({len(analysis.measurement.points)} batch shapes measured), "
        f"and {analysis.measurement.handoff * 1e3:.2f} ms a call beyond its batch",
        f"for {_target(analysis)}: {choice.setting.label()}",
        f"  serves up to {rec.capacity:.0f} calls/s (simulated, open loop)",
    ]
    if rec.knee is not None:
        lines.append(
            f"  knee: {rec.knee.load.label()} (p99 {_ms(rec.knee.p99)} ms; beyond it p99 climbs)"
        )
    for extra in rec.extras:
        lines.append(f"  {extra.what}: {extra.capacity:.0f} calls/s ({_gain(rec, extra.capacity)})")
    lines.append(f"  what to expect (each row {_runs(analysis)}; the p99 range is theirs):")
    lines.append("  load        throughput   p50 ms   p99 ms   p99 range")
    for outcome in analysis.recommendation.expected:
        lines.append(_row_text(outcome))
    for outcome in rec.closed:
        lines.append(_row_text(outcome))
    return "\n".join(lines)


def _runs(analysis: Analysis) -> str:
    """What each figure of what to expect is: the median of how many runs, how long."""
    paths = max((o.paths for o in analysis.recommendation.expected), default=1)
    calls = f"{analysis.simulator.requests:,} calls"
    if paths == 1:
        return f"one simulated run of {calls}, from an idle start"
    return f"the median of {paths} simulated runs of {calls} each, from an idle start"


def _range(o: Outcome) -> str:
    return "" if o.p99_range is None else f"{_ms(o.p99_range[0])}-{_ms(o.p99_range[1])}"


def _row_text(o: Outcome) -> str:
    late = "" if o.sustained else "  (falls behind)"
    return (
        f"  {o.load.label():<11} {o.throughput:>8.0f}/s {_ms(o.p50):>8} {_ms(o.p99):>8}"
        f"   {_range(o):<11}{late}"
    ).rstrip()


def _gain(rec: Recommendation, capacity: float) -> str:
    if rec.capacity <= 0:
        return "n/a"
    return f"{(capacity / rec.capacity - 1) * 100:+.0f} %"


def _table(outcomes: tuple[Outcome, ...] | list[Outcome], first: str) -> list[str]:
    rows = [
        f"| {first} | throughput (calls/s) | p50 (ms) | p99 (ms) | p99 range (ms) | keeps up |",
        "|---|---|---|---|---|---|",
    ]
    for o in outcomes:
        rows.append(
            f"| {o.load.label()} | {o.throughput:.0f} | {_ms(o.p50)} | {_ms(o.p99)} | "
            f"{_range(o)} | {'yes' if o.sustained else 'no'} |"
        )
    return rows


def markdown(analysis: Analysis, plots: list[str]) -> str:
    rec, m, curve = analysis.recommendation, analysis.measurement, analysis.curve
    choice = rec.choice
    out = [
        f"# Settings for {m.name}",
        "",
        f"Target: {_target(analysis)}. Measured on the proxy's own executor "
        f"({m.lanes} lane{'s' if m.lanes > 1 else ''}), then simulated: the real scheduler on "
        f"a virtual clock, {analysis.simulator.requests} calls a run, "
        f"{len(analysis.settings)} settings.",
        "",
        "## Recommendation",
        "",
        f"**{choice.setting.label()}**: serves up to **{rec.capacity:.0f} calls/s** "
        f"within the target (open loop, Poisson arrivals).",
        "",
        "```python",
        options_code(analysis).rstrip(),
        "```",
        "",
    ]
    if rec.knee is not None:
        out += [
            f"The knee: {rec.knee.load.label()}, p99 {_ms(rec.knee.p99)} ms; beyond it the "
            f"p99 climbs past twice its value at the lightest load.",
            "",
        ]
    out += [
        "## What more would buy",
        "",
        "| change | calls/s within the target | gain |",
        "|---|---|---|",
    ]
    for extra in rec.extras:
        out.append(
            f"| {extra.what} ({extra.setting.label()}, {extra.lanes} "
            f"lane{'s' if extra.lanes > 1 else ''}) | "
            f"{extra.capacity:.0f} | {_gain(rec, extra.capacity)} |"
        )
    out += [
        "",
        "## Latency against load (the recommendation)",
        "",
        f"Each row is {_runs(analysis)}, and the p99 range is the lowest and highest p99 "
        "among them: a longer run meets bigger bursts of arrivals, and near capacity "
        "its p99 is higher. Open loop:",
        "",
    ]
    out += _table(list(analysis.recommendation.expected), "arrivals")
    if rec.closed:
        out += ["", "Closed loop (each caller calls again once answered):", ""]
        out += _table(list(rec.closed), "callers")
    out += [
        "",
        "## Every setting",
        "",
        "Ranked on one simulated run each, every setting on the same arrivals (the "
        "recommendation's capacity above is by its typical runs).",
        "",
        "| setting | calls/s within the target |",
        "|---|---|",
    ]
    out += [f"| {c.setting.label()} | {c.capacity:.0f} |" for c in rec.ranking]
    out += ["", "## The cost curve", "", f"Fitted: {curve.describe()}.", ""]
    out += [
        f"A lone call took {m.handoff * 1e3:.2f} ms beyond its batch's model time (the "
        "hand-offs to the executor and back: each simulated call pays it too).",
        "",
    ]
    out += [
        "| batch | longest item | median (ms) | min (ms) | max (ms) | fitted (ms) | items/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in m.points:
        out.append(
            f"| {p.size} | {'' if p.length is None else p.length} | {_ms(p.median)} | "
            f"{_ms(min(p.seconds))} | {_ms(max(p.seconds))} | {_ms(curve(p.size, p.length))} | "
            f"{p.size / p.median:.0f} |"
        )
    out += [""]
    out += [f"![{name}]({name})" for name in plots] or ["(No plots: matplotlib is not installed.)"]
    out += [
        "",
        "The simulation counts the model's time, not the proxy's own CPU time (tens of "
        "microseconds a call): for a model much faster than that, expect less.",
        "",
    ]
    return "\n".join(out)


def write_report(directory: Path | str, analysis: Analysis, *, plots: bool = True) -> list[Path]:
    """Write the report into `directory` (made if need be); the paths written."""
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    drawn = _plots(folder, analysis) if plots else []
    written = [folder / name for name in drawn]
    code = folder / "options.py"
    code.write_text(options_code(analysis), encoding="utf-8")
    report = folder / "report.md"
    report.write_text(markdown(analysis, drawn), encoding="utf-8")
    return [report, code, *written]


def _plots(folder: Path, analysis: Analysis) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    m, curve, rec = analysis.measurement, analysis.curve, analysis.recommendation
    figure, axes = plt.subplots(figsize=(6, 4))
    lengths = sorted({p.length for p in m.points}, key=lambda x: x or 0)
    for length in lengths:
        points = [p for p in m.points if p.length == length]
        label = "measured" if length is None else f"measured, longest {length}"
        sizes = [p.size for p in points]
        axes.plot(sizes, [p.median * 1e3 for p in points], "o", label=label)
        line = [curve(s, length) * 1e3 for s in range(min(sizes), max(sizes) + 1)]
        axes.plot(range(min(sizes), max(sizes) + 1), line, "-", alpha=0.6)
    axes.set_xlabel("batch size")
    axes.set_ylabel("model time per batch (ms)")
    axes.set_title(f"{m.name}: cost curve")
    axes.legend()
    figure.tight_layout()
    figure.savefig(folder / "cost.png", dpi=120)
    plt.close(figure)

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for choice in rec.ranking[:SHOWN]:
        runs = [o for o in choice.outcomes if o.sustained]
        if not runs:
            continue
        lead = choice is rec.choice
        axes.plot(
            [o.throughput for o in runs],
            [o.p99 * 1e3 for o in runs],
            "-o" if lead else "-",
            linewidth=2.5 if lead else 1,
            label=choice.setting.label() + (" (recommended)" if lead else ""),
        )
    if rec.target is not None:
        axes.axhline(rec.target * 1e3, color="grey", linestyle="--", label="p99 target")
        axes.plot([rec.capacity], [rec.target * 1e3], "k*", markersize=14)
    axes.set_xlabel("throughput (calls/s)")
    axes.set_ylabel("p99 latency (ms)")
    axes.set_yscale("log")
    axes.set_title("p99 against load, simulated")
    axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(folder / "latency.png", dpi=120)
    plt.close(figure)
    return ["cost.png", "latency.png"]
