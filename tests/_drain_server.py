"""A FastAPI app on `Serving(drain_timeout=...)` over a slow model, served by uvicorn in
a process of its own, for the SIGTERM tests of the drain's deadline.

    python tests/_drain_server.py REPORT.json EXPECTED MODEL_SECONDS DRAIN_TIMEOUT GRACE [thread]

It binds 127.0.0.1 on a port the kernel picks and prints that port once uvicorn
listens. `GET /square/{n}` answers `{"square": n * n}` through a proxy whose batches
of up to 2 take MODEL_SECONDS each, one at a time (on the event loop, or with
`thread` on a worker thread), so a few requests make a backlog longer than the
deadline. Once EXPECTED requests are in the app it prints "busy": the test sends
SIGTERM then. DRAIN_TIMEOUT "none" means no drain deadline; GRACE is uvicorn's
`timeout_graceful_shutdown` ("none": unbounded). At the end of the lifespan it
writes REPORT.json: the seconds from the signal to the end of the drain and the
proxy's final stats. Exit status: 0 (the previous SIGTERM handler only returns, so
uvicorn's re-raised signal lands there).
"""

import asyncio
import json
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any

import uvicorn
from fastapi import Depends, FastAPI
from typing_extensions import override

import batchproxy
from batchproxy.integrations.fastapi import Serving, install


class Slow(batchproxy.Proxy[int, int]):
    def __init__(self, seconds: float, offload: bool) -> None:
        super().__init__(batch_size=2, max_concurrent_batches=1, offload=offload, name="slow")
        self.seconds = seconds

    @override
    async def _inference(self, items: list[int]) -> list[int]:
        await asyncio.sleep(self.seconds)
        return [n * n for n in items]


class SlowOnThread(Slow):
    @override
    def _inference(self, items: list[int]) -> list[int]:  # type: ignore[override]
        time.sleep(self.seconds)
        return [n * n for n in items]


def main() -> int:
    report_path, expected, seconds = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    drain = None if sys.argv[4] == "none" else float(sys.argv[4])
    grace = None if sys.argv[5] == "none" else int(sys.argv[5])
    thread = sys.argv[6:] == ["thread"]
    proxy = (SlowOnThread if thread else Slow)(seconds, thread)
    serving = Serving(proxy, drain_timeout=drain)
    signalled: list[float] = []
    seen = [0]

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with serving.running():
            yield
        stats = proxy.stats
        report: dict[str, Any] = {
            "drained_after": time.monotonic() - signalled[0] if signalled else None,
            "requests": stats.requests,
            "succeeded": stats.succeeded,
            "errors": stats.errors,
            "cancelled": stats.cancelled,
        }
        await asyncio.to_thread(report_path.write_text, json.dumps(report))

    app = FastAPI(lifespan=lifespan)
    install(app, serving)

    @app.get("/square/{n}")
    async def square(
        n: int, slow: Annotated[Slow, Depends(serving.provider(Slow))]
    ) -> dict[str, int]:
        seen[0] += 1
        if seen[0] == expected:
            print("busy", flush=True)
        return {"square": await slow.inference(n)}

    class Server(uvicorn.Server):
        @override
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            assert sockets is not None
            print(sockets[0].getsockname()[1], flush=True)

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    # the handler uvicorn restores and re-raises the signal to once it has shut down;
    # it notes the signal's time first (uvicorn's handler, and Serving's, run after it)
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    config = uvicorn.Config(
        app, log_level="warning", access_log=False, timeout_graceful_shutdown=grace
    )
    server = Server(config)
    original = server.handle_exit

    def handle_exit(sig: int, frame: Any) -> None:
        signalled.append(time.monotonic())
        original(sig, frame)

    server.handle_exit = handle_exit  # type: ignore[method-assign]
    server.run(sockets=[listener])
    return 0


if __name__ == "__main__":
    sys.exit(main())
