"""A stream read from a plain thread: `stream_sync`'s iterator over an async stream
that lives on another thread's event loop.

The stream is opened on that loop by the first step, and each `next()` runs one step
there and blocks for it (`run`: the call form's own routing, which bounds the wait
and withdraws the step if the thread is interrupted). Closing the iterator (a `for`
left early, then `close()` or the iterator's collection, best inside
`contextlib.closing`) closes the stream there, which withdraws the call, as
`aclose()` on the async stream does.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Callable, Coroutine, Generator
from typing import Any, TypeVar

__all__ = ["chunks_from_thread"]

T = TypeVar("T")

_END = object()
"""What a step answers once the stream has ended."""

Run = Callable[[Callable[[], Coroutine[Any, Any, Any]]], Any]
"""Run a coroutine made by its argument on the stream's loop; block for its result."""


def chunks_from_thread(
    open_stream: Callable[[], AsyncGenerator[T, None]], run: Run
) -> Generator[T, None, None]:
    """Iterate `open_stream()`'s chunks in this thread (see the module); `run` routes
    each step to the stream's loop."""
    streams: list[AsyncGenerator[T, None]] = []  # the stream, once opened there

    async def step() -> Any:
        if not streams:
            streams.append(open_stream())
        try:
            return await anext(streams[0])
        except StopAsyncIteration:
            return _END

    async def close() -> None:
        await streams[0].aclose()

    try:
        while (chunk := run(step)) is not _END:
            yield chunk
    finally:
        if streams:  # (a loop that has ended holds nothing left to withdraw)
            with contextlib.suppress(Exception):
                run(close)
