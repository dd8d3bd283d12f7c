"""A server of `lone.py`, instrumented: `python -m benchmarks.servers.lone_server KIND THREADS`.

KIND is `regular` (`regular_server.py`'s app) or one of batchproxy's, built as the
README shows its service (`Serving` with its defaults, `install`, a route awaiting
the proxy of `batchproxy_server.embedder()`): `batchproxy`, `batchproxy-nofreeze`
(`freeze_gc=False`), `batchproxy-nowatch` (`cancel_on_disconnect=False`). torch runs on
THREADS threads. `GET /gcstats` answers the collector's passes per generation (count,
seconds, objects collected, from `gc.callbacks`), the process's CPU seconds, and what
is frozen.
"""

from __future__ import annotations

import gc
import sys
import threading
import time
from typing import Any

from fastapi import FastAPI

from benchmarks.servers import _common  # noqa: F401
from benchmarks.servers._http import serve

KINDS = ("regular", "batchproxy", "batchproxy-nofreeze", "batchproxy-nowatch")

PASSES: dict[str, list[float]] = {"passes": [0, 0, 0], "seconds": [0.0] * 3, "collected": [0] * 3}
_started = [0.0]


def _on_pass(phase: str, info: dict[str, Any]) -> None:
    if phase == "start":
        _started[0] = time.perf_counter()
        return
    generation = info["generation"]
    PASSES["passes"][generation] += 1
    PASSES["seconds"][generation] += time.perf_counter() - _started[0]
    PASSES["collected"][generation] += info["collected"]


def _thread_cpu() -> dict[str, float]:
    """CPU seconds of each Python thread, by role: the event loop's, the model's (the
    proxy's worker thread, or the regular way's pool thread), and the others'."""
    seconds: dict[str, float] = {}
    for thread in threading.enumerate():
        if thread.ident is None:
            continue
        try:
            cpu = time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
        except OSError:
            continue
        name = thread.name
        role = (
            "loop"
            if thread is threading.main_thread()
            else "model"
            if name.startswith(("batchproxy-", "minilm-regular"))
            else "other"
        )
        seconds[role] = seconds.get(role, 0.0) + cpu
    return seconds


def create_app(kind: str) -> FastAPI:
    if kind == "regular":
        from benchmarks.servers.regular_server import create_app as regular_app

        app = regular_app()
    else:
        from benchmarks.servers.batchproxy_server import create_app as batchproxy_app

        app = batchproxy_app(
            freeze_gc=kind != "batchproxy-nofreeze",
            cancel_on_disconnect=kind != "batchproxy-nowatch",
        )

    @app.get("/gcstats")
    async def gcstats() -> dict[str, Any]:
        return {
            **PASSES,
            "cpu": time.process_time(),
            "threads": _thread_cpu(),
            "frozen": gc.get_freeze_count(),
        }

    return app


if __name__ == "__main__":
    kind, threads = sys.argv[1], int(sys.argv[2])
    if kind not in KINDS:
        raise SystemExit(f"KIND must be one of {KINDS}, got {kind!r}")
    gc.callbacks.append(_on_pass)
    app = create_app(kind)
    import torch

    torch.set_num_threads(threads)  # (after the load, which sets _common.THREADS)
    serve(app)
