"""`Proxy[In, Out]`: the public face. Lifecycle, the call methods, options, observation.

One request's way through the library, top to bottom:

1. `Proxy.inference` (here) finds the proxy bound to the running loop (else
   `Binder.serve_elsewhere`, `_loops.binding`), and `Intake.admit` (`_intake`) makes
   the request and queues it in the binding's `Scheduler` (`_scheduling.scheduler`, with
   `_scheduling.queue`).
2. The scheduler decides when a batch leaves and who is in it, and calls
   `Runner.start_batch` (`_runs.batches`): a batch task, in a fresh context.
3. The batch task claims its requests, calls the model through the `Executor`
   (`_executors.base`: the loop, a `WorkerThread`, worker processes, Ray actors), and
   `Settlement.deliver` (`_settle`) resolves each caller's future with its own
   result; the slot is freed for the next batch.
4. The caller resumes in `inference` with its result.

Also: `_options`, `_lifecycle`, `_events` (counts and tells `_listeners`), `_loops.bridge`,
the run kinds (`_runs.streams`, `_generation`; chosen in `_runs.model`)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import types
import weakref
from abc import ABC
from collections.abc import AsyncGenerator, Callable, Hashable
from typing import Any, TypeVar

from typing_extensions import Self, Unpack

from . import _validate
from ._arguments import call_with_arguments, model_arguments
from ._call_forms import CallForms
from ._errors import BatchProxyError
from ._events import Events
from ._executors.base import Executor, WeakWatcher
from ._executors.worker_thread import WorkerThread
from ._fork import forget_threads_in_forked_children
from ._intake import Intake
from ._lifecycle import Lifecycle, State
from ._listeners import Listener, Listeners
from ._loops.binding import Binder
from ._loops.sync_scope import SyncScope
from ._options import ConfigurableOptions, Options, ProxyOptions, options_for
from ._reachable import check_queue_bound
from ._runs.batches import ModelOutput, RunKind, Runner, current_batch
from ._runs.drain import cut_drain
from ._runs.model import choose_executor, refuse_reruns, run_kind_of
from ._runs.streams import _CLOSED, StreamRequest
from ._scheduling.placement import by_tenant
from ._settle import Settlement
from ._stats import Health, ProxyStats, StatsRecorder

__all__ = ["Proxy"]

In = TypeVar("In")
Out = TypeVar("Out")

_UNINITIALIZED = Lifecycle("(uninitialized)", State.UNINITIALIZED)
_NO_BINDER: Any = types.SimpleNamespace(current=None)  # so a first call reaches _require_init


class Proxy(ABC, CallForms[In, Out], SyncScope):
    """Batch concurrent `await proxy.inference(item)` calls into `_inference(items)` calls.

    Subclass it and implement `_inference`. `batch_size` is the most items in one
    call; the other options are keywords, described with `Options`. Two more:

    - `offload`: where batches run. `True` runs `_inference` on a private worker
      thread, a `WorkerThread` shares one between proxies; a plain `def
      _inference` always runs on a worker thread, never on the event loop. An
      executor that hosts a model of its own (`ProcessWorkers`, `RayActors`,
      `WorkerThread(model=...)`) replaces `_inference`: use `Proxy(offload=...)`
      directly, without a subclass.
    - `name`: how stats, errors and logs name this proxy (default: class name).

    `async with proxy:` starts it and drains it (`aclose()`) on exit; from plain code
    (no event loop in the thread), `with proxy:` does the same on the process's `with`
    loop, and threads call it inside with `inference_sync`, `submit` and
    `inference_many_sync`.

    Hooks a subclass may override: `_inference` (the model) and `_cost` (an item's
    cost, by `length` by default). The other underscore names are the library's
    own (its `GenerationProxy`, `TensorProxy` and `@batch` use them): do not
    override them.
    """

    # These are the library's own; do not override.
    _group_by_length = True  # TensorProxy(length_aware=False): costs without grouping
    _pads_batch_axis = False  # TensorProxy: fills batches up to `batch_sizes` itself
    _model_name = "_inference"  # what the model is called in logs
    # the class defaults, so a subclass that forgot super().__init__() gets a clear error
    _lifecycle = _UNINITIALIZED
    _binder: Binder[In] = _NO_BINDER

    def __init__(
        self,
        batch_size: int = 64,
        *,
        offload: bool | Executor = False,
        name: str | None = None,
        **options: Unpack[ProxyOptions],
    ) -> None:
        self.name: str = _validate.name(name) or type(self).__name__
        # held by the intake (`_options` reads it there)
        opts = options_for(f"{type(self).__name__}()", batch_size, options)
        # None unless `_inference` takes per-batch arguments (`with_args`)
        self._arguments = model_arguments(type(self), self.name, opts.key is not None)
        model = self._model_function()
        kind = self._run_kind(model, offload)
        refuse_reruns(self.name, kind, opts)
        executor, self._owns_executor = choose_executor(
            type(self).__name__, self.name, model, self._has_own_model(), offload
        )
        self._executor = executor
        # every count and every listener call of this proxy goes through its events
        self._events = Events(StatsRecorder(self.name), Listeners(self.name))
        settlement = Settlement(self.name, self._events)
        lifecycle = Lifecycle(self.name)
        self._intake: Intake[In] = Intake(
            name=self.name,
            options=opts,
            lifecycle=lifecycle,
            settlement=settlement,
            cost=self._cost,
            streams=kind.streams,
            keys=not kind.admits_itself,
            arguments=self._arguments,
        )
        self._runner: Runner[In] = Runner(
            name=self.name,
            model_name=self._model_name,
            model=model,
            executor=executor,
            kind=kind,
            holder=self._intake,
            by_cost=self._intake.measures,
            group_by_cost=self._group_by_length,
            lifecycle=lifecycle,
            settlement=settlement,
            on_cap_change=self._apply_limits,
            model_pads=self._pads_batch_axis,
        )
        runner = self._runner
        self._binder: Binder[In] = Binder(self, lifecycle, settlement, runner.new_scheduler)
        # weak: the executor may outlive the proxy
        self._capacity_watcher = WeakWatcher(self, Proxy._on_capacity, Proxy._queued)
        executor.watch_capacity(self._capacity_watcher)
        if isinstance(executor, WorkerThread) and self._owns_executor:
            # a proxy dropped without aclose() still stops its thread
            weakref.finalize(self, executor.close).atexit = False
        forget_threads_in_forked_children(self)
        check_queue_bound(self, self.name, opts)
        self._lifecycle = lifecycle  # initialized: the proxy can be used

    # -- the model (hooks) ---------------------------------------------------------------

    def _inference(self, items: list[In], /) -> ModelOutput[Out]:
        """Run the model on one batch; return one result per item, in order. Or stream:
        a generator (`async def` or plain `def`) that yields one element per caller
        still in the batch at each step; see `stream()`.

        Implement it in a subclass (unless `offload` hosts the model). May be `async
        def` or plain `def` (run on a worker thread). Put an `Exception` instance in
        slot i to fail caller i alone; raise to fail the whole batch.
        """
        raise NotImplementedError  # __init__ refuses a proxy without a model

    def _cost(self, item: In) -> int:
        """An item's cost, by `length` (called only when there is one). A hook: a
        subclass may compute it otherwise (an int >= 0)."""
        return self._intake.measure(item)

    # These are the library's own; do not override.

    def _model_function(self) -> Callable[[list[In]], Any]:
        """The library's own (not a hook): what a batch calls; `_inference`, or
        `_inference` with its per-batch arguments, if it takes them (`GenerationProxy`,
        `TensorProxy` and `@batch` supply another callable)."""
        arguments = self._arguments
        if arguments is None:
            return self._inference
        return call_with_arguments(self._inference, arguments.count)

    def _run_kind(self, model: Callable[..., Any], offload: object) -> RunKind:
        """The library's own (not a hook): how this proxy's batches run; streams for a
        generator model, else batches (`GenerationProxy` runs its engine)."""
        return run_kind_of(self.name, model, offload)

    def _has_own_model(self) -> bool:
        cls = type(self)
        return (
            cls._inference is not Proxy._inference
            or cls._model_function is not Proxy._model_function
        )

    def __repr__(self) -> str:
        state = "open" if self._lifecycle.open else "closed"
        return (
            f"<{type(self).__name__} {self.name!r} batch_size={self._options.batch_size} {state}>"
        )

    # -- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        """Bind to the running event loop and start the worker thread, if any.

        Optional: the first call does it lazily. Idempotent.
        """
        self._require_init()
        if self._binder.bind(asyncio.get_running_loop()) is None:
            raise RuntimeError(
                f"{self.name} is already running in another event loop (in another thread); "
                f"use proxy.submit(item) to call it from here"
            )
        self._start_worker()

    def _start_worker(self) -> None:
        """Start the private worker thread now, if the proxy has one not running yet."""
        executor = self._executor
        if self._owns_executor and isinstance(executor, WorkerThread) and not executor.started:
            executor.start()

    async def aclose(self, *, timeout: float | None = None) -> None:
        """Stop intake, run every accepted request to its outcome, release the worker.

        New calls get `ProxyClosed` from the moment this is called. Idempotent.
        Awaited from inside this proxy's `_inference` (where waiting for the
        batch would wait for itself), it returns at once and the close completes
        on the proxy's loop as soon as that batch is done.

        `timeout` (seconds, >= 0; None: no bound) is the drain's deadline: until then
        the proxy drains as without one; at the deadline the calls still queued get
        `DrainDeadline` (a `ProxyClosed`) and so do the callers of the batches still
        running, which are abandoned: cancelled on the event loop (a model on a
        thread or in a process runs on, its result dropped; the proxy's own worker
        thread is left to end when it does). Then it returns: every accepted call
        has its outcome. Streams end with the same error. A drain that ends before
        its deadline is exactly the drain without one. Several `aclose()` under way
        at once share the earliest deadline among them (one without a timeout waits
        for the others' drain to end, at their deadline at the latest).
        """
        self._require_init()
        if timeout is not None:
            timeout = _validate.duration("timeout", timeout, allow_zero=True, allow_inf=True)
            if timeout == math.inf:
                timeout = None
        self._lifecycle.drain()
        binding = self._binder.current
        cut = False
        if binding is not None and not binding.loop.is_closed():
            calling_batch = current_batch.get()
            if calling_batch in binding.batch_tasks:  # from the model, maybe on the worker
                close = functools.partial(self.aclose, timeout=timeout)
                binding.loop.call_soon_threadsafe(binding.close_after, calling_batch, close)
                return
            drain = functools.partial(
                binding.drain, timeout, functools.partial(cut_drain, self._runner, binding)
            )
            if binding.loop is asyncio.get_running_loop():
                await drain()
            elif (routed := self._binder.route(drain)) is not None:  # another loop
                with contextlib.suppress(BatchProxyError):  # its loop ended meanwhile:
                    await asyncio.wrap_future(routed)  # what was queued is settled
            else:  # its loop is paused: what is queued cannot run; what runs ends there
                self._binder.refuse_queued(binding)
            cut = binding.was_cut
        self._lifecycle.close()
        self._executor.unwatch_capacity(self._capacity_watcher)
        if self._owns_executor:
            stuck = cut or not self._runner.health.healthy
            if stuck and isinstance(self._executor, WorkerThread):
                self._executor.close(wait=False)  # its thread may be stuck in the model
            else:
                await self._executor.aclose()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # `with proxy:` from plain code (no event loop in the thread): `SyncScope`'s

    @property
    def closed(self) -> bool:
        return not self._lifecycle.open

    def _require_init(self) -> None:
        if self._lifecycle is _UNINITIALIZED:
            raise RuntimeError(
                f"{type(self).__name__}.__init__ must call super().__init__() "
                f"before the proxy is used"
            )

    def _after_fork_in_child(self) -> None:
        """In a forked child the parent's loop runs no more: the next call binds to the
        child's loop. The parent's queued, routed and running calls are the parent's."""
        self._binder.forget_after_fork()

    # -- options -------------------------------------------------------------------------

    @property
    def options(self) -> Options:
        """The proxy's options now (read-only; change them with `configure`)."""
        return self._intake.options  # where they are held, alone

    _options = options  # (what `CallForms` reads)

    def configure(self, **changes: Unpack[ConfigurableOptions]) -> None:
        """Change limits and policies while the proxy runs; the options mean what they
        mean for the constructor (see `Options`).

        Every value is checked before any is applied, so a bad call changes nothing.
        Thread-safe: from another thread the change reaches the proxy's loop through
        `call_soon_threadsafe`. It applies from the next batch on; running batches and
        queued requests are left as they are (a lower `max_queue_size` refuses new
        calls until the queue is below it; a new `timeout` or `shed_late` applies to
        calls made from now on, a new `batch_timeout` to batches started from now on,
        `isolate_errors` and `on_batch_timeout` to failures and overruns from now on,
        `stream_buffer` to chunks from now on). `max_concurrent_batches=None` follows
        the executor's capacity again.
        """
        self._require_init()
        new = self._options.evolve(**changes)
        refuse_reruns(self.name, self._runner.kind, new)
        check_queue_bound(self, self.name, new)
        self._intake.options = new  # where they are held: the runner reads them there
        self._runner.cap.set_limit(new.batch_size)
        self._apply_limits()

    def _apply_limits(self) -> None:
        """Hand the current limits to the scheduler, on its loop, from any thread."""
        binding = self._binder.current
        if binding is not None:  # else the next loop's scheduler starts with them
            binding.apply(self._runner.limits())

    def _on_capacity(self, capacity: int) -> None:
        """The executor was resized (maybe from another thread): follow it, if we do."""
        if self._options.max_concurrent_batches is None and self._lifecycle.open:
            self._apply_limits()

    def _queued(self) -> tuple[int, int]:  # for an autoscaling executor
        return getattr(self._binder.current, "queued", 0), self._options.batch_size

    # -- calls ---------------------------------------------------------------------------

    async def inference(
        self,
        item: In,
        *,
        timeout: float | None = None,
        priority: int = 0,
        tenant: Hashable | None = None,
        key: Hashable | None = None,
    ) -> Out:
        """Queue one item, wait for its batch, return its own result.

        `timeout` (seconds; default: the proxy's) bounds the whole call; `priority`:
        higher goes first, FIFO within a level. `tenant`: whose call it is, for fair
        sharing; `key`: batch it only with calls of the same key. These are the
        `CallOptions` every call method takes (spelt out here: the hot path).
        """
        binding = self._binder.current
        if binding is None or binding.loop is not asyncio.get_running_loop():
            self._require_init()  # bind here, or route to the loop it runs in
            return await self._binder.serve_elsewhere(  # (a lambda here costs cells per call)
                functools.partial(
                    self.inference, item, timeout=timeout, priority=priority, tenant=tenant, key=key
                )
            )
        request = self._intake.admit(binding, item, timeout, priority, tenant, key)
        try:
            result: Out = await request.future
            return result
        except asyncio.CancelledError:
            if request.future.cancelled():
                self._intake.abandon(binding, request)
            else:  # answered, then cancelled before this task resumed: it sees the cancel
                self._runner.settlement.recount_as_cancelled(request.future)
            raise
        finally:
            timer = request.deadline_timer
            if timer is not None:
                timer.cancel()
            # an error raised here keeps this frame in its traceback, and the frame's
            # request keeps its future, which keeps the error: a cycle per failed call
            del request

    async def stream(
        self,
        item: In,
        *,
        timeout: float | None = None,
        priority: int = 0,
        tenant: Hashable | None = None,
        key: Hashable | None = None,
    ) -> AsyncGenerator[Out, None]:
        """Queue one item; yield its chunks as its batch's steps produce them.

        For a proxy whose `_inference` is a generator (and for a `GenerationProxy`):
        `async for chunk in proxy.stream(item)`, best inside `contextlib.aclosing`.
        The stream ends when the model ends it (`END`, `Last`, or the generator
        returning) and raises what the model put in its slot, or raised. Leaving the
        loop early (`break`), closing the iterator or being cancelled withdraws the
        call: a queued one never reaches the model, a running one is dropped from its
        batch at the next step. `timeout` bounds the whole stream. On a proxy that
        does not stream, the stream is its one result. The keywords are `inference`'s.
        """
        if not self._runner.kind.streams:
            yield await self.inference(
                item, timeout=timeout, priority=priority, tenant=tenant, key=key
            )
            return
        self._require_init()
        binding = self._binder.bind(asyncio.get_running_loop())
        if binding is None:
            raise RuntimeError(
                f"{self.name} runs in an event loop in another thread; stream from there"
            )
        request = self._intake.admit(binding, item, timeout, priority, tenant, key, stream=True)
        assert isinstance(request, StreamRequest)
        chunks, future = request.chunks, request.future
        over = False  # the consumer read the end of the stream
        try:
            while (chunk := await chunks.get()) is not _CLOSED:
                yield chunk
            over = True
            future.result()  # the stream's error, if it failed
        finally:
            self._intake.end_stream(binding, request, read_to_the_end=over)

    # -- observation ---------------------------------------------------------------------

    @property
    def stats(self) -> ProxyStats:
        """An immutable snapshot of counters, queue depth and recent latencies."""
        self._require_init()
        binding, runner = self._binder.current, self._runner
        depth, running = (
            (0, 0)
            if binding is None
            else (binding.scheduler.queue.live, binding.scheduler.in_flight)
        )
        estimate = runner.cost_model.estimate()
        slots = runner.limits().slots
        tenants = None if binding is None else by_tenant(binding.scheduler.queue)
        stats = self._events.stats
        return stats.snapshot(depth, running, runner.cap.cap, estimate, slots, tenants)

    @property
    def health(self) -> Health:
        """Whether the model answers in time (`batch_timeout`) and the executor can run a
        batch (a pool with no worker ready cannot); if not, why."""
        self._require_init()
        own, executor = self._runner.health, self._executor.health
        return executor if own.healthy and executor is not None and not executor else own

    @property
    def healthy(self) -> bool:
        """`proxy.health.healthy`: False from a batch overrunning `batch_timeout` until
        one returns in time, and while the executor has no worker ready."""
        return self.health.healthy

    def add_listener(self, listener: Listener) -> None:
        """Register hooks called on the event loop; see `Listener`."""
        self._events.listeners.add(listener)

    def remove_listener(self, listener: Listener) -> None:
        self._events.listeners.remove(listener)
