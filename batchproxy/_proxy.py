"""`Proxy[In, Out]`: the public face. Lifecycle, the `inference*` calls, and batch runs.

Data path: `inference()` makes a request (item, future, priority, arrival time,
deadline timer) and queues it in the scheduler; the scheduler picks a batch when
the policy says so and calls `_start_batch`; a batch task runs `_inference`
through the executor, checks the results and resolves each caller's future,
skipping callers that are already done. Everything here runs on the event loop
the proxy is bound to, so no locks are needed; other threads and loops come in
through `submit()`.

Cancellation, written down:

- A caller cancelled while its request is queued: the request leaves the queue
  and never reaches the model.
- A caller cancelled while its batch runs: the batch runs on; its result is
  dropped.
- A deadline passing: same as cancellation, but the caller gets
  `DeadlineExceeded` (a `TimeoutError`).
- The batch task itself cancelled (its event loop shutting down): the callers
  still waiting get `InferenceError`, and the cancellation propagates.
- `_inference` raising `CancelledError` on its own: an ordinary batch failure.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import functools
import inspect
import logging
import time
import weakref
from abc import ABC
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
    Set,
)
from types import EllipsisType
from typing import Any, Generic, Literal, NamedTuple, TypeVar, overload

from typing_extensions import Self

from . import _validate
from ._background_loop import BackgroundLoop, background_loop_of
from ._bridge import LoopBridge
from ._cost_model import CostModel
from ._errors import (
    BatchProxyError,
    BatchSizeMismatch,
    BatchTimeout,
    DeadlineExceeded,
    InferenceError,
    ProxyClosed,
    QueueFull,
    StreamBufferFull,
)
from ._executor import Executor, LoopExecutor
from ._fork import forget_threads_in_forked_children
from ._oom import BatchCap, OomPredicate, is_out_of_memory
from ._queue import Request
from ._scheduler import Scheduler
from ._stats import Health, Listener, ProxyStats, StatsRecorder
from ._streaming import (
    _CLOSED,
    _FINISHED,
    Last,
    Steps,
    StreamEnd,
    StreamRequest,
    is_closing,
    let_consumers_read,
    matching_view,
)
from ._worker_thread import WorkerThread

__all__ = ["Proxy"]

logger = logging.getLogger("batchproxy")

In = TypeVar("In")
Out = TypeVar("Out")
T = TypeVar("T")


_HEALTHY = Health(healthy=True, reason=None, since=None)


class Proxy(ABC, Generic[In, Out]):
    """Batch concurrent `await proxy.inference(item)` calls into `_inference(items)` calls.

    Subclass it and implement `_inference`. Arguments:

    - `batch_size`: the most items in one `_inference` call.
    - `max_delay_ms`: the longest a request waits for company once a batch slot
      is free (a lone request on an idle proxy does not wait; see the scheduler).
    - `max_queue_size`: refuse calls with `QueueFull` beyond this many waiting
      requests (default: unbounded).
    - `timeout`: default deadline in seconds for every call (default: none).
    - `max_concurrent_batches`: how many batches may run at once (default: the
      executor's capacity, 1 for a thread, n for n worker processes or actors).
    - `offload`: where batches run. `True` runs `_inference` on a private worker
      thread, a `WorkerThread` shares one between proxies; a plain `def
      _inference` always runs on a worker thread, never on the event loop. An
      executor that hosts a model of its own (`ProcessWorkers`, `RayActors`,
      `WorkerThread(model=...)`) replaces `_inference`: use `Proxy(offload=...)`
      directly, without a subclass.
    - `name`: how stats, errors and logs name this proxy (default: class name).
    - `length`: a per-item cost (e.g. sequence length). When given, batches are
      formed from requests of similar cost (little padding), `max_batch_tokens`
      is enforced, and `stats.padding_waste` is tracked.
    - `max_batch_tokens`: the most padded tokens in one batch: members x largest
      cost (default cost: `batchproxy.tensors.length`). An item over it runs alone.
    - `oom_backoff` (opt-in): `True` (or your predicate of what counts as out of
      memory) reruns a batch whose `_inference` ran out of memory (`MemoryError`,
      `torch.cuda.OutOfMemoryError`, ...) in smaller chunks and lowers the batch
      cap for a while. Off by default: an exception then fails the whole batch.
    - `window`: how long a partial batch waits for company when a slot is free:
      `"adaptive"` (default) leaves as soon as waiting stops paying, by the
      arrival rate and the cost model; `"fixed"` waits out `max_delay_ms`. Under
      both, a request arriving to an idle proxy goes at once.
    - `aging_ms` (opt-in): starvation guard. Levels are served by their oldest
      request's arrival minus `aging_ms` per level of priority, and a level whose
      oldest request has waited `aging_ms` goes oldest first; so no request is
      overtaken by one Δp levels higher that came more than Δp x `aging_ms`
      after it. Off: strict priority, then earliest deadline first.
    - `shed_late` (opt-in): refuse a call with a deadline at once, with
      `DeadlineExceeded`, when the cost model predicts it cannot be answered in
      time even at full speed (counted in `stats.shed`), instead of letting it
      wait to fail.
    - `isolate_errors` (opt-in): when `_inference` raises an `Exception`, run each
      half of the batch again on its own, down to single items, so only the items
      that make it raise fail (with what the model raised for them) and the others
      get their results. At most 2n - 2 extra model calls for a batch of n, about
      2 log2(n) for one bad item; counted in `stats.isolation_splits`.
    - `batch_timeout` (opt-in, seconds): a watchdog. A batch still running after
      this long fails its callers with `BatchTimeout`, frees its slot, is cancelled
      (a model on a thread or in a process cannot be interrupted: it runs on there)
      and marks the proxy unhealthy (`proxy.health`) until a later batch returns in
      time. `on_batch_timeout`: `"serve"` (default) keeps taking calls; `"stop"`
      stops intake, like `aclose()`: queued and new calls get `ProxyClosed`.
    - `stream_buffer` (streams only): the most chunks a stream may hold unread. A
      consumer that stops reading without closing its stream (a `break` while it
      still holds the iterator) is dropped from its batch at that point with
      `StreamBufferFull`, instead of chunks piling up; None: no bound.
    """

    _group_by_length = True  # TensorProxy(length_aware=False): costs without grouping
    _model_name = "_inference"  # what the model is called in logs

    # class-level defaults, so a subclass that forgot super().__init__() reaches
    # _require_init() and its clear error instead of an AttributeError
    _initialized = False
    _loop: asyncio.AbstractEventLoop | None = None
    _closing: asyncio.Task[None] | None = None  # a close begun inside a batch
    _health = _HEALTHY  # until a batch overruns
    _bridge: LoopBridge | None = None  # calls from other threads and loops (see _bridge)
    # per-loop state, set by _unbind() (and only there reset)
    _scheduler: Scheduler[In] | None
    _batch_tasks: set[asyncio.Task[None]]  # running, or about to
    _not_started: set[asyncio.Task[None]]  # of those, the ones that have not run a step
    _overran_batches: dict[asyncio.Future[Any], BatchTimeout]  # still running

    def __init__(
        self,
        batch_size: int = 64,
        *,
        max_delay_ms: float = 5.0,
        max_queue_size: int | None = None,
        timeout: float | None = None,
        max_concurrent_batches: int | None = None,
        offload: bool | Executor = False,
        name: str | None = None,
        length: Callable[[In], int] | None = None,
        max_batch_tokens: int | None = None,
        oom_backoff: bool | OomPredicate = False,
        window: Literal["adaptive", "fixed"] = "adaptive",
        aging_ms: float | None = None,
        shed_late: bool = False,
        isolate_errors: bool = False,
        batch_timeout: float | None = None,
        on_batch_timeout: Literal["serve", "stop"] = "serve",
        stream_buffer: int | None = 1024,
    ) -> None:
        self._batch_size = _validate.count("batch_size", batch_size)
        self._max_delay = _validate.duration(
            "max_delay_ms", max_delay_ms, allow_zero=True, milliseconds=True
        )
        self._max_queue_size = _validate.optional_count("max_queue_size", max_queue_size)
        self._timeout = _validate.timeout("timeout", timeout)
        concurrent = (
            None
            if max_concurrent_batches is None  # the executor's capacity, as it changes
            else _validate.count("max_concurrent_batches", max_concurrent_batches)
        )
        if name is not None and not isinstance(name, str):
            raise TypeError(f"name must be a str or None, got {type(name).__name__} {name!r}")
        if name == "":
            raise ValueError(f"name must be a non-empty str or None, got {name!r}")
        self.name: str = name or type(self).__name__
        self._batch_task_name = f"batchproxy-{self.name}-batch"
        self._max_batch_tokens = _validate.optional_count("max_batch_tokens", max_batch_tokens)
        self._default_length = length is None and self._max_batch_tokens is not None
        if self._default_length:
            from .tensors import length as sequence_length

            length = sequence_length
        if length is not None and not callable(length):
            raise TypeError(f"length must be a callable or None, got {length!r}")
        self._length = length
        if oom_backoff is True:
            oom_backoff = is_out_of_memory
        elif not (oom_backoff is False or callable(oom_backoff)):
            raise TypeError(f"oom_backoff must be a bool or a predicate, got {oom_backoff!r}")
        self._is_oom: OomPredicate | None = oom_backoff or None
        self._adaptive = _is_adaptive(window)
        self._aging = _aging_seconds(aging_ms)
        self._shed_late = _validate.flag("shed_late", shed_late)
        self._isolate_errors = _validate.flag("isolate_errors", isolate_errors)
        self._batch_timeout = _validate.timeout("batch_timeout", batch_timeout)
        self._stop_on_overrun = _stops_on_overrun(on_batch_timeout)
        self._stream_buffer = _validate.optional_count("stream_buffer", stream_buffer)
        self._cap = BatchCap(self._batch_size)
        self._cost_model = CostModel("item" if length is None else "token")

        self._model = self._model_function()
        self._streaming = self._streams(offload)
        self._executor, self._owns_executor = self._choose_executor(offload)
        self._follow_capacity = concurrent is None
        self._max_concurrent = self._executor.capacity if concurrent is None else concurrent
        self._capacity_watcher = _capacity_watcher(self)  # weak: the executor may outlive us
        self._executor.watch_capacity(self._capacity_watcher)
        if isinstance(self._executor, WorkerThread) and self._owns_executor:
            # a proxy dropped without aclose() still stops its thread
            weakref.finalize(self, self._executor.close).atexit = False

        self._stats = StatsRecorder(self.name)
        self._unbind()
        self._closed = False
        self._stopped_by: BatchProxyError | None = None  # closed itself, because of this
        forget_threads_in_forked_children(self)
        self._initialized = True

    def _inference(
        self, items: list[In], /
    ) -> (
        Awaitable[Sequence[Out | BaseException]]
        | Sequence[Out | BaseException]
        | AsyncIterator[Sequence[Out | Last[Out] | StreamEnd | BaseException]]
        | Iterator[Sequence[Out | Last[Out] | StreamEnd | BaseException]]
    ):
        """Run the model on one batch; return one result per item, in order.

        Or stream: a generator (`async def` or plain `def`) that yields one element per
        caller still in the batch at each step; see `stream()`.

        Implement it in a subclass (unless `offload` hosts the model). May be
        `async def` or plain `def` (a plain `def` runs on a worker thread). Put an
        `Exception` instance in slot i to fail caller i alone; raise to fail the
        whole batch.
        """
        raise NotImplementedError  # __init__ refuses a proxy without a model

    def _has_own_model(self) -> bool:
        cls = type(self)
        return (
            cls._inference is not Proxy._inference
            or cls._model_function is not Proxy._model_function
        )

    def _model_function(self) -> Callable[[list[In]], Any]:
        """What a batch calls; `_inference` unless a subclass supplies another callable."""
        return self._inference

    def _streams(self, offload: object) -> bool:
        """Whether `_inference` is a generator (its results are streams); refuse the
        options such a model cannot honour."""
        model = self._model
        if not (inspect.isasyncgenfunction(model) or inspect.isgeneratorfunction(model)):
            return False
        if self._isolate_errors or self._is_oom is not None:
            raise self._cannot_rerun("isolate_errors" if self._isolate_errors else "oom_backoff")
        if inspect.isasyncgenfunction(self._model) and offload is not False:
            raise TypeError(
                f"{self.name}: an async generator _inference runs on the event loop; to run "
                f"its steps on a worker thread, make it a plain generator (def ... yield)"
            )
        return True

    def _cannot_rerun(self, option: str) -> TypeError:
        return TypeError(
            f"{self.name}: {option} reruns parts of a batch, which a streaming "
            f"_inference (a generator) cannot do; leave it off"
        )

    def _choose_executor(self, offload: object) -> tuple[Executor, bool]:
        own_model = self._has_own_model()
        if isinstance(offload, Executor):
            if offload.hosts_model and own_model:
                raise TypeError(
                    f"{type(self).__name__} implements _inference, but offload={offload!r} "
                    f"runs a model of its own: use Proxy(offload=...) without a subclass, "
                    f"or an executor that runs _inference (a WorkerThread)"
                )
            if not offload.hosts_model and not own_model:
                raise TypeError(_no_model(type(self).__name__))
            return offload, False
        if not isinstance(offload, bool):
            raise TypeError(
                f"offload must be a bool or an Executor (WorkerThread, ProcessWorkers, ...), "
                f"got {type(offload).__name__} {offload!r}"
            )
        if not own_model:
            raise TypeError(_no_model(type(self).__name__))
        on_loop = inspect.iscoroutinefunction(self._model) or inspect.isasyncgenfunction(
            self._model
        )
        if offload or not on_loop:
            return WorkerThread(name=f"batchproxy-{self.name}"), True
        return LoopExecutor(), False

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<{type(self).__name__} {self.name!r} batch_size={self._batch_size} {state}>"

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Bind to the running event loop and start the worker thread, if any.

        Optional: the first call does it lazily. Idempotent.
        """
        loop = asyncio.get_running_loop()
        if loop is not self._loop and not self._bind(loop):
            raise RuntimeError(
                f"{self.name} is already running in another event loop (in another thread); "
                f"use proxy.submit(item) to call it from here"
            )
        if self._closed:
            raise self._closed_error()
        if self._owns_executor and isinstance(self._executor, WorkerThread):
            self._executor.start()

    async def aclose(self) -> None:
        """Stop intake, run every accepted request to its outcome, release the worker.

        New calls get `ProxyClosed` from the moment this is called. Idempotent.
        Awaited from inside this proxy's `_inference` (where waiting for the
        batch would wait for itself), it returns at once and the close completes
        on the proxy's loop as soon as that batch is done.
        """
        self._require_init()
        self._closed = True
        loop, scheduler = self._loop, self._scheduler
        if loop is not None and scheduler is not None and not loop.is_closed():
            calling_batch = _current_batch.get()
            if calling_batch in self._batch_tasks:  # from the model, maybe on the worker
                loop.call_soon_threadsafe(self._close_after, calling_batch)
                return
            if loop is asyncio.get_running_loop():
                await self._drain()
            elif (drain := self._route(self._drain)) is not None:  # from another loop
                with contextlib.suppress(BatchProxyError):  # its loop ended meanwhile:
                    await asyncio.wrap_future(drain)  # what was queued is settled
            else:  # its loop is paused: what is queued cannot run; what runs ends there
                self._refuse_queued(loop, scheduler)
        self._executor.unwatch_capacity(self._capacity_watcher)
        if self._owns_executor:
            if not self._health.healthy and isinstance(self._executor, WorkerThread):
                self._executor.close(wait=False)  # its thread may be stuck in the model
            else:
                await self._executor.aclose()

    def _close_after(self, batch: asyncio.Task[Any]) -> None:
        async def close() -> None:
            await asyncio.wait([batch])
            await self.aclose()

        assert self._loop is not None
        self._closing = self._loop.create_task(close())

    async def _drain(self) -> None:
        scheduler = self._scheduler
        assert scheduler is not None
        scheduler.drain()
        # a batch the watchdog abandoned may not end (a model ignoring cancellation)
        while running := [t for t in self._batch_tasks if t not in self._overran_batches]:
            await asyncio.wait(running)
        scheduler.close()

    def _refuse_queued(self, loop: asyncio.AbstractEventLoop, scheduler: Scheduler[In]) -> None:
        """Fail every queued request with `ProxyClosed`, thread-safely, on its own loop."""
        scheduler.close()
        with contextlib.suppress(RuntimeError):  # it closed meanwhile: nobody waits there
            for request in scheduler.queue.drain():
                loop.call_soon_threadsafe(self._refuse, request)

    def _closed_error(self) -> ProxyClosed:
        """What a call to this closed proxy gets: why it stopped, if it stopped itself."""
        cause = self._stopped_by
        error = ProxyClosed(self.name, None if cause is None else str(cause))
        error.__cause__ = cause
        return error

    def _refuse(self, request: Request[In]) -> None:
        if not request.future.done():
            request.future.set_exception(self._closed_error())
            self._stats.errors += 1
            self._finished("error", request)

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    @property
    def closed(self) -> bool:
        return self._closed

    def _require_init(self) -> None:
        if not self._initialized:
            raise RuntimeError(
                f"{type(self).__name__}.__init__ must call super().__init__() "
                f"before the proxy is used"
            )

    def _bind(self, loop: asyncio.AbstractEventLoop) -> bool:
        """Make `loop` this proxy's loop; False if the current one still runs elsewhere."""
        self._require_init()
        if self._closed:
            raise self._closed_error()
        old = self._loop
        if old is not None and not old.is_closed():
            if old.is_running():
                return False
            if self._scheduler is not None and not self._scheduler.idle:
                raise _StillBusy(
                    f"{self.name} still has requests on an event loop that is not running; "
                    f"finish them there (or close that loop) before using it from another loop"
                )
        if old is not None:
            self._abandon_loop()
        self._loop = loop
        self._bridge = LoopBridge(loop, self._loop_ending)
        background = background_loop_of(loop)
        if background is not None:  # however it got there, it closes with that loop
            background._adopt(self)
        self._scheduler = Scheduler(
            loop,
            batch_size=self._dispatch_size(),
            max_delay=self._max_delay,
            max_concurrent_batches=self._max_concurrent,
            start_batch=self._start_batch,
            by_cost=self._length is not None,
            group_by_cost=self._group_by_length,
            max_batch_tokens=self._max_batch_tokens,
            adaptive=self._adaptive,
            cost_model=self._cost_model,
            aging=self._aging,
        )
        return True

    def _after_fork_in_child(self) -> None:
        """In a forked child the parent's event loop runs no more (its thread is gone,
        or it is the parent's): the next call binds to the child's loop. The parent's
        queued, routed and running calls are the parent's."""
        if self._bridge is not None:
            self._bridge.forget()
            self._bridge = None
        self._unbind()

    def _abandon_loop(self) -> None:
        """Forget an event loop that has ended; whatever waited on it is gone with it."""
        if self._scheduler is not None:
            self._scheduler.close()
            self._scheduler.queue.drain()
        self._unbind()

    def _unbind(self) -> None:
        """Forget the event loop and the state that lived on it: its scheduler (and
        queue), batch tasks and overrun batches; calls routed to it that are still open
        get the "loop ended" error. The one place that resets them."""
        if self._bridge is not None:
            self._bridge.close()
        self._loop = self._bridge = self._scheduler = self._closing = None
        self._batch_tasks, self._not_started, self._overran_batches = set(), set(), {}

    async def _loop_ending(self) -> None:
        """The bound loop is ending (in its `shutdown_asyncgens()`, once its tasks were
        cancelled): fail what is queued, cancel the batches still running (their
        callers get `InferenceError`), and unbind: the next call binds to its own loop."""
        scheduler = self._scheduler
        if scheduler is None or scheduler.loop is not asyncio.get_running_loop():
            return  # moved on already
        error = self._loop_ended_error()
        while True:  # until nothing is left: a cancelled batch frees a slot for the next
            self._fail(scheduler.queue.drain(), error)
            tasks = list(self._batch_tasks)
            if not tasks:
                break
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks)
        scheduler.close()
        self._unbind()

    def _loop_ended_error(self) -> BatchProxyError:
        """What a call cut off by its event loop's end gets (it was not cancelled)."""
        if self._closed:
            return self._closed_error()
        return InferenceError(
            self.name,
            asyncio.CancelledError(),
            "the event loop serving it ended before this call was answered",
        )

    def configure(
        self,
        *,
        batch_size: int | EllipsisType = ...,
        max_delay_ms: float | EllipsisType = ...,
        max_concurrent_batches: int | EllipsisType | None = ...,
        max_queue_size: int | EllipsisType | None = ...,
        timeout: float | EllipsisType | None = ...,
        window: Literal["adaptive", "fixed"] | EllipsisType = ...,
        aging_ms: float | EllipsisType | None = ...,
        shed_late: bool | EllipsisType = ...,
        isolate_errors: bool | EllipsisType = ...,
        batch_timeout: float | EllipsisType | None = ...,
        on_batch_timeout: Literal["serve", "stop"] | EllipsisType = ...,
        stream_buffer: int | EllipsisType | None = ...,
    ) -> None:
        """Change limits and policies while the proxy runs; `...` (the default) keeps a
        value. The options mean what they mean for the constructor.

        Every value is checked like the constructor's before any is applied, so a
        bad call changes nothing. Thread-safe: from another thread the change
        reaches the proxy's loop through `call_soon_threadsafe`. It applies from
        the next batch on; running batches and queued requests are left as they
        are (a lower `max_queue_size` refuses new calls until the queue is below it;
        a new `timeout` or `shed_late` applies to calls made from now on, a new
        `batch_timeout` to batches started from now on, `isolate_errors` and
        `on_batch_timeout` to failures and overruns from now on, `stream_buffer`
        to chunks from now on). `max_concurrent_batches=None` follows the
        executor's capacity again.
        """
        self._require_init()
        size = self._batch_size if batch_size is ... else _validate.count("batch_size", batch_size)
        delay = (
            self._max_delay
            if max_delay_ms is ...
            else _validate.duration(
                "max_delay_ms", max_delay_ms, allow_zero=True, milliseconds=True
            )
        )
        if max_concurrent_batches is ...:
            follow, slots = self._follow_capacity, self._max_concurrent
        elif max_concurrent_batches is None:
            follow, slots = True, self._executor.capacity
        else:
            follow = False
            slots = _validate.count("max_concurrent_batches", max_concurrent_batches)
        room = (
            self._max_queue_size
            if max_queue_size is ...
            else _validate.optional_count("max_queue_size", max_queue_size)
        )
        buffer = (
            self._stream_buffer
            if stream_buffer is ...
            else _validate.optional_count("stream_buffer", stream_buffer)
        )
        new = self._configured_policies(
            timeout, window, aging_ms, shed_late, isolate_errors, batch_timeout, on_batch_timeout
        )
        self._batch_size, self._max_delay, self._max_concurrent = size, delay, slots
        self._follow_capacity = follow
        self._max_queue_size, self._stream_buffer = room, buffer
        self._timeout, self._shed_late = new.timeout, new.shed_late
        self._adaptive, self._aging = new.adaptive, new.aging
        self._isolate_errors = new.isolate_errors
        self._batch_timeout, self._stop_on_overrun = new.batch_timeout, new.stop_on_overrun
        self._cap.set_limit(size)
        self._apply_limits()

    def _configured_policies(
        self,
        timeout: object,
        window: object,
        aging_ms: object,
        shed_late: object,
        isolate_errors: object,
        batch_timeout: object,
        on_batch_timeout: object,
    ) -> _Policies:
        """The policies after `configure(...)`, each checked (`...` keeps the current one)."""
        isolate = (
            self._isolate_errors
            if isolate_errors is ...
            else _validate.flag("isolate_errors", isolate_errors)
        )
        if isolate and self._streaming:
            raise self._cannot_rerun("isolate_errors")
        return _Policies(
            timeout=self._timeout if timeout is ... else _validate.timeout("timeout", timeout),
            adaptive=self._adaptive if window is ... else _is_adaptive(window),
            aging=self._aging if aging_ms is ... else _aging_seconds(aging_ms),
            shed_late=(
                self._shed_late if shed_late is ... else _validate.flag("shed_late", shed_late)
            ),
            isolate_errors=isolate,
            batch_timeout=(
                self._batch_timeout
                if batch_timeout is ...
                else _validate.timeout("batch_timeout", batch_timeout)
            ),
            stop_on_overrun=(
                self._stop_on_overrun
                if on_batch_timeout is ...
                else _stops_on_overrun(on_batch_timeout)
            ),
        )

    def _dispatch_size(self) -> int:
        """The most requests the scheduler puts in one batch: the current cap."""
        return self._cap.cap

    def _on_capacity(self, capacity: int) -> None:
        """The executor was resized (maybe from another thread): follow it, if we do."""
        if self._follow_capacity and not self._closed:
            self._max_concurrent = capacity
            self._apply_limits()

    def _apply_limits(self) -> None:
        """Hand the current limits to the scheduler, on its loop, from any thread."""
        loop, scheduler = self._loop, self._scheduler
        if loop is None or scheduler is None or loop.is_closed():
            return  # the next event loop's scheduler starts with these values
        limits = self._limits()
        bridge = self._bridge
        if bridge is not None and bridge.on_loop_thread:
            scheduler.reconfigure(*limits)
        else:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(scheduler.reconfigure, *limits)

    def _limits(self) -> tuple[int, float, int, bool, float | None]:
        """What the scheduler is told: batch size, delay, slots, window, aging."""
        return (
            self._dispatch_size(),
            self._max_delay,
            self._max_concurrent,
            self._adaptive,
            self._aging,
        )

    # -- calls ---------------------------------------------------------------------------

    async def inference(self, item: In, *, timeout: float | None = None, priority: int = 0) -> Out:
        """Queue one item, wait for its batch, return its own result.

        `timeout` (seconds; default: the proxy's) bounds the whole call; `priority`:
        higher goes first, FIFO within a level.
        """
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # bind here, or route to the loop it runs in
            return await self._from_another_loop(
                lambda: self.inference(item, timeout=timeout, priority=priority)
            )
        request = self._enqueue(loop, item, timeout, priority)
        try:
            result: Out = await request.future
            return result
        except asyncio.CancelledError:
            if request.future.cancelled():
                self._abandon(request)
            else:  # answered, then cancelled before this task resumed: it sees the cancel
                self._recount_as_cancelled(request.future)
            raise
        finally:
            timer = request.deadline_timer
            if timer is not None:
                timer.cancel()

    async def stream(
        self, item: In, *, timeout: float | None = None, priority: int = 0
    ) -> AsyncGenerator[Out, None]:
        """Queue one item; yield its chunks as its batch's steps produce them.

        For a proxy whose `_inference` is a generator (and for a `GenerationProxy`):
        `async for chunk in proxy.stream(item)`. The stream ends when the model ends
        it (`END`, `Last`, or the generator returning) and raises what the model put
        in its slot, or raised. Leaving the loop early (`break`), closing the
        iterator or being cancelled withdraws the call: a queued one never reaches
        the model, a running one is dropped from its batch at the next step.
        `timeout` bounds the whole stream. On a proxy that does not stream, the
        stream is its one result.
        """
        if not self._streaming:
            yield await self.inference(item, timeout=timeout, priority=priority)
            return
        loop = asyncio.get_running_loop()
        if loop is not self._loop and not self._bind(loop):
            raise RuntimeError(
                f"{self.name} runs in an event loop in another thread; stream from there"
            )
        request = self._enqueue(loop, item, timeout, priority, stream=True)
        assert isinstance(request, StreamRequest)
        chunks, future = request.chunks, request.future
        over = False  # the consumer read the end of the stream
        try:
            while (chunk := await chunks.get()) is not _CLOSED:
                yield chunk
            over = True
            future.result()  # the stream's error, if it failed
        finally:
            if request.deadline_timer is not None:
                request.deadline_timer.cancel()
            if not over:
                if future.done() and not future.cancelled():  # ended unread: the consumer left
                    self._recount_as_cancelled(future)
                else:
                    self._withdraw([request])

    @overload
    async def inference_many(
        self,
        items: Iterable[In],
        *,
        timeout: float | None = ...,
        priority: int = ...,
        return_exceptions: Literal[False] = ...,
    ) -> list[Out]: ...

    @overload
    async def inference_many(
        self,
        items: Iterable[In],
        *,
        timeout: float | None = ...,
        priority: int = ...,
        return_exceptions: bool,
    ) -> list[Out | Exception]: ...

    async def inference_many(
        self,
        items: Iterable[In],
        *,
        timeout: float | None = None,
        priority: int = 0,
        return_exceptions: bool = False,
    ) -> list[Out] | list[Out | Exception]:
        """Queue each item as its own request; return their results in order.

        The items are batched like separate calls (with each other and with
        everyone else's). `timeout` bounds the whole call. By default the first
        failure is raised as soon as it happens and the remaining items are
        withdrawn; with `return_exceptions=True` failures take their item's place
        in the list. An empty input returns `[]` without touching the model.
        """
        if isinstance(items, (str, bytes, bytearray, Mapping)):
            raise TypeError(
                f"inference_many takes an iterable of items, got {type(items).__name__}; "
                f"wrap a single item in a list or call inference()"
            )
        _validate.timeout("timeout", timeout)  # checked even for no items
        _validate.priority(priority)
        batch = list(items)
        if not batch:
            return []
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            return await self._from_another_loop(
                lambda: self.inference_many(
                    batch, timeout=timeout, priority=priority, return_exceptions=return_exceptions
                )
            )
        self._check_room(len(batch))
        requests: list[Request[In]] = []
        try:
            for item in batch:
                requests.append(self._enqueue(loop, item, timeout, priority))
        except BaseException:  # an item refused (its length, shed_late) refuses the list:
            self._withdraw(requests)  # the items queued before it never reach the model
            raise
        futures = [request.future for request in requests]
        answered = loop.create_future()
        remaining = len(requests)

        def on_done(future: asyncio.Future[Any]) -> None:
            # runs before the next dispatch decision, so withdrawn items are never sent
            nonlocal remaining
            remaining -= 1
            failed = not future.cancelled() and future.exception() is not None
            if failed and not return_exceptions:
                self._withdraw(requests)
            if (remaining == 0 or (failed and not return_exceptions)) and not answered.done():
                answered.set_result(None)

        for future in futures:
            future.add_done_callback(on_done)
        try:
            await answered
            if not return_exceptions:
                for future in futures:  # the first failure, in item order
                    if future.done() and not future.cancelled() and future.exception():
                        future.result()
            results: list[Any] = [f.exception() or f.result() for f in futures]
            return results
        finally:
            self._withdraw(requests)

    def _withdraw(self, requests: list[Request[In]]) -> None:
        """Cancel the requests not answered yet; cancel every deadline timer."""
        for request in requests:
            if not request.future.done():
                request.future.cancel()
                self._abandon(request)
            elif request.deadline_timer is not None:
                request.deadline_timer.cancel()

    def submit(
        self, item: In, *, timeout: float | None = None, priority: int = 0
    ) -> concurrent.futures.Future[Out]:
        """Thread-safe entry: queue `item` from any thread; returns a concurrent future.

        The call goes through the proxy's event loop if that runs in another
        thread; a proxy running in no event loop is started on the default
        `BackgroundLoop`. Calling this from the proxy's own loop thread is
        refused: blocking on the future would deadlock.
        """
        future, _ = self._submit_threadsafe("submit", item, timeout, priority)
        return future

    def inference_sync(self, item: In, *, timeout: float | None = None, priority: int = 0) -> Out:
        """Blocking `inference`, for plain threads (Flask, Django sync views, scripts).

        Goes through the proxy's loop like `submit()`. `timeout` bounds the whole
        call (`DeadlineExceeded`); a wait interrupted by `KeyboardInterrupt` or
        the like withdraws the call. If the proxy's loop ends first, the call gets
        `InferenceError` (`ProxyClosed` if the proxy was closed): it never blocks
        for ever. Refused on the proxy's own loop thread.
        """
        self._require_init()
        seconds = self._timeout if timeout is None else _validate.timeout("timeout", timeout)
        future, bridge = self._submit_threadsafe("inference_sync", item, timeout, priority)
        # the proxy's loop enforces the deadline; the extra wait here only guards
        # against a loop too busy to answer at all
        if bridge is not None and not bridge.wait(
            future, None if seconds is None else seconds + 0.5
        ):
            assert seconds is not None  # only a bounded wait ends without the result
            raise DeadlineExceeded(self.name, seconds)
        return future.result()

    def _submit_threadsafe(
        self, method: str, item: In, timeout: float | None, priority: int
    ) -> tuple[concurrent.futures.Future[Out], LoopBridge | None]:
        """Route a call from this thread to the proxy's loop (to the default
        `BackgroundLoop`, where the proxy then binds, if it runs in none); the future
        and the bridge it went through (None: refused at once)."""
        self._require_init()
        self._refuse_own_model(method)

        def call() -> Coroutine[Any, Any, Out]:
            return self.inference(item, timeout=timeout, priority=priority)

        while True:  # each pass routes the call, or finds the loop it tried gone
            bridge = self._bridge
            if bridge is not None:
                if bridge.on_loop_thread:
                    raise self._would_deadlock(method)
                future = bridge.route(call, self._loop_ended_error)
                if future is not None:
                    return future, bridge
                if bridge.ending:  # the proxy leaves that loop in a moment: then bind anew
                    bridge.done.result()
                    continue
            if self._closed:  # refused as ever, without starting a loop to say so
                refused: concurrent.futures.Future[Out] = concurrent.futures.Future()
                refused.set_exception(self._closed_error())
                return refused, None
            background = BackgroundLoop.default()
            if background._on_loop_thread():  # where this proxy would now run
                raise self._would_deadlock(method)
            with contextlib.suppress(RuntimeError):  # it closed meanwhile: try the next one
                routed = background._route(call, self._loop_ended_error)
                if routed is not None:  # the proxy binds there, and closes with it
                    return routed

    def _route(
        self, make: Callable[[], Coroutine[Any, Any, T]]
    ) -> concurrent.futures.Future[T] | None:
        """Run `make()` on the proxy's loop for a caller elsewhere; None if that loop has
        ended or does not run."""
        bridge = self._bridge
        return None if bridge is None else bridge.route(make, self._loop_ended_error)

    async def _from_another_loop(self, make: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """Serve a call made on a loop this proxy is not bound to: bind to it and run
        `make()` here if the proxy is free; else route `make()` to the loop the proxy
        runs in (another thread's). A loop caught between the phases of its shutdown
        (not running for a moment, calls still on it) is given `_PAUSED_GRACE` seconds
        before the call is refused; one in its end hook, until the proxy has left it."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + _PAUSED_GRACE
        while True:
            bridge = self._bridge
            if bridge is not None:
                future = bridge.route(make, self._loop_ended_error)
                if future is not None:
                    return await asyncio.wrap_future(future)
                if bridge.ending:  # the proxy leaves that loop in a moment
                    await asyncio.wrap_future(bridge.done)
                    continue
            try:
                if self._bind(loop):
                    return await make()
            except _StillBusy:
                if loop.time() >= give_up:
                    raise
                await asyncio.sleep(_PAUSED_GRACE / 100)
            # else its loop runs again: route to it

    def _refuse_own_model(self, method: str) -> None:
        """Refuse a call made by this proxy's own model (in one of its batches, on the loop
        or its worker thread): that call could only run after the batch waiting for it."""
        if _current_batch.get() in self._batch_tasks:
            raise RuntimeError(
                f"{self.name}.{method}() was called from inside its own model: the model's "
                f"batch would wait for a call that can only run after that batch, a "
                f"deadlock. Call the model's code directly instead"
            )

    def _would_deadlock(self, method: str) -> RuntimeError:
        return RuntimeError(
            f"{self.name}.{method}() was called on the proxy's own event-loop thread, where "
            f"waiting for its result would deadlock; use await proxy.inference(item)"
        )

    # -- requests ------------------------------------------------------------------------

    def _check_room(self, wanted: int) -> None:
        if self._closed:
            raise self._closed_error()
        limit = self._max_queue_size
        assert self._scheduler is not None
        if limit is not None and self._scheduler.queue.live + wanted > limit:
            stats = self._stats
            stats.rejected += wanted
            if stats.listeners:
                stats.notify("request_rejected", wanted)
            raise QueueFull(self.name, limit)

    def _enqueue(
        self,
        loop: asyncio.AbstractEventLoop,
        item: In,
        timeout: object,
        priority: object,
        stream: bool = False,
    ) -> Request[In]:
        if stream is not self._streaming:
            raise TypeError(
                f"{self.name} streams its results (its _inference is a generator): "
                f"use `async for chunk in proxy.stream(item)`"
            )
        if type(priority) is not int:
            priority = _validate.priority(priority)
        if _current_batch.get() is not None:  # (inline: every call passes here)
            self._refuse_own_model("stream" if stream else "inference")
        seconds = self._timeout if timeout is None else _validate.timeout("timeout", timeout)
        cost = 1 if self._length is None else self._cost(item)
        self._check_room(1)
        now = loop.time()
        scheduler = self._scheduler
        assert scheduler is not None
        kind = StreamRequest if stream else Request
        if seconds is None:
            request: Request[In] = kind(item, loop.create_future(), priority, now, cost)
        else:
            deadline = now + seconds
            if self._shed_late:
                self._shed_if_late(scheduler, priority, deadline, cost, seconds)
            request = kind(item, loop.create_future(), priority, now, cost, deadline)
            request.deadline_timer = loop.call_at(deadline, self._expire, request, seconds)
        scheduler.submit(request)
        stats = self._stats
        stats.requests += 1
        if stats.listeners:
            stats.notify("request_queued", scheduler.queue.live)
        return request

    def _shed_if_late(
        self, scheduler: Scheduler[In], priority: int, deadline: float, cost: int, seconds: float
    ) -> None:
        """Refuse a call at once when even the soonest predicted answer misses its deadline."""
        expected = scheduler.expected_finish(priority, deadline, cost)
        if expected is not None and expected > deadline:
            stats = self._stats
            stats.shed += 1
            if stats.listeners:
                stats.notify("request_shed")
            raise DeadlineExceeded(self.name, seconds, expected - (deadline - seconds))

    def _cost(self, item: In) -> int:
        assert self._length is not None
        try:
            cost = self._length(item)
        except TypeError as exc:
            if not self._default_length:
                raise
            raise TypeError(
                f"{self.name}: max_batch_tokens measures items with batchproxy.tensors.length, "
                f"which says: {exc}; pass length=... to measure these items"
            ) from exc
        if isinstance(cost, bool) or not isinstance(cost, int) or cost < 0:
            raise TypeError(
                f"{self.name}: length(item) must return an int >= 0, got {cost!r} "
                f"for {type(item).__name__}"
            )
        return cost

    def _expire(self, request: Request[In], seconds: float) -> None:
        """Deadline timer: fail the call; a queued request leaves without reaching the model."""
        future = request.future
        if future.done():
            return
        future.set_exception(DeadlineExceeded(self.name, seconds))
        if self._scheduler is not None:
            self._scheduler.queue.discard(request)
        self._stats.timed_out += 1
        self._finished("timed_out", request)

    def _abandon(self, request: Request[In]) -> None:
        """The caller is gone (cancelled): take its request out if still queued; count it once."""
        if not request.future.cancelled():
            return
        if self._scheduler is not None:
            self._scheduler.queue.discard(request)
        if request.deadline_timer is not None:
            request.deadline_timer.cancel()
            request.deadline_timer = None
        self._stats.cancelled += 1
        self._finished("cancelled", request)

    def _recount_as_cancelled(self, future: asyncio.Future[Any]) -> None:
        """Count a settled call as cancelled instead: its caller was cancelled before it
        could take the outcome. (`request_finished` reported the outcome already.)"""
        stats = self._stats
        error = future.exception()
        if error is None:
            stats.succeeded -= 1
        elif isinstance(error, DeadlineExceeded) and error.proxy == self.name:
            stats.timed_out -= 1
        else:
            stats.errors -= 1
        stats.cancelled += 1

    def _finished(self, outcome: str, request: Request[In]) -> None:
        stats = self._stats
        if stats.listeners:
            seconds = request.future.get_loop().time() - request.enqueued_at
            stats.notify("request_finished", outcome, seconds)

    # -- batches -------------------------------------------------------------------------

    def _start_batch(self, requests: list[Request[In]] | None) -> None:
        """Start a batch task for `requests` (None: it takes what is queued when it runs).

        The scheduler counted the batch in flight. The task's coroutine settles its
        requests and frees the slot however it ends, once it has started; a task
        cancelled before its first step never runs a line of it, so its done
        callback does that instead (`_batch_task_done`).
        """
        assert self._loop is not None
        # a batch serves many callers: it starts from an empty contextvars context
        # rather than from whichever caller's context triggered the dispatch
        run = self._run_stream(requests) if self._streaming else self._run_batch(requests)
        task = contextvars.Context().run(
            self._loop.create_task, run, name=self._batch_task_name
        )  # named: a default name costs a counter and a format per batch
        self._batch_tasks.add(task)
        self._not_started.add(task)
        task.add_done_callback(functools.partial(self._batch_task_done, self._scheduler, requests))

    def _batch_task_done(
        self,
        scheduler: Scheduler[In] | None,
        requests: list[Request[In]] | None,
        task: asyncio.Task[None],
    ) -> None:
        """A batch task ended. If it never started (cancelled before its first step:
        "cancel every other task" at shutdown), fail its callers and free its slot."""
        self._batch_tasks.discard(task)
        if task not in self._not_started:
            return  # it ran: it settled its requests and freed its slot itself
        self._not_started.discard(task)
        if scheduler is None or not self._serves(scheduler):
            return  # its event loop is gone, and the slot with it
        if requests is None:  # it was to take what is queued: that batch fails instead
            requests = scheduler.take_reserved()
            if not requests:
                return  # nobody left: take_reserved freed the slot
        self._fail(requests, self._cancelled_batch_error(asyncio.CancelledError()))
        scheduler.batch_finished()

    def _started(self) -> asyncio.Task[Any]:
        """The batch task now running its first step (it settles its batch itself)."""
        task = asyncio.current_task()
        assert task is not None
        self._not_started.discard(task)
        _current_batch.set(task)  # seen by the model, on any executor
        return task

    def _cancelled_batch_error(self, cancel: BaseException) -> InferenceError:
        """What the callers of a batch cancelled from outside get (its event loop is
        ending, or something cancelled every task)."""
        return InferenceError(
            self.name,
            cancel,
            "the batch task was cancelled from outside (the event loop ending, or every "
            "task cancelled) before this call was answered",
        )

    async def _run_batch(self, requests: list[Request[In]] | None) -> None:
        loop, scheduler = self._loop, self._scheduler
        assert loop is not None
        assert scheduler is not None
        task = self._started()
        if requests is None:  # started by an arrival to an idle proxy: take the batch now
            requests = scheduler.take_reserved()
            if not requests:
                return
        size = len(requests)
        started = loop.time()
        units = self._record_start(requests, started)
        watchdog = (
            None
            if self._batch_timeout is None
            else loop.call_at(started + self._batch_timeout, self._overran, task, requests)
        )
        error: BaseException | None = None
        released = False  # the slot was handed on before the callers were answered
        try:
            try:
                results, whole = await self._call_model([r.item for r in requests])
            except BaseException as exc:
                error = self._model_failure(exc, loop, task)
                if error is None:  # the event loop is ending: so does the batch
                    if isinstance(exc, asyncio.CancelledError):
                        self._fail(requests, self._cancelled_batch_error(exc))
                    raise
            else:
                # returned after the watchdog gave up on it
                late = bool(self._overran_batches) and task in self._overran_batches
                released = (
                    not late
                    and scheduler.queue.live > 0  # (the cheap test first: often nobody waits)
                    and _clean(results, size)
                    and scheduler.batch_finished_early()
                )
                finished = loop.time()
                error = self._deliver(requests, results, finished)
                if error is None and whole and not late:  # one timely call on the whole batch
                    self._cost_model.add(units, finished - started)
            if error is not None:
                self._batch_failed(requests, error)
        finally:
            if watchdog is not None:
                watchdog.cancel()
            self._batch_ended(task, scheduler, size, loop.time() - started, error, released)

    async def _run_stream(self, requests: list[Request[In]] | None) -> None:
        """Run a streaming batch: step the generator, hand each step's elements to the
        callers still there, until it returns or nobody is left. `batch_timeout`
        bounds each step."""
        loop, scheduler = self._loop, self._scheduler
        assert loop is not None
        assert scheduler is not None
        claimed = self._claim_batch(scheduler, requests)
        if claimed is None:
            return
        requests, task = claimed
        started = loop.time()
        self._record_start(requests, started)
        steps = Steps(self._model([r.item for r in requests]), self._executor)
        error: BaseException | None = None
        try:
            finished, error = await self._step_through(steps, requests, task)
            if not finished:  # everybody left, or the batch failed: the generator is not done
                with contextlib.suppress(Exception):
                    await steps.close()
        except asyncio.CancelledError as exc:  # not the watchdog's: the loop is ending
            error = self._cancelled_batch_error(exc)
            raise
        finally:
            self._stream_batch_ended(task, scheduler, requests, error, started)

    def _claim_batch(
        self, scheduler: Scheduler[In], requests: list[Request[In]] | None
    ) -> tuple[list[Request[In]], asyncio.Task[Any]] | None:
        """What a streaming batch task runs: its requests (taken from the queue now if an
        arrival to an idle proxy started it; None if every one left meanwhile) and the
        task, made the current batch for the model. (`_run_batch` does the same inline:
        it is the idle path's hot spot.)"""
        task = self._started()
        if requests is None:
            requests = scheduler.take_reserved()
            if not requests:
                return None
        return requests, task

    def _serves(self, scheduler: Scheduler[In]) -> bool:
        """Whether `scheduler` is still this proxy's, on a live loop: else a batch ending
        now was closed as garbage after its event loop ended, and its slot with it."""
        return scheduler is self._scheduler and not scheduler.loop.is_closed()

    def _stream_batch_ended(
        self,
        task: asyncio.Task[Any],
        scheduler: Scheduler[In],
        requests: list[Request[In]],
        error: BaseException | None,
        started: float,
    ) -> None:
        """A streaming batch is over: fail its open streams with `error`, or end them."""
        if not self._serves(scheduler):
            return
        now = scheduler.loop.time()
        if error is not None:
            self._batch_failed(requests, error)
        else:
            self._end_streams(requests, now)
        self._batch_ended(task, scheduler, len(requests), now - started, error, False)

    async def _step_through(
        self, steps: Steps, requests: list[Request[In]], task: asyncio.Task[Any]
    ) -> tuple[bool, BaseException | None]:
        """The steps of a streaming batch: (whether the generator returned, the error
        that ended the batch, if one did)."""
        loop = self._loop
        assert loop is not None
        told = unmarked = requests  # the callers in the last keep; those not ended by it
        keep: list[int] | None = None
        while True:
            await let_consumers_read(told)
            watchdog = (
                None
                if self._batch_timeout is None
                else loop.call_later(self._batch_timeout, self._overran, task, told)
            )
            try:
                elements = await steps.send(keep)
            except BaseException as exc:
                error = self._model_failure(exc, loop, task)
                if error is None:  # the event loop is ending: so does the batch
                    raise
                return True, error
            finally:
                if watchdog is not None:
                    watchdog.cancel()
            if elements is _FINISHED:
                return True, None
            try:
                elements = self._result_sequence(elements)
            except BaseException as exc:
                return False, _caller_error(self.name, exc)
            view = matching_view((told, unmarked, requests), len(elements))
            if view is None:
                return False, BatchSizeMismatch(self.name, len(told), len(elements))
            now = loop.time()
            marked = set()  # ended by the model itself, this step
            for request, element in zip(view, elements, strict=True):
                if is_closing(element):
                    marked.add(request)
                if not request.future.done():
                    self._stream_element(request, element, now)
            unmarked = [r for r in unmarked if r not in marked]
            keep = [i for i, r in enumerate(view) if not r.future.done()]
            told = [view[i] for i in keep]
            if not told:
                return False, None

    def _model_failure(
        self,
        exc: BaseException,
        loop: asyncio.AbstractEventLoop,
        batch: asyncio.Future[Any] | None,
    ) -> Exception | None:
        """What a model call (or step) of `batch` that raised `exc` means for its callers:
        the error they get, or None when `exc` must propagate (the batch's event loop is
        ending: its task was cancelled from outside, or closed after the loop was)."""
        if _closing_with_its_loop(exc, loop):
            return None
        if isinstance(exc, asyncio.CancelledError):
            if batch is not None and batch in self._overran_batches:
                _uncancel(batch)  # our own watchdog cancelled it, not the event loop
                return self._overran_batches[batch]
            if _cancel_requested():
                return None
        if not isinstance(exc, Exception):
            logger.error("%s.%s raised %r", self.name, self._model_name, exc)
        return _caller_error(self.name, exc)

    def _stream_element(self, request: Request[In], element: object, now: float) -> bool:
        """Hand one step's element to its streaming caller: a chunk, or the end; whether
        a chunk went (a plain one, or `Last`'s)."""
        assert isinstance(request, StreamRequest)
        if not is_closing(element):
            if self._unread_too_long(request):
                return False
            request.chunks.put_nowait(element)
            return True
        if isinstance(element, BaseException):
            self._fail([request], _caller_error(self.name, element))
            return False
        if isinstance(element, Last):
            request.chunks.put_nowait(element.chunk)
        self._end_streams([request], now)
        return isinstance(element, Last)

    def _unread_too_long(self, request: StreamRequest[In]) -> bool:
        """Whether a stream's consumer has stopped reading (see `_streaming`): if so, fail
        it, which takes it out of its batch at the next step."""
        unread = request.chunks.qsize()
        if self._closed and unread >= 2:  # a chunk unread for a whole step, and a turn
            error: BatchProxyError = ProxyClosed(
                self.name, detail="it closed while this stream's consumer was not reading it"
            )
        elif self._stream_buffer is not None and unread >= self._stream_buffer:
            error = StreamBufferFull(self.name, self._stream_buffer)
        else:
            return False
        self._fail([request], error)
        return True

    def _end_streams(self, requests: list[Request[In]], now: float) -> None:
        """End the streams still open among `requests`, successfully."""
        stats = self._stats
        for request in requests:
            if not request.future.done():
                request.future.set_result(None)
                stats.succeeded += 1
                stats.total_latency.append(now - request.enqueued_at)
                self._finished("succeeded", request)

    def _batch_ended(
        self,
        task: asyncio.Task[Any],
        scheduler: Scheduler[In],
        size: int,
        seconds: float,
        error: BaseException | None,
        released: bool,
    ) -> None:
        """The model call of a batch is over: record it, mark the proxy healthy again if
        it answered in time, and free the batch slot (unless already handed on)."""
        if not self._serves(scheduler):
            return
        stats = self._stats
        stats.model_time.append(seconds)
        if stats.listeners:
            stats.notify("batch_finished", size, seconds, error)
        if self._overran_batches.pop(task, None) is not None:
            return  # the watchdog failed its callers and freed its slot already
        if not self._health.healthy and not self._overran_batches and not self._closed:
            self._health = _HEALTHY  # the model answers in time again
        if not released:
            scheduler.batch_finished()

    def _overran(self, task: asyncio.Task[None], requests: list[Request[In]]) -> None:
        """Watchdog: the batch ran past `batch_timeout`. Fail its callers now, free its
        slot, abandon the model call (cancel it) and mark the proxy unhealthy."""
        assert self._batch_timeout is not None
        assert self._scheduler is not None
        error = BatchTimeout(self.name, self._batch_timeout, len(requests))
        self._overran_batches[task] = error
        self._stats.timed_out_batches += 1
        self._health = Health(False, str(error), time.time())
        logger.error("%s", error)
        self._fail(requests, error)
        self._scheduler.batch_finished()
        task.cancel()
        if self._stop_on_overrun and not self._closed:
            self._stop_intake(error)

    def _stop_intake(self, cause: BatchProxyError) -> None:
        """Take no more work after `cause`: new calls and queued requests get `ProxyClosed`."""
        self._closed = True
        self._stopped_by = cause
        scheduler = self._scheduler
        assert scheduler is not None
        scheduler.close()
        for request in scheduler.queue.drain():
            self._refuse(request)

    def _record_start(self, requests: list[Request[In]], started: float) -> int:
        """Count a batch that starts now; return the units the model computes: items,
        or padded tokens (batch x longest) when items have a length."""
        stats, size = self._stats, len(requests)
        stats.batches += 1
        stats.items += size
        stats.batch_sizes[size] = stats.batch_sizes.get(size, 0) + 1
        waits = [started - request.enqueued_at for request in requests]
        stats.queue_wait.extend(waits)
        units = size if self._length is None else size * max(r.cost for r in requests)
        if self._length is not None:
            stats.record_padding(real=sum(r.cost for r in requests), padded=units)
        if stats.listeners:
            stats.notify("batch_started", size, waits)
        return units

    async def _call_model(self, items: list[In], *, top: bool = True) -> tuple[Any, bool]:
        """Run the model on `items`: (its results, whether one call on all of them made
        them, as opposed to calls on pieces).

        Out of memory (with `oom_backoff`): lower the cap and run the items in chunks
        of the cap, each lowering it further if need be. Raised (with
        `isolate_errors`): run each half on its own, down to single items, so that
        only the items that make the model raise fail. Either way an item that fails
        alone gets the error in its own slot, so only its caller fails.
        """
        try:
            results = await self._executor.run(self._model, items)
        except Exception as exc:
            oom = self._is_oom is not None and self._is_oom(exc)
            if not (oom or self._isolate_errors):
                raise
            if len(items) == 1:
                return [exc], False
            half = (len(items) + 1) // 2
            if oom:
                self._back_off(len(items), exc)
            else:
                self._stats.isolation_splits += 1
                if top:
                    logger.warning(
                        "%s: a batch of %d raised %r; re-running it in halves to find the "
                        "items that fail", self.name, len(items), exc,
                    )  # fmt: skip
            pieces: list[Any] = []
            start = 0
            while start < len(items):  # by index: a piece answered with a wrong count
                piece = self._cap.cap if oom else half  # the cap may drop meanwhile
                chunk = items[start : start + piece]  # shows up as a mismatch
                results, _ = await self._call_model(chunk, top=False)
                pieces.extend(self._result_sequence(results))
                start += len(chunk)
            return pieces, False
        cap = self._cap
        if cap.cap < cap.limit and cap.succeeded(len(items)):  # backed off: creep back up
            self._apply_cap()
        return results, True

    def _back_off(self, size: int, exc: Exception) -> None:
        """A batch of `size` ran out of memory: lower the cap."""
        self._cap.out_of_memory(size)
        self._stats.oom_splits += 1
        self._apply_cap()
        logger.warning(
            "%s: out of memory on a batch of %d (%r); retrying in chunks of %d",
            self.name, size, exc, self._cap.cap,
        )  # fmt: skip

    def _apply_cap(self) -> None:
        scheduler = self._scheduler
        if scheduler is not None:
            scheduler.reconfigure(*self._limits())

    def _deliver(
        self, requests: list[Request[In]], results: object, now: float
    ) -> Exception | None:
        """Hand result i to caller i; return the batch-wide error instead when the results
        cannot be matched to the callers."""
        try:
            results = self._result_sequence(results)
        except BaseException as exc:  # a sequence whose len() or iteration itself fails
            return _caller_error(self.name, exc)
        if len(results) != len(requests):
            return BatchSizeMismatch(self.name, len(requests), len(results))
        stats = self._stats
        latency = stats.total_latency
        succeeded = errors = 0
        for request, result in zip(requests, results, strict=True):
            future = request.future
            if future.done():
                continue
            if isinstance(result, BaseException):
                future.set_exception(_caller_error(self.name, result))
                errors += 1
                if stats.listeners:
                    self._finished("error", request)
            else:
                future.set_result(result)
                succeeded += 1
                if stats.listeners:
                    self._finished("succeeded", request)
            latency.append(now - request.enqueued_at)
        stats.succeeded += succeeded
        stats.errors += errors
        return None

    def _result_sequence(self, results: object) -> list[Any] | tuple[Any, ...]:
        """What the model returned, as a list or tuple (an array becomes a list of its
        rows); a TypeError if it is not a sequence of results."""
        if type(results) is list or type(results) is tuple:  # subclasses: len/iter may raise
            return results
        cause: Exception | None = None
        if hasattr(results, "__len__") and not isinstance(
            results, (str, bytes, bytearray, Mapping, Set)
        ):
            try:
                return list(results)  # type: ignore[call-overload,no-any-return]
            except TypeError as exc:  # a 0-d array, say
                cause = exc
        error = TypeError(
            f"{self.name}._inference must return a sequence with one result per item "
            f"(list, tuple or array), got {type(results).__name__}"
        )
        raise error from cause

    def _batch_failed(self, requests: list[Request[In]], error: BaseException) -> None:
        """The batch failed as a whole: its callers still waiting get `error`."""
        stats = self._stats
        stats.failed_batches += 1
        self._fail(requests, error)
        if stats.listeners:
            stats.notify("error", error, len(requests))

    def _fail(self, requests: list[Request[In]], error: BaseException) -> None:
        for request in requests:
            if not request.future.done():
                request.future.set_exception(error)
                self._stats.errors += 1
                self._finished("error", request)

    # -- observation ---------------------------------------------------------------------

    @property
    def stats(self) -> ProxyStats:
        """An immutable snapshot of counters, queue depth and recent latencies."""
        self._require_init()
        scheduler = self._scheduler
        depth, running = (
            (0, 0) if scheduler is None else (scheduler.queue.live, scheduler.in_flight)
        )
        return self._stats.snapshot(depth, running, self._cap.cap, self._cost_model.estimate())

    @property
    def health(self) -> Health:
        """Whether the model answers in time (see `batch_timeout`), and if not, why."""
        return self._health

    @property
    def healthy(self) -> bool:
        """`proxy.health.healthy`: False from a batch overrunning `batch_timeout` until a
        later batch returns in time. Always True without a `batch_timeout`."""
        return self._health.healthy

    def add_listener(self, listener: Listener) -> None:
        """Register hooks called on the event loop; see `Listener`."""
        if not isinstance(listener, Listener):
            raise TypeError(f"listener must be a batchproxy.Listener, got {listener!r}")
        self._stats.listeners.append(listener)

    def remove_listener(self, listener: Listener) -> None:
        self._stats.listeners.remove(listener)


_current_batch: contextvars.ContextVar[asyncio.Task[Any] | None] = contextvars.ContextVar(
    "batchproxy_current_batch", default=None
)
"""The batch task a model call belongs to (propagated to the worker thread)."""


def _no_model(cls: str) -> str:
    return (
        f"{cls} has no model: subclass Proxy and implement _inference, or pass offload= an "
        f"executor that hosts one (ProcessWorkers, RayActors, WorkerThread(model=...))"
    )


def _capacity_watcher(proxy: Proxy[Any, Any]) -> Callable[[int], None]:
    """A capacity callback that does not keep `proxy` alive."""
    ref = weakref.ref(proxy)

    def changed(capacity: int) -> None:
        target = ref()
        if target is not None:
            target._on_capacity(capacity)

    return changed


def _caller_error(proxy: str, error: BaseException) -> Exception:
    """How an error from the model reaches its callers: an `Exception` as it is, but a
    `StopIteration` (a future refuses it) in a `RuntimeError`, as Python does when one
    escapes a coroutine, and any other `BaseException` in `InferenceError`."""
    if isinstance(error, StopIteration):
        wrapped = RuntimeError(f"{proxy}._inference gave a StopIteration as a result: {error!r}")
        wrapped.__cause__ = error
        return wrapped
    return error if isinstance(error, Exception) else InferenceError(proxy, error)


def _clean(results: object, size: int) -> bool:
    """Whether `results` answers every caller with a result (no error for anyone)."""
    return (
        (type(results) is list or type(results) is tuple)  # a subclass's len() may raise
        and len(results) == size
        and not any(isinstance(r, BaseException) for r in results)
    )


class _StillBusy(RuntimeError):
    """The proxy's loop is not running and still has its calls: it cannot move."""


_PAUSED_GRACE = 0.1
"""Seconds a call from another loop waits for the proxy's loop, stopped with calls
still on it, to run again or end (between the phases of `asyncio.run`'s shutdown)."""


class _Policies(NamedTuple):
    """The scheduling and failure policies `configure()` may change, checked."""

    timeout: float | None
    adaptive: bool
    aging: float | None
    shed_late: bool
    isolate_errors: bool
    batch_timeout: float | None
    stop_on_overrun: bool


def _is_adaptive(window: object) -> bool:
    return _validate.choice("window", window, ("adaptive", "fixed")) == "adaptive"


def _aging_seconds(aging_ms: object) -> float | None:
    if aging_ms is None:
        return None
    return _validate.duration("aging_ms", aging_ms, allow_zero=False, milliseconds=True)


def _stops_on_overrun(on_batch_timeout: object) -> bool:
    return _validate.choice("on_batch_timeout", on_batch_timeout, ("serve", "stop")) == "stop"


def _closing_with_its_loop(error: BaseException, loop: asyncio.AbstractEventLoop) -> bool:
    """Whether `error` is the `GeneratorExit` of a batch coroutine closed by garbage
    collection after its event loop was closed (not a model raising GeneratorExit)."""
    return isinstance(error, GeneratorExit) and loop.is_closed()


def _uncancel(task: asyncio.Future[Any]) -> None:
    """Withdraw a cancellation the proxy requested itself (Python 3.11+ keeps count)."""
    uncancel = getattr(task, "uncancel", None)
    if uncancel is not None:
        uncancel()


def _cancel_requested() -> bool:
    """Whether the current task was cancelled from outside (Python 3.11+ can tell)."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    return bool(cancelling is not None and cancelling())
