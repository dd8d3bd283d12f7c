"""`ModelHost`: a proxy served over a Unix domain socket to other processes.

Each connection is one client process (a `RemoteProxy` on one event loop). Each
`("call", ...)` message becomes a task awaiting `proxy.inference(...)`, so the
calls of every connected process queue in the one proxy and share its batches; the
answer goes back on the connection it came from. A `("cancel", id)` cancels that
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
    calls still pending fail with `HostUnavailable`), closes the proxy and removes
    the socket file.
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
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[_Connection] = set()
        self._entered = False
        self._closing = False

    @property
    def connections(self) -> int:
        """Client connections open now."""
        return len(self._connections)

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
        connections = list(self._connections)
        calls = [task for connection in connections for task in connection.calls.values()]
        if calls:  # the calls in flight finish, up to drain_timeout
            await asyncio.wait(calls, timeout=self.drain_timeout)
        await asyncio.gather(*(connection.close(READ_GRACE) for connection in connections))
        with contextlib.suppress(Exception):
            await server.wait_closed()
        await self._close_proxy()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    async def _close_proxy(self) -> None:
        if self._entered:
            self._entered = False
            await self.proxy.__aexit__(None, None, None)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not _same_user(writer):
            self.refused += 1
            writer.transport.abort()
            return
        connection = _Connection(self, writer)
        self._connections.add(connection)
        try:
            while True:
                message = await read_message(reader)
                if message[0] == "call" and self._closing:
                    closing = HostUnavailable(self.path, "the host is shutting down")
                    await connection.send_error(message[1], closing)
                elif message[0] == "call":
                    _, ident, item, options = message
                    connection.start(ident, item, options)
                elif message[0] == "cancel":
                    connection.cancel(message[1])
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client process closed the connection, or died
        finally:
            connection.peer_gone.set()  # it reads no more: its unread segments can go
            self._connections.discard(connection)
            await connection.close()


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

    def start(self, ident: int, item: Any, options: dict[str, Any]) -> None:
        task = asyncio.get_running_loop().create_task(self._call(ident, item, options))
        self.calls[ident] = task

    def cancel(self, ident: int) -> None:
        task = self.calls.get(ident)
        if task is not None:
            task.cancel()

    async def _call(self, ident: int, sealed: list[Any], options: dict[str, Any]) -> None:
        try:
            try:
                item = open_sealed(sealed)
            except Exception as exc:
                raise TypeError(f"the model host could not read the call's item: {exc!r}") from exc
            call = dict(options)
            deadline = call.pop("deadline", None)
            if deadline is not None:  # the time left of the caller's own timeout
                left = deadline - time.monotonic()
                if left <= 0:
                    name = getattr(self.host.proxy, "name", type(self.host.proxy).__name__)
                    raise DeadlineExceeded(str(name), float(call["timeout"]))
                call["timeout"] = left
            value = await self.host.proxy.inference(item, **call)
        except asyncio.CancelledError:
            return  # the caller cancelled (or left): nobody waits for an answer
        except Exception as exc:
            await self.send_error(ident, exc)
        else:
            try:
                data, names = sealed_message("result", ident, value)
            except Exception as exc:  # a result that cannot travel fails its own call only
                error = TypeError(f"the model host could not send the call's result: {exc!r}")
                await self.send_error(ident, error)
            else:
                await self.send(data, names)
        finally:
            self.calls.pop(ident, None)

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
