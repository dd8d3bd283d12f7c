"""The scheduling benchmark's Markdown report: a table per section, the notes, and the
targets' verdicts.
"""

from __future__ import annotations

from typing import Any

from benchmarks._harness.report import verdict
from benchmarks.overhead.overhead import CALLERS
from benchmarks.scheduling._real import CpuResult, IdleResult
from benchmarks.scheduling._setup import (
    CLOSED_BATCH,
    CLOSED_CALLERS,
    CPU_BATCH,
    DEFAULT_DELAY_MS,
    IDLE_DELAY_MS,
    IDLE_GAP_S,
    NO_WINDOW,
    SWEEP_BATCH,
    TARGET_CLOSED_SHARE,
    TARGET_IDLE_FLOOR_RATIO,
    TARGET_MINIMAL_RATIO,
    TARGET_THROUGHPUT_VS_BEST,
    Config,
)
from benchmarks.scheduling._virtual import (
    DEFAULT_POLICY,
    SETUPS,
    ClosedResult,
    LoadResult,
    Setup,
)

# -- report ----------------------------------------------------------------------------


def sweep_tables(setup: Setup, loads: list[LoadResult]) -> str:
    lines = [
        f"#### {setup.label}: `max_concurrent_batches={setup.slots}`, "
        f"`simulated_model(cost, serial={setup.serial})`, capacity {setup.capacity:,.0f} req/s",
        "",
        "| load | offered | policy | throughput / offered | p50 | p99 | mean batch |",
        "|---|---|---|---|---|---|---|",
    ]
    for load in loads:
        for r in load.policies:
            mark = " (best fixed)" if r.policy == load.best_fixed else ""
            lines.append(
                f"| {load.load:.0%} | {load.offered_rate:,.0f}/s | {r.policy}{mark} "
                f"| {r.throughput_ratio:.4f} | {r.p50_ms:.2f} ms | {r.p99_ms:.2f} ms "
                f"| {r.mean_batch_size:.1f} |"
            )
    return "\n".join(lines)


def sweep_summary(results: dict[str, list[LoadResult]]) -> str:
    lines = [
        f"| configuration | load | best fixed | adaptive {DEFAULT_DELAY_MS:g} ms throughput "
        f"vs best (≥ {TARGET_THROUGHPUT_VS_BEST:g}) | adaptive p99 vs best p99 (≤) |",
        "|---|---|---|---|---|",
    ]
    for setup in SETUPS:
        for load in results[setup.key]:
            adaptive, best = load.row(DEFAULT_POLICY.label), load.row(load.best_fixed)
            lines.append(
                f"| {setup.label} | {load.load:.0%} | {load.best_fixed} "
                f"| {load.adaptive_throughput_vs_best:.4f}: {verdict(load.throughput_met)} "
                f"| {adaptive.p99_ms:.2f} vs {best.p99_ms:.2f} ms "
                f"({load.adaptive_p99_vs_best:.3f}x): {verdict(load.p99_met)} |"
            )
    return "\n".join(lines)


def all_alike(load: LoadResult) -> bool:
    return len({(r.throughput_ratio, r.p99_ms) for r in load.policies}) == 1


def sweep_notes(results: dict[str, list[LoadResult]]) -> str:
    lines = []
    for setup in SETUPS:
        alike = [f"{load.load:.0%}" for load in results[setup.key] if all_alike(load)]
        if alike:
            lines.append(
                f"- {setup.label}: at {', '.join(alike)} load every policy gave the same "
                f"throughput and p99 (best fixed is then the first listed)."
            )
    one, serial = SETUPS[0], SETUPS[2]
    if one.capacity == serial.capacity:  # same rates and seeds: the same arrivals
        pairs = zip(results[one.key], results[serial.key], strict=True)
        compared = ", ".join(
            f"{a.load:.0%}: {b.row(DEFAULT_POLICY.label).p99_ms:.2f} vs "
            f"{a.row(DEFAULT_POLICY.label).p99_ms:.2f} ms"
            for a, b in pairs
        )
        lines.append(
            f"- {serial.label} against {one.label}, same arrivals, adaptive "
            f"{DEFAULT_DELAY_MS:g} ms p99: {compared}."
        )
    lines.append(
        "- Throughput / offered: successful calls per second from the first arrival to the "
        "last answer, over arrivals per second from the first arrival to the last; just "
        "under 1 when every request is served (the last answers come after the last arrival)."
    )
    return "\n".join(lines)


def closed_table(results: list[ClosedResult]) -> str:
    lines = [
        "| clock | run | requests | throughput | share of ideal (≥ 97 %) | model busy "
        "| mean batch | p50 | p99 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.clock} | {r.seconds:g} s | {r.requests:,} | {r.throughput:,.0f}/s "
            f"| {r.share:.1%}: {verdict(r.share >= TARGET_CLOSED_SHARE)} | {r.model_busy:.1%} "
            f"| {r.mean_batch_size:.1f} | {r.p50_ms:.2f} ms | {r.p99_ms:.2f} ms |"
        )
    ideal = results[0].ideal
    lines += [
        "",
        f"- Ideal: {CLOSED_BATCH} / cost({CLOSED_BATCH}) = {ideal:,.0f} req/s, full batches "
        f"back to back. Model busy: the time the model ran (as the loop's clock saw it) over "
        f"the run; on the real loop each `asyncio.sleep` also overshoots its cost, so the "
        f"share of ideal is lower than the model-busy share by that overshoot.",
    ]
    return "\n".join(lines)


def cpu_table(results: list[CpuResult]) -> str:
    by_side = {r.side: r for r in results}
    base, minimal = by_side["direct await"].us, by_side[NO_WINDOW].us
    lines = [
        "| side | CPU per request | added over direct await | vs minimal batcher, no window "
        "| mean batch | repetitions |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        ratio = r.us / minimal
        target = ""
        if r.side == "batchproxy, defaults":
            target = f" (≤ {TARGET_MINIMAL_RATIO:g}: {verdict(ratio <= TARGET_MINIMAL_RATIO)})"
        batch = "—" if r.mean_batch_size is None else f"{r.mean_batch_size:.1f}"
        lines.append(
            f"| {r.side} | {r.us:.2f} µs | {r.us - base:+.2f} µs | {ratio:.2f}x{target} "
            f"| {batch} | {min(r.reps_us):.2f} to {max(r.reps_us):.2f} µs |"
        )
    return "\n".join(lines)


def idle_table(results: list[IdleResult]) -> str:
    lines = [
        "| quiet | side | samples | added p50 | vs no window | added p99 | direct await p50 |",
        "|---|---|---|---|---|---|---|",
    ]
    floor = {r.quiet_ms: r.added_p50_ms for r in results if r.side == NO_WINDOW}
    for r in results:
        ratio = r.added_p50_ms / floor[r.quiet_ms]
        target = ""
        if r.side == "batchproxy" and r.quiet_ms == IDLE_GAP_S * 1e3:
            met = ratio <= TARGET_IDLE_FLOOR_RATIO
            target = f" (≤ {TARGET_IDLE_FLOOR_RATIO:g}x: {verdict(met)})"
        lines.append(
            f"| {r.quiet_ms:g} ms | {r.side} | {r.samples} | {r.added_p50_ms:.3f} ms "
            f"| {ratio:.2f}x{target} | {r.added_p99_ms:.3f} ms | {r.direct_p50_ms:.4f} ms |"
        )
    return "\n".join(lines)


def report(results: dict[str, Any], config: Config) -> str:
    sweep_results: dict[str, list[LoadResult]] = results["sweep"]
    return "\n\n".join(
        [
            f"### 1. Policy sweep (virtual clock): cost(n) = 0.010 + 0.0002 n s, "
            f"batch_size={SWEEP_BATCH}, Poisson, {config.sweep_seconds:g} s per run",
            *(sweep_tables(setup, sweep_results[setup.key]) for setup in SETUPS),
            "#### Default adaptive policy against the best fixed one",
            sweep_summary(sweep_results),
            sweep_notes(sweep_results),
            f"### 2. Closed loop: {CLOSED_CALLERS} callers, batch_size={CLOSED_BATCH}, "
            f"one slot, default policy",
            closed_table(results["closed"]),
            f"### 3. CPU per request: {CALLERS:,} concurrent callers, identity model, "
            f"batch_size={CPU_BATCH}, median of {config.cpu_repetitions} repetitions "
            f"of {config.cpu_rounds * CALLERS:,} requests",
            cpu_table(results["cpu"]),
            f"### 4. Lone request on an idle batcher: max_delay_ms={IDLE_DELAY_MS:g}, "
            f"a quiet spell before each (target judged at {IDLE_GAP_S * 1e3:g} ms)",
            idle_table(results["idle"]),
        ]
    )
