"""The GPU headline's BERT-over-HTTP section: `run(args)`, called by `benchmarks/gpu/gpu.py`.

Per model (`examples/bert_app.py`: BERT classification, random weights, seed 0):

1. Over HTTP, the app under uvicorn in a child process on 127.0.0.1 (pinned to
   `args.server_cpus`), loaded by closed-loop aiohttp clients in `CLIENT_PROCESSES`
   child processes (pinned one each to `args.client_cpus`; one process at 1 and 5
   clients). At 1, 5, 100 and 150 concurrent clients, for the regular path (one
   forward pass per request), the batched one (`TensorProxy`) and the HTTP floor
   (`/constant`, the model untouched), the order of the paths alternating by level:
   the time for N requests fired at once until the last answer (the median of
   BURSTS bursts), then a closed loop for LOOP_SECONDS: throughput, p50/p99 latency,
   mean batch size (the server's `/metrics`). A sample of batched answers must equal
   the regular ones within a tolerance for the dtype. The levels run on the proxy's
   default thread (HEADLINE_OVERLAP). Then one client sends PAIRS texts both ways,
   interleaved request by request: the lone client's speedup with its 95 % interval.
2. In process, no HTTP, the same model: items/s one forward pass per item, in full
   batches of 64 fed directly (the ceiling), and through the proxy with 150
   coroutines.
3. The overlap's gain (CUDA: the next batch's collate and copy overlapping the
   current batch's compute): batched at 150 clients over HTTP on a second server
   started with the other `overlap`, and through the proxy in process with and without,
   each with the GPU's utilisation meanwhile (`nvidia-smi`; None on a CPU).

Returns the numbers as a JSON-able dict, prints a Markdown table, writes
`args.out / "gpu-http.png"`. Progress lines go to stdout as it runs.

Its parts: the app's server process (`_server`), the measurements (`_http_measure`), the
table and plot (`_http_report`), and the load generator every HTTP benchmark shares
(`benchmarks/_harness/clients.py`).

Standalone (for testing): `python -m benchmarks.gpu._http --device cpu --quick`.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import RESULTS
from benchmarks._harness.clients import Clients
from benchmarks.gpu._http_measure import (
    BATCH_SIZE,
    BURSTS,
    IN_PROCESS_SECONDS,
    LEVELS,
    LOOP_SECONDS,
    PAIRS,
    QUICK_BURSTS,
    QUICK_IN_PROCESS_SECONDS,
    QUICK_LOOP_SECONDS,
    QUICK_PAIRS,
    QUICK_WARMUP_SECONDS,
    TOLERANCE,
    WARMUP_SECONDS,
    log,
    run_model,
)
from benchmarks.gpu._http_report import markdown, plot

# ------------------------------------------------------------------------ the entry


def client_process_count(cpus: Sequence[int] | None) -> int:
    if cpus:
        return max(1, min(4, len(cpus)))
    return min(4, max(2, (os.cpu_count() or 2) // 4))


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The section: see the module docstring. Returns its numbers (JSON-able)."""
    started = time.perf_counter()
    quick = bool(args.quick)
    plan = {
        "loop_seconds": QUICK_LOOP_SECONDS if quick else LOOP_SECONDS,
        "bursts": QUICK_BURSTS if quick else BURSTS,
        "in_process_seconds": QUICK_IN_PROCESS_SECONDS if quick else IN_PROCESS_SECONDS,
        "warmup_seconds": QUICK_WARMUP_SECONDS if quick else WARMUP_SECONDS,
        "pairs": QUICK_PAIRS if quick else PAIRS,
        "processes": client_process_count(args.client_cpus),
    }
    models = list(args.models)
    if quick and not args.device.startswith("cuda"):
        models = ["bert-tiny"]
    log(f"models {models} on {args.device} ({args.dtype}), plan {plan}")
    result: dict[str, Any] = {
        "section": "gpu-http",
        "device": args.device,
        "dtype": args.dtype,
        "quick": quick,
        "batch_size": BATCH_SIZE,
        "levels": list(LEVELS),
        "client_processes": plan["processes"],
        "server_cpus": args.server_cpus,
        "client_cpus": args.client_cpus,
        "plan": plan,
        "models": {},
    }
    clients = Clients(plan["processes"], args.client_cpus)
    try:
        for name in models:
            result["models"][name] = run_model(name, args, clients, plan)
    finally:
        clients.close()
    out = Path(args.out)
    figure = out / "gpu-http.png"
    plot(result, figure)
    result["figure"] = str(figure)
    result["seconds"] = time.perf_counter() - started
    text = markdown(result)
    result["markdown"] = text
    print(text, flush=True)
    log(f"done in {result['seconds']:.1f} s; figure {figure}")
    return result


def _cpus(text: str | None) -> list[int] | None:
    return [int(c) for c in text.split(",")] if text else None


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dtype", default="float32", choices=sorted(TOLERANCE))
    parser.add_argument("--models", default="bert-base,bert-large")
    parser.add_argument("--out", type=Path, default=RESULTS / "runs")
    parser.add_argument("--server-cpus", type=_cpus, default=None, help="e.g. 0,1,2,3")
    parser.add_argument("--client-cpus", type=_cpus, default=None)
    args = parser.parse_args(argv)
    args.models = args.models.split(",")
    result = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu-http.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
