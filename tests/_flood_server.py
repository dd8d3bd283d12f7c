"""A small FastAPI app on a bounded proxy, served by uvicorn in a process of its own.

    python tests/_flood_server.py REPORT.json

`test_flood.py` starts it, floods it with HTTP requests and sends it SIGTERM.
It binds 127.0.0.1 on a port the kernel picks and, once uvicorn listens, prints
that port as its first line of output. `GET /square/{n}` answers
`{"n": n, "square": n * n}` through `Squares` (`max_queue_size=256`, batches of
up to 32 taking 50 ms each); `QueueFull` becomes 503 with `Retry-After: 1`. On
the first `QueueFull` it prints "full": the test sends SIGTERM then.

On SIGTERM uvicorn stops listening, closes the connections that hold no request,
lets the requests it holds run to their response, and then runs the lifespan
shutdown, which calls `proxy.aclose()` and writes REPORT.json: every request the
app saw (its handler ran) and the status it answered, and the proxy's stats
when the signal arrived and at the end.

Exit status: uvicorn re-raises the signal once it has shut down, so that a
plain `uvicorn app:app` ends killed by SIGTERM; here the previous SIGTERM handler
is one that only returns, so the re-raised signal lands there and the process
exits 0 when the shutdown completed (the report written, every accepted request
settled), 1 otherwise.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from typing_extensions import override

import batchproxy

MAX_QUEUE_SIZE = 256
BATCH_SIZE = 32
MODEL_SECONDS = 0.05
COUNTERS = [
    *("requests", "succeeded", "errors", "timed_out", "cancelled", "rejected"),
    *("batches", "items", "queue_depth", "in_flight"),
]


class Squares(batchproxy.Proxy[int, int]):
    """A model that takes 50 ms per batch, on the event loop."""

    def __init__(self) -> None:
        super().__init__(batch_size=BATCH_SIZE, max_queue_size=MAX_QUEUE_SIZE, name="squares")

    @override
    async def _inference(self, items: list[int]) -> list[int]:
        await asyncio.sleep(MODEL_SECONDS)
        return [n * n for n in items]


def counts(stats: batchproxy.ProxyStats) -> dict[str, Any]:
    """The counters of a stats snapshot (no latency windows)."""
    return {key: getattr(stats, key) for key in COUNTERS}


class Report:
    """What the app saw, written as JSON at the end of the lifespan."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.statuses: dict[int, int] = {}  # request n -> status answered; -1 while handled
        self.closed = 0  # handlers that met ProxyClosed
        self.full = False  # a call has met QueueFull
        self.at_signal: dict[str, Any] | None = None
        self.settled = False

    def write(self, final: batchproxy.ProxyStats) -> None:
        settled = (
            final.requests == final.succeeded + final.errors + final.timed_out + final.cancelled
            and final.queue_depth == 0
            and final.in_flight == 0
        )
        document = {
            "statuses": {str(n): status for n, status in self.statuses.items()},
            "closed": self.closed,
            "at_signal": self.at_signal,
            "final": counts(final),
            "settled": settled,
        }
        self.path.write_text(json.dumps(document))
        self.settled = settled


def create_app(report: Report) -> tuple[FastAPI, Squares]:
    proxy = Squares()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await proxy.start()
        try:
            yield
        finally:
            await proxy.aclose()
            report.write(proxy.stats)

    app = FastAPI(lifespan=lifespan)

    @app.get("/square/{n}")
    async def square(n: int) -> JSONResponse:
        report.statuses[n] = -1  # accepted: uvicorn handed the request to the app
        try:
            value = await proxy.inference(n)
        except batchproxy.QueueFull as exc:
            if not report.full:
                report.full = True
                print("full", flush=True)  # the queue is full: the test may signal now
            report.statuses[n] = 503
            return JSONResponse({"detail": str(exc)}, 503, headers={"Retry-After": "1"})
        except batchproxy.ProxyClosed as exc:
            report.closed += 1
            report.statuses[n] = 503
            return JSONResponse({"detail": str(exc)}, 503, headers={"Retry-After": "1"})
        report.statuses[n] = 200
        return JSONResponse({"n": n, "square": value})

    return app, proxy


class Server(uvicorn.Server):
    """Prints the port once listening; notes the proxy's stats when a signal arrives."""

    def __init__(self, config: uvicorn.Config, proxy: Squares, report: Report) -> None:
        super().__init__(config)
        self.proxy = proxy
        self.report = report
        self.loop: asyncio.AbstractEventLoop | None = None

    @override
    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        self.loop = asyncio.get_running_loop()
        assert sockets is not None
        print(sockets[0].getsockname()[1], flush=True)

    @override
    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.loop is not None and self.report.at_signal is None:
            # read the stats on the loop, between callbacks, not halfway through one
            self.loop.call_soon_threadsafe(self._note_signal)
        super().handle_exit(sig, frame)

    def _note_signal(self) -> None:
        if self.report.at_signal is None:
            self.report.at_signal = counts(self.proxy.stats)


def main() -> int:
    report = Report(Path(sys.argv[1]))
    app, proxy = create_app(report)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    # the handler uvicorn restores and re-raises the signal to once it has shut down
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    config = uvicorn.Config(app, log_level="warning", access_log=False, backlog=4096)
    Server(config, proxy, report).run(sockets=[listener])
    return 0 if report.settled else 1


if __name__ == "__main__":
    sys.exit(main())
