"""`ModelHost`: a proxy served over a Unix domain socket to other processes.

Each connection is one client process (a `RemoteProxy` on one event loop), a
`_peer.Peer` here. Each `("call", ...)` message becomes a task awaiting
`proxy.inference(...)`, each `("many", ...)` one awaiting
`proxy.inference_many(...)` (the list admitted whole or refused whole), and each
`("stream", ...)` one reading `proxy.stream(...)`, so the calls of every connected
process queue in the one proxy and share its batches; the answers go back on the
connection they came from (a stream's chunks as they come, then its end or its
error). A call whose `key` is `RemoteArguments` (`remote.with_args(...)`) goes
through `proxy.with_args(...)` instead. A call's deadline is checked as its message
is read (one that passed on the way is answered `DeadlineExceeded` and counted in
`expired`, even if its caller's `("cancel", id)` follows it). A `("cancel", id)`
cancels that task (a queued request leaves the queue, a running one's result is
dropped), and a connection that ends (its process exited or died) cancels all of its
calls: nothing of a departed client is left in the host, nor any shared-memory
segment of an answer it did not read (`_shm`).
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

from .._errors import DrainDeadline, HostUnavailable
from .._stats import Health
from ._peer import CALLS, Peer
from ._wire import MessageReader, answer_message

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
        self._connections: set[Peer] = set()
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

    async def _drain(self, connections: list[Peer], calls: list[asyncio.Task[None]]) -> None:
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
        connection = Peer(self, writer)
        self._connections.add(connection)
        inbox = MessageReader(reader)
        try:
            while True:
                # (each handed on, not kept in this frame while the next are awaited: its
                # buffers may map shared memory, freed only with the last reference)
                messages = await inbox.next()
                messages.reverse()
                while messages:
                    if self._handled(connection, messages[-1]):
                        messages.pop()
                    else:
                        await self._handle(connection, messages.pop())
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client process closed the connection, or died
        finally:
            connection.peer_gone.set()  # it reads no more: its unread segments can go
            self._connections.discard(connection)
            await connection.close()

    def _handled(self, connection: Peer, message: tuple[Any, ...]) -> bool:
        """A call or a cancel from a client, taken at once (while the host serves);
        False for a message that `_handle` takes."""
        if message[0] in CALLS and not self._closing:
            connection.start(*message)
        elif message[0] == "cancel":
            connection.cancel(message[1])
        else:
            return False
        return True

    async def _handle(self, connection: Peer, message: tuple[Any, ...]) -> None:
        """One message from a client."""
        if message[0] in CALLS and self._closing:
            closing = HostUnavailable(self.path, "the host is shutting down")
            await connection.send_error(message[1], closing)
        elif message[0] in CALLS:
            connection.start(*message)
        elif message[0] == "cancel":
            connection.cancel(message[1])
        elif message[0] == "health":  # a web worker's readiness, answered at once
            await connection.send(*answer_message("result", message[1], self.health()))


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
