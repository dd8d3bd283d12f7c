"""The BERT app's server for the GPU benchmark's HTTP sections: `launch_server(config)`
starts it in a child process (`python -m benchmarks.gpu._server CONFIG`), pinned, under
uvicorn on a free port of 127.0.0.1 (`demo.serve_app`); with `timed` in the config it
is wrapped in `TimedApp` (the server's own time per route, for the lone-client section).
"""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request
from collections import defaultdict
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from demo import Service

from benchmarks._harness.clients import pin

BATCH_SIZE = 64
STARTUP_TIMEOUT = 300.0
REQUEST_TIMEOUT = 120.0


# ------------------------------------------------------------------------- the server


def serve(config: dict[str, Any]) -> None:
    """The server child: pin, then serve the app (`demo.serve_app`: a free loopback port,
    printed; until stdin closes, or SIGTERM)."""
    pin(config.get("cpus"))
    from bert_app import create_app
    from demo import serve_app

    app = create_app(
        config["model"],
        config["device"],
        config["dtype"],
        BATCH_SIZE,
        overlap=config["overlap"],
        timeout=REQUEST_TIMEOUT,
    )
    if config.get("timed"):  # the lone-client section's server: where its time goes
        app = TimedApp(app)
    serve_app(app, timeout_keep_alive=300, backlog=4096)


def launch_server(config: dict[str, Any]) -> Service:
    """The app in a child process (`demo.Service`), launched: the port is known; its
    `ready()` returns once the model is loaded (so two servers can load at the same time)."""
    from demo import Service

    command = [sys.executable, "-m", "benchmarks.gpu._server", json.dumps(config)]
    return Service(command, STARTUP_TIMEOUT).launch()


def batch_totals(service: Service) -> dict[str, tuple[float, float]]:
    """The proxy's batch-size histogram in the server's `/metrics`: (items, batches)."""
    from demo import batch_size_totals

    with urllib.request.urlopen(f"{service.base_url}/metrics", timeout=30) as response:
        return batch_size_totals(response.read().decode())


class TimedApp:
    """An ASGI app wrapped: the seconds from each request's start to its response's
    last byte, summed per path; `GET /timings` answers them (as JSON) and starts
    afresh."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.seconds: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["path"] == "/timings":
            await self.answer(send)
            return
        started = time.perf_counter()

        async def timed_send(message: Any) -> None:
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                total = self.seconds[scope["path"]]
                total[0] += time.perf_counter() - started
                total[1] += 1

        await self.app(scope, receive, timed_send)

    async def answer(self, send: Any) -> None:
        ms = {path: 1000 * s / max(1, n) for path, (s, n) in self.seconds.items()}
        self.seconds.clear()
        headers = [(b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": json.dumps({"ms": ms}).encode()})


def timings(base_url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{base_url}/timings", timeout=30) as response:
        answer: dict[str, Any] = json.loads(response.read())
        return answer


if __name__ == "__main__":
    serve(json.loads(sys.argv[1]))
