"""`RemoteProxy`: a proxy's call methods in a process that does not hold the model,
answered by a `ModelHost` over its Unix domain socket.

One connection (`_connection.Connection`) per event loop (a web worker's, and the
`BackgroundLoop` that plain threads call through), opened on its first call there and
again on the first call after it was lost.

Every wait of a call is bounded in this process by the call's own deadline
(`_deadline`), whatever the host does; every health question by `connect_timeout`.

For a web service (`Serving`), `start()` waits for the host (starting it, with
`host=`: see `_launch`) and then watches it: one `health` question every
`health_every` seconds, so readiness includes the host, and a lost host is seen (and
started again, with `host=`) even while no request comes. Each new connection asks
once too, so `health` follows a reconnection without `start()`. `aclose()` lets the
calls in flight on every loop finish, then closes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import math
import os
import time
import weakref
from collections.abc import AsyncGenerator, Awaitable, Callable, Generator, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from typing_extensions import Unpack

from .. import _validate
from .._errors import DeadlineExceeded, DrainDeadline, HostUnavailable, ProxyClosed
from .._loops.sync_scope import SyncScope
from .._loops.sync_stream import chunks_from_thread
from .._option_values import CallOptions, check_call
from .._stats import Health
from ._arguments import RemoteArguments, RemoteWithArguments
from ._connection import Connection, NotSent
from ._deadline import Deadline
from ._launch import RELAUNCH_PAUSE_MAX, Candidate, lock_is_free
from ._threads import blocked_on, refuse_blocking, submitted

__all__ = ["RemoteProxy"]

T = TypeVar("T")

_HAND_OVER = 1.0
"""Seconds `aclose()` waits, past its own timeout, for another loop to close its
connection (and how often it checks that the loop still runs)."""


class RemoteProxy(SyncScope):
    """Calls to the proxy a `ModelHost` serves on `path`, from this process.

    The proxy's call methods, with its call options (`timeout`, `priority`,
    `tenant`, `key`), checked here before anything is sent: `inference`,
    `inference_many`, `stream` (the host's stream, chunk by chunk; a proxy that
    does not stream sends its one result), from plain threads `submit` and
    `inference_sync`, and `with_args(...)` (the host proxy's per-batch arguments).
    The host applies the options, so its batches mix the calls of every connected
    process. A timeout travels as a deadline. The host's errors arrive as the same
    exceptions, with their message and attributes (`QueueFull`, `DeadlineExceeded`,
    `InvalidItem`, the model's own; one that cannot be rebuilt here as a
    `RuntimeError` naming its type and message), a drain's deadline cuts calls off
    with `DrainDeadline`, and a host that cannot be reached or is lost with the
    call in flight raises `HostUnavailable` (never a hang). Cancelling a call (or
    closing its stream early) cancels it in the host.

    A call's `timeout` holds in this process too, whatever the host does: a host
    that does not answer (its loop blocked, the process stopped) keeps the call
    waiting at most 0.05 s (`_deadline.MARGIN`) past its deadline (for the
    connection, to write the call, for its answer or a stream's next chunk). The
    call then ends with `DeadlineExceeded`, and is withdrawn in the host if the
    host ever reads it. (A host that runs answers first: its proxy counts the call
    timed out.)

    In a `Serving` it is one of the service's proxies: `start()` waits up to
    `start_timeout` seconds for the host (with `host="module:factory"`, the first
    worker that finds none starts one, which exits `host_idle_exit` seconds after
    its last worker left), then asks its health every `health_every` seconds
    (`health`, `healthy`, so `/readyz` includes the host); `aclose(timeout=...)`
    lets the calls in flight finish, then closes (later calls raise `ProxyClosed`).
    `async with remote:` is `start()`, then `aclose()`, as for a proxy (and `with
    remote:` from plain code, on the process's `with` loop, where its plain-thread
    calls then go). `name`: the
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
        """`start()` (the host found, or started with `host=`), as `async with proxy:`
        starts a proxy."""
        await self.start()
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
        """The host proxy's `inference_many`: each item batched like a call of its own,
        results in order, the list admitted whole or refused whole (`QueueFull`: the
        model sees none of it). Without `return_exceptions` the first failure raises
        (the other items are withdrawn); with it, a failed item's exception takes its
        place, also for the call's deadline passing here and for `HostUnavailable`
        (no host, or the host lost). A string, bytes or a mapping is refused
        (`TypeError`), as by the proxy. One item that cannot be pickled fails alone
        (in its place) with `return_exceptions`, else the whole call, before
        anything is sent."""
        if isinstance(items, (str, bytes, bytearray, Mapping)):
            raise TypeError(
                f"inference_many takes an iterable of items, got {type(items).__name__}; "
                f"wrap a single item in a list or call inference()"
            )
        options = _options("inference_many()", call)  # checked even for no items
        batch = list(items)
        if not batch:
            return []
        deadline = Deadline.of(self.name, options)
        try:
            return await self._sent(
                deadline, lambda c: c.many(batch, options, return_exceptions, deadline)
            )
        except HostUnavailable as exc:
            if not return_exceptions:
                raise
            path, detail = exc.path, exc.detail
        except DeadlineExceeded:
            if deadline is None or not deadline.passed or not return_exceptions:
                raise  # (the host's own answer: a refusal of the whole list, `shed_late`)
            return [deadline.exceeded() for _ in batch]  # the call's own deadline, here
        return [HostUnavailable(path, detail) for _ in batch]

    async def stream(self, item: Any, **call: Unpack[CallOptions]) -> AsyncGenerator[Any, None]:
        """`item`'s chunks from the host proxy's `stream` as they come (its `timeout`
        bounds the whole stream). Leaving the loop early, closing the iterator or
        being cancelled cancels the call in the host."""
        options = _options("stream()", call)
        deadline = Deadline.of(self.name, options)
        connection = await self._connect(deadline)
        try:
            chunks = connection.stream(item, options, deadline)
            first = await chunks.__anext__()
        except NotSent:  # (nothing sent, so nothing yielded: once more, connected again)
            connection = await self._connect(deadline)
            chunks = connection.stream(item, options, deadline)
            first = await chunks.__anext__()
        except StopAsyncIteration:
            return
        async with contextlib.aclosing(chunks):
            yield first
            async for chunk in chunks:
                yield chunk

    def stream_sync(self, item: Any, **call: Unpack[CallOptions]) -> Generator[Any, None, None]:
        """From a plain thread: `stream`'s chunks, as `Proxy.stream_sync` (each read
        through `submit`'s loop). Refused in a thread that runs an event loop."""
        _options("stream_sync()", call)  # here: a bad option raises in the caller
        refuse_blocking(self, "stream_sync", "stream")
        chunks = functools.partial(self.stream, item, **call)
        return chunks_from_thread(chunks, lambda make: blocked_on(submitted(self, make())))

    def submit(self, item: Any, **call: Unpack[CallOptions]) -> concurrent.futures.Future[Any]:
        """From a plain thread: `inference` on the process-wide `BackgroundLoop` (the
        `with` loop inside `with remote:`); a `concurrent.futures.Future` of its result
        (cancel it to cancel the call)."""
        options = _options("submit()", call)  # here: a bad option raises in the caller
        return submitted(self, self._call(item, options))

    def inference_sync(self, item: Any, **call: Unpack[CallOptions]) -> Any:
        """From a plain thread: block for `inference`'s result (through `submit`'s loop,
        which holds its deadline as `inference` does). An interrupted wait
        (`KeyboardInterrupt`) cancels the call. Refused in a thread that runs an event
        loop, which it would block (`await remote.inference(...)` there)."""
        options = _options("inference_sync()", call)
        refuse_blocking(self, "inference_sync", "inference")
        return blocked_on(submitted(self, self._call(item, options)))

    def inference_many_sync(
        self, items: Iterable[Any], *, return_exceptions: bool = False, **call: Unpack[CallOptions]
    ) -> list[Any]:
        """From a plain thread: block for `inference_many`'s results, as `inference_sync`."""
        refuse_blocking(self, "inference_many_sync", "inference_many")
        many = self.inference_many(items, return_exceptions=return_exceptions, **call)
        return blocked_on(submitted(self, many))  # (its checks raise in this thread)

    def with_args(self, *args: Any, **kwargs: Any) -> RemoteWithArguments:
        """The call methods with these per-batch arguments for the host proxy's
        `_inference`, as `proxy.with_args(...)`: `await
        remote.with_args(normalize=True).inference(text)`. They travel with each call
        (hashable and picklable), and the host's proxy checks them (a `TypeError`
        back if its `_inference` does not take them)."""
        return RemoteWithArguments(self, RemoteArguments.of(args, kwargs))

    async def _call(self, item: Any, options: dict[str, Any]) -> Any:
        """One call with its options checked (`_options`), on this loop's connection,
        by its deadline."""
        deadline = Deadline.of(self.name, options)
        return await self._sent(deadline, lambda c: c.call(item, options, deadline))

    # -- as a service's proxy -----------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def health(self) -> Health:
        """The host's health as last heard (`start()` keeps asking, and each new
        connection asks once), or why not: no host, the connection lost, no answer
        within `connect_timeout`, or this proxy closed."""
        if self._closed:
            return Health(False, f"{self.name} is closed", None)
        return self._health

    @property
    def healthy(self) -> bool:
        """`remote.health.healthy`, as `proxy.healthy`."""
        return self.health.healthy

    async def start(self) -> None:
        """Wait up to `start_timeout` for the host (starting one, with `host=`, if none
        answers), then watch its health from this loop. Raises `HostUnavailable` if no
        host answered in time (each health question waits `connect_timeout` at most:
        a host that does not run holds no start), and `RuntimeError` at once if the
        host it started failed to load (its module cannot be imported, its factory
        raised): a `Serving` then reports a failed load; idempotent."""
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
                self._refuse_failed_load()
                self._start_host()
                if deadline is not None and loop.time() + pause > deadline:
                    raise HostUnavailable(
                        self.path, f"no model host answered within {self.start_timeout} s"
                    ) from exc
            await asyncio.sleep(pause)
            pause = min(2 * pause, self.health_every)
        self._watch = loop.create_task(self._watching(), name=f"batchproxy-{self.name}-watch")

    async def aclose(self, *, timeout: float | None = None) -> None:
        """Stop taking calls (`ProxyClosed`), let those in flight on every loop finish
        (this one's, and those of threads through the `BackgroundLoop`), for up to
        `timeout` seconds, the drain's deadline (then they fail with `DrainDeadline`,
        `running=True`, as a proxy's do, and are withdrawn in the host), and close the
        connections (another running loop's on that loop). A host that does not run
        holds the close no longer than its calls' deadlines, or `timeout`. Idempotent."""
        if timeout is not None:  # (>= 0, as for `Proxy.aclose`: a drain's deadline may be now)
            timeout = _validate.duration("timeout", timeout, allow_zero=True, allow_inf=True)
            timeout = None if timeout == math.inf else timeout
        until = None if timeout is None else time.monotonic() + timeout
        self._closed = True
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.cancel()
            # (ProxyClosed: a question it was asking when this began found it closed)
            with contextlib.suppress(asyncio.CancelledError, ProxyClosed):
                await watch
        connections = list(self._connections.items())
        self._connections.clear()
        self._connecting.clear()  # (a finished one holds its connection)
        why = f"{self.name} was closed"
        seconds = float(timeout or 0.0)
        cut = functools.partial(DrainDeadline, self.name, seconds, running=True)
        await asyncio.gather(
            *(self._shut(loop, connection, why, until, cut) for loop, connection in connections)
        )
        if self._candidate is not None and not self._candidate.running:  # (reaped)
            self._candidate = None  # (one still running serves on, for the other workers)

    async def _shut(
        self,
        loop: asyncio.AbstractEventLoop,
        connection: Connection,
        why: str,
        until: float | None,
        cut: Callable[[], BaseException],
    ) -> None:
        """Let `connection`'s calls finish (until `until`: those still waiting then end
        with `cut()`, the drain's `DrainDeadline`), then close it, on its loop."""
        if loop is asyncio.get_running_loop():
            await connection.shut(why, until, cut)
            return
        if not loop.is_running():
            return  # a loop that no longer runs: its transports go with it
        shut = connection.shut(why, until, cut)
        try:
            shutting = asyncio.run_coroutine_threadsafe(shut, loop)
        except RuntimeError:  # (closed meanwhile)
            shut.close()
            return
        done = asyncio.wrap_future(shutting)
        # bounded: a loop that stops before it runs this never answers
        while not done.done() and loop.is_running():
            left = _HAND_OVER if until is None else until + _HAND_OVER - time.monotonic()
            if left <= 0:
                break
            await asyncio.wait([done], timeout=min(left, _HAND_OVER))
        if done.done() and not done.cancelled():
            done.exception()  # (retrieved: nothing is logged)

    async def _watching(self) -> None:
        """Ask the host's health every `health_every` seconds; a host that cannot be
        reached, or does not answer, is unhealthy (and started again, with `host=`,
        unless one holds the host lock). A host started here that fails to load is
        started again only after a pause that doubles from `health_every` up to
        `RELAUNCH_PAUSE_MAX` (each start loads the model to fail again), the health
        saying why; an answer ends the pauses."""
        loop = asyncio.get_running_loop()
        failure: str | None = None  # why the last host started here failed to load
        pause = self.health_every  # before the next start, once one failed to load
        start_at = 0.0
        while True:
            await asyncio.sleep(self.health_every)
            try:
                self._heard(await self._ask())
                failure, pause, start_at = None, self.health_every, 0.0
            except HostUnavailable as exc:
                failed = self._load_failure()
                if failed is not None:
                    failure, start_at = failed, loop.time() + pause
                    pause = min(2 * pause, RELAUNCH_PAUSE_MAX)
                self._lost(exc.detail if failure is None else f"failed to load: {failure}")
                if loop.time() >= start_at:
                    self._start_host()

    async def _ask(self) -> Health:
        """The host's health, asked now; `HostUnavailable` if it cannot be reached, or
        does not answer within `connect_timeout`."""
        seconds = self.connect_timeout
        deadline = Deadline(self.name, seconds, time.monotonic() + seconds)
        try:
            return await self._sent(deadline, lambda c: c.health(deadline))
        except DeadlineExceeded:
            pass
        raise HostUnavailable(self.path, f"no answer within {seconds} s")

    def _heard(self, health: Health) -> None:
        self._health = health

    def _lost(self, why: str) -> None:
        """The host cannot be reached, or the connection to it was lost: not healthy
        from now (since the first such word) until it answers again."""
        since = self._health.since if not self._health.healthy else None
        self._health = Health(False, f"model host at {self.path}: {why}", since or time.time())

    def _load_failure(self) -> str | None:
        """Why the host candidate this worker started last failed to load, once it has
        exited saying so (forgetting it: the next question starts another), else None."""
        candidate = self._candidate
        if candidate is None or candidate.running or candidate.failure is None:
            return None
        self._candidate = None
        return candidate.failure

    def _refuse_failed_load(self) -> None:
        """Raise `RuntimeError` if the host candidate this worker started last exited
        because its load failed (`_launch`): starting another would fail the same way."""
        failure = self._load_failure()
        if failure is not None:
            raise RuntimeError(
                f"the model host {self.host!r} for {self.path} failed to load: {failure}"
            )

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

    async def _connect(self, deadline: Deadline | None) -> Connection:
        """This loop's connection, opened if need be (within `connect_timeout`, and
        `deadline` for this caller)."""
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
        if deadline is None:
            return await asyncio.shield(connecting)
        return await deadline.bound(asyncio.shield(connecting))

    async def _sent(
        self, deadline: Deadline | None, send: Callable[[Connection], Awaitable[T]]
    ) -> T:
        """`send(connection)` on this loop's connection; once more on a new one if that
        was lost before any of the message could be written (`NotSent`)."""
        try:
            return await send(await self._connect(deadline))
        except NotSent:
            return await send(await self._connect(deadline))

    async def _open(self, loop: asyncio.AbstractEventLoop) -> Connection:
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_unix_connection(self.path), self.connect_timeout
            )
        except (OSError, asyncio.TimeoutError) as exc:
            raise HostUnavailable(self.path, f"cannot connect ({exc!r})") from exc
        if self._closed:  # (closed meanwhile: `aclose()` has shut the connections it knew)
            writer.transport.abort()
            raise ProxyClosed(self.name)
        connection = Connection(self.path, loop, reader, writer, self._lost, self._heard)
        self._connections[loop] = connection
        connection.ask_health()  # (`health` follows a reconnection, watched or not)
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
