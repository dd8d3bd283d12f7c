"""Fair sharing between tenants: a 10x flood from one tenant, FIFO vs fair, side by side.

Run: `python -m benchmarks.scheduling.fairness` (or `make bench-fairness`); `--quick` for a smoke
run. Prints Markdown tables and writes the numbers as JSON to `benchmarks/results/`.
The target is printed next to the numbers, not asserted.

Four tenants each send open-loop Poisson traffic at `RATE` requests/s to one proxy
(`batch_size=32`, one batch slot, default window) whose model takes
`fixed + per_item x n` seconds for a batch of n. In the flood, tenant 0 sends 10x
that rate. Sides:

- `unloaded`: no flood (the others' reference p99), calls naming their tenant;
- `FIFO`: the flood, calls naming no tenant (one queue, as before fair sharing);
- `FIFO, bounded`: the same with `max_queue_size=4 x PER_TENANT`: the usual guard
  against a flood, which refuses everyone's calls once the flood fills the queue;
- `fair`: the flood, calls naming their tenant, `max_queue_size_per_tenant=PER_TENANT`;
- `fair, gc off` (real time only): `fair` with the garbage collector paused while the
  traffic runs, to show how much of the real-time tail is collection pauses (a
  full collection walks every waiting caller's task: thousands during a flood).

Per side: the p50 and p99 latency of the three other tenants' answered calls, the
share of their calls refused (`QueueFull`), and the flooder's. Target: under the
flood, the others' p99 with `fair` within 20 % of their unloaded p99.

Two model cost lines: 20 ms + 0.1 ms/item (the flood overloads the model: capacity
1,379 requests/s against 1,950 offered) and 10 ms + 0.2 ms/item (capacity 1,951/s:
the flood fills every batch to 32 but just fits). Each runs on the virtual clock
(`batchproxy.simulation`: exact, deterministic) and in real time (the model is an
`asyncio.sleep`, so the proxy's own CPU time and the loop's timer slack count too).
"""

from __future__ import annotations

import asyncio
import gc
import sys
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from batchproxy import Percentiles, QueueFull, batch, simulation
from benchmarks._harness.report import arguments, environment, headline, write_report

TENANTS = 4
RATE = 150.0  # requests/s of each tenant, unloaded
FLOOD = 10  # the flooder's rate, as a multiple of RATE
BATCH = 32
PER_TENANT = 200  # max_queue_size_per_tenant (and, x TENANTS, FIFO's max_queue_size)
TARGET = 1.2  # the others' flood p99 / unloaded p99, with fair sharing

COSTS: dict[str, tuple[float, float]] = {
    "20 ms + 0.1 ms/item": (0.020, 0.0001),
    "10 ms + 0.2 ms/item": (0.010, 0.0002),
}
SIDES = ("unloaded", "FIFO", "FIFO, bounded", "fair")
GC_OFF = "fair, gc off"  # real time only: the same with the garbage collector paused


@dataclass(frozen=True)
class Outcome:
    """What one side's callers saw (latencies in ms)."""

    others_p50_ms: float
    others_p99_ms: float
    others_refused: float  # share of the other tenants' calls refused with QueueFull
    flooder_p99_ms: float
    flooder_refused: float


def arrivals(duration: float, *, flood: bool, seed: int = 0) -> list[tuple[float, int]]:
    """(time, tenant) of every call, in time order; tenant 0 floods if `flood`."""
    calls = [
        (at, tenant)
        for tenant in range(TENANTS)
        for at in simulation.poisson(
            RATE * (FLOOD if flood and tenant == 0 else 1), duration, seed=seed * 100 + tenant + 1
        )
    ]
    return sorted(calls)


async def scenario(
    cost: tuple[float, float], side: str, duration: float, *, seed: int = 0
) -> Outcome:
    """One side's traffic through a fresh proxy, on the running loop (virtual or real)."""
    loop = asyncio.get_running_loop()
    fixed, per_item = cost
    options: dict[str, Any] = {"batch_size": BATCH}
    if side == "FIFO, bounded":
        options["max_queue_size"] = PER_TENANT * TENANTS
    if side in ("fair", GC_OFF):
        options["max_queue_size_per_tenant"] = PER_TENANT
    proxy = batch(**options)(simulation.simulated_model(lambda n: fixed + per_item * n))
    names_tenant = side in ("unloaded", "fair", GC_OFF)
    latencies: list[list[float]] = [[] for _ in range(TENANTS)]
    refused = [0] * TENANTS
    sent = [0] * TENANTS

    async def call(tenant: int, item: int) -> None:
        started = loop.time()
        try:
            await (proxy(item, tenant=tenant) if names_tenant else proxy(item))
        except QueueFull:
            refused[tenant] += 1
        else:
            latencies[tenant].append(loop.time() - started)

    tasks = []
    if side == GC_OFF:
        gc.disable()
    origin = loop.time()
    for item, (at, tenant) in enumerate(arrivals(duration, flood=side != "unloaded", seed=seed)):
        delay = origin + at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        sent[tenant] += 1
        tasks.append(loop.create_task(call(tenant, item)))
    await asyncio.gather(*tasks)
    gc.enable()
    await proxy.aclose()
    others = Percentiles.of([x for tenant in range(1, TENANTS) for x in latencies[tenant]])
    flooder = Percentiles.of(latencies[0])  # all zeros when none answered
    return Outcome(
        others_p50_ms=others.p50 * 1e3,
        others_p99_ms=others.p99 * 1e3,
        others_refused=sum(refused[1:]) / max(1, sum(sent[1:])),
        flooder_p99_ms=flooder.p99 * 1e3,
        flooder_refused=refused[0] / max(1, sent[0]),
    )


def run_sides(
    runner: Callable[[Coroutine[Any, Any, Outcome]], Outcome],
    duration: float,
    sides: Sequence[str] = SIDES,
) -> dict[str, dict[str, Outcome]]:
    """Every cost line's sides, each on a fresh loop made by `runner`."""
    return {
        name: {side: runner(scenario(cost, side, duration)) for side in sides}
        for name, cost in COSTS.items()
    }


def table(clock: str, results: dict[str, dict[str, Outcome]]) -> str:
    lines = [
        f"| {clock} | side | others p50 | others p99 | others p99 / unloaded | "
        "others refused | flooder p99 | flooder refused |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, sides in results.items():
        reference = sides["unloaded"].others_p99_ms
        for side, o in sides.items():
            lines.append(
                f"| {name} | {side} | {o.others_p50_ms:.1f} ms | {o.others_p99_ms:.1f} ms | "
                f"{o.others_p99_ms / reference:.2f}x | {o.others_refused:.1%} | "
                f"{o.flooder_p99_ms:.1f} ms | {o.flooder_refused:.1%} |"
            )
    return "\n".join(lines)


def verdicts(results: dict[str, dict[str, Outcome]]) -> list[str]:
    out = []
    for name, sides in results.items():
        for side in ("fair", GC_OFF):
            if side in sides:
                ratio = sides[side].others_p99_ms / sides["unloaded"].others_p99_ms
                met = "met" if ratio <= TARGET else "NOT met"
                out.append(
                    f"{name}, {side}: flood p99 / unloaded p99 = {ratio:.2f}x ({met}, <= {TARGET}x)"
                )
    return out


def floor_note() -> str:
    """Why a flood costs the others something even when shared fairly."""
    parts = []
    for name, (fixed, per_item) in COSTS.items():
        full = fixed + per_item * BATCH
        parts.append(f"{name}: a full batch takes {full * 1e3:.1f} ms")
    return (
        "Floor: a call arriving while the flooder's full batch runs waits for it to "
        "end, then rides the next (full) batch: up to 2 full-batch model times. "
        + "; ".join(parts)
        + "."
    )


def main(argv: Sequence[str] | None = None) -> int:
    cli = arguments("fairness", __doc__, argv)
    virtual_s, real_s = (2.0, 1.0) if cli.quick else (20.0, 5.0)
    env = environment()
    print(headline("fairness: a 10x flood from one tenant, FIFO vs fair", env, quick=cli.quick))
    results = {}
    for clock, runner, duration, names in (
        ("virtual clock", simulation.run, virtual_s, SIDES),
        ("real time", asyncio.run, real_s, (*SIDES, GC_OFF)),
    ):
        sides = run_sides(runner, duration, names)
        results[clock] = sides
        print()
        print(table(clock, sides))
        print()
        for line in verdicts(sides):
            print(f"- {clock}, {line}")
    print()
    print(floor_note())
    write_report(
        cli.output,
        env,
        quick=cli.quick,
        config={
            "virtual_seconds": virtual_s,
            "real_seconds": real_s,
            "tenants": TENANTS,
            "rate": RATE,
            "flood": FLOOD,
            "batch_size": BATCH,
            "per_tenant": PER_TENANT,
            "costs": {name: list(cost) for name, cost in COSTS.items()},
        },
        targets={"fair_others_p99_vs_unloaded": TARGET},
        results={
            "results": {
                clock: {name: {side: asdict(o) for side, o in s.items()} for name, s in r.items()}
                for clock, r in results.items()
            },
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
