"""What every benchmark records beside its numbers: the machine, and where results go."""

from __future__ import annotations

import argparse
import json
import os
import platform
from collections.abc import Sequence
from datetime import date
from pathlib import Path
from typing import Any

import batchproxy

RESULTS = Path(__file__).resolve().parent / "results"


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


def quick_run_arguments(
    name: str, description: str | None, argv: Sequence[str] | None
) -> tuple[bool, Path]:
    """Parse `--quick` and `--output` for benchmark `name`; returns (quick, output path)."""
    quick, _, output = run_arguments(name, description, argv)
    return quick, output


def run_arguments(
    name: str,
    description: str | None,
    argv: Sequence[str] | None,
    mode: tuple[str, str] | None = None,
) -> tuple[bool, bool, Path]:
    """Parse `--quick`, `--output` and, if given, a `mode` (its flag, its help) for
    benchmark `name`; returns (quick, in that mode, output path). A mode writes
    `name-flag.json` (`name-flag-quick.json` with `--quick`)."""
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
    args = parser.parse_args(argv)
    quick: bool = args.quick
    in_mode: bool = bool(flag) and args.mode
    stem = f"{name}-{flag}" if in_mode else name
    output: Path = args.output or RESULTS / (f"{stem}-quick.json" if quick else f"{stem}.json")
    return quick, in_mode, output


def headline(name: str, env: dict[str, Any], *, quick: bool) -> str:
    """The first line of a benchmark's report: what, when, on what."""
    return (
        f"batchproxy {env['batchproxy']} {name}, {env['date']}, "
        f"{env['implementation']} {env['python']}, {env['cpus']} CPUs, {env['platform']}"
        + (" (--quick: smoke run, numbers are noisy)" if quick else "")
    )
