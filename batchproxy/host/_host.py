"""`ModelHost`: a proxy served over a Unix domain socket to other processes.

Each connection is one client process (a `RemoteProxy` on one event loop). Each
`("call", ...)` message becomes a task awaiting `proxy.inference(...)`, each
`("many", ...)` one awaiting `proxy.inference_many(...)` (the list admitted whole or
refused whole), and each `("stream", ...)` one reading `proxy.stream(...)`, so the
calls of every connected process queue in the one proxy and share its batches; the
answers go back on the connection they came from (a stream's chunks as they come,
then its end or its error). A call whose `key` is `RemoteArguments`
(`remote.with_args(...)`) goes through `proxy.with_args(...)` instead. A call's
deadline is checked as its message is read (one that passed on the way is answered
`DeadlineExceeded` and counted in `expired`, even if its caller's `("cancel", id)`
follows it). A `("cancel", id)` cancels that task (a queued request leaves the
queue, a running one's result is dropped), and a connection that ends (its process
exited or died) cancels all of its calls: nothing of a departed client is left in
the host, nor any shared-memory segment of an answer it did not read (`_shm`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import stat
import struct
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from .._errors import DeadlineExceeded, DrainDeadline, HostUnavailable
from .._stats import Health
from . import _shm
from ._arguments import RemoteArguments
from ._deadline import MARGIN
from ._wire import (
    message_bytes,
    open_sealed,
    pack_error,
    read_message,
    seal,
    sealed_message,
    segment_names,
)

__all__ = ["ModelHost"]

_PEER = struct.Struct("3i")  # struct ucred: pid, uid, gid
READ_GRACE = 5.0
"""Seconds a closing host waits for a client to read the answers it has written in
shared memory before it unlinks them."""


class ModelHost:
    """Serve `proxy` (anything with the proxy's `async inference(item, **call)`: a
    `Proxy`, a `TensorProxy`, a `@batch` function, on any executor) on the Unix
    domain socket `path`, to `RemoteProxy` callers in other processes of this user.

    `async with host:` enters the proxy (if it is an async context manager), creates
    the socket (owner-only, mode 0600, in a directory you choose; a stale socket file
    is replaced, a live one refused with `FileExistsError`), and on exit stops
    listening, lets the calls in flight finish for up to `drain_timeout` seconds
    (None: no bound) by closing the proxy with that deadline (its
    `aclose(timeout=...)`: a model that hangs holds no close, and each call the
    deadline cuts off is answered `DrainDeadline`), lets each client read the
    answers already written in shared memory (for up to `READ_GRACE` seconds),
    closes every connection and removes the socket file.
    Peers of another user are refused (`SO_PEERCRED`) and counted in `refused`.
    """

    def __init__(self, proxy: Any, path: str | os.PathLike[str], *,
                 drain_timeout: float | None = 30.0) -> None:  # fmt: skip
        if not callable(getattr(proxy, "inference", None)):
            raise TypeError(f"ModelHost needs a proxy with inference(), got {proxy!r}")
        self.proxy = proxy
        self.path = os.fspath(path)
        self.drain_timeout = drain_timeout
        self.refused = 0
        """Connections refused because their process belongs to another user."""
        self.expired = 0
        """Calls whose deadline had passed on their way here (each item of a list):
        answered `DeadlineExceeded` without reaching the proxy (so not in its
        `stats.timed_out`)."""
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[_Connection] = set()
        self._entered = False
        self._closing = False

    @property
    def connections(self) -> int:
        """Client connections open now."""
        return len(self._connections)

    def health(self) -> Health:
        """What the host tells a `RemoteProxy` that asks: its proxy's `health`, or not
        healthy while the host or its proxy closes."""
        if self._closing or getattr(self.proxy, "closed", False):
            return Health(False, f"the model host at {self.path} is closing", time.time())
        health = getattr(self.proxy, "health", None)
        return health if isinstance(health, Health) else Health(True, None, None)

    async def __aenter__(self) -> ModelHost:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def start(self) -> None:
        if self._server is not None or self._closing:
            raise RuntimeError(f"ModelHost at {self.path} is already serving")
        _clear_stale_socket(self.path)
        enter = getattr(self.proxy, "__aenter__", None)
        if enter is not None:
            await enter()
            self._entered = True
        old_mask = os.umask(0o177)  # the socket file is born owner-only
        try:
            self._server = await asyncio.start_unix_server(self._serve, path=self.path)
        except BaseException:
            await self._close_proxy()
            raise
        finally:
            os.umask(old_mask)
        os.chmod(self.path, 0o600)

    async def serve_forever(self) -> None:
        """Until cancelled (then the `async with` closes it)."""
        assert self._server is not None, "start() the host first"
        await self._server.serve_forever()

    async def aclose(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        self._closing = True  # calls that arrive from now on are refused
        server.close()  # no new connections
        loop = asyncio.get_running_loop()
        deadline = None if self.drain_timeout is None else loop.time() + self.drain_timeout
        connections = list(self._connections)
        calls = [task for connection in connections for task in connection.calls.values()]
        if calls:
            await self._drain(connections, calls)
        await asyncio.gather(*(connection.close(READ_GRACE) for connection in connections))
        with contextlib.suppress(Exception):
            await server.wait_closed()
        # the proxy's own drain by the same deadline: a hung model holds no close
        await self._close_proxy(None if deadline is None else max(0.0, deadline - loop.time()))
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    async def _drain(self, connections: list[_Connection], calls: list[asyncio.Task[None]]) -> None:
        """Let the calls in flight finish, up to `drain_timeout`; each that the deadline
        cuts off is answered `DrainDeadline`, as the proxy's own drain answers it.

        A proxy the host entered and closes (a `Proxy`, a `@batch` function) drains
        itself, with the same deadline: it answers each call it cuts off (`running`:
        whether its batch had begun), and the host sends those answers. Another is
        waited for up to the deadline; the calls still running then are cancelled and
        answered `DrainDeadline` (`running=True`: the host cannot tell)."""
        if self._entered and callable(getattr(self.proxy, "aclose", None)):
            await asyncio.sleep(0)  # the calls just read reach the proxy's queue first
            await self._close_proxy(self.drain_timeout)
            await asyncio.wait(calls, timeout=READ_GRACE)  # (their answers are being sent)
            return
        _, late = await asyncio.wait(calls, timeout=self.drain_timeout)
        if late:
            timeout = float(self.drain_timeout or 0.0)
            name = self.proxy_name
            await asyncio.gather(
                *(
                    connection.cut(late, lambda: DrainDeadline(name, timeout, running=True))
                    for connection in connections
                )
            )

    @property
    def proxy_name(self) -> str:
        """The served proxy's name (its class's, if it has none), for the errors the
        host answers in its stead."""
        return str(getattr(self.proxy, "name", type(self.proxy).__name__))

    async def _close_proxy(self, timeout: float | None = None) -> None:
        """Close the proxy entered at start: `aclose(timeout=...)` where it has one (a
        `Proxy`, a `@batch` function), else its `__aexit__`."""
        if not self._entered:
            return
        self._entered = False
        aclose = getattr(self.proxy, "aclose", None)
        if aclose is None:
            await self.proxy.__aexit__(None, None, None)
        elif timeout is None:
            await aclose()
        else:
            await aclose(timeout=timeout)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not _same_user(writer):
            self.refused += 1
            writer.transport.abort()
            return
        connection = _Connection(self, writer)
        self._connections.add(connection)
        try:
            while True:
                # (handed on, not kept in this frame while the next one is awaited: its
                # buffers may map shared memory, freed only with the last reference)
                await self._handle(connection, await read_message(reader))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client process closed the connection, or died
        finally:
            connection.peer_gone.set()  # it reads no more: its unread segments can go
            self._connections.discard(connection)
            await connection.close()

    async def _handle(self, connection: _Connection, message: tuple[Any, ...]) -> None:
        """One message from a client."""
        if message[0] in _CALLS and self._closing:
            closing = HostUnavailable(self.path, "the host is shutting down")
            await connection.send_error(message[1], closing)
        elif message[0] in _CALLS:
            connection.start(*message)
        elif message[0] == "cancel":
            connection.cancel(message[1])
        elif message[0] == "health":  # a web worker's readiness, answered at once
            await connection.send(*sealed_message("result", message[1], self.health()))


class _Connection:
    """One client process: its calls in flight by id, and the one writer they answer on."""

    def __init__(self, host: ModelHost, writer: asyncio.StreamWriter) -> None:
        self.host = host
        self.writer = writer
        self.calls: dict[int, asyncio.Task[None]] = {}
        self.deadlines: dict[int, float] = {}  # of the calls in `calls` that have one
        self.segments = _shm.Ledger()  # of the answers written, until the client reads them
        self.peer_gone = asyncio.Event()
        self._lock = asyncio.Lock()  # one message written at a time
        self._eof = False  # the host closed its side for writing

    def start(
        self, kind: str, ident: int, sealed: Any, options: dict[str, Any], *extra: Any
    ) -> None:
        """Start answering a call just read (its deadline checked now, as it arrives:
        a `cancel` read next finds it counted)."""
        items = len(sealed) if kind == "many" else 1
        call = self._call_options(options, items)
        task = asyncio.get_running_loop().create_task(
            self._call(kind, ident, sealed, options, call, *extra)
        )
        self.calls[ident] = task
        if "deadline" in options:
            self.deadlines[ident] = options["deadline"]
        # unlisted when it ends, however: a task cancelled before its first step (its
        # cancel read with its call) never runs its coroutine, nor a `finally` in it
        task.add_done_callback(lambda _: self._forget(ident))

    def cancel(self, ident: int) -> None:
        """The caller left: cancel its call. One whose deadline has passed (its caller
        stopped waiting for a host that did not answer in time) is left to end as
        timed out by the proxy's own timer, which is due (a cancel now would count it
        cancelled): it is cancelled only if it still runs `MARGIN` seconds later."""
        task = self.calls.get(ident)
        if task is None:
            return
        deadline = self.deadlines.get(ident)
        if deadline is not None and time.monotonic() >= deadline:
            asyncio.get_running_loop().call_later(MARGIN, task.cancel)
            return
        task.cancel()

    def _forget(self, ident: int) -> None:
        self.calls.pop(ident, None)
        self.deadlines.pop(ident, None)

    async def _call(
        self,
        kind: str,
        ident: int,
        sealed: Any,
        options: dict[str, Any],
        call: dict[str, Any] | None,
        return_exceptions: bool = False,
    ) -> None:
        """Answer call `ident` (`call`: its options for the proxy, None if its deadline
        passed on the way): its result, the results of a list, or each chunk of its
        stream then its end; or its error (the first, for a stream: it ends there)."""
        try:
            if kind == "many":
                await self._many(ident, sealed, options, call, return_exceptions)
                return
            if call is None:
                raise self._late(options)
            item = _item(sealed)
            proxy = _target(self.host.proxy, call)
            if kind == "call":
                await self._answer(ident, "result", await proxy.inference(item, **call))
                return
            async with contextlib.aclosing(proxy.stream(item, **call)) as chunks:
                async for chunk in chunks:
                    await self._answer(ident, "chunk", chunk)
            await self.send(*sealed_message("end", ident, None))
        except asyncio.CancelledError:
            return  # the caller cancelled (or left): nobody waits for an answer
        except Exception as exc:
            await self.send_error(ident, exc)

    async def _many(
        self,
        ident: int,
        sealed: list[list[Any]],
        options: dict[str, Any],
        call: dict[str, Any] | None,
        return_exceptions: bool,
    ) -> None:
        """Answer a list: its items through the proxy's `inference_many` (admitted
        whole or refused whole), each result or error in its place. An item that
        cannot be read here fails alone with `return_exceptions`, else the whole
        list, before any of it reaches the proxy."""
        if call is None and not return_exceptions:
            raise self._late(options)
        unreadable: dict[int, TypeError] = {}
        readable: list[Any] = []
        for index, parts in enumerate(sealed):
            item, error = _item_or_error(parts)
            if error is not None and not return_exceptions:
                del unreadable, readable  # (this frame is in its traceback: keep no list of it)
                try:
                    raise error
                finally:
                    del error
            if error is None:
                readable.append(item)
            else:
                unreadable[index] = error
        if call is None:  # with return_exceptions: each item's own DeadlineExceeded
            results = [self._late(options) for _ in readable]
        elif readable:
            results = await self._inference_many(readable, call, return_exceptions)
        else:
            results = []
        answers = iter(results)
        outcomes = [
            unreadable.pop(i) if i in unreadable else next(answers) for i in range(len(sealed))
        ]
        await self._answer_many(ident, outcomes)

    async def _inference_many(
        self, items: list[Any], call: dict[str, Any], return_exceptions: bool
    ) -> list[Any]:
        """The proxy's `inference_many` (one with `inference` alone: a call per item)."""
        proxy = _target(self.host.proxy, call)
        many = getattr(proxy, "inference_many", None)
        if many is not None:
            return list(await many(items, return_exceptions=return_exceptions, **call))
        calls = [proxy.inference(item, **call) for item in items]
        return list(await asyncio.gather(*calls, return_exceptions=return_exceptions))

    def _call_options(self, options: dict[str, Any], items: int = 1) -> dict[str, Any] | None:
        """The proxy's call options for a call: its deadline back to the time it has
        left (on the machine's monotonic clock), or None if it has passed (counted in
        `expired`, once for each of its items)."""
        call = dict(options)
        deadline = call.pop("deadline", None)
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                self.host.expired += items
                return None
            call["timeout"] = left
        return call

    def _late(self, options: dict[str, Any]) -> DeadlineExceeded:
        """The error of a call whose deadline passed on its way here."""
        return DeadlineExceeded(self.host.proxy_name, float(options["timeout"]))

    async def _answer_many(self, ident: int, outcomes: list[Any]) -> None:
        """Send a list's answer: each item's result, or its error (an exception in its
        place, or a result that cannot travel: `TypeError`), sealed on its own."""
        entries: list[tuple[str, list[Any]]] = []
        names: list[str] = []
        try:
            for outcome in outcomes:
                kind, parts = _sealed_outcome(outcome)
                names += segment_names(parts)
                entries.append((kind, parts))
            data = message_bytes(("results", ident, entries))
        except BaseException:
            _shm.unlink(names)
            raise
        await self.send(data, names)

    async def _answer(self, ident: int, kind: str, value: Any) -> None:
        """Send a result or chunk; one that cannot travel raises `TypeError` (which
        fails its own call only)."""
        try:
            data, names = sealed_message(kind, ident, value)
        except Exception as exc:
            raise TypeError(f"the model host could not send the call's {kind}: {exc!r}") from exc
        await self.send(data, names)

    async def cut(
        self, tasks: Collection[asyncio.Task[None]], error: Callable[[], BaseException]
    ) -> None:
        """Cancel this connection's calls among `tasks`, and answer each `error()`."""
        cut = {ident: task for ident, task in self.calls.items() if task in tasks}
        for task in cut.values():
            task.cancel()
        await asyncio.gather(*cut.values(), return_exceptions=True)
        for ident in cut:
            await self.send_error(ident, error())

    async def send_error(self, ident: int, error: BaseException) -> None:
        await self.send(*sealed_message("error", ident, pack_error(error)))  # (it pickles)

    async def send(self, data: bytes, names: list[str]) -> None:
        """Write one message; `names`, its segments, are the ledger's once written."""
        try:
            async with self._lock:
                if self.writer.is_closing() or self._eof:
                    return
                self.writer.write(data)
                self.segments.add(names)  # the client unlinks them as it reads them
                names = []
                with contextlib.suppress(ConnectionError):
                    await self.writer.drain()
        finally:
            _shm.unlink(names)  # never written (cancelled, or closed): nobody else knows them

    async def close(self, grace: float = 0.0) -> None:
        """Cancel the calls, close, and unlink the answers' segments the client has not
        read. With `grace` (the host closing, the client maybe still there), first
        close the writing side only and give the client up to `grace` seconds to read
        what was written: it reads to the end of the stream, then closes its side."""
        calls = list(self.calls.values())
        for task in calls:
            task.cancel()
        try:
            if calls:
                await asyncio.gather(*calls, return_exceptions=True)
            if grace > 0 and not self.writer.is_closing() and self.segments.sweep():
                self._eof = True  # (first: no message may follow the end of the stream)
                with contextlib.suppress(Exception):  # (a transport with no half-close)
                    self.writer.write_eof()
                    await asyncio.wait_for(self.peer_gone.wait(), grace)
        finally:  # even if cancelled: nothing of this connection outlives it
            self.writer.close()
            self.segments.unlink_all()
        with contextlib.suppress(Exception):
            await self.writer.wait_closed()


_CALLS = ("call", "many", "stream")
"""The messages that start a call."""


def _item(sealed: list[Any]) -> Any:
    """A call's item, opened; `TypeError` if it cannot be read here."""
    try:
        return open_sealed(sealed)
    except Exception as exc:
        raise _unreadable(exc) from exc


def _item_or_error(sealed: list[Any]) -> tuple[Any, TypeError | None]:
    """`(item, None)`, or `(None, the TypeError of _item)`, returned and never raised (a
    traceback would keep this frame's callers, which hold the list it goes in)."""
    try:
        return open_sealed(sealed), None
    except Exception as exc:
        return None, _unreadable(exc)


def _unreadable(exc: Exception) -> TypeError:
    return TypeError(f"the model host could not read the call's item: {exc!r}")


def _sealed_outcome(outcome: Any) -> tuple[str, list[Any]]:
    """One item's answer in a list's, sealed: `("result", value)`, or `("error",
    packed)` for an exception or a result that cannot travel."""
    if not isinstance(outcome, BaseException):
        try:
            return "result", seal(outcome)
        except Exception as exc:
            error = TypeError(f"the model host could not send the call's result: {exc!r}")
            return "error", seal(pack_error(error))
    return "error", seal(pack_error(outcome))


def _target(proxy: Any, call: dict[str, Any]) -> Any:
    """What answers a call: `proxy`, or for a call whose `key` is `RemoteArguments`
    (`remote.with_args(...)`, taken out of `call`) `proxy.with_args(...)`."""
    arguments = call.get("key")
    if isinstance(arguments, RemoteArguments):
        del call["key"]
        return arguments.call(proxy)
    return proxy


def _same_user(writer: asyncio.StreamWriter) -> bool:
    """Whether the peer process runs as this process's user (Linux's SO_PEERCRED;
    where the option does not exist, the socket file's mode alone keeps others out)."""
    sock: socket.socket | None = writer.get_extra_info("socket")
    option = getattr(socket, "SO_PEERCRED", None)
    if sock is None or option is None:
        return True
    _pid, uid, _gid = _PEER.unpack(sock.getsockopt(socket.SOL_SOCKET, option, _PEER.size))
    return bool(uid == os.getuid())


def _clear_stale_socket(path: str) -> None:
    """Remove a socket file no host listens on; refuse one a host does."""
    target = Path(path)
    if not target.exists():
        return
    if not stat.S_ISSOCK(target.stat().st_mode):
        raise FileExistsError(f"{path} exists and is not a socket: not replaced")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:  # nobody listening: a host that died left it
        target.unlink()
    else:
        raise FileExistsError(f"a model host is already listening on {path}")
    finally:
        probe.close()
