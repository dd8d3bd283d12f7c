"""`LoopBridge`: the proxy's event loop as other threads and loops see it.

A proxy serves from one event loop at a time. A call made anywhere else (a plain
thread's `inference_sync` or `submit`, a task on another loop) is *routed*: it
runs as a task on the proxy's loop, and a `concurrent.futures.Future` brings its
outcome back. The invariant: every routed call is settled exactly once, here
(`_settle`), however the proxy's loop ends. The ways a call can be cut off, and
who settles it:

- Its caller withdraws it (cancels the future, or the task awaiting it on another
  loop is cancelled): the future is cancelled; the task on the proxy's loop, if
  it started, is cancelled there, which withdraws the request.
- The loop cancels its task (`asyncio.run` cancels every task as it returns):
  the task's done callback settles it with the proxy's "loop ended" error, an
  `InferenceError` (its caller was not cancelled: a `CancelledError` would make
  a `TaskGroup` or `asyncio.timeout` around the call take it for one).
- It reaches the loop after the loop's last iteration (its callback would be
  dropped by `loop.close()`), or the loop ends while it waits in a batch: the
  loop-end hook settles it. The hook is an async generator registered with the
  loop when the bridge is made (its first step, on the loop's thread);
  `loop.shutdown_asyncgens()`, which `asyncio.run`, `asyncio.Runner` and
  `BackgroundLoop` call once every task is done, closes it, and its `finally`
  marks the bridge ended (later calls are not routed: the caller goes to the
  next loop), settles every call still open and lets the proxy settle what is
  left on the loop.
- A loop closed without `shutdown_asyncgens()` runs no hook: the calls still
  open are settled when the proxy binds to its next loop (`close()`), and a
  thread blocked in `wait()` looks at the loop once a second and settles them
  itself when it finds it closed. A hook cut short (the loop stopped and was
  closed while it ran) never marks the bridge done: a caller waiting for that
  (`wait_ended()`, `ended()`) looks at the loop the same way. No thread is left
  blocked.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import threading
import time
import weakref
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from .. import _validate

__all__ = ["LoopBridge"]

T = TypeVar("T")

_LOOK_EVERY = 1.0
"""Seconds between a blocked thread's looks at a loop that may have closed unannounced."""


class _Routed:
    """One routed call: the error it gets if the loop's end cuts it off, and its task
    once it started. (Not its future: the future's done callback holds the call, so the
    two would form a cycle per call; the bridge holds the future while the call is open,
    its caller after.)"""

    __slots__ = ("ended_error", "task")

    def __init__(self, ended_error: Callable[[], BaseException]) -> None:
        self.ended_error = ended_error
        self.task: asyncio.Task[Any] | None = None


class LoopBridge:
    """Routes calls from other threads to `loop`, and settles each one however it ends.

    Made on the loop's thread while the loop runs. `on_end()`, if given, is awaited
    on the loop when it ends, once the routed calls are settled, to settle what else
    is left there.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        on_end: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.loop = loop
        # the thread itself, not its id: a thread started after it ended may get its id
        self.thread = threading.current_thread()
        self._on_end = on_end
        self._armed = True  # the loop-end hook still has work to do
        self._lock = threading.Lock()
        # routed and not settled, with the future each one settles (under _lock)
        self._open: dict[_Routed, concurrent.futures.Future[Any]] = {}
        self._ended = False  # the loop ended, or the proxy left it: route nothing more
        self.done: concurrent.futures.Future[None] = concurrent.futures.Future()
        """Set once the loop's end is dealt with (the hook ran, or `close()`)."""
        self._watcher: AsyncGenerator[None, None] | None = _watch_end(weakref.ref(self))

    @property
    def on_loop_thread(self) -> bool:
        return threading.current_thread() is self.thread

    @property
    def ending(self) -> bool:
        """Whether the loop-end hook is settling what is left on the loop right now: the
        owner is still bound there until `done` (wait for it rather than route)."""
        return self._ended and not self.done.done()

    def route(
        self,
        make: Callable[[], Coroutine[Any, Any, T]],
        ended_error: Callable[[], BaseException],
    ) -> concurrent.futures.Future[T] | None:
        """Run `make()` as a task on the loop; its outcome arrives in the future, or
        `ended_error()` if the loop's end cuts it off. None (nothing routed) if the loop
        has ended or does not run: serve the call elsewhere."""
        call = _Routed(ended_error)
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            if self._ended or not self.loop.is_running():
                return None
            self._open[call] = future
        future.add_done_callback(functools.partial(self._withdraw, call))
        try:
            # the callback runs in a copy of this thread's contextvars context, as
            # run_coroutine_threadsafe's does (so the proxy sees a model calling itself)
            self.loop.call_soon_threadsafe(self._start, call, make)
        except RuntimeError:  # the loop closed since we looked
            self._settle(call, error=ended_error())
        return future

    def wait(self, future: concurrent.futures.Future[Any], timeout: float | None) -> bool:
        """Block until `future` (routed here) is done or `timeout` passes: whether it is
        done. If the loop closes unannounced meanwhile, its calls are settled first."""
        timeout = None if timeout is None else min(timeout, _validate.MAX_WAIT)
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                step = _LOOK_EVERY if left is None else min(left, _LOOK_EVERY)
                if concurrent.futures.wait([future], step).done:
                    return True
                if self.loop.is_closed():
                    self.close()
                    return True  # settled now
                if left is not None and left <= step:
                    return not future.cancel()  # cancel() fails only if it just finished
        except BaseException:  # KeyboardInterrupt and the like: withdraw the call
            future.cancel()
            raise

    def wait_ended(self) -> None:
        """Block (any thread but the loop's) until the loop's end is dealt with (`done`).
        If the loop is closed with its end hook cut short (its shutdown stopped early),
        the hook never finishes: settle its calls here and mark it done."""
        while not self.done.done():
            if self.loop.is_closed():
                self.close()
                return
            concurrent.futures.wait([self.done], _LOOK_EVERY)

    async def ended(self) -> None:
        """`wait_ended()` for a task on another loop."""
        done = asyncio.wrap_future(self.done)
        while not done.done():
            if self.loop.is_closed():
                self.close()  # sets `done`: the wrapper follows it on this loop
            await asyncio.wait([done], timeout=_LOOK_EVERY)

    def close(self) -> None:
        """The proxy leaves this loop (it ended, or the proxy moves to another): route
        nothing more, settle every call still open, and retire the loop-end hook."""
        self._end()
        self.forget()
        _set(self.done)

    def forget(self) -> None:
        """Retire the loop-end hook without settling anything (in a forked child, whose
        calls and loop are the parent's): closed now, not by the garbage collector."""
        self._armed = False
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            with contextlib.suppress(StopIteration, RuntimeError):
                watcher.aclose().send(None)  # disarmed: its finally returns at once

    def __del__(self) -> None:
        # Collected (its proxy dropped) while its loop may still run: nothing can be routed
        # here any more (a routed call's future keeps its bridge alive). Close the hook now:
        # the loop's collector of unfinished generators would start a task to close it.
        if getattr(self, "_watcher", None) is not None:
            self.forget()

    # -- internals ---------------------------------------------------------------------

    def _start(self, call: _Routed, make: Callable[[], Coroutine[Any, Any, Any]]) -> None:
        """On the loop: start the call's task, unless it was settled or withdrawn first."""
        with self._lock:
            if call not in self._open:
                return
            task = call.task = self.loop.create_task(self._run(call, make))
        task.add_done_callback(lambda _: self._finished(call, task))

    async def _run(self, call: _Routed, make: Callable[[], Coroutine[Any, Any, Any]]) -> None:
        """The call's task: make the call, and settle it in the step that ends it.

        Both races here are with a caller that gives up from its own thread (a blocking
        call's guard, `LoopBridge.wait`). A call withdrawn between `_start` and this
        first step is never made: the proxy would count a call its caller never saw.
        An outcome settled here, not by `_finished` one loop iteration later, reaches
        its caller before the loop can stall between the proxy counting it and the
        caller hearing of it (a refusal counted, a `DeadlineExceeded` seen)."""
        with self._lock:
            if call not in self._open:
                return
        try:
            result = await make()
        except Exception as error:  # (not raised again: the task would keep the error,
            self._settle(call, error=error)  # whose traceback keeps this frame's `call`,
            return  # which keeps the task: a cycle per failed call)
        self._settle(call, result=result)

    def _finished(self, call: _Routed, task: asyncio.Task[Any]) -> None:
        """On the loop: the call's task ended; settle the call if `_run` did not (the
        loop cancelled it, or a `BaseException` such as `KeyboardInterrupt` ended it)."""
        if task.cancelled():
            # not by its caller (a withdrawn call is no longer open): by the loop, ending
            self._settle(call, error=call.ended_error())
        elif (error := task.exception()) is not None:
            self._settle(call, error=error)

    def _withdraw(self, call: _Routed, future: concurrent.futures.Future[Any]) -> None:
        """The call's future is done: if its caller cancelled it, stop its task."""
        if not future.cancelled():
            return
        with self._lock:
            self._open.pop(call, None)
            task = call.task
        if task is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nothing runs there
                self.loop.call_soon_threadsafe(task.cancel)

    def _settle(
        self, call: _Routed, *, result: Any = None, error: BaseException | None = None
    ) -> None:
        """The one place a routed call's future gets its outcome (once: whoever takes the
        call out of `_open` settles it)."""
        with self._lock:
            future = self._open.pop(call, None)
        if future is not None:
            _resolve(future, result, error)

    def _end(self) -> list[_Routed]:
        """Route nothing more; settle the open calls; return them (their tasks may run)."""
        with self._lock:
            self._ended = True
            calls, self._open = self._open, {}
        for call, future in calls.items():
            _resolve(future, None, call.ended_error())
        return list(calls)

    async def _loop_ending(self) -> None:
        """On the loop, from `shutdown_asyncgens()`: settle the open calls, stop their
        tasks and let the proxy settle the rest."""
        on_end, self._on_end, self._armed = self._on_end, None, False
        self._watcher = None  # running now: nobody closes it by hand
        try:
            tasks = [call.task for call in self._end() if call.task is not None]
            for task in tasks:
                task.cancel()
            if on_end is not None:
                await on_end()
            await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            _set(self.done)


def _set(future: concurrent.futures.Future[None]) -> None:
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        future.set_result(None)


def _resolve(
    future: concurrent.futures.Future[Any], result: Any, error: BaseException | None
) -> None:
    if future.set_running_or_notify_cancel():  # False: its caller cancelled it just now
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)


def _watch_end(bridge: weakref.ref[LoopBridge]) -> AsyncGenerator[None, None] | None:
    """An async generator whose `finally` runs when the running loop shuts its
    generators down, registered with it by its first step (made on the loop's thread,
    while it runs: the loop's own first-step hook, `sys.set_asyncgen_hooks`, registers
    it); None where the loop keeps no such hooks."""

    async def watch() -> AsyncGenerator[None, None]:
        try:
            yield
        finally:
            target = bridge()  # weak: the loop's registry must not keep a proxy alive
            if target is not None and target._armed:
                await target._loop_ending()

    watcher = watch()
    try:
        watcher.asend(None).send(None)
    except StopIteration:
        return watcher
    return None  # pragma: no cover - a generator that yields steps once
