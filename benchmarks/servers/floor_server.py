"""The HTTP floor: the same FastAPI server, body and answer, with no model.

Every request is parsed and answered with one constant 384-float vector: what HTTP,
JSON and the client cost on this machine, the most any served stack could answer.

`python -m benchmarks.servers.floor_server` serves it in one process, as the one-process stacks are
served (`_http.serve`); `--workers N` (N > 1) serves it from N uvicorn workers, as
`host_server.py` serves its web workers: the floor of a layout with N web workers.
"""

from __future__ import annotations

import argparse
import math

from fastapi import FastAPI

from benchmarks.servers._http import EmbedIn, EmbedOut, serve

DIMENSION = 384
CONSTANT = [1.0 / math.sqrt(DIMENSION) + 1e-9 * i for i in range(DIMENSION)]  # long floats


def create_app() -> FastAPI:
    app = FastAPI()

    @app.post("/embed")
    async def embed(body: EmbedIn) -> EmbedOut:
        return EmbedOut(embedding=CONSTANT)

    return app


def serve_workers(workers: int) -> None:
    """`workers` uvicorn workers, bound and run as `host_server.py` runs its own (this
    process leads its group: the supervisor and the workers go with it)."""
    from benchmarks.servers._common import announce_port, log_to_file, run_workers

    log_to_file()
    run_workers("benchmarks.servers.floor_server:create_app", announce_port(), workers)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=1)
    workers = parser.parse_args().workers
    if workers > 1:
        serve_workers(workers)
    else:
        serve(create_app())
