"""`benchmarks/servers/run.py` without building anything: its command line, its summary
and targets on made-up rounds, and the HTTP floor served and stopped as the driver does.
(No peer's environment is built and no model is loaded here.)"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

for _module in ("fastapi", "uvicorn", "httpx", "aiohttp"):
    pytest.importorskip(_module)

import httpx  # noqa: E402

RUN = Path(__file__).resolve().parents[2] / "benchmarks" / "servers" / "run.py"


@pytest.fixture(scope="module")
def run() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_servers_run", RUN)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def test_quick_is_levels_1_and_8_one_round(run: ModuleType, tmp_path: Path) -> None:
    parsed = run.arguments("servers", None, ["--quick"], extra=run.extra_flags)
    plan = run.plan_of(parsed)
    assert (plan.levels, plan.rounds) == ((1, 8), 1)
    assert parsed.output.name == "servers-quick.json"
    assert run.parse_stacks(parsed.args.stacks) == list(run.DEFAULT)
    assert "host" in run.ALL  # (run when named: on 2 cores it only adds processes)
    assert "host" not in run.DEFAULT
    assert run.parse_stacks("host,batchproxy") == ["host", "batchproxy"]
    full = run.plan_of(run.arguments("servers", None, ["--levels", "1,150"], extra=run.extra_flags))
    assert (full.levels, full.rounds) == ((1, 150), run.ROUNDS)
    assert all(5 <= len(text.split()) <= 60 for text in full.texts)
    with pytest.raises(SystemExit):
        run.parse_stacks("batchproxy,nginx")


def test_rows_are_medians_and_fractions_and_the_targets_read_them(run: ModuleType) -> None:
    def rounds(*throughputs: float) -> list[dict[str, object]]:
        return [
            {
                "levels": {1: {"throughput": t, "p50_ms": 10.0, "p99_ms": 20.0, "errors": 0}},
                "check": {"ok": True},
            }
            for t in throughputs
        ]

    measured = {
        "floor": rounds(400.0, 500.0, 600.0),
        "batchproxy": rounds(45.0, 50.0, 60.0),
        "regular": rounds(50.0, 50.0, 50.0),
    }
    rows = run.summarize(measured, [90.0, 100.0, 110.0], (1,))
    mine = run.row(rows, "batchproxy", 1)
    assert mine["throughput"] == {"median": 50.0, "min": 45.0, "max": 60.0, "rounds": [45, 50, 60]}
    assert mine["of_ceiling"] == pytest.approx(0.5)
    assert mine["of_floor"] == pytest.approx(0.1)
    verdicts = run.verdicts(rows, 100.0)
    assert [v["met"] for v in verdicts if v["clients"] == 1] == [True, True]
    assert all(v["met"] is None for v in verdicts if v["clients"] != 1)  # not measured
    assert "| HTTP floor (no model) | 1 | 500.0 (400.0-600.0) |" in run.table(rows, None)


def test_the_floor_answers_a_vector_and_stops_with_its_group(run: ModuleType) -> None:
    service = run.StackService(run.STACKS["floor"], Path(sys.executable))
    try:
        service.start()
        answer = httpx.post(f"{service.base_url}/embed", json={"text": "Hello."}, timeout=10)
        assert answer.status_code == 200
        assert len(answer.json()["embedding"]) == 384
    finally:
        service.stop()
    assert service.process is not None
    assert service.process.poll() is not None
