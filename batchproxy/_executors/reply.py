"""`Reply`: a batch's answer from another thread, which wakes the task awaiting it at once.

An `asyncio.Future` set in a loop callback wakes its task one loop iteration later:
`set_result` only schedules the task's next step. A worker thread's answer already
arrives in a callback of its own (`call_soon_threadsafe`), so awaiting an
`asyncio.Future` there costs a batch an iteration that `run_in_executor` does not
pay: the batch task wakes one iteration after the answer, and its callers one after
that. A `Reply` runs the task's step inside that callback, so the callers wake in
the iteration after the answer, as a `run_in_executor` caller does: one iteration
(about 10 µs, more in a server's cold caches) off every batch's way back.

It has what a task needs of a future it awaits (asyncio's future protocol:
`_asyncio_future_blocking`, `get_loop`, `add_done_callback`, `result`, `cancel`),
and no more. Who may do what:

- the awaiting task's event loop: everything (`set_result` in a bare callback, never
  from inside a task: asyncio allows one task step at a time, so there it falls back
  to waking the task next iteration, as a Future would);
- another thread: `cancelled()` only (a read: whether the batch was abandoned).

A task cancelled while it awaits cancels the `Reply` (asyncio does that), whose
callbacks then run next iteration, as a Future's do; a result set after that is
dropped (`set_result` is not called once `done()`: see `worker_thread._resolve`).
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable, Generator
from typing import Any

__all__ = ["Reply"]

_Callback = tuple[Callable[["Reply"], object], contextvars.Context | None]

_PENDING, _ANSWERED, _CANCELLED = 0, 1, 2


class Reply:
    """One outcome from another thread (a batch's, or `aclose`'s notice that the thread
    ended), set once on its loop; awaited by one task."""

    __slots__ = ("_asyncio_future_blocking", "_callbacks", "_loop", "_message", "_result", "_state")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._state = _PENDING
        self._result: Any = None
        self._message: Any = None  # a cancellation's message
        self._callbacks: list[_Callback] = []
        self._asyncio_future_blocking = False  # (asyncio's protocol: set while awaited)

    def get_loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def done(self) -> bool:
        return self._state != _PENDING

    def cancelled(self) -> bool:
        return self._state == _CANCELLED

    def result(self) -> Any:
        if self._state == _ANSWERED:
            return self._result
        if self._state == _CANCELLED:
            raise asyncio.CancelledError(self._message)
        raise asyncio.InvalidStateError("the batch has no answer yet")

    def add_done_callback(
        self,
        callback: Callable[[Reply], object],
        *,
        context: contextvars.Context | None = None,
    ) -> None:
        if self._state == _PENDING:
            self._callbacks.append((callback, context))
        else:
            self._loop.call_soon(callback, self, context=context)

    def set_result(self, result: Any, *, wake_now: bool = True) -> None:
        """Answer, and run the awaiting task's step now (next iteration from inside a
        task: one step at a time). `wake_now=False`: next iteration, as a Future does,
        for an outcome the task will raise: raised in a step run from here, its
        traceback would reach this frame (and the caller's), which hold the outcome,
        and so itself: a reference cycle per failed batch (Python 3.12 on)."""
        if self._state != _PENDING:
            raise asyncio.InvalidStateError("the batch was answered already")
        self._state, self._result = _ANSWERED, result
        if not wake_now or asyncio.current_task(self._loop) is not None:
            self._wake_next_iteration()
            return
        callbacks, self._callbacks = self._callbacks, []
        for callback, context in callbacks:
            if context is None:
                callback(self)
            else:
                context.run(callback, self)

    def cancel(self, msg: Any | None = None) -> bool:
        """Cancel the wait (the awaiting task was cancelled): its callbacks run next
        iteration, as a Future's do. False if it was answered or cancelled already."""
        if self._state != _PENDING:
            return False
        self._state, self._message = _CANCELLED, msg
        self._wake_next_iteration()
        return True

    def _wake_next_iteration(self) -> None:
        """Schedule the callbacks, as a Future does when it is done."""
        callbacks, self._callbacks = self._callbacks, []
        for callback, context in callbacks:
            self._loop.call_soon(callback, self, context=context)

    def __await__(self) -> Generator[Reply, None, Any]:
        if self._state == _PENDING:
            self._asyncio_future_blocking = True
            yield self  # the task adds its wake-up (`add_done_callback`) and waits
        return self.result()
