"""`python -m batchproxy.host module:factory --socket PATH`: a model host on its own.

`factory` is a callable in an importable module (`module:attribute`, dotted
attributes allowed) that returns the proxy to serve, or an awaitable of it (a
coroutine function may load the weights). The host serves it on `PATH` until
SIGTERM or SIGINT, then drains for up to `--drain-timeout` seconds and removes the
socket. One line on stderr says when it is ready.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import inspect
import signal
import sys
from collections.abc import Sequence
from typing import Any

from ._host import ModelHost


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


async def serve(factory: Any, path: str, drain_timeout: float | None) -> None:
    proxy = factory()
    if inspect.isawaitable(proxy):
        proxy = await proxy
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    async with ModelHost(proxy, path, drain_timeout=drain_timeout):
        print(f"batchproxy.host: serving {proxy!r} on {path}", file=sys.stderr, flush=True)
        await stop.wait()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m batchproxy.host", description=__doc__)
    parser.add_argument("factory", help="module:callable returning the proxy to serve")
    parser.add_argument("--socket", required=True, help="the Unix socket's path")
    parser.add_argument("--drain-timeout", type=float, default=30.0)
    args = parser.parse_args(argv)
    sys.path.insert(0, "")  # the current directory, as `python -m` users expect
    asyncio.run(serve(load_factory(args.factory), args.socket, args.drain_timeout))


if __name__ == "__main__":
    main()
