"""One client process as the `ModelHost` sees it (`Peer`): its calls in flight by id,
each a task answering on the one writer (a result, a list's results, a stream's
chunks then its end, or an error), and the shared-memory segments of the answers it
has not read yet.

A call's deadline is checked as its message is read: one that passed on the way is
answered `DeadlineExceeded` without reaching the proxy, and counted in the host's
`expired`. A call is unlisted when its task ends, however it ends (a task cancelled
before its first step never runs its coroutine).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Collection
from typing import Any, Protocol

from .._errors import DeadlineExceeded
from . import _shm
from ._arguments import RemoteArguments
from ._deadline import MARGIN
from ._wire import (
    Outbox,
    answer_message,
    open_sealed,
    owned,
    pack_error,
    seal,
    segment_names,
)

__all__ = ["CALLS", "Host", "Peer"]


class Host(Protocol):
    """What a `Peer` uses of its `ModelHost`."""

    proxy: Any
    expired: int  # (counted by the peer that read the call)

    @property
    def proxy_name(self) -> str: ...


class Peer:
    """One client process: its calls in flight by id, and the one writer they answer on."""

    def __init__(self, host: Host, writer: asyncio.StreamWriter) -> None:
        self.host = host
        self.writer = writer
        self.outbox = Outbox(asyncio.get_running_loop(), writer)  # (one write per iteration)
        self._room = writer.transport.get_write_buffer_limits()[1]  # (then, writes pause)
        self.calls: dict[int, asyncio.Task[None]] = {}
        self.deadlines: dict[int, float] = {}  # of the calls in `calls` that have one
        self.segments = _shm.Ledger()  # of the answers written, until the client reads them
        self.peer_gone = asyncio.Event()
        self._lock = asyncio.Lock()  # one drain at a time (Python 3.10's streams allow no more)
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
            await self.send(*answer_message("end", ident, None))
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
        except BaseException:
            _shm.unlink(names)
            raise
        await self.send(("results", ident, entries), names)

    async def _answer(self, ident: int, kind: str, value: Any) -> None:
        """Send a result or chunk; one that cannot travel raises `TypeError` (which
        fails its own call only)."""
        try:
            message, names = answer_message(kind, ident, value)
        except Exception as exc:
            raise TypeError(f"the model host could not send the call's {kind}: {exc!r}") from exc
        await self.send(message, names)

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
        await self.send(*answer_message("error", ident, pack_error(error)))  # (it pickles)

    async def send(self, message: tuple[Any, ...], names: list[str]) -> None:
        """Write one message (its values sealed: `answer_message`) with the others sent in this
        iteration of the loop (the outbox), waiting for room if the client reads slower
        than this host writes; `names`, its segments, are the ledger's once queued."""
        try:
            if self.writer.is_closing() or self._eof:
                return
            self.outbox.put(message)
            self.segments.add(names)  # the client unlinks them as it reads them
            names = []
            if self.outbox.size() > self._room:
                self.outbox.flush()
                async with self._lock:
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
            self.outbox.flush()  # (the answers already sent, the drain's cut-offs among them)
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


CALLS = ("call", "many", "stream")
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
            return "result", owned(seal(outcome))
        except Exception as exc:
            error = TypeError(f"the model host could not send the call's result: {exc!r}")
            return "error", owned(seal(pack_error(error)))
    return "error", owned(seal(pack_error(outcome)))


def _target(proxy: Any, call: dict[str, Any]) -> Any:
    """What answers a call: `proxy`, or for a call whose `key` is `RemoteArguments`
    (`remote.with_args(...)`, taken out of `call`) `proxy.with_args(...)`."""
    arguments = call.get("key")
    if isinstance(arguments, RemoteArguments):
        del call["key"]
        return arguments.call(proxy)
    return proxy
