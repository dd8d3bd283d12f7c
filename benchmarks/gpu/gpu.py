"""`make bench-gpu`: batchproxy on a real GPU, every measurement of issue 31 in one run.

Sections, in this order (each writes its part of `gpu.json` as soon as it ends, so a
run cut short still leaves what it measured):

- `tests`: the CUDA tests (tests/tensors/test_cuda.py, with
  tests/executors/test_overlap.py and tests/tensors/test_tensor_proxy.py) under pytest:
  the device thread and its stream, round trips, overlap, a real out-of-memory batch,
  captured graphs;
- `lone` (`_lone.py`): one client in process on BERT-base, the regular way
  against the proxy (inputs pinned on the fly or not), interleaved, with the mean
  time of each stage of a call;
- `http` (`_http.py`): BERT-base and BERT-large classification over HTTP
  (the examples' FastAPI app, `examples/bert_app.py`), the regular way against
  the batched way at 1, 5, 100 and 150 clients, beside the HTTP floor and the
  same model in process; the overlap's gain and the GPU's utilisation;
- `generation` (`_generation.py`): GPT-2 small, no batching against
  continuous batching, tokens/s;
- `graphs` (`_graphs.py`): preferred batch sizes with captured CUDA graphs
  against any size.

Run: `python -m benchmarks.gpu.gpu --device cuda` on a GPU machine (`--dtype bfloat16`
for half precision; `--sections http,tests` for fewer); `--device cpu --quick` is a
smoke run of the same code on a CPU (tiny models, few requests; the `tests` section
then reports its CUDA tests as skipped). Writes `gpu.json` (and the sections' plots)
to `--out` (default: `benchmarks/results/runs/`, git-ignored).
`--publish FOLDER` takes a GPU run's files from FOLDER (gpu.json and the plots) into
`benchmarks/results/`, where the docs show them, the HTTP plot redrawn with the card
and the date in its title.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import RESULTS, ROOT, pythonpath

SECTIONS = ("tests", "lone", "http", "generation", "graphs")
MODULES = {
    "lone": "benchmarks.gpu._lone",
    "http": "benchmarks.gpu._http",
    "generation": "benchmarks.gpu._generation",
    "graphs": "benchmarks.gpu._graphs",
}
CUDA_TESTS = (
    "tests/tensors/test_cuda.py",
    "tests/executors/test_overlap.py",
    "tests/tensors/test_tensor_proxy.py",
)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--quick", action="store_true", help="a smoke run: tiny models")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    parser.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated")
    parser.add_argument("--models", default=None, help="http: bert-base,bert-large")
    parser.add_argument(
        "--lone-parts", default=None, help="lone: some of interleaved,back_to_back,launch,..."
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "runs")
    parser.add_argument("--server-cpus", default=None, help="http: CPUs for the server, e.g. 0-5")
    parser.add_argument("--client-cpus", default=None, help="http: CPUs for the load")
    parser.add_argument(
        "--publish", type=Path, default=None, help="a GPU run's folder: into benchmarks/results"
    )
    args = parser.parse_args(argv)
    args.sections = [s for s in args.sections.split(",") if s]
    args.lone_parts = args.lone_parts.split(",") if args.lone_parts else None
    unknown = set(args.sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    if args.models is None:
        args.models = ["bert-tiny"] if args.quick else ["bert-base", "bert-large"]
    else:
        args.models = args.models.split(",")
    cpus = os.cpu_count() or 1
    if args.server_cpus is None and args.client_cpus is None and cpus >= 8:
        half = cpus // 2  # the server's process and the load generators apart
        args.server_cpus, args.client_cpus = f"0-{half - 1}", f"{half}-{cpus - 1}"
    args.server_cpus = cpu_list(args.server_cpus)
    args.client_cpus = cpu_list(args.client_cpus)
    return args


def cpu_list(text: str | None) -> list[int] | None:
    """`"0-3,8"` -> [0, 1, 2, 3, 8]."""
    if text is None:
        return None
    found: list[int] = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        found.extend(range(int(low), int(high or low) + 1))
    return found


def machine(args: argparse.Namespace) -> dict[str, Any]:
    """What ran it: the card, the driver, torch, the cores."""
    import torch

    info: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "device": args.device,
        "dtype": args.dtype,
        "quick": args.quick,
        "server_cpus": args.server_cpus,
        "client_cpus": args.client_cpus,
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    if args.device == "cuda":
        properties = torch.cuda.get_device_properties(0)
        info["gpu"] = properties.name
        info["gpu_memory_gib"] = round(properties.total_memory / 2**30, 1)
        info["cuda"] = torch.version.cuda
        try:
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=30, check=False,
            )  # fmt: skip
            info["driver"] = smi.stdout.strip() or None
        except (OSError, subprocess.TimeoutExpired):
            info["driver"] = None
    return info


def run_tests(args: argparse.Namespace) -> dict[str, Any]:
    """The CUDA tests under pytest, in a process of their own: counts and the log tail."""
    log = args.out / "gpu-tests.log"
    started = time.perf_counter()
    completed = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", "-q",
         "--timeout=300", *CUDA_TESTS],
        cwd=ROOT, capture_output=True, text=True, check=False,
        env={**os.environ, "PYTHONPATH": pythonpath()},
    )  # fmt: skip
    output = completed.stdout + completed.stderr
    log.write_text(output)
    counts = {
        word: int(number)
        for number, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)", output)
    }
    outcomes = re.findall(r"^(PASSED|FAILED|SKIPPED|ERROR) (\S+)", output, re.MULTILINE)
    print("\n".join(output.splitlines()[-25:]), flush=True)
    return {
        "returncode": completed.returncode,
        "counts": counts,
        "cuda_tests": {name: outcome for outcome, name in outcomes if "test_cuda" in name},
        "seconds": round(time.perf_counter() - started, 1),
    }


def section(name: str) -> Callable[[argparse.Namespace], dict[str, Any]]:
    if name == "tests":
        return run_tests
    module = importlib.import_module(MODULES[name])
    run: Callable[[argparse.Namespace], dict[str, Any]] = module.run
    return run


def publish(run: Path, results: Path = RESULTS) -> None:
    """A GPU run's gpu.json and plots into `results`, the HTTP plot titled with the card."""
    document = json.loads((run / "gpu.json").read_text())
    info = document["machine"]
    if info.get("quick") or info.get("device") != "cuda":
        raise SystemExit(f"{run / 'gpu.json'} is not a full GPU run: not published")
    shutil.copyfile(run / "gpu.json", results / "gpu.json")
    for name in ("gpu_generation.png", "gpu_graphs.png"):
        if (run / name).is_file():
            shutil.copyfile(run / name, results / name)
    http = document["sections"].get("http")
    if http and "models" in http:
        from benchmarks.gpu._http_report import plot

        where = f"{info['gpu']}, {info['date']}: server on {len(info['server_cpus'])} cores"
        plot(http, results / "gpu-http.png", where)
    print(f"published {run} into {results}")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.publish is not None:
        publish(args.publish)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    document: dict[str, Any] = {"machine": machine(args), "sections": {}}
    output = args.out / ("gpu-quick.json" if args.quick else "gpu.json")
    failed = []
    for name in args.sections:
        print(f"\n== {name} ({time.strftime('%H:%M:%S')})", flush=True)
        started = time.perf_counter()
        try:
            result = section(name)(args)
        except Exception as exc:  # one broken section must not cost the others' numbers
            import traceback

            traceback.print_exc()
            result = {"error": f"{type(exc).__name__}: {exc}"}
            failed.append(name)
        result["section_seconds"] = round(time.perf_counter() - started, 1)
        document["sections"][name] = result
        output.write_text(json.dumps(document, indent=2, default=str) + "\n")
        print(f"== {name} took {result['section_seconds']} s", flush=True)
    print(f"\nresults written to {output}")
    tests = document["sections"].get("tests")
    if tests is not None and tests.get("returncode") not in (0, None):
        failed.append("tests")
    if failed:
        print(f"sections that failed: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
