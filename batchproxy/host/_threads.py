"""A `RemoteProxy`'s calls from plain threads (`submit`, `inference_sync`,
`inference_many_sync`): each runs on the `with` loop inside `with remote:`, else on
the process-wide `BackgroundLoop`; a closed remote refuses it without starting a
loop, and a blocked thread that is interrupted withdraws its call."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Coroutine
from typing import Any, Protocol, TypeVar

from .._errors import ProxyClosed
from .._loops.background_loop import BackgroundLoop

__all__ = ["blocked_on", "refuse_blocking", "submitted"]

T = TypeVar("T")


class _Remote(Protocol):
    name: str
    _with_loop: BackgroundLoop | None

    @property
    def closed(self) -> bool: ...


def submitted(remote: _Remote, call: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
    """`call` run for a plain thread (see the module): its future."""
    if remote.closed:
        call.close()
        refused: concurrent.futures.Future[T] = concurrent.futures.Future()
        refused.set_exception(ProxyClosed(remote.name))
        return refused
    return (remote._with_loop or BackgroundLoop.default()).submit(call)


def blocked_on(future: concurrent.futures.Future[T]) -> T:
    """Block for `future` (a call bounded by its deadline); cancel it if interrupted."""
    try:
        concurrent.futures.wait([future])
    except BaseException:  # interrupted: the call is withdrawn, not left queued
        future.cancel()
        raise
    return future.result()


def refuse_blocking(remote: object, method: str, instead: str) -> None:
    """Raise in a thread that runs an event loop, which blocking would block."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return  # no loop in this thread: the usual case
    raise RuntimeError(
        f"{remote!r}.{method}() was called in a thread running an event loop, "
        f"which it would block: await remote.{instead}(...) there"
    )
