"""The shared harness: every benchmark's arguments, and the JSON document it writes.

Every benchmark in `benchmarks/` parses its command line with `arguments()`
(`--quick`, `--output`, an optional mode flag and its own extra flags) and writes
one JSON document with `write_report()`, whose top-level keys are the same for
all of them: `environment` (date, versions, machine), `quick` (a smoke run),
`config` (the run's parameters), `targets` (what the numbers are checked against;
`{"none": why}` for a benchmark with no pass mark, see `no_targets`), then the
benchmark's own results.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Any

import batchproxy
from benchmarks import RESULTS

COMMON_KEYS = ("environment", "quick", "config", "targets")


def environment(**extra: Any) -> dict[str, Any]:
    """Date, versions and machine, plus whatever the benchmark adds."""
    return {
        "date": date.today().isoformat(),
        "batchproxy": batchproxy.__version__,
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        **extra,
    }


def write_json(output: Path, document: dict[str, Any]) -> None:
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(document, indent=2) + "\n")
    print(f"\nresults written to {output}")


def no_targets(reason: str) -> dict[str, str]:
    """The `targets` of a benchmark with no pass mark: why it has none."""
    return {"none": reason}


def write_report(
    output: Path,
    env: dict[str, Any],
    *,
    quick: bool,
    config: Mapping[str, Any],
    targets: Mapping[str, Any],
    results: Mapping[str, Any],
) -> None:
    """Write a benchmark's document: the common keys, then its `results`' keys."""
    if not targets:
        raise ValueError("targets is empty: give no_targets(why) for a benchmark with none")
    clash = set(COMMON_KEYS) & set(results)
    if clash:
        raise ValueError(f"results may not use the common keys {sorted(clash)}")
    document = {
        "environment": env,
        "quick": quick,
        "config": dict(config),
        "targets": dict(targets),
        **results,
    }
    write_json(output, document)


@dataclass(frozen=True)
class Run:
    """What a benchmark's command line asked for."""

    quick: bool
    output: Path
    mode: bool  # the benchmark's mode flag was given (False for one with no mode)
    args: argparse.Namespace  # every parsed flag, the benchmark's own extras included


def arguments(
    name: str,
    description: str | None,
    argv: Sequence[str] | None,
    *,
    mode: tuple[str, str] | None = None,
    extra: Callable[[argparse.ArgumentParser], None] | None = None,
) -> Run:
    """Parse `--quick`, `--output`, if given a `mode` (its flag, its help) and the flags
    `extra` adds to the parser, for benchmark `name`. The output defaults to
    `benchmarks/results/name.json`, `name-quick.json` with `--quick` (git-ignored); a
    mode writes `name-flag.json` (`name-flag-quick.json`)."""
    flag, mode_help = mode or ("", "")
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="a fast smoke run (noisy numbers)")
    if flag:
        parser.add_argument(f"--{flag}", action="store_true", dest="mode", help=mode_help)
    parser.add_argument(
        "--output",
        type=Path,
        default=None,
        help=f"where to write the JSON results (default: benchmarks/results/{name}.json, "
        f"or {name}-quick.json with --quick"
        + (f"; {name}-{flag}.json, {name}-{flag}-quick.json with --{flag})" if flag else ")"),
    )
    if extra is not None:
        extra(parser)
    args = parser.parse_args(argv)
    quick: bool = args.quick
    in_mode: bool = bool(flag) and args.mode
    stem = f"{name}-{flag}" if in_mode else name
    output: Path = args.output or RESULTS / (f"{stem}-quick.json" if quick else f"{stem}.json")
    return Run(quick, output, in_mode, args)


def verdict(met: bool) -> str:
    """A target's verdict in a Markdown report: `met`, or `**missed**`."""
    return "met" if met else "**missed**"


def headline(name: str, env: dict[str, Any], *, quick: bool) -> str:
    """The first line of a benchmark's report: what, when, on what."""
    return (
        f"batchproxy {env['batchproxy']} {name}, {env['date']}, "
        f"{env['implementation']} {env['python']}, {env['cpus']} CPUs, {env['platform']}"
        + (" (--quick: smoke run, numbers are noisy)" if quick else "")
    )
