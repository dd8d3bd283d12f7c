"""`RemoteProxy`: a proxy's call methods in a process that does not hold the model,
answered by a `ModelHost` over its Unix domain socket.

One connection (`_connection.Connection`) per event loop (a web worker's, and the
`BackgroundLoop` that plain threads call through), opened on its first call there and
again on the first call after it was lost.

For a web service (`Serving`), `start()` waits for the host (starting it, with
`host=`: see `_launch`) and then watches it: one `health` question every
`health_every` seconds, so readiness includes the host, and a lost host is seen (and
started again, with `host=`) even while no request comes. `aclose()` lets the calls
in flight finish, then closes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import math
import os
import time
import weakref
from collections.abc import AsyncGenerator, Iterable
from pathlib import Path
from typing import Any

from typing_extensions import Unpack

from .. import _validate
from .._errors import DeadlineExceeded, HostUnavailable, ProxyClosed
from .._loops.background_loop import BackgroundLoop
from .._option_values import CallOptions, check_call
from .._stats import Health
from ._connection import Connection, NotSent
from ._launch import Candidate, lock_is_free

__all__ = ["RemoteProxy"]

_HAND_OVER = 1.0
"""Seconds `aclose()` waits for another loop to close its connection."""

_SYNC_MARGIN = 0.5
"""Seconds a thread waits beyond its call's timeout (which the host enforces) before it
gives up on a host too busy to answer at all."""


class RemoteProxy:
    """Calls to the proxy a `ModelHost` serves on `path`, from this process.

    The proxy's call methods, with its call options (`timeout`, `priority`,
    `tenant`, `key`), checked here before anything is sent: `inference`,
    `inference_many`, `stream` (the host's stream, chunk by chunk; a proxy that
    does not stream sends its one result), and from plain threads `submit` and
    `inference_sync`. The host applies the options, so its batches mix the calls
    of every connected process. A timeout travels as a deadline. The host's errors
    arrive as the same exceptions (`QueueFull`, `DeadlineExceeded`, `InvalidItem`,
    the model's own), and a host that cannot be reached or is lost with the call in
    flight raises `HostUnavailable` (never a hang). Cancelling a call (or closing
    its stream early) cancels it in the host.

    In a `Serving` it is one of the service's proxies: `start()` waits up to
    `start_timeout` seconds for the host (with `host="module:factory"`, the first
    worker that finds none starts one, which exits `host_idle_exit` seconds after
    its last worker left), then asks its health every `health_every` seconds
    (`health`, so `/readyz` includes the host); `aclose(timeout=...)` lets the calls
    in flight finish, then closes (later calls raise `ProxyClosed`). `name`: the
    service's name for it (default: the socket file's stem). `connect_timeout`:
    seconds to wait for the socket.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        name: str | None = None,
        host: str | None = None,
        connect_timeout: float = 5.0,
        start_timeout: float | None = 600.0,
        health_every: float = 1.0,
        host_idle_exit: float = 10.0,
    ) -> None:
        self.path = os.fspath(path)
        self.name = _validate.name(name) or Path(self.path).stem
        if host is not None and (not isinstance(host, str) or ":" not in host):
            raise ValueError(f"host must be 'module:factory' or None, got {host!r}")
        self.host = host
        self.connect_timeout = _validate.duration(
            "connect_timeout", connect_timeout, allow_zero=False
        )
        self.start_timeout = _validate.timeout("start_timeout", start_timeout)
        self.health_every = _validate.duration("health_every", health_every, allow_zero=False)
        self.host_idle_exit = _validate.duration("host_idle_exit", host_idle_exit, allow_zero=False)
        # by loop; each changed on its own loop only (aclose() of another hands over)
        self._connections: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Connection] = (
            weakref.WeakKeyDictionary()
        )
        self._connecting: weakref.WeakKeyDictionary[
            asyncio.AbstractEventLoop, asyncio.Task[Connection]
        ] = weakref.WeakKeyDictionary()
        self._closed = False
        self._health = Health(False, "not started: no word from the model host yet", None)
        self._watch: asyncio.Task[None] | None = None
        self._candidate: Candidate | None = None  # the host this worker started last

    def __repr__(self) -> str:
        return f"RemoteProxy({self.path!r})"

    async def __aenter__(self) -> RemoteProxy:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # -- calls --------------------------------------------------------------------------

    async def inference(self, item: Any, **call: Unpack[CallOptions]) -> Any:
        """`item`'s result from the host's proxy (see the class)."""
        return await self._call(item, _options("inference()", call))

    async def inference_many(
        self, items: Iterable[Any], *, return_exceptions: bool = False, **call: Unpack[CallOptions]
    ) -> list[Any]:
        """Each item as its own call, all at once; results in order. With
        `return_exceptions`, a failed item's exception takes its place instead of
        the first failure raising (the other calls are then cancelled)."""
        options = _options("inference_many()", call)  # checked once; one deadline for all
        calls = [asyncio.ensure_future(self._call(item, options)) for item in items]
        try:
            return list(await asyncio.gather(*calls, return_exceptions=return_exceptions))
        finally:
            # (popped, not a loop variable: an error raised here keeps this frame in its
            # traceback, and a failed call's task keeps the error: a cycle per failure)
            while calls:
                calls.pop().cancel()

    async def stream(self, item: Any, **call: Unpack[CallOptions]) -> AsyncGenerator[Any, None]:
        """`item`'s chunks from the host proxy's `stream` as they come (its `timeout`
        bounds the whole stream). Leaving the loop early, closing the iterator or
        being cancelled cancels the call in the host."""
        options = _options("stream()", call)
        connection = await self._connect()
        try:
            chunks = connection.stream(item, options)
            first = await chunks.__anext__()
        except NotSent:  # (nothing sent, so nothing yielded: once more, connected again)
            connection = await self._connect()
            chunks = connection.stream(item, options)
            first = await chunks.__anext__()
        except StopAsyncIteration:
            return
        async with contextlib.aclosing(chunks):
            yield first
            async for chunk in chunks:
                yield chunk

    def submit(self, item: Any, **call: Unpack[CallOptions]) -> concurrent.futures.Future[Any]:
        """From a plain thread: `inference` on the process-wide `BackgroundLoop`; a
        `concurrent.futures.Future` of its result (cancel it to cancel the call)."""
        options = _options("submit()", call)  # here: a bad option raises in the caller
        return BackgroundLoop.default().submit(self._call(item, options))

    def inference_sync(self, item: Any, **call: Unpack[CallOptions]) -> Any:
        """From a plain thread: block for `inference`'s result (on the process-wide
        `BackgroundLoop`). An interrupted wait (`KeyboardInterrupt`) cancels the call.
        Refused in a thread that runs an event loop, which it would block (`await
        remote.inference(...)` there)."""
        options = _options("inference_sync()", call)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass  # no loop in this thread: the usual case
        else:
            raise RuntimeError(
                f"{self!r}.inference_sync() was called in a thread running an event loop, "
                f"which it would block: await remote.inference(...) there"
            )
        future = BackgroundLoop.default().submit(self._call(item, options))
        seconds = options.get("timeout")
        try:
            done, _ = concurrent.futures.wait(
                [future], None if seconds is None else seconds + _SYNC_MARGIN
            )
        except BaseException:  # interrupted: the call is withdrawn, not left queued
            future.cancel()
            raise
        if not done and future.cancel():  # (cancel() fails only if it just finished)
            assert seconds is not None  # only a bounded wait ends without the result
            raise DeadlineExceeded(self.name, seconds)
        return future.result()

    async def _call(self, item: Any, options: dict[str, Any]) -> Any:
        """One call with its options checked (`_options`), on this loop's connection (a
        new one if that was lost before the call could be written: `NotSent`)."""
        try:
            return await (await self._connect()).call(item, options)
        except NotSent:
            return await (await self._connect()).call(item, options)

    # -- as a service's proxy -----------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def health(self) -> Health:
        """The host's health as last heard (`start()` keeps asking), or why not: no
        host, the connection lost, or this proxy closed."""
        if self._closed:
            return Health(False, f"{self.name} is closed", None)
        return self._health

    async def start(self) -> None:
        """Wait up to `start_timeout` for the host (starting one, with `host=`, if none
        answers), then watch its health from this loop. Raises `HostUnavailable` if no
        host answered in time; idempotent."""
        if self._closed:
            raise ProxyClosed(self.name)
        if self._watch is not None and not self._watch.done():
            return
        loop = asyncio.get_running_loop()
        deadline = None if self.start_timeout is None else loop.time() + self.start_timeout
        pause = 0.02
        while True:
            try:
                self._heard(await self._ask())
                break
            except HostUnavailable as exc:
                self._start_host()
                if deadline is not None and loop.time() + pause > deadline:
                    raise HostUnavailable(
                        self.path, f"no model host answered within {self.start_timeout} s"
                    ) from exc
            await asyncio.sleep(pause)
            pause = min(2 * pause, self.health_every)
        self._watch = loop.create_task(self._watching(), name=f"batchproxy-{self.name}-watch")

    async def aclose(self, *, timeout: float | None = None) -> None:
        """Stop taking calls (`ProxyClosed`), let those in flight finish (for up to
        `timeout` seconds: then they fail with `HostUnavailable`), and close the
        connections (another running loop's on that loop). Idempotent."""
        if timeout is not None:  # (>= 0, as for `Proxy.aclose`: a drain's deadline may be now)
            timeout = _validate.duration("timeout", timeout, allow_zero=True, allow_inf=True)
            timeout = None if timeout == math.inf else timeout
        self._closed = True
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch
        here = asyncio.get_running_loop()
        connections = list(self._connections.items())
        self._connections.clear()
        self._connecting.clear()  # (a finished one holds its connection)
        mine = [connection for loop, connection in connections if loop is here]
        if mine:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(mine[0].drained(), timeout)
        why = f"{self.name} was closed"
        for loop, connection in connections:
            if loop is here:
                await connection.close(why)
            elif loop.is_running():
                # bounded: a loop that stops before it runs this never answers
                with contextlib.suppress(RuntimeError, asyncio.TimeoutError):
                    closing = asyncio.run_coroutine_threadsafe(connection.close(why), loop)
                    await asyncio.wait_for(asyncio.wrap_future(closing), _HAND_OVER)
            # else: a loop that no longer runs; its transports go with it
        if self._candidate is not None and not self._candidate.running:  # (reaped)
            self._candidate = None  # (one still running serves on, for the other workers)

    async def _watching(self) -> None:
        """Ask the host's health every `health_every` seconds; a host that cannot be
        reached is unhealthy (and started again, with `host=`)."""
        while True:
            await asyncio.sleep(self.health_every)
            try:
                self._heard(await asyncio.wait_for(self._ask(), self.connect_timeout))
            except HostUnavailable as exc:
                self._lost(exc.detail)
                self._start_host()
            except asyncio.TimeoutError:
                self._lost(f"no answer within {self.connect_timeout} s")

    async def _ask(self) -> Health:
        try:
            return await (await self._connect()).health()
        except NotSent:
            return await (await self._connect()).health()

    def _heard(self, health: Health) -> None:
        self._health = health

    def _lost(self, why: str) -> None:
        """The host cannot be reached, or the connection to it was lost: not healthy
        from now (since the first such word) until it answers again."""
        since = self._health.since if not self._health.healthy else None
        self._health = Health(False, f"model host at {self.path}: {why}", since or time.time())

    def _start_host(self) -> None:
        """With `host=`: start a host candidate, unless the last one still runs (it is
        loading, or it is the host and merely slow)."""
        if self.host is None or self._closed:
            return
        if self._candidate is not None and self._candidate.running:
            return
        if lock_is_free(self.path):  # (held: a host is loading, maybe another worker's)
            self._candidate = Candidate(self.host, self.path, self.host_idle_exit)

    # -- connections --------------------------------------------------------------------

    async def _connect(self) -> Connection:
        if self._closed:
            raise ProxyClosed(self.name)
        loop = asyncio.get_running_loop()
        connection = self._connections.get(loop)
        if connection is not None and connection.writable():
            return connection
        connecting = self._connecting.get(loop)
        if connecting is None or connecting.done():
            connecting = self._connecting[loop] = loop.create_task(self._open(loop))
            connecting.add_done_callback(_seen)
        return await asyncio.shield(connecting)

    async def _open(self, loop: asyncio.AbstractEventLoop) -> Connection:
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_unix_connection(self.path), self.connect_timeout
            )
        except (OSError, asyncio.TimeoutError) as exc:
            raise HostUnavailable(self.path, f"cannot connect ({exc!r})") from exc
        connection = Connection(self.path, loop, reader, writer, self._lost)
        self._connections[loop] = connection
        return connection


def _seen(connecting: asyncio.Task[Connection]) -> None:
    """A connecting task's failure is its callers' to raise (each through its shield);
    marked seen here, so that one whose callers had all left (cancelled) is not
    logged as never retrieved."""
    if not connecting.cancelled():
        connecting.exception()


def _options(where: str, call: CallOptions) -> dict[str, Any]:
    """The call's options as they travel, checked as the proxy checks them: a timeout
    (None or infinite: none) goes with its deadline on the machine's monotonic clock."""
    check_call(where, call)
    options: dict[str, Any] = {"priority": _validate.priority(call.get("priority", 0))}
    for name in ("tenant", "key"):
        value = call.get(name)
        if value is not None:
            options[name] = _validate.hashable(name, value)
    timeout = _validate.timeout("timeout", call.get("timeout"))
    if timeout is not None:
        options["timeout"] = timeout
        options["deadline"] = time.monotonic() + timeout
    return options
