"""What every benchmark records beside its numbers: the machine, and where results go."""

from __future__ import annotations

import json
import os
import platform
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
