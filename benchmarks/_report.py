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
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="a fast smoke run (noisy numbers)")
    parser.add_argument(
        "--output",
        type=Path,
        default=None,
        help=f"where to write the JSON results (default: benchmarks/results/{name}.json, "
        f"or {name}-quick.json with --quick)",
    )
    args = parser.parse_args(argv)
    quick: bool = args.quick
    output: Path = args.output or RESULTS / (f"{name}-quick.json" if quick else f"{name}.json")
    return quick, output


def headline(name: str, env: dict[str, Any], *, quick: bool) -> str:
    """The first line of a benchmark's report: what, when, on what."""
    return (
        f"batchproxy {env['batchproxy']} {name}, {env['date']}, "
        f"{env['implementation']} {env['python']}, {env['cpus']} CPUs, {env['platform']}"
        + (" (--quick: smoke run, numbers are noisy)" if quick else "")
    )
