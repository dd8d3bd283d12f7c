"""The hot path against an earlier commit: `overhead.py` on both, side by side.

Run: `python -m benchmarks.overhead.ab --base REF` (`make bench-ab BASE=REF`); `--quick` for
a smoke run. The same script, `benchmarks/overhead/overhead.py` of this checkout (public API
only), runs in turns on this checkout's `batchproxy` and on REF's (a temporary git
worktree), `--rounds` times each, in alternating order. Reported, as head / base
ratios of the medians over the rounds:

- the CPU per request under load (1,000 callers, `batch_size=64`): the proxy's own
  time per request, and what it adds over the bare batcher measured in the same run;
- the lone request's latency on an idle proxy, p50 and p99, and of a single caller's
  back-to-back calls (no pause: the call path's own time), p50.

A refactor that keeps the hot path keeps each ratio near 1 (within the noise of
the rounds, which the report shows as min-max).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import ROOT
from benchmarks._harness.report import arguments, environment, headline, write_report

TARGET_RATIO = 1.05  # head / base: no slower than 5 % beyond the noise

MEASURES = {
    "cpu_us_per_request": ("cpu", "proxy_us"),
    "cpu_added_us_per_request": ("cpu", "added_us"),
    "idle_p50_us": ("idle", "proxy_p50_us"),
    "idle_p99_us": ("idle", "proxy_p99_us"),
    "back_to_back_p50_us": ("busy", "proxy_p50_us"),
}


def _overhead(package: Path, quick: bool, output: Path) -> dict[str, Any]:
    """One run of this checkout's overhead benchmark on the batchproxy in `package` (a
    folder that holds only it: first on the path, and the working directory, so that
    `benchmarks` is this checkout's and `batchproxy` the side's)."""
    command = [sys.executable, "-m", "benchmarks.overhead.overhead", "--output", str(output)]
    if quick:
        command.append("--quick")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(package), str(ROOT)])}
    subprocess.run(command, check=True, env=env, cwd=package, stdout=subprocess.DEVNULL)
    document: dict[str, Any] = json.loads(output.read_text())
    return document


def _package(tree: Path, folder: Path) -> Path:
    """`folder`, holding a link to `tree`'s batchproxy and nothing else."""
    folder.mkdir()
    (folder / "batchproxy").symlink_to(tree / "batchproxy", target_is_directory=True)
    return folder


def _short(ref: str) -> str:
    """`ref`'s abbreviated commit."""
    command = ["git", "-C", str(ROOT), "rev-parse", "--short", ref]
    return subprocess.run(command, check=True, capture_output=True, text=True).stdout.strip()


def _worktree(base: str, folder: Path) -> Path:
    tree = folder / "base"
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", "--quiet", str(tree), base],
        check=True,
    )
    return tree


def main(argv: Sequence[str] | None = None) -> int:
    def extra(parser: Any) -> None:
        parser.add_argument("--base", required=True, help="the git ref to compare with")
        parser.add_argument("--rounds", type=int, default=None, help="runs per side")

    run = arguments("ab", (__doc__ or "").splitlines()[0], argv, extra=extra)
    base: str = run.args.base
    rounds: int = run.args.rounds or (2 if run.quick else 5)
    commit, head = _short(base), _short("HEAD")
    env = environment(base=commit, head=head)
    print(headline(f"A/B {head} against {commit}", env, quick=run.quick))
    samples: dict[str, dict[str, list[float]]] = {"base": {}, "head": {}}
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        tree = _worktree(base, folder)
        packages = {
            "base": _package(tree, folder / "base-package"),
            "head": _package(ROOT, folder / "head-package"),
        }
        try:
            for index in range(rounds):
                order = [("base", packages["base"]), ("head", packages["head"])]
                for side, path in order if index % 2 == 0 else order[::-1]:
                    document = _overhead(path, run.quick, folder / f"{side}-{index}.json")
                    for name, (section, key) in MEASURES.items():
                        samples[side].setdefault(name, []).append(document[section][key])
                    print(f"round {index + 1}/{rounds}: {side} done", flush=True)
        finally:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                check=False,
            )
    ratios: dict[str, dict[str, float]] = {}
    print("\n| measure | base (median) | head (median) | head / base |")
    print("|---|---:|---:|---:|")
    for name in MEASURES:
        b, h = samples["base"][name], samples["head"][name]
        ratio = statistics.median(h) / statistics.median(b)
        ratios[name] = {
            "base_median": statistics.median(b),
            "head_median": statistics.median(h),
            "ratio": ratio,
            "base_min": min(b), "base_max": max(b),
            "head_min": min(h), "head_max": max(h),
        }  # fmt: skip
        print(
            f"| {name} | {statistics.median(b):.2f} ({min(b):.2f}-{max(b):.2f}) "
            f"| {statistics.median(h):.2f} ({min(h):.2f}-{max(h):.2f}) | {ratio:.3f} |"
        )
    write_report(
        run.output,
        env,
        quick=run.quick,
        config={"base": commit, "head": head, "rounds": rounds},
        targets={"max_ratio": TARGET_RATIO},
        results={"ratios": ratios, "samples": samples},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
