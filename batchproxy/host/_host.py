"""`ModelHost`: a proxy served over a Unix domain socket to other processes.

Each connection is one client process (a `RemoteProxy` on one event loop). Each
`("call", ...)` message becomes a task awaiting `proxy.inference(...)`, and each
`("stream", ...)` one a task reading `proxy.stream(...)`, so the calls of every
connected process queue in the one proxy and share its batches; the answers go
back on the connection they came from (a stream's chunks as they come, then its
end or its error). A `("cancel", id)` cancels that
task (a queued request leaves the queue, a running one's result is dropped), and a
connection that ends (its process exited or died) cancels all of its calls:
nothing of a departed client is left in the host, nor any shared-memory segment of
an answer it did not read (`_shm`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import stat
import struct
import time
from pathlib import Path
from typing import Any

from .._errors import DeadlineExceeded, HostUnavailable
from .._stats import Health
from . import _shm
from ._wire import open_sealed, pack_error, read_message, sealed_message

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
    (None: no bound), lets each client read the answers already written in shared
    memory (for up to `READ_GRACE` seconds), closes every connection (their callers'
    calls still pending fail with `HostUnavailable`), closes the proxy (its drain by
    the `drain_timeout` deadline: a model that hangs holds no close) and removes the
    socket file.
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
        """Calls whose deadline had passed on their way here: answered `DeadlineExceeded`
        without reaching the proxy (so not in its `stats.timed_out`)."""
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
        if calls:  # the calls in flight finish, up to drain_timeout
            await asyncio.wait(calls, timeout=self.drain_timeout)
        await asyncio.gather(*(connection.close(READ_GRACE) for connection in connections))
        with contextlib.suppress(Exception):
            await server.wait_closed()
        # the proxy's own drain by the same deadline: a hung model holds no close
        await self._close_proxy(None if deadline is None else max(0.0, deadline - loop.time()))
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

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
        if message[0] in ("call", "stream") and self._closing:
            closing = HostUnavailable(self.path, "the host is shutting down")
            await connection.send_error(message[1], closing)
        elif message[0] in ("call", "stream"):
            kind, ident, item, options = message
            connection.start(ident, item, options, stream=kind == "stream")
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
        self.segments = _shm.Ledger()  # of the answers written, until the client reads them
        self.peer_gone = asyncio.Event()
        self._lock = asyncio.Lock()  # one message written at a time
        self._eof = False  # the host closed its side for writing

    def start(self, ident: int, item: Any, options: dict[str, Any], *, stream: bool) -> None:
        task = asyncio.get_running_loop().create_task(self._call(ident, item, options, stream))
        self.calls[ident] = task
        # unlisted when it ends, however: a task cancelled before its first step (its
        # cancel read with its call) never runs its coroutine, nor a `finally` in it
        task.add_done_callback(lambda _: self.calls.pop(ident, None))

    def cancel(self, ident: int) -> None:
        task = self.calls.get(ident)
        if task is not None:
            task.cancel()

    async def _call(
        self, ident: int, sealed: list[Any], options: dict[str, Any], stream: bool
    ) -> None:
        """Answer call `ident`: its result, or each chunk of its stream then its end;
        or its error (the first, for a stream: it ends there)."""
        try:
            try:
                item = open_sealed(sealed)
            except Exception as exc:
                raise TypeError(f"the model host could not read the call's item: {exc!r}") from exc
            call = self._call_options(options)
            if not stream:
                await self._answer(ident, "result", await self.host.proxy.inference(item, **call))
                return
            async with contextlib.aclosing(self.host.proxy.stream(item, **call)) as chunks:
                async for chunk in chunks:
                    await self._answer(ident, "chunk", chunk)
            await self.send(*sealed_message("end", ident, None))
        except asyncio.CancelledError:
            return  # the caller cancelled (or left): nobody waits for an answer
        except Exception as exc:
            await self.send_error(ident, exc)

    def _call_options(self, options: dict[str, Any]) -> dict[str, Any]:
        """The proxy's call options for a call: its deadline back to the time it has
        left (on the machine's monotonic clock), or `DeadlineExceeded` if none."""
        call = dict(options)
        deadline = call.pop("deadline", None)
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                self.host.expired += 1
                name = getattr(self.host.proxy, "name", type(self.host.proxy).__name__)
                raise DeadlineExceeded(str(name), float(call["timeout"]))
            call["timeout"] = left
        return call

    async def _answer(self, ident: int, kind: str, value: Any) -> None:
        """Send a result or chunk; one that cannot travel raises `TypeError` (which
        fails its own call only)."""
        try:
            data, names = sealed_message(kind, ident, value)
        except Exception as exc:
            raise TypeError(f"the model host could not send the call's {kind}: {exc!r}") from exc
        await self.send(data, names)

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
