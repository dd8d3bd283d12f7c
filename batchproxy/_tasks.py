"""Batch tasks, and whether one was cancelled from outside.

A batch task runs in a fresh `contextvars` context: a batch serves many callers, so
it sees none of theirs. A `CancelledError` in it means one of two things: the task
was cancelled (its event loop ending, "cancel every other task"; the cancellation
must propagate), or the model raised it on its own (an ordinary batch failure). A
task's count of cancellation requests (`Task.cancelling()`) tells them apart.

Python 3.10's tasks keep no such count, so there a batch task is a `CountingTask`:
asyncio's own task, which counts its `cancel()` requests as 3.11's does (`cancelling`,
`uncancel`). A loop with a task factory of its own makes its tasks as it likes; on
3.10 those cannot tell, and a cancellation from outside counts as the model's error.
"""

from __future__ import annotations

import asyncio
import contextvars
import sys
from collections.abc import Coroutine
from typing import Any

__all__ = ["cancel_requested", "current_batch", "new_task", "uncancel"]

current_batch: contextvars.ContextVar[asyncio.Task[Any] | None] = contextvars.ContextVar(
    "batchproxy_current_batch", default=None
)
"""The batch task a model call belongs to (propagated to the worker thread): how the
proxy recognises a call its own model makes, and whether `batch_key()` is called in one."""


if sys.version_info >= (3, 11):

    def new_task(
        loop: asyncio.AbstractEventLoop, run: Coroutine[Any, Any, None], name: str
    ) -> asyncio.Task[None]:
        """A batch task, in a fresh `contextvars` context (named: a default name costs a
        counter and a format)."""
        return loop.create_task(run, name=name, context=contextvars.Context())

else:

    class CountingTask(asyncio.Task[None]):
        """A task that counts the requests to cancel it (Python 3.10)."""

        _cancel_requests = 0

        def cancel(self, msg: Any | None = None) -> bool:
            if not self.done():
                self._cancel_requests += 1
            return super().cancel(msg)

        def cancelling(self) -> int:
            return self._cancel_requests

        def uncancel(self) -> int:
            if self._cancel_requests > 0:
                self._cancel_requests -= 1
            return self._cancel_requests

    def new_task(
        loop: asyncio.AbstractEventLoop, run: Coroutine[Any, Any, None], name: str
    ) -> asyncio.Task[None]:
        if loop.get_task_factory() is not None:
            return contextvars.Context().run(loop.create_task, run, name=name)
        return contextvars.Context().run(CountingTask, run, loop=loop, name=name)


def uncancel(task: asyncio.Future[Any]) -> None:
    """Withdraw a cancellation the proxy requested itself."""
    withdraw = getattr(task, "uncancel", None)
    if withdraw is not None:
        withdraw()


def cancel_requested() -> bool:
    """Whether the current task was cancelled from outside (a task that keeps no count
    of its cancellation requests cannot tell: False)."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    return bool(cancelling is not None and cancelling())
