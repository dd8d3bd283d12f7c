"""Streams: end markers, the request that carries chunks, and stepping a streaming model.

A streaming call is a request whose future settles when the stream ends (a
result of None) or fails; its chunks travel through a queue of their own, which
also gets `_CLOSED` when the future settles, for any reason (end, error,
deadline, refusal, cancellation), so a consumer never waits on a stream that is
over. The consumer side is `Proxy.stream`; the producers are `Proxy` with a
generator `_inference` (static batches) and `GenerationProxy` (continuous ones).

A consumer may stop reading without closing its stream (it `break`s out of its
loop but still holds the iterator, which Python does not close until it is
dropped). So the chunks a stream holds unread are bounded: before each step the
batch lets consumers with unread chunks take them (`let_consumers_read`: one
turn of the event loop, so a model that never awaits cannot starve them), and a
stream that still holds `stream_buffer` unread chunks leaves its batch with
`StreamBufferFull` (two, once the proxy is closing: `aclose()` does not wait for
consumers that do not read).
"""

from __future__ import annotations

import asyncio
import enum
import inspect
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from ._executor import Executor
from ._queue import Request

__all__ = ["END", "Last", "StreamEnd", "StreamRequest"]

T = TypeVar("T")


class StreamEnd(enum.Enum):
    """The type of `END`."""

    END = "END"

    def __repr__(self) -> str:
        return "batchproxy.END"


END = StreamEnd.END
"""Put in a caller's slot of a streaming step: that caller's stream ends, no chunk."""


@dataclass(frozen=True, slots=True)
class Last(Generic[T]):
    """Put in a caller's slot of a streaming step: deliver `chunk`, then end the stream."""

    chunk: T


_CLOSED: Any = object()  # in a chunk queue: the stream's future has settled


class StreamRequest(Request[T]):
    """A request whose result is a stream of chunks."""

    __slots__ = ("chunks",)

    def __init__(
        self,
        item: T,
        future: asyncio.Future[Any],
        priority: int,
        enqueued_at: float,
        cost: int = 1,
        deadline: float = math.inf,
    ) -> None:
        super().__init__(item, future, priority, enqueued_at, cost, deadline)
        self.chunks: asyncio.Queue[Any] = asyncio.Queue()
        future.add_done_callback(self._close)

    def _close(self, _: asyncio.Future[Any]) -> None:
        self.chunks.put_nowait(_CLOSED)


async def let_consumers_read(requests: Iterable[Request[Any]]) -> None:
    """Before a step: if a stream among `requests` holds unread chunks, give the event
    loop one turn, so the consumers waiting for chunks take them first."""
    for request in requests:
        if isinstance(request, StreamRequest) and request.chunks.qsize():
            await asyncio.sleep(0)
            return


def is_closing(element: object) -> bool:
    """Whether a slot's element ends its stream (`END`, `Last`, an exception)."""
    return element is END or isinstance(element, (Last, BaseException))


_FINISHED: Any = object()  # what a step gives once the generator has returned


class Steps:
    """Drives a streaming `_inference`'s generator one step at a time: an async
    generator on the event loop, a plain one on the proxy's executor (its thread)."""

    __slots__ = ("_executor", "_generator", "_on_loop", "_started")

    def __init__(self, generator: Any, executor: Executor) -> None:
        self._generator = generator
        self._on_loop = inspect.isasyncgen(generator)
        self._executor = executor
        self._started = False

    async def send(self, keep: list[int] | None) -> Any:
        """The next step's elements (sending `keep`, the positions that go on), or
        `_FINISHED` when the generator returns."""
        generator = self._generator
        self._started = True
        if self._on_loop:
            try:
                return await generator.asend(keep)
            except StopAsyncIteration:
                return _FINISHED

        def advance(_: object) -> Any:
            try:
                return generator.send(keep)
            except StopIteration:  # a future refuses StopIteration: say it otherwise
                return _FINISHED

        return await self._executor.run(advance, [])

    async def close(self) -> None:
        """Close the generator (its `finally` blocks run), where it runs."""
        generator = self._generator
        if not self._started:
            return
        if self._on_loop:
            await generator.aclose()
        else:
            await self._executor.run(lambda _: generator.close(), [])


def matching_view(views: tuple[list[T], ...], count: int) -> list[T] | None:
    """The first of `views` (lists of callers) with `count` members: how a step's
    elements line up with callers; None if none has that many."""
    for view in views:
        if len(view) == count:
            return view
    return None
