"""`python -m batchproxy.host module:factory --socket PATH`: a model host on its own.

`factory` is a callable in an importable module (`module:attribute`, dotted
attributes allowed) that returns the proxy to serve, or an awaitable of it (a
coroutine function may load the weights). The host serves it on `PATH` until
SIGTERM or SIGINT, then drains for up to `--drain-timeout` seconds and removes the
socket. One line on stderr says when it is ready.

`--lock`: first take the host lock of `PATH` (`PATH.lock`), and exit at once (status
0, nothing loaded) if another host holds it; `--exit-when-idle S`: exit (draining as
on SIGTERM) once no client has been connected for S seconds. `RemoteProxy(path,
host="module:factory")` starts its host this way (see `_launch`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import inspect
import signal
import sys
from collections.abc import Sequence
from typing import Any

from ._host import ModelHost
from ._launch import hold_lock


def load_factory(spec: str) -> Any:
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise SystemExit(f"expected module:factory, got {spec!r}")
    target: Any = importlib.import_module(module_name)
    for part in attribute.split("."):
        target = getattr(target, part)
    if not callable(target):
        raise SystemExit(f"{spec} is not callable")
    return target


async def serve(
    factory: Any, path: str, drain_timeout: float | None, exit_when_idle: float | None = None
) -> None:
    proxy = factory()
    if inspect.isawaitable(proxy):
        proxy = await proxy
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    async with ModelHost(proxy, path, drain_timeout=drain_timeout) as host:
        print(f"batchproxy.host: serving {proxy!r} on {path}", file=sys.stderr, flush=True)
        if exit_when_idle is None:
            await stop.wait()
        else:
            await _until_idle(host, exit_when_idle, stop)


async def _until_idle(host: ModelHost, seconds: float, stop: asyncio.Event) -> None:
    """Until `stop` is set, or no client has been connected for `seconds`."""
    loop = asyncio.get_running_loop()
    idle_since = loop.time()
    while not stop.is_set():
        if host.connections:
            idle_since = loop.time()
        elif loop.time() - idle_since >= seconds:
            return
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), min(0.1, seconds))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m batchproxy.host", description=__doc__)
    parser.add_argument("factory", help="module:callable returning the proxy to serve")
    parser.add_argument("--socket", required=True, help="the Unix socket's path")
    parser.add_argument("--drain-timeout", type=float, default=30.0)
    parser.add_argument("--lock", action="store_true", help="exit if a host holds PATH.lock")
    parser.add_argument("--exit-when-idle", type=float, default=None, metavar="SECONDS")
    args = parser.parse_args(argv)
    if args.lock and hold_lock(args.socket) is None:  # (held until this process ends)
        return  # another host serves: nothing loaded
    sys.path.insert(0, "")  # the current directory, as `python -m` users expect
    factory = load_factory(args.factory)
    asyncio.run(serve(factory, args.socket, args.drain_timeout, args.exit_when_idle))


if __name__ == "__main__":
    main()
