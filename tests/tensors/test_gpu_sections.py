"""The GPU benchmark's sections (`benchmarks/gpu/_generation.py`, `_graphs.py`,
`_lone.py`) run end to end in their quick CPU mode, so the one run on a rented GPU
does not fail on something a CPU would have shown. Numbers are not checked, only that
each section returns its result (the CPU has no graphs) and that float32 streams match."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # (the benchmarks package)


def arguments(tmp_path: Path, device: str = "cpu") -> argparse.Namespace:
    return argparse.Namespace(device=device, quick=True, dtype="float32", out=tmp_path)


def test_generation_section_runs_on_the_cpu(tmp_path: Path) -> None:
    section = importlib.import_module("benchmarks.gpu._generation")
    result = section.run(arguments(tmp_path))
    json.dumps(result)  # JSON-able
    assert result["error"] is None
    assert result["streams_compared"] == section.QUICK.reference
    assert result["streams_equal"] == result["streams_compared"]  # float32: all of them
    assert [side["side"] for side in result["sides"]] == ["no batching", "continuous"]
    assert all(side["tokens_per_s"] > 0 for side in result["sides"])


def test_graphs_section_runs_on_the_cpu_without_graphs(tmp_path: Path) -> None:
    section = importlib.import_module("benchmarks.gpu._graphs")
    result = section.run(arguments(tmp_path))
    json.dumps(result)
    assert result["graphs"] is False
    assert result["capture_errors"] == []
    assert [side["side"] for side in result["sides"]] == ["any size", "fixed sizes"]
    assert all(side["items_per_s"] > 0 for side in result["sides"])
    assert result["max_output_difference"] < 1e-3  # the same model, other padding


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graphs_section_captures_on_cuda(tmp_path: Path) -> None:
    section = importlib.import_module("benchmarks.gpu._graphs")
    result = section.run(arguments(tmp_path, "cuda"))
    assert result["graphs"] is True, result["capture_errors"]


def test_lone_section_runs_on_the_cpu(tmp_path: Path) -> None:
    """Every part of the one-client section, the HTTP one (a server and a client
    process) included."""
    pytest.importorskip("fastapi")
    pytest.importorskip("aiohttp")
    section = importlib.import_module("benchmarks.gpu._lone")
    args = arguments(tmp_path)
    args.models = ["bert-tiny"]
    result = section.run(args)
    json.dumps(result)
    for key in ("interleaved", "back_to_back"):
        paths = result[key]["paths"]
        assert set(paths) == set(section.PATHS)
        assert result[key]["departures"] == {"idle": sum(result[key]["departures"].values())}
        stages = paths["batched"]["stages_ms"]
        assert {"thread_prepare", "thread_compute", "thread_finish"} <= set(stages)
        assert all(numbers["mean_ms"] > 0 for numbers in paths.values())
    assert set(result["launch"]) >= {"pool_thread", "worker_thread_device"}
    for mode in ("back_to_back", "back_to_back_after_load", "interleaved"):
        assert result["http"][mode]["speedup"] > 0
        assert set(result["http"][mode]["on_server"]["ms"]) >= {"/classify", "/classify/regular"}
    assert len(result["under_load"]["pinned"]["items_s"]) == 2
