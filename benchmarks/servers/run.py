"""`make bench-servers`: batchproxy's kind of service beside the regular way and the
peers, over HTTP, in front of all-MiniLM-L6-v2, read as fractions of what the machine
allows (issue 30).

The stacks, each a server in a child process of its own on a free port of 127.0.0.1
(`benchmarks/servers/*_server.py`; torch on THREADS threads, one model replica,
batches of BATCH_SIZE at most, a WINDOW_MS window where a stack has one):

- batchproxy: the README's service, FastAPI with `Serving` and `install`, a
  `TensorProxy` (length-aware, the adaptive window, `offload=True`), `Serving`
  and `install` with their defaults; each handler tokenizes its own text;
- host (only when named, `--stacks host,...`, or with gpu-sim): the same service split as
  docs/serving.md's "Several web workers" shows, two uvicorn workers (HTTP, JSON,
  tokenizing) in front of one model host process (`host_server.py`);
- regular: FastAPI, one forward pass per request on one model thread;
- litserve, mosec: the peers, each with its own dynamic batching, each in its own
  virtual environment that this script builds (`benchmarks/servers/.venvs/<stack>`,
  git-ignored; torch pinned in the pip command; reused while its requirements' hash
  is the same, `--rebuild` to build again);
- floor: the same FastAPI server answering a constant vector, no model: the most any
  served stack can answer here (HTTP, JSON and the client); floor2 (only when named,
  or with gpu-sim): the same from two uvicorn workers, as the host's web workers run;
- ceiling: no HTTP, the same model in one process fed full batches (`ceiling.py`): the
  most the model can answer here.

The model (`--model`, `$BENCH_MODEL` in every server): `minilm` (the default), or
`gpu-sim` (`_gpu_sim.py`: MiniLM's tokenizer in front of a model shaped like bert-base
on a GPU: a GIL-bound launch, then a device that takes no CPU), whose stacks default
to all of them (host and floor2 included) and whose results are `servers-gpu-sim*`.

The load: one aiohttp client process (`_harness.clients.Clients`, the load generator
every HTTP benchmark shares) running a closed loop: at each level (1, 8, 32 and 150
clients), every client sends its next sentence as soon as its last one is answered, for
SECONDS; the sentences are seeded word salad of 5 to 60 words. Per level: throughput
(answers in the time), p50 and p99 latency. Each stack is started (ready once every
request for a second, each on a new connection, was answered: every web worker up),
warmed up, checked (CHECK_TEXTS sentences sent at once: every vector must equal the
sentence run alone, unpadded, in process, within TOLERANCE), measured at every level and
stopped, one stack at a time; ROUNDS rounds, the stacks' order reversed every other
round. A row is the median over the rounds with their min and max, its throughput as a
fraction of the ceiling's and of the floor's at the same level. The targets of issue 30
are checked, not asserted.

Written: `benchmarks/results/servers.json` and `servers.png` (`--quick`: levels 1 and
8, one short round, `servers-quick.{json,png}`, git-ignored; gpu-sim:
`servers-gpu-sim.*`, `servers-gpu-sim-quick.*`). Every process started
here is stopped, even on failure (each server leads a process group of its own).

Run: `python -m benchmarks.servers.run [--quick] [--model gpu-sim]
[--stacks batchproxy,regular,...]`.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from demo import versions
from sample_text import make_sentences

from benchmarks._harness.clients import Clients
from benchmarks._harness.report import Run, arguments, environment, headline, write_report
from benchmarks.servers._common import (
    BATCH_SIZE,
    MODELS,
    THREADS,
    WINDOW_MS,
)
from benchmarks.servers._measure import Plan, measure_stack, run_ceiling
from benchmarks.servers._stacks import (
    ALL,
    CEILING,
    CHECK_TEXTS,
    DEFAULT,
    DIMENSION,
    LEVELS,
    MAX_WORDS,
    MIN_WORDS,
    MODEL_LABELS,
    QUICK_LEVELS,
    QUICK_ROUNDS,
    QUICK_SECONDS,
    QUICK_WARMUP_SECONDS,
    ROUNDS,
    SECONDS,
    STACKS,
    TEXTS,
    TOLERANCE,
    WARMUP_SECONDS,
    log,
)
from benchmarks.servers._summary import fmt, plot, spread, summarize, table, verdicts
from benchmarks.servers._venvs import Environment, base_requirements, build

# -------------------------------------------------------------------------------- main


def extra_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        choices=MODELS,
        default=MODELS[0],
        help="minilm (the default: all-MiniLM-L6-v2 on the CPU) or gpu-sim (MiniLM's "
        "tokenizer, a model shaped like bert-base on a GPU; writes servers-gpu-sim*)",
    )
    parser.add_argument(
        "--stacks",
        default=None,
        help=f"comma-separated, from {','.join(ALL)} (default: all but host and floor2; "
        "all with --model gpu-sim)",
    )
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 3; quick 1)")
    parser.add_argument(
        "--seconds", type=float, default=None, help="closed loop per level (default 15; quick 2)"
    )
    parser.add_argument(
        "--levels", default=None, help="comma-separated client counts (default 1,8,32,150)"
    )
    parser.add_argument(
        "--rebuild", action="store_true", help="build the peers' environments again"
    )


def parse(argv: Sequence[str] | None) -> Run:
    """The command line (`_report.arguments`, with this script's flags); with
    `--model gpu-sim` and no `--output`, the results go to `servers-gpu-sim*.json`."""
    doc = __doc__.splitlines()[0] if __doc__ else None
    run = arguments("servers", doc, argv, extra=extra_flags)
    if run.args.model != MODELS[0] and run.args.output is None:
        stem = f"servers-{run.args.model}"
        output = run.output.with_name(f"{stem}-quick.json" if run.quick else f"{stem}.json")
        run = dataclasses.replace(run, output=output)
    return run


def stacks_of(run: Run) -> list[str]:
    """`--stacks`, or the model's default stacks."""
    return parse_stacks(run.args.stacks or ",".join(DEFAULT[run.args.model]))


def parse_stacks(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in ALL]
    if unknown or not names:
        raise SystemExit(f"--stacks: unknown {unknown} (known: {', '.join(ALL)})")
    return names


def plan_of(run: Run) -> Plan:
    args = run.args
    levels = QUICK_LEVELS if run.quick else LEVELS
    return Plan(
        model=args.model,
        levels=tuple(int(v) for v in args.levels.split(",")) if args.levels else levels,
        rounds=args.rounds or (QUICK_ROUNDS if run.quick else ROUNDS),
        seconds=args.seconds or (QUICK_SECONDS if run.quick else SECONDS),
        warmup_seconds=QUICK_WARMUP_SECONDS if run.quick else WARMUP_SECONDS,
        texts=make_sentences(TEXTS, seed=30, min_words=MIN_WORDS, max_words=MAX_WORDS),
        check=make_sentences(CHECK_TEXTS, seed=31, min_words=MIN_WORDS, max_words=MAX_WORDS),
    )


@dataclass
class Outcome:
    """What a run gathered: per stack its rounds, the ceiling's, what failed."""

    pythons: dict[str, Path] = field(default_factory=dict)  # each stack's Python
    built: dict[str, Environment] = field(default_factory=dict)  # the peers'
    measured: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    ceilings: list[float] = field(default_factory=list)
    failures: list[dict[str, Any]] = field(default_factory=list)

    def fail(self, name: str, round_index: int | None, error: str) -> None:
        where = "" if round_index is None else f" in round {round_index + 1}"
        log(f"{name}: FAILED{where}: {error}")
        self.failures.append({"stack": name, "round": round_index, "error": error})


def environments(names: Sequence[str], rebuild: bool, outcome: Outcome) -> None:
    """Each stack's Python: the project's, or the peer's own environment (built if need be;
    a peer whose environment cannot be built is left out, and said so)."""
    for name in names:
        if name == CEILING:
            continue
        stack = STACKS[name]
        if not stack.peer:
            outcome.pythons[name] = Path(sys.executable)
            continue
        try:
            outcome.built[name] = build(stack, rebuild)
        except Exception as exc:
            outcome.fail(name, None, f"no environment, left out: {exc}")
            continue
        outcome.pythons[name] = outcome.built[name].python


def rounds(names: Sequence[str], plan: Plan, outcome: Outcome) -> None:
    """Every round, the stacks in turn (the order reversed every other round); a stack
    that fails is reported and the others go on."""
    log("the reference vectors (each sentence alone, in process)")
    reference = run_ceiling(0.0, plan.texts[:BATCH_SIZE], plan.check, plan.model)["reference"]
    outcome.measured = {name: [] for name in outcome.pythons}
    order = [name for name in names if name == CEILING or name in outcome.pythons]
    clients = Clients(1, None)
    try:
        for round_index in range(plan.rounds):
            this_round = order if round_index % 2 == 0 else order[::-1]
            log(f"round {round_index + 1}/{plan.rounds}: {', '.join(this_round)}")
            for name in this_round:
                try:
                    if name == CEILING:
                        result = run_ceiling(plan.seconds, plan.texts, [], plan.model)
                        outcome.ceilings.append(result["throughput"])
                        log(f"ceiling: {result['throughput']:.1f} texts/s")
                        continue
                    stack, python = STACKS[name], outcome.pythons[name]
                    measured = measure_stack(stack, python, clients, plan, reference)
                    measured["round"] = round_index
                    outcome.measured[name].append(measured)
                    if not measured["check"]["ok"]:
                        log(f"{name}: VECTORS DO NOT MATCH: {measured['check']}")
                except Exception as exc:
                    outcome.fail(name, round_index, repr(exc))
    finally:
        clients.close()


def print_report(
    rows: Sequence[dict[str, Any]],
    ceiling: dict[str, Any] | None,
    checks: Sequence[dict[str, Any]],
    outcome: Outcome,
) -> None:
    print()
    print(table(rows, ceiling))
    print()
    for name, outcomes in outcome.measured.items():
        for measured in outcomes:
            check = measured["check"]
            worst = check.get("max_abs_diff")
            if not check["ok"]:
                said = f"NOT OK: {check.get('error') or f'max |diff| {worst:.2e}'}"
            elif worst is None:
                said = f"{DIMENSION} floats each (a constant: nothing to compare)"
            else:
                said = f"ok, max |diff| {worst:.2e} <= {TOLERANCE:.0e}"
            print(f"vectors, {name}, round {measured['round'] + 1}: {said}")
    for name, built in outcome.built.items():
        if built.install_seconds is not None:
            print(f"environment {name}: built in {built.install_seconds:.0f} s")
    for failure in outcome.failures:
        print(f"FAILED: {failure}")
    print()
    for check in checks:
        verdict = {True: "met", False: "NOT met", None: "not measured"}[check["met"]]
        print(
            f"target at {check['clients']} clients: batchproxy {check['target']}: "
            f"{fmt(check['batchproxy'])} vs {fmt(check['against'])}: {verdict}"
        )


def main(argv: Sequence[str] | None = None) -> int:
    run = parse(argv)
    names = stacks_of(run)
    plan = plan_of(run)
    began = time.perf_counter()
    outcome = Outcome()
    environments(names, run.args.rebuild, outcome)
    env = environment(
        model=MODEL_LABELS[plan.model],
        client="one aiohttp process, closed loop",
        versions=versions("torch", "transformers", "fastapi", "uvicorn", "aiohttp", "uvloop"),
        peers={name: built.versions for name, built in outcome.built.items()},
    )
    print(headline("servers", env, quick=run.quick), flush=True)
    rounds(names, plan, outcome)

    measured = {name: m for name, m in outcome.measured.items() if m}
    rows = summarize(measured, outcome.ceilings, plan.levels)
    ceiling = spread(outcome.ceilings)
    checks = verdicts(rows, ceiling["median"] if ceiling else None)
    print_report(rows, ceiling, checks, outcome)
    peers = {n: [*base_requirements(), *STACKS[n].requirements] for n in outcome.built}
    write_report(
        run.output,
        env,
        quick=run.quick,
        config={
            "model": plan.model,
            "stacks": names,
            "levels": list(plan.levels),
            "rounds": plan.rounds,
            "seconds": plan.seconds,
            "warmup_seconds": plan.warmup_seconds,
            "batch_size": BATCH_SIZE,
            "window_ms": WINDOW_MS,
            "torch_threads": THREADS,
            "words": [MIN_WORDS, MAX_WORDS],
            "texts": TEXTS,
            "check_texts": CHECK_TEXTS,
            "tolerance": TOLERANCE,
            "peer_requirements": peers,
        },
        targets={
            "clients_1": {"p99_vs_regular_max": 1.1, "throughput_vs_regular_min": 0.97},
            "clients_32": {"p99_vs_best_peer_max": 1.0, "throughput_vs_best_peer_min": 1.0},
            "clients_150": {"throughput_vs_best_peer_min": 1.2, "throughput_vs_ceiling_min": 0.8},
        },
        results={
            "rows": rows,
            "ceiling": ceiling,
            "verdicts": checks,
            "startup_s": {n: [m["startup_s"] for m in ms] for n, ms in measured.items()},
            "install_s": {n: built.install_seconds for n, built in outcome.built.items()},
            "failures": outcome.failures,
        },
    )
    png = run.output.with_suffix(".png")
    title = f"{plan.model} over HTTP ({env['date']}, {env['cpus']} CPUs"
    if plan.model == MODELS[0]:
        title = f"all-MiniLM-L6-v2 over HTTP ({env['date']}, {env['cpus']} CPUs"
    plot(
        rows,
        ceiling["median"] if ceiling else None,
        png,
        title + (", --quick)" if run.quick else ")"),
    )
    print(f"plot written to {png}")
    print(f"total time: {time.perf_counter() - began:.0f} s")
    return 1 if outcome.failures else 0


if __name__ == "__main__":
    sys.exit(main())
