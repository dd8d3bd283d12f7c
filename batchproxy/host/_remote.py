"""`RemoteProxy`: a proxy's call methods in a process that does not hold the model,
answered by a `ModelHost` over its Unix domain socket.

One connection per event loop, opened on the first call and again on the first call
after it was lost. Each call has an id; the answer with that id settles that call's
future and no other (the host answers each call once). The connection's reader is
the only code that settles those futures from the host's answers; when the
connection ends it fails the calls still waiting with `HostUnavailable`, and a call
whose caller is cancelled leaves with a `("cancel", id)` to the host. The items'
shared-memory segments the host has not read when the connection ends are unlinked
then (`_shm`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import os
import time
from collections.abc import Hashable, Iterable
from typing import Any

from .._errors import HostUnavailable
from . import _shm
from ._wire import message_bytes, open_sealed, read_message, sealed_message, unpack_error

__all__ = ["RemoteProxy"]


class RemoteProxy:
    """Calls to the proxy a `ModelHost` serves on `path`, from this process.

    `inference` and `inference_many` take the proxy's call options (`timeout`,
    `priority`, `tenant`, `key`); the host applies them, so its batches mix the
    calls of every connected process. A timeout travels as a deadline. The host's
    errors arrive as the same exceptions (`QueueFull`, `DeadlineExceeded`,
    `InvalidItem`, the model's own), and a host that cannot be reached or is lost
    with the call in flight raises `HostUnavailable` (never a hang). Cancelling a
    call cancels it in the host. `connect_timeout`: seconds to wait for the socket.
    """

    def __init__(self, path: str | os.PathLike[str], *, connect_timeout: float = 5.0) -> None:
        self.path = os.fspath(path)
        self.connect_timeout = connect_timeout
        self._connection: _Connection | None = None
        self._connecting: asyncio.Task[_Connection] | None = None

    def __repr__(self) -> str:
        return f"RemoteProxy({self.path!r})"

    async def __aenter__(self) -> RemoteProxy:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def inference(
        self,
        item: Any,
        *,
        timeout: float | None = None,
        priority: int = 0,
        tenant: Hashable | None = None,
        key: Hashable | None = None,
    ) -> Any:
        """`item`'s result from the host's proxy (see the class)."""
        options: dict[str, Any] = {"priority": priority}
        if tenant is not None:
            options["tenant"] = tenant
        if key is not None:
            options["key"] = key
        if timeout is not None:
            if isinstance(timeout, bool) or not timeout > 0 or not math.isfinite(timeout):
                raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
            options["timeout"] = float(timeout)
            options["deadline"] = time.monotonic() + timeout
        connection = await self._connect()
        return await connection.call(item, options)

    async def inference_many(
        self, items: Iterable[Any], *, return_exceptions: bool = False, **call: Any
    ) -> list[Any]:
        """Each item as its own call, all at once; results in order. With
        `return_exceptions`, a failed item's exception takes its place instead of
        the first failure raising (the other calls are then cancelled)."""
        calls = [asyncio.ensure_future(self.inference(item, **call)) for item in items]
        try:
            return list(await asyncio.gather(*calls, return_exceptions=return_exceptions))
        finally:
            for task in calls:
                task.cancel()

    async def aclose(self) -> None:
        """Close this process's connection (calls still waiting fail with
        `HostUnavailable`); the next call opens a new one."""
        connection, self._connection = self._connection, None
        if connection is not None:
            await connection.close("the RemoteProxy was closed")

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        connection = self._connection
        if connection is not None and connection.loop is loop and connection.open:
            return connection
        connecting = self._connecting
        if connecting is None or connecting.get_loop() is not loop or connecting.done():
            connecting = self._connecting = loop.create_task(self._open(loop))
        return await asyncio.shield(connecting)

    async def _open(self, loop: asyncio.AbstractEventLoop) -> _Connection:
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_unix_connection(self.path), self.connect_timeout
            )
        except (OSError, asyncio.TimeoutError) as exc:
            raise HostUnavailable(self.path, f"cannot connect ({exc!r})") from exc
        old = self._connection
        self._connection = connection = _Connection(self.path, loop, reader, writer)
        if old is not None and old.loop is not loop:
            old.abandon()  # its loop is gone or another: nothing to await there
        return connection


class _Connection:
    """The socket to the host on one event loop: the calls waiting by id, and the reader
    task that settles them."""

    def __init__(
        self,
        path: str,
        loop: asyncio.AbstractEventLoop,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        self.path = path
        self.loop = loop
        self.writer = writer
        self.open = True
        self.waiting: dict[int, asyncio.Future[tuple[str, list[Any]]]] = {}
        self.segments = _shm.Ledger()  # of the items written, until the host reads them
        self._ids = itertools.count()
        self._lock = asyncio.Lock()
        self._reader = loop.create_task(self._read(reader))

    async def call(self, item: Any, options: dict[str, Any]) -> Any:
        ident = next(self._ids)
        try:
            data, names = sealed_message("call", ident, item, options)
        except Exception as exc:  # an item that cannot travel fails here, alone
            raise TypeError(
                f"the call cannot be sent to the model host at {self.path}: {exc!r}"
            ) from exc
        future: asyncio.Future[tuple[str, list[Any]]] = self.loop.create_future()
        self.waiting[ident] = future
        try:
            try:
                async with self._lock:
                    if not self.open:
                        raise HostUnavailable(self.path, "the connection to the host was lost")
                    self.writer.write(data)
                    self.segments.add(names)  # the host unlinks them as it reads the call
                    names = []
                    await self.writer.drain()
            except HostUnavailable:
                raise
            except ConnectionError as exc:
                raise HostUnavailable(self.path, f"the connection broke ({exc!r})") from exc
            kind, sealed = await future  # settled by _read only
        except asyncio.CancelledError:
            if self.waiting.pop(ident, None) is not None and self.open:
                with contextlib.suppress(Exception):  # the host drops the call
                    self.writer.write(message_bytes(("cancel", ident)))
            raise
        finally:
            self.waiting.pop(ident, None)
            _shm.unlink(names)  # never written (cancelled, or lost): nobody else knows them
        try:
            answer = open_sealed(sealed)
        except _shm.SegmentLost as exc:  # the host closed before this call read it
            raise HostUnavailable(self.path, f"the answer was lost ({exc})") from exc
        except Exception as exc:  # fails this call alone
            raise TypeError(f"the model host's answer cannot be read here: {exc!r}") from exc
        if kind == "error":
            raise unpack_error(answer)
        return answer

    async def _read(self, reader: asyncio.StreamReader) -> None:
        why = "the host closed the connection"
        try:
            while True:
                kind, ident, sealed = await read_message(reader)
                future = self.waiting.pop(ident, None)
                if future is None or future.done():
                    continue  # a call cancelled meanwhile
                future.set_result((kind, sealed))  # opened by the call itself
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            if not isinstance(exc, asyncio.IncompleteReadError):
                why = f"the connection to the host broke ({exc!r})"
        except asyncio.CancelledError:
            why = "the RemoteProxy was closed"
            raise
        finally:
            self._fail_waiting(why)

    def _fail_waiting(self, why: str) -> None:
        self.open = False
        waiting, self.waiting = self.waiting, {}
        for future in waiting.values():
            if not future.done():
                future.set_exception(HostUnavailable(self.path, why))
        self.writer.close()
        self.segments.unlink_all()  # the items the host did not read: nobody will now

    async def close(self, why: str) -> None:
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader
        self._fail_waiting(why)
        with contextlib.suppress(Exception):
            await self.writer.wait_closed()

    def abandon(self) -> None:
        """Let go of a connection whose loop is not running here (closed, or another
        thread's): mark it closed without touching that loop."""
        self.open = False
