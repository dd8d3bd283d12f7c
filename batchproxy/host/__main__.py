"""`python -m batchproxy.host module:factory --socket PATH`: a model host on its own.

`factory` is a callable in an importable module (`module:attribute`, dotted
attributes allowed) that returns the proxy to serve, or an awaitable of it (a
coroutine function may load the weights). The host serves it on `PATH` until
SIGTERM or SIGINT, then drains for up to `--drain-timeout` seconds and removes the
socket. One line on stderr says when it is ready.

Once the factory's proxy is loaded, before serving, the host collects once and
`gc.freeze()`s what is alive (the model, the framework), as a `Serving` does in a web
service by default: the collector's full passes then skip them. On by default, for the
same reasons (docs/serving.md, "Garbage-collection pauses"); `--no-freeze-gc` leaves
the collector alone (`--freeze-gc`, the default, is still accepted).

A load that fails (taking the lock, importing the factory's module, calling the
factory, entering the proxy, binding the socket) prints its traceback and exits with
status 3 (`LOAD_FAILED`); with `--report-fd N`, it first writes its error's type and
message on file descriptor N (a pipe from the process that started it), which is
closed once serving.

`--loop`: the event loop to serve on: `auto` (the default) is uvloop where it is
installed (as uvicorn's default: `uvicorn[standard]`), else asyncio's; `asyncio` or
`uvloop` to choose (`asyncio`: the event loop policy's, asyncio's own unless the
process set another). The host's loop carries every call of every web worker
(reading the calls, a task each, writing the answers), and uvloop runs the loop's
own part of that in C (docs/benchmarks.md, "CPU per request through the host").

`--lock`: first take the host lock of `PATH` (`PATH.lock`), and exit at once (status
0, nothing loaded) if another host holds it; `--exit-when-idle S`: exit (draining as
on SIGTERM) once no client has been connected for S seconds. `RemoteProxy(path,
host="module:factory")` starts its host this way (see `_launch`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import os
import signal
import sys
import traceback
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from .._collector import freezes
from .._factory import load_factory
from ._host import ModelHost
from ._launch import LOAD_FAILED, hold_lock


async def serve(
    factory: Any,
    path: str,
    drain_timeout: float | None,
    exit_when_idle: float | None = None,
    *,
    freeze_gc: bool = True,
    serving: Callable[[], None] = lambda: None,
) -> None:
    """Load the factory's proxy and serve it on `path` until SIGTERM or SIGINT (or idle
    for `exit_when_idle` seconds); `serving()` is called once it listens."""
    proxy = factory()
    if inspect.isawaitable(proxy):
        proxy = await proxy
    if freeze_gc:
        freezes.hold()  # (for the process's life: it ends when serving does)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    async with ModelHost(proxy, path, drain_timeout=drain_timeout) as host:
        serving()
        loop_name = type(loop).__module__.partition(".")[0]  # ("asyncio", "uvloop")
        print(f"batchproxy.host: serving {proxy!r} on {path} ({loop_name})", file=sys.stderr,
              flush=True)  # fmt: skip
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
    parser.add_argument(
        "--freeze-gc",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="gc.freeze() what is alive once loaded (default: on)",
    )
    parser.add_argument(
        "--loop", choices=LOOPS, default="auto", help="auto: uvloop where it is installed"
    )
    parser.add_argument("--report-fd", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    report = _Report(args.report_fd)
    try:
        if args.lock and hold_lock(args.socket) is None:  # (held until this process ends)
            return  # another host serves: nothing loaded
        sys.path.insert(0, "")  # the current directory, as `python -m` users expect
        factory = load_factory(args.factory)
        run(
            serve(
                factory,
                args.socket,
                args.drain_timeout,
                args.exit_when_idle,
                freeze_gc=args.freeze_gc,
                serving=report.close,
            ),
            args.loop,
        )
    except Exception as exc:
        if not report.loading:
            raise
        traceback.print_exc()
        report.failed(exc)
        sys.exit(LOAD_FAILED)
    finally:
        report.close()


LOOPS = ("auto", "asyncio", "uvloop")


def loop_factory(loop: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The `--loop` choice's factory: uvloop's (`auto`: where it is installed; `uvloop`:
    `ImportError` where it is not), or None for asyncio's own."""
    if loop == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if loop == "uvloop":
            raise
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def run(main: Coroutine[Any, Any, None], loop: str) -> None:
    """`asyncio.run(main)` on the `--loop` chosen."""
    factory = loop_factory(loop)
    if factory is None:
        asyncio.run(main)
        return
    if sys.version_info >= (3, 11):
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(main)
        return
    import uvloop  # (Python 3.10: no loop factory; this process's policy, then)

    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    asyncio.run(main)


class _Report:
    """The `--report-fd` pipe, if any: why the load failed, or closed once serving."""

    def __init__(self, fd: int | None) -> None:
        self.fd = fd
        self.loading = True

    def failed(self, exc: BaseException) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.write(self.fd, f"{type(exc).__name__}: {exc}".encode()[:4096])

    def close(self) -> None:
        self.loading = False
        fd, self.fd = self.fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


if __name__ == "__main__":
    main()
