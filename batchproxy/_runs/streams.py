"""Streams: end markers, the request that carries chunks, and the static stream run.

A streaming call is a request whose future settles when the stream ends (a
result of None) or fails; its chunks travel through a queue of their own, which
also gets `_CLOSED` when the future settles, for any reason (end, error,
deadline, refusal, cancellation), so a consumer never waits on a stream that is
over. The consumer side is `Proxy.stream`; the producers are `Proxy` with a
generator `_inference` (static batches: `STREAMS`, `run_stream` below) and
`GenerationProxy` (continuous ones); both hand out elements with
`hand_element`.

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
import contextlib
import enum
import inspect
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from .._errors import BatchProxyError, BatchSizeMismatch, ProxyClosed, StreamBufferFull
from .._executors.base import Executor
from .._loops.binding import Binding
from .._scheduling.queue import Request
from .._settle import caller_error
from .batches import RunKind, Runner

__all__ = ["END", "STREAMS", "Last", "StreamEnd", "StreamRequest", "hand_element", "run_stream"]

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


def hand_element(runner: Runner[Any], request: Request[Any], element: object, now: float) -> bool:
    """Hand one step's element to its streaming caller: a chunk, or the end; whether a
    chunk went (a plain one, or `Last`'s)."""
    assert isinstance(request, StreamRequest)
    settlement = runner.settlement
    if not is_closing(element):
        if _unread_too_long(runner, request):
            return False
        request.chunks.put_nowait(element)
        return True
    if isinstance(element, BaseException):
        settlement.fail([request], caller_error(runner.name, element))
        return False
    if isinstance(element, Last):
        request.chunks.put_nowait(element.chunk)
    settlement.end_streams([request], now)
    return isinstance(element, Last)


def _unread_too_long(runner: Runner[Any], request: StreamRequest[Any]) -> bool:
    """Whether a stream's consumer has stopped reading (see the module docstring): if so,
    fail it, which takes it out of its batch at the next step."""
    unread = request.chunks.qsize()
    limit = runner.options.stream_buffer
    if not runner.lifecycle.open and unread >= 2:  # a chunk unread for a step, and a turn
        error: BatchProxyError = ProxyClosed(
            runner.name, detail="it closed while this stream's consumer was not reading it"
        )
    elif limit is not None and unread >= limit:
        error = StreamBufferFull(runner.name, limit)
    else:
        return False
    runner.settlement.fail([request], error)
    return True


async def run_stream(
    runner: Runner[T], binding: Binding[T], requests: list[Request[T]] | None
) -> None:
    """A streaming batch: step the generator, hand each step's elements to the callers
    still there, until it returns or nobody is left. `batch_timeout` bounds each step."""
    claimed = runner.claim(binding, requests)
    if claimed is None:
        return
    requests, task = claimed
    loop = binding.loop
    started = loop.time()
    runner.record_start(requests, started)
    steps = Steps(runner.model([r.item for r in requests]), runner.executor)
    error: BaseException | None = None
    try:
        finished, error = await _step_through(runner, binding, steps, requests, task)
        if not finished:  # everybody left, or the batch failed: the generator is not done
            with contextlib.suppress(Exception):
                await steps.close()
    except asyncio.CancelledError as exc:  # not the watchdog's: the loop is ending
        error = runner.cancelled_batch_error(exc)
        raise
    finally:
        if binding.serving:  # else closed as garbage after its loop ended
            now = loop.time()
            if error is None:
                runner.settlement.end_streams(requests, now)
            elif not binding.abandoned(task):  # (else counted when abandoned)
                runner.batch_failed(requests, error)
            runner.batch_ended(binding, task, len(requests), now - started, error)
        runner.end_task(binding, task)


async def _step_through(
    runner: Runner[T],
    binding: Binding[T],
    steps: Steps,
    requests: list[Request[T]],
    task: asyncio.Task[Any],
) -> tuple[bool, BaseException | None]:
    """The steps of a streaming batch: (whether the generator returned, the error that
    ended the batch, if one did)."""
    loop = binding.loop
    told = unmarked = requests  # the callers in the last keep; those not ended by it
    keep: list[int] | None = None
    while True:
        await let_consumers_read(told)
        watchdog = runner.watch(binding, task, told)
        try:
            elements = await steps.send(keep)
        except BaseException as exc:
            error = runner.model_failure(exc, binding, task)
            if error is None:  # the event loop is ending: so does the batch
                raise
            return True, error
        finally:
            if watchdog is not None:
                watchdog.cancel()
        if elements is _FINISHED:
            return True, None
        try:
            elements = runner.result_sequence(elements)
        except BaseException as exc:
            return False, caller_error(runner.name, exc)
        view = matching_view((told, unmarked, requests), len(elements))
        if view is None:
            return False, BatchSizeMismatch(runner.name, len(told), len(elements))
        now = loop.time()
        marked = set()  # ended by the model itself, this step
        for request, element in zip(view, elements, strict=True):
            if is_closing(element):
                marked.add(request)
            if not request.future.done():
                hand_element(runner, request, element, now)
        unmarked = [r for r in unmarked if r not in marked]
        keep = [i for i, r in enumerate(view) if not r.future.done()]
        told = [view[i] for i in keep]
        if not told:
            return False, None


STREAMS = RunKind(run_stream, streams=True)
"""The run kind of a proxy whose `_inference` is a generator (static batches)."""
