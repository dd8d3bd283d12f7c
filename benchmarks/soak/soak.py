"""A soak: a million requests through one proxy while everything goes wrong at random.

Run: `python -m benchmarks.soak.soak` (or `make bench-soak`); `--quick` for a smoke run
of 20,000 requests. Prints a Markdown table and writes `benchmarks/results/soak.json`
and `soak.md` (`soak-quick.*` with `--quick`). `tests/failures/test_soak.py` runs the
same code on 20,000 requests and asserts the accounting and the absence of leaks.

The load: `concurrency` callers at once (1,000), each making one call after
another, every call a task of its own (`proxy.inference(job)`, so that it can be
cancelled), until `requests` calls have been made. The proxy's model runs on the
event loop; it usually answers after one loop turn, one batch in five after 0.2
to 3 ms. At random:

- callers are cancelled (5 %), 0.05 to 3 ms after their call reached the proxy
  (its first step): while queued, while their batch runs, or after their answer
  was set but before they resumed (they see the cancel, and `proxy.stats` counts
  them cancelled);
- calls carry a deadline (10 %) of 0.2 to 20 ms, which many miss (some of those
  callers are cancelled too, before or after their deadline fails them);
- a job fails alone: the model returns a `ValueError` in its slot (3 %);
- a job fails its whole batch: the model raises (0.05 %) or returns one result
  too few (0.02 %, `BatchSizeMismatch`);
- priorities 0 to 2;
- every 5 to 50 ms, `proxy.configure(...)` picks a new `batch_size` (8 to 128),
  `max_delay_ms` (0 to 5), `max_concurrent_batches` (1 to 4) and `max_queue_size`
  (300 to 2,000, or unbounded): the sizes below 1,000 refuse calls (`QueueFull`),
  and a refused caller waits 5 to 20 ms before its next call.

Reported:

- accounting: every call ended as one of succeeded, failed, cancelled, rejected or
  timed out, counted by the callers and by `proxy.stats`; the two must agree, and
  each sum to the calls issued;
- RSS (from /proc) at ten checkpoints, one per tenth of the calls, while the load
  runs; the growth is the highest later checkpoint minus the first, taken after
  the first tenth (the warm-up). Target: at most 20 MB;
- live asyncio tasks and futures (found with `gc.get_objects()` after a
  `gc.collect()`), batchproxy requests and the queue depth, before the load, at
  each checkpoint, after it and after `aclose()`: after must equal before; and the
  requests beyond those queued (served, or dead entries left in the queue) must
  stay within the calls in flight at every checkpoint.

`soak_host.py` runs the same `Load` through a model host (a `RemoteProxy` for the
proxy): there a call may also end with `HostUnavailable` (counted `unavailable`; its
caller then waits 1 to 2 s, `unavailable_backoff_ms`: a `Serving`'s `Retry-After`
is 1 s).

`--deadlines` runs the load of issue 16 instead (`STEADY`, written to
`soak-deadlines.*`): every call carries a 30 s deadline (none expires) and gets a
fresh 10 KB result, and 256 callers keep a proxy with `batch_size=64` and one
batch slot busy (each batch takes 1 to 2 ms), so that its queue never empties;
nothing is cancelled, fails or is reconfigured. Served requests that stay in the
queue then show as live requests and RSS growing with the calls (before the fix:
553 MB after 52,000). It also reports the smallest queue depth at a batch start,
from the warm-up to the last call (the depth `Listener.request_queued` last told,
less the batches started since).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from benchmarks._harness.report import arguments, environment, headline, verdict, write_report
from benchmarks.soak._mix import (
    FULL,
    QUICK,
    STEADY,
    STEADY_QUICK,
    TARGET_RSS_GROWTH_MB,
    Result,
    soak,
)

# -- report ----------------------------------------------------------------------------


def markdown(result: Result) -> str:
    s = result.stats
    agree = result.agreement()
    rows = [
        "| outcome | counted by the callers | counted by proxy.stats | agree |",
        "|---|---:|---:|---|",
        *(
            f"| {name} | {mine:,} | {theirs:,} | {'yes' if mine == theirs else '**no**'} |"
            for name, (mine, theirs) in agree.items()
        ),
    ]
    growth, config = result.rss_growth_mb, result.config
    lines = [
        f"{config.requests:,} requests, {config.concurrency:,} in flight, "
        + (f"every call with a {config.timeout:g} s deadline, " if config.timeout else "")
        + (f"{config.result_bytes:,}-byte results, " if config.result_bytes else "")
        + f"{result.seconds:.1f} s ({config.requests / result.seconds:,.0f} requests/s), "
        f"{s['batches']:,} batches (mean {s['items'] / max(1, s['batches']):.1f} items, "
        f"{s['failed_batches']:,} failed), {result.reconfigurations:,} reconfigurations.",
        "",
        *rows,
        "",
        "| measure | before | after warm-up | peak during the load | after the load "
        "| after aclose() | target |",
        "|---|---:|---:|---:|---:|---:|---|",
        f"| RSS (MB) | {result.before.rss_mb:.1f} | {result.checkpoints[0].rss_mb:.1f} "
        f"| {max(c.rss_mb for c in result.checkpoints):.1f} | {result.after.rss_mb:.1f} "
        f"| {result.closed.rss_mb:.1f} | growth after warm-up {growth:+.1f} MB ≤ "
        f"{TARGET_RSS_GROWTH_MB:g} MB: {verdict(growth <= TARGET_RSS_GROWTH_MB)} |",
        census_row("live tasks", result, "tasks"),
        census_row("live futures", result, "futures"),
        census_row("batchproxy requests", result, "requests"),
        census_row("queue depth", result, "queue_depth"),
        census_row("requests not queued", result, "unqueued", bound=config.concurrency),
        "",
        "Smallest queue depth at a batch start, from the warm-up to the last call: "
        + ("not watched" if result.min_queue_depth is None else f"{result.min_queue_depth:,}")
        + ". Requests not queued: in a batch, answered, or dead entries left in the queue; at "
        "most the calls in flight, so that requests ≤ queue depth + calls in flight.",
        "",
        "Checkpoints (one per tenth of the calls, while the load runs):",
        "",
        "| calls issued | seconds | RSS (MB) | tasks | futures (pending) | requests "
        "| queue depth |",
        "|---:|---:|---:|---:|---:|---:|---:|",
        *(
            f"| {c.issued:,} | {c.seconds:.1f} | {c.rss_mb:.1f} | {c.tasks:,} "
            f"| {c.futures:,} ({c.pending_futures:,}) | {c.requests:,} | {c.queue_depth:,} |"
            for c in result.checkpoints
        ),
    ]
    return "\n".join(lines)


def census_row(label: str, result: Result, name: str, bound: int | None = None) -> str:
    """A measure's row; its target: after = before (and a peak within `bound`)."""
    values = [
        getattr(c, name)
        for c in (result.before, result.checkpoints[0], result.after, result.closed)
    ]
    peak = max(getattr(c, name) for c in result.checkpoints)
    before, warm, after, closed = values
    ok = after == before and closed <= before and (bound is None or peak <= bound)
    target = "after = before"
    if bound is not None:
        target = f"peak ≤ {bound:,} calls in flight, {target}"
    return (
        f"| {label} | {before:,} | {warm:,} | {peak:,} | {after:,} | {closed:,} "
        f"| {target}: {verdict(ok)} |"
    )


def to_json(result: Result) -> dict[str, Any]:
    """The results as the JSON document has them (beside its `config`,
    `asdict(result.config)`, and its `targets`, the RSS growth's)."""
    return {
        "seconds": result.seconds,
        "requests_per_second": result.config.requests / result.seconds,
        "rss_growth_mb": result.rss_growth_mb,
        "tally": asdict(result.tally),
        "stats": result.stats,
        "agreement": result.agreement(),
        "census": {
            "before": asdict(result.before),
            "checkpoints": [asdict(c) for c in result.checkpoints],
            "after": asdict(result.after),
            "closed": asdict(result.closed),
        },
        "reconfigurations": result.reconfigurations,
        "min_queue_depth": result.min_queue_depth,
        "peak_unqueued_requests": max(c.unqueued for c in result.checkpoints),
    }


def main(argv: Sequence[str] | None = None) -> int:
    cli = arguments(
        "soak",
        (__doc__ or "").splitlines()[0],
        argv,
        mode=("deadlines", "every call with a deadline, the queue never empty (issue 16)"),
    )
    full, short = (STEADY, STEADY_QUICK) if cli.mode else (FULL, QUICK)
    config = short if cli.quick else full
    name = "soak-deadlines" if cli.mode else "soak"
    env = environment()
    print(headline(name, env, quick=cli.quick))
    print()
    result = asyncio.run(soak(config, progress=True))
    text = markdown(result)
    print(text)
    cli.output.parent.mkdir(parents=True, exist_ok=True)
    cli.output.with_suffix(".md").write_text(
        headline(name, env, quick=cli.quick) + "\n\n" + text + "\n"
    )
    write_report(
        cli.output,
        env,
        quick=cli.quick,
        config=asdict(result.config),
        targets={"rss_growth_mb": TARGET_RSS_GROWTH_MB},
        results=to_json(result),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
