"""The BERT-over-HTTP section's Markdown table and plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.gpu._http_measure import HEADLINE_OVERLAP, LEVELS, OVERLAP_CLIENTS, PATHS
from benchmarks.gpu._server import BATCH_SIZE

# ------------------------------------------------------------------------ reporting


def _f(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if not a or not b else f"{a / b:.2f}x"


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"### BERT over HTTP ({result['device']}, {result['dtype']}, batch_size {BATCH_SIZE}, "
        f"{result['client_processes']} client processes at 100/150, 1 at 1/5; overlap "
        f"{'on' if HEADLINE_OVERLAP else 'off'})",
        "",
        "| model | clients | path | N at once (s) | req/s | p50 (ms) | p99 (ms) "
        "| mean batch | vs regular |",
        "|:--|--:|:--|--:|--:|--:|--:|--:|--:|",
    ]
    for name, model in result["models"].items():
        regular = {r["clients"]: r for r in model["http"] if r["path"] == "regular"}
        for path_name in PATHS:
            for row in (r for r in model["http"] if r["path"] == path_name):
                base = regular[row["clients"]]
                lines.append(
                    f"| {name} | {row['clients']} | {path_name} | {row['burst_s']:.3f} "
                    f"| {row['throughput']:.0f} | {_f(row['p50_ms'])} | {_f(row['p99_ms'])} "
                    f"| {_f(row['mean_batch_size'])} "
                    f"| {_ratio(row['throughput'], base['throughput'])} |"
                )
    lines += [
        "",
        "| model | batched = regular (max diff, tol) | in process: batch 1 items/s "
        "| batches of 64 items/s | proxy, 150 coroutines items/s (mean batch) |",
        "|:--|:--|--:|--:|--:|",
    ]
    for name, model in result["models"].items():
        local, check = model["in_process"], model["check"]
        lines.append(
            f"| {name} | {'yes' if check['ok'] else 'NO'} ({check['max_abs_diff']:.1e}, "
            f"{check['tolerance']:g}) | {local['batch1_items_s']:.0f} "
            f"| {local['batch64_items_s']:.0f} | {local['proxy_overlap_items_s']:.0f} "
            f"({_f(local['proxy_overlap_mean_batch'])}) |"
        )
    lines += [
        "",
        "| model | one client, interleaved pairs | batched / regular speed (95 %) "
        "| p50 ms: regular, batched | p99 ms: regular, batched |",
        "|:--|--:|--:|--:|--:|",
    ]
    for name, model in result["models"].items():
        lone = model["one_client"]
        lines.append(
            f"| {name} | {lone['pairs']} | {lone['speedup']:.3f}x ({lone['low']:.3f}-"
            f"{lone['high']:.3f}) | {_f(lone['regular_p50_ms'])}, {_f(lone['batched_p50_ms'])} "
            f"| {_f(lone['regular_p99_ms'])}, {_f(lone['batched_p99_ms'])} |"
        )
    lines += [
        "",
        "| model | where | overlap on: items/s (GPU %) | overlap off: items/s (GPU %) | gain |",
        "|:--|:--|--:|--:|--:|",
    ]
    for name, model in result["models"].items():
        for where, pair in model["overlap"].items():
            on, off = pair["on"], pair["off"]
            on_rate = on.get("throughput", on.get("items_s"))
            off_rate = off.get("throughput", off.get("items_s"))
            where_text = (
                f"HTTP, {OVERLAP_CLIENTS} clients"
                if where == "http"
                else (f"in process, {OVERLAP_CLIENTS} coroutines")
            )
            lines.append(
                f"| {name} | {where_text} | {on_rate:.0f} ({_f(on['gpu_util'], 0)}) "
                f"| {off_rate:.0f} ({_f(off['gpu_util'], 0)}) | {_ratio(on_rate, off_rate)} |"
            )
    return "\n".join(lines)


def plot(result: dict[str, Any], output: Path, where: str | None = None) -> None:
    """Throughput and p99 against clients, per model; `where` (the card, the date) goes
    into the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = result["models"]
    figure, axes = plt.subplots(len(models), 2, figsize=(12, 4.2 * len(models)), squeeze=False)
    styles = {"regular": ("tab:red", "o"), "batched": ("tab:blue", "s"), "floor": ("gray", "^")}
    for row_axes, (name, model) in zip(axes, models.items(), strict=True):
        left, right = row_axes
        for path_name, (color, marker) in styles.items():
            rows = [r for r in model["http"] if r["path"] == path_name]
            levels = [r["clients"] for r in rows]
            left.plot(levels, [r["throughput"] for r in rows], marker=marker, color=color,
                      label=path_name)  # fmt: skip
            right.plot(levels, [r["p99_ms"] or float("nan") for r in rows], marker=marker,
                       color=color, label=path_name)  # fmt: skip
        for axis, ylabel in ((left, "throughput (req/s)"), (right, "p99 latency (ms)")):
            axis.set_xscale("log")
            axis.set_xticks(list(LEVELS))
            axis.set_xticklabels([str(level) for level in LEVELS])
            axis.minorticks_off()
            axis.set_xlabel("concurrent clients")
            axis.set_ylabel(ylabel)
            axis.set_title(f"{name}: {ylabel.split(' (')[0]}")
            axis.grid(True, alpha=0.3)
            axis.legend()
        right.set_yscale("log")
        left.set_ylim(bottom=0)
    title = f"BERT classification over HTTP ({result['device']}, {result['dtype']})"
    figure.suptitle(title if where is None else f"{title}\n{where}")
    figure.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, dpi=110)
    plt.close(figure)
