"""Loop binding: which event loop serves a proxy, and how calls made elsewhere reach it.

A proxy serves from one event loop at a time: the first that calls it (or
`start()`s it). A `Binding` is the state that lives on that loop: its scheduler
(and queue), its batch tasks, the batches the watchdog gave up on, the bridge
for calls from other threads. `Binder` owns the current binding and makes every
decision about loops in one place:

- A call on the bound loop is served there (the caller checks `current.loop`).
- A call on another loop (`serve_elsewhere`): the proxy binds to that loop if it
  is free (unbound, or its loop closed, or stopped and idle), else the call is
  routed to the loop it runs in. A loop caught between the phases of its
  shutdown (not running for a moment, calls still on it) gets `_PAUSED_GRACE`
  seconds before the call is refused; one in its end hook, until the proxy has
  left it.
- A call from a plain thread (`from_thread`): routed to the bound loop, or, if
  it runs in none, to the default `BackgroundLoop`, where the proxy then binds.
- The bound loop ends (`asyncio.run` returning, `BackgroundLoop.close()`): its
  bridge's hook (`_loop_ending`) fails what is queued with the "loop ended"
  error, cancels the batches still running there, and unbinds: the next call
  binds anew. A loop closed without that hook is noticed when the proxy binds
  next (`abandon`).

Everything here runs on the bound loop except where a method says "any thread".
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import time
from collections.abc import Callable, Coroutine
from typing import Any, Generic, TypeVar

from .._errors import BatchProxyError, BatchTimeout, InferenceError
from .._lifecycle import Lifecycle
from .._scheduling.scheduler import Limits, Scheduler
from .._settle import Settlement
from .background_loop import default_host, host_of
from .bridge import LoopBridge

__all__ = ["Binder", "Binding", "StillBusy"]

T = TypeVar("T")
In = TypeVar("In")

_PAUSED_GRACE = 0.1
"""Seconds a call from another loop waits for the proxy's loop, stopped with calls
still on it, to run again or end (between the phases of `asyncio.run`'s shutdown)."""


class StillBusy(RuntimeError):
    """The proxy's loop is not running and still has its calls: the proxy cannot move."""


class Binding(Generic[In]):
    """The state of a proxy that lives on one event loop. Reset only by making a new one.

    Data, each field with its one writer (the others only read it):

    - `loop`, `clock`, `new_future`, `bridge`: set at construction, never changed.
    - `scheduler`: set by `Binder.bind` right after construction (the runner makes it:
      it starts this binding's batches), never changed.
    - `batch_tasks`, `not_started`, `overran`, `members`: written by the runs
      (`_runs/batches.py`) alone, which own a batch task from its start to its end;
      read here (`drain`), by the binder (`_loop_ending`), the proxy and the drain's
      cut (`_runs.drain`).
    - `closing`: `close_after`. `left`: the binder, when the proxy leaves the loop.
    - `deadline`, `cut`: `drain` (a drain with a deadline), alone.
    """

    __slots__ = (
        "batch_tasks",
        "bridge",
        "clock",
        "closing",
        "cut",
        "deadline",
        "left",
        "loop",
        "members",
        "new_future",
        "not_started",
        "overran",
        "scheduler",
    )

    scheduler: Scheduler[In]  # set right after construction (it starts this binding's batches)

    def __init__(self, loop: asyncio.AbstractEventLoop, bridge: LoopBridge) -> None:
        self.loop = loop
        # `loop.time`: the same clock, without the method call where it is
        # asyncio's own (`time.monotonic`); a loop with a clock of its own (a virtual
        # one in tests, uvloop's) keeps it
        standard = type(loop).time is asyncio.BaseEventLoop.time
        self.clock: Callable[[], float] = time.monotonic if standard else loop.time
        # `loop.create_future`, likewise: asyncio's own makes a Future in C, in one call
        self.new_future: Callable[[], asyncio.Future[Any]] = (
            functools.partial(asyncio.Future, loop=loop)
            if type(loop).create_future is asyncio.BaseEventLoop.create_future
            else loop.create_future
        )
        self.bridge = bridge
        # Invariant: a task is here from its start (`Runner.start_batch`) until its run
        # kind ends (`Runner.end_task`), or, cancelled before its first step, until its
        # done callback has settled its batch
        self.batch_tasks: set[asyncio.Task[None]] = set()
        # Invariant: of those, the ones that have not run a step yet, each with the done
        # callback that settles its batch and frees its slot if it never does
        # (`Runner.never_started`; `Runner.claim` removes both at the first step)
        self.not_started: dict[asyncio.Task[None], Callable[[asyncio.Task[None]], None]] = {}
        # Invariant: the batches the watchdog gave up on (it failed their callers and
        # freed their slots), until their model call ends (`Runner.batch_ended`)
        self.overran: dict[asyncio.Future[Any], BatchTimeout] = {}
        # Invariant: each task of `batch_tasks` with what gives its callers still in it
        # (read only when a drain's deadline passes: `_runs.drain`)
        self.members: dict[asyncio.Task[None], Callable[[], list[Any]]] = {}
        # the earliest deadline of the drains under way (loop time), and its timer
        self.deadline: tuple[float, asyncio.TimerHandle] | None = None
        # set once a drain's deadline passed: the drains waiting return
        self.cut: asyncio.Future[None] | None = None
        self.closing: asyncio.Task[None] | None = None  # an aclose() begun inside a batch
        self.left = False  # the proxy left this loop (it ended, or the proxy moved on)

    def close_after(
        self, batch: asyncio.Task[Any], aclose: Callable[[], Coroutine[Any, Any, None]]
    ) -> None:
        """`aclose()` awaited from inside `batch` (where it would wait for itself): run it
        here once `batch` has ended."""

        async def close() -> None:
            await asyncio.wait([batch])
            await aclose()

        self.closing = self.loop.create_task(close())

    @property
    def serving(self) -> bool:
        """Whether the proxy is still on this binding's live loop: else a batch ending
        now was closed as garbage after its loop ended, and its slot with it."""
        return not self.left and not self.loop.is_closed()

    @property
    def queued(self) -> int:
        """Requests waiting in the queue (read from any thread: an autoscaler's load)."""
        return self.scheduler.queue.live

    async def drain(
        self, timeout: float | None = None, cut: Callable[[float], None] | None = None
    ) -> None:
        """`aclose()` on this loop: every queued request goes as soon as a slot is free;
        return once every batch has ended (but those the watchdog gave up on).

        With `timeout` (seconds, and `cut`): at the deadline, `cut(timeout)` settles
        every call still queued or running (it abandons their batches) and the drain
        returns. Drains under way together share the earliest deadline."""
        scheduler = self.scheduler
        scheduler.drain()
        if timeout is not None and cut is not None:
            self._set_deadline(self.loop.time() + timeout, timeout, cut)
        # a batch the watchdog abandoned may not end (a model ignoring cancellation);
        # nor may one abandoned at the deadline
        while running := [t for t in self.batch_tasks if t not in self.overran]:
            if self.cut is None:
                await asyncio.wait(running)
            elif self.cut.done():
                break
            else:
                await asyncio.wait([*running, self.cut], return_when=asyncio.FIRST_COMPLETED)
        scheduler.close()

    def _set_deadline(self, when: float, timeout: float, cut: Callable[[float], None]) -> None:
        """Arm the drain's deadline at loop time `when`, unless an earlier one is armed."""
        if self.cut is not None and self.cut.done():
            return  # a deadline passed already: it cut everything
        if self.deadline is not None:
            if self.deadline[0] <= when:
                return  # the earlier deadline wins
            self.deadline[1].cancel()
        if self.cut is None:
            self.cut = self.loop.create_future()

        def passed() -> None:
            self.deadline = None
            cut(timeout)
            if self.cut is not None and not self.cut.done():
                self.cut.set_result(None)

        self.deadline = (when, self.loop.call_at(when, passed))

    def abandoned(self, task: asyncio.Task[Any]) -> bool:
        """Whether the watchdog or the drain's deadline gave up on the batch of `task`: it
        was counted then (failed, timed out), and is not again however its task ends."""
        return (bool(self.overran) and task in self.overran) or self.was_cut

    @property
    def was_cut(self) -> bool:
        """Whether a drain's deadline passed (batches may have been abandoned)."""
        return self.cut is not None and self.cut.done()

    def apply(self, limits: Limits) -> None:
        """Hand new limits to the scheduler, on its loop, from any thread."""
        if self.loop.is_closed():
            return
        if self.bridge.on_loop_thread:
            self.scheduler.reconfigure(limits)
        else:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                self.loop.call_soon_threadsafe(self.scheduler.reconfigure, limits)


class Binder(Generic[In]):
    """Binds one proxy to the loop that calls it; routes calls from elsewhere."""

    def __init__(
        self,
        owner: Any,
        lifecycle: Lifecycle,
        settlement: Settlement,
        new_scheduler: Callable[[Binding[In]], Scheduler[In]],
    ) -> None:
        self._owner = owner  # adopted by the BackgroundLoop it binds to (closed with it)
        self._lifecycle = lifecycle
        self._settlement = settlement
        self._new_scheduler = new_scheduler
        self.current: Binding[In] | None = None

    @property
    def name(self) -> str:
        return self._lifecycle.name

    def bind(self, loop: asyncio.AbstractEventLoop) -> Binding[In] | None:
        """Bind to `loop` (the running one); None if the proxy still runs on another loop.
        `StillBusy` if that loop is stopped with calls on it; `ProxyClosed` if closed."""
        if not self._lifecycle.open:
            raise self._lifecycle.closed_error()
        old = self.current
        if old is not None:
            if old.loop is loop:
                return old
            if not old.loop.is_closed():
                if old.loop.is_running():
                    return None
                if not old.scheduler.idle:
                    raise StillBusy(
                        f"{self.name} still has requests on an event loop that is not "
                        f"running; finish them there (or close that loop) before using it "
                        f"from another loop"
                    )
            self.abandon()
        binding = Binding[In](loop, LoopBridge(loop, self._loop_ending))
        binding.scheduler = self._new_scheduler(binding)
        self.current = binding
        host = host_of(loop)
        if host is not None:  # however it got there, it closes with that loop
            host.adopt(self._owner)
        return binding

    def abandon(self) -> None:
        """Leave the current loop, which has ended or is left behind: what was queued there
        is dropped with it (its callers were on it), calls routed to it get the "loop
        ended" error."""
        binding, self.current = self.current, None
        if binding is not None:
            binding.left = True
            binding.scheduler.close()
            binding.scheduler.queue.drain()
            binding.bridge.close()
            host = host_of(binding.loop)
            if host is not None:
                host.release(self._owner)

    def forget_after_fork(self) -> None:
        """In a forked child: the parent's loop and calls are the parent's."""
        binding, self.current = self.current, None
        if binding is not None:
            binding.left = True
            binding.bridge.forget()

    def refuse_queued(self, binding: Binding[In]) -> None:
        """`aclose()` from another thread while `binding`'s loop is paused: fail every
        queued request with `ProxyClosed`, thread-safely, on its own loop (what runs ends
        there when it runs again)."""
        binding.scheduler.close()
        error = self._lifecycle.closed_error()
        with contextlib.suppress(RuntimeError):  # it closed meanwhile: nobody waits there
            for request in binding.scheduler.queue.drain():
                binding.loop.call_soon_threadsafe(self._settlement.fail, [request], error)

    def ended_error(self) -> BatchProxyError:
        """What a call cut off by its loop's end gets (any thread): it was not cancelled."""
        if not self._lifecycle.open:
            return self._lifecycle.closed_error()
        return InferenceError(
            self.name,
            asyncio.CancelledError(),
            "the event loop serving it ended before this call was answered",
        )

    def route(
        self, make: Callable[[], Coroutine[Any, Any, T]]
    ) -> concurrent.futures.Future[T] | None:
        """Run `make()` on the bound loop for a caller elsewhere (any thread); None if the
        proxy runs in no loop, or its loop has ended or does not run."""
        binding = self.current
        return None if binding is None else binding.bridge.route(make, self.ended_error)

    async def serve_elsewhere(self, make: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """Serve a call made on a loop the proxy is not bound to (see the module doc):
        `make()` runs here once bound, or on the proxy's loop."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + _PAUSED_GRACE
        while True:
            binding = self.current
            if binding is not None:
                future = binding.bridge.route(make, self.ended_error)
                if future is not None:
                    return await asyncio.wrap_future(future)
                if binding.bridge.ending:  # the proxy leaves that loop in a moment
                    await binding.bridge.ended()
                    continue
            try:
                if self.bind(loop) is not None:
                    return await make()
            except StillBusy:
                if loop.time() >= give_up:
                    raise
                await asyncio.sleep(_PAUSED_GRACE / 100)
            # else its loop runs again: route to it

    def from_thread(
        self, method: str, make: Callable[[], Coroutine[Any, Any, T]]
    ) -> tuple[concurrent.futures.Future[T], LoopBridge | None]:
        """Route a call from a plain thread (any thread but the loop's): the future, and
        the bridge it went through (None: refused at once, the proxy is closed)."""
        while True:  # each pass routes the call, or finds the loop it tried gone
            binding = self.current
            if binding is not None:
                if binding.bridge.on_loop_thread:
                    raise self.would_deadlock(method)
                future = binding.bridge.route(make, self.ended_error)
                if future is not None:
                    return future, binding.bridge
                if binding.bridge.ending:  # the proxy leaves that loop in a moment
                    binding.bridge.wait_ended()
                    continue
            if not self._lifecycle.open:  # refused as ever, without starting a loop to say so
                refused: concurrent.futures.Future[T] = concurrent.futures.Future()
                refused.set_exception(self._lifecycle.closed_error())
                return refused, None
            host = default_host()
            if host.on_loop_thread():  # where this proxy would now run
                raise self.would_deadlock(method)
            with contextlib.suppress(RuntimeError):  # it closed meanwhile: try the next one
                routed = host.route(make, self.ended_error)
                if routed is not None:  # the proxy binds there, and closes with it
                    return routed

    def would_deadlock(self, method: str) -> RuntimeError:
        return RuntimeError(
            f"{self.name}.{method}() was called on the proxy's own event-loop thread, where "
            f"waiting for its result would deadlock; use await proxy.inference(item)"
        )

    async def _loop_ending(self) -> None:
        """The bound loop is ending (in its `shutdown_asyncgens()`, once its tasks were
        cancelled): fail what is queued, cancel the batches still running (their callers
        get `InferenceError`), and unbind: the next call binds to its own loop."""
        binding = self.current
        if binding is None or binding.loop is not asyncio.get_running_loop():
            return  # moved on already
        error = self.ended_error()
        while True:  # until nothing is left: a cancelled batch frees a slot for the next
            self._settlement.fail(binding.scheduler.queue.drain(), error)
            tasks = list(binding.batch_tasks)
            if not tasks:
                break
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks)
        self.abandon()
