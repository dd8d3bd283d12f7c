"""An aiohttp app on `install(app, Serving(...))`, served by `web.run_app` as the docs
show it, in a process of its own, for the SIGTERM tests of aiohttp's drain.

    python tests/_aiohttp_drain_server.py REPORT.json EXPECTED DRAIN_TIMEOUT LOOP [GRACE]

It binds 127.0.0.1 on a port the kernel picks, listens, prints that port, then runs
`web.run_app` on that socket. `GET /square/{n}` answers `{"square": n * n}` through a
proxy (batches of up to 2, one at a time, on the event loop) whose model waits until
the process gets SIGUSR1: the test holds every call in flight as long as it likes.
Once EXPECTED requests are in the app it prints "busy": the test sends SIGTERM then.
DRAIN_TIMEOUT "none" means no drain deadline; LOOP is "asyncio" or "uvloop" (the
loop `run_app` is given); GRACE, if given, is `run_app`'s `shutdown_timeout`
(aiohttp's default: 60 s). After the helper's cleanup (the drain)
it writes REPORT.json: the proxy's final stats, the service's state and the threads
still alive. `run_app` returns on SIGTERM, so the exit status is 0.
"""

import asyncio
import json
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Any

from aiohttp import web
from typing_extensions import override

import batchproxy
from batchproxy.integrations.aiohttp import Serving, install, ready_proxy


class Held(batchproxy.Proxy[int, int]):
    """Squares its items once `release` is set (by SIGUSR1)."""

    def __init__(self) -> None:
        super().__init__(batch_size=2, max_concurrent_batches=1, name="held")
        self.release = asyncio.Event()

    @override
    async def _inference(self, items: list[int]) -> list[int]:
        await self.release.wait()
        return [n * n for n in items]


def main() -> int:
    report_path, expected = Path(sys.argv[1]), int(sys.argv[2])
    drain = None if sys.argv[3] == "none" else float(sys.argv[3])
    grace = float(sys.argv[5]) if len(sys.argv) > 5 else 60.0
    if sys.argv[4] == "uvloop":
        import uvloop

        loop = uvloop.new_event_loop()
    else:
        loop = asyncio.new_event_loop()
    proxy = Held()
    serving = Serving(proxy, drain_timeout=drain)
    seen = [0]

    async def square(request: web.Request) -> web.Response:
        held = ready_proxy(request, Held)
        seen[0] += 1
        if seen[0] == expected:
            print("busy", flush=True)
        return web.json_response({"square": await held.inference(int(request.match_info["n"]))})

    async def on_startup(app: web.Application) -> None:
        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, proxy.release.set)

    async def report(app: web.Application) -> None:
        stats = proxy.stats
        threads = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
        result: dict[str, Any] = {
            "requests": stats.requests,
            "succeeded": stats.succeeded,
            "errors": stats.errors,
            "cancelled": stats.cancelled,
            "disconnected": stats.disconnected,
            "state": serving.state.name,
            "threads": threads,
        }
        await asyncio.to_thread(report_path.write_text, json.dumps(result))

    app = web.Application()
    install(app, serving)
    app.on_startup.append(on_startup)
    app.on_cleanup.append(report)  # (after install's cleanup_ctx: the drain)
    app.router.add_get("/square/{n}", square)

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    print(listener.getsockname()[1], flush=True)
    web.run_app(app, sock=listener, print=None, access_log=None, loop=loop, shutdown_timeout=grace)
    return 0


if __name__ == "__main__":
    sys.exit(main())
