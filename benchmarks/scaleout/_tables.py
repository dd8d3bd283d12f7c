"""The scale-out benchmark's Markdown report: a table per section, the notes, the targets'
verdicts.
"""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks._harness.report import verdict
from benchmarks.scaleout._dispatch import DispatchResult, PayloadResult
from benchmarks.scaleout._machine import MachineResult
from benchmarks.scaleout._setup import (
    BATCH_SIZE,
    CALLERS,
    PAYLOAD_ARRAYS,
    PAYLOAD_MB,
    TARGET_PROCESSES_VS_THREAD,
    Config,
)
from benchmarks.scaleout._throughput import ThroughputResult

# -- report -----------------------------------------------------------------------------------


def machine_table(machine: MachineResult, config: Config) -> str:
    rounds = ", ".join(f"{r:.2f}" for r in machine.ceiling_rounds)
    return "\n".join(
        [
            "| measure | result |",
            "|---|---|",
            f"| model cost per item, this process ({config.calibration_batches} batches of "
            f"{BATCH_SIZE}) | {machine.item_ms:.3f} ms median ({machine.item_ms_min:.3f} to "
            f"{machine.item_ms_max:.3f} ms) |",
            f"| one bare process, back to back | {machine.one_process_items_per_s:,.0f} items/s |",
            f"| two bare processes at once | {machine.two_processes_items_per_s:,.0f} items/s |",
            f"| ceiling: two ÷ one | {machine.ceiling:.2f}x (rounds: {rounds}) |",
        ]
    )


def throughput_table(results: list[ThroughputResult]) -> str:
    lines = [
        "| phase | side | requests | throughput | ÷ one thread | per round: median (range) "
        "| mean batch | p50 | p99 | this process's CPU |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        ratio = f"{r.vs_thread:.2f}x"
        if r.side == "processes":
            met = r.vs_thread >= TARGET_PROCESSES_VS_THREAD
            ratio += f" (≥ {TARGET_PROCESSES_VS_THREAD:g}: {verdict(met)})"
        spread = (
            f"{statistics.median(r.vs_thread_rounds):.2f}x "
            f"({min(r.vs_thread_rounds):.2f} to {max(r.vs_thread_rounds):.2f})"
        )
        if r.side == "thread":
            ratio, spread = "1 (baseline)", "—"
        lines.append(
            f"| {r.phase} | {r.label} | {r.requests:,} | {r.throughput:,.0f}/s | {ratio} "
            f"| {spread} | {r.mean_batch_size:.1f} | {r.p50_ms:.1f} ms | {r.p99_ms:.1f} ms "
            f"| {r.own_cpu_cores:.2f} cores |"
        )
    return "\n".join(lines)


def throughput_notes(results: list[ThroughputResult], machine: MachineResult) -> str:
    lines = []
    by_side = {r.side: r for r in results if r.side != "thread"}
    if "processes" in by_side:
        r = by_side["processes"]
        lines.append(
            f"- 2 processes ÷ one thread: {r.vs_thread:.2f}x, target ≥ "
            f"{TARGET_PROCESSES_VS_THREAD:g}: {verdict(r.vs_thread >= TARGET_PROCESSES_VS_THREAD)};"
            f" {r.vs_thread / machine.ceiling:.0%} of the machine's own ceiling "
            f"({machine.ceiling:.2f}x, two bare processes ÷ one, measured in rounds of its own "
            f"before these: on a machine whose speed drifts the share is rough, and can pass "
            f"100 %)."
        )
    if "ray" in by_side:
        r = by_side["ray"]
        lines.append(
            f"- 2 Ray actors ÷ one thread: {r.vs_thread:.2f}x; "
            f"{r.vs_thread / machine.ceiling:.0%} of the machine's ceiling."
        )
    else:
        lines.append("- (c) 2 Ray actors: skipped, ray is not installed (`pip install ray`).")
    thread_rows = [r for r in results if r.side == "thread"]
    if len(thread_rows) == 2:
        without, with_ray = thread_rows
        lines.append(
            f"- One thread, without Ray and with Ray running: {without.throughput:,.0f}/s and "
            f"{with_ray.throughput:,.0f}/s."
        )
    lines.append(
        f"- Ideal one thread, from the per-item cost in section 0: "
        f"{1e3 / machine.item_ms:,.0f}/s; the machine's speed drifts, so each ratio compares "
        f"rounds that took turns, never runs far apart in time."
    )
    lines.append(
        "- This process's CPU: its CPU time over the rounds' wall time. For one thread it "
        "includes the model; for the others it is the proxy, the callers and the hand-off "
        "(pickling and pipes, or Ray's client), CPU the workers cannot have on a 2-CPU machine."
    )
    return "\n".join(lines)


def dispatch_table(results: list[DispatchResult]) -> str:
    lines = [
        "| executor | round trip p50 | p99 | added over direct await (p50) | per item (p50) |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.executor} | {r.p50_us:,.1f} µs | {r.p99_us:,.1f} µs | {r.added_p50_us:+,.1f} µs "
            f"| {r.per_item_us:,.2f} µs |"
        )
    return "\n".join(lines)


def payload_table(results: list[PayloadResult]) -> str:
    lines = [
        "| executor | payload | round trips | round trip p50 | min | moved (both ways) |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.executor} | {PAYLOAD_ARRAYS} x float32 of {PAYLOAD_MB / PAYLOAD_ARRAYS:g} MB "
            f"= {r.mb_each_way:g} MB each way | {r.round_trips} | {r.p50_ms:.1f} ms "
            f"| {r.min_ms:.1f} ms | {r.mb_per_s:,.0f} MB/s |"
        )
    return "\n".join(lines)


def report(machine: MachineResult, results: dict[str, Any], config: Config) -> str:
    return "\n\n".join(
        [
            f"### 0. The machine: model of {machine.work:,} loop iterations per item",
            machine_table(machine, config),
            f"### 1. Throughput: {CALLERS} callers, closed loop, batch_size={BATCH_SIZE}, "
            f"{config.rounds} rounds of {config.round_seconds:g} s per side and phase, "
            f"taking turns",
            throughput_table(results["throughput"]),
            throughput_notes(results["throughput"], machine),
            f"### 2. Dispatch cost: identity model, batches of {BATCH_SIZE} small ints one at a "
            f"time, {config.dispatch_batches:,} per executor, taking turns",
            dispatch_table(results["dispatch"]),
            payload_table(results["payload"]),
        ]
    )
