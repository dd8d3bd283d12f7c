"""Batch runs: a batch task, from the scheduler's decision to its slot's release.

The scheduler decides that a batch leaves and calls `Runner.start_batch`, which
starts a task for it in a fresh `contextvars` context (a batch serves many
callers, so it sees none of theirs). The task runs the proxy's run kind: a plain
batch (`run_batch`, first below), a static stream (`_runs.streams.run_stream`) or a
`GenerationProxy` engine. Each kind is one straight coroutine that claims its
batch, calls the model through the executor, settles its callers
(`Settlement`) and releases its slot, however it ends; the pieces they share are
the methods of `Runner`, the only hooks a run kind uses.

A plain batch run, in order:

1. claim: mark the task started; a batch started by an arrival to an idle proxy
   takes what is queued now (that iteration's other arrivals join it);
2. record the start (stats, listeners) and arm the watchdog (`batch_timeout`);
3. call the model (`call_model`; with `oom_backoff` or `isolate_errors`, the
   re-runs of `_runs.reruns`, paid for only when turned on);
4. settle: result i to caller i, or the batch's error to every caller;
5. release: record the model time, mark the proxy healthy again if it answered
   in time, free the slot (unless handed on early, below).

Cancellation, written down:

- A caller cancelled while its batch runs: the batch runs on; its result is
  dropped (its future is done; settlement skips it).
- The batch task cancelled from outside (its event loop ending, "cancel every
  other task"): the callers still waiting get `InferenceError`, the slot is
  freed, and the cancellation propagates. A task cancelled before its first
  step never runs a line of its coroutine: its done callback settles its batch
  and frees its slot instead (`Runner.never_started`).
- The watchdog's own cancellation (`batch_timeout` passed): the callers already
  got `BatchTimeout` and the slot was freed when it fired; the task ends quietly.
- `_inference` raising `CancelledError` on its own: an ordinary batch failure (told
  from a cancellation by the task's count of cancel requests, on 3.10 too: `_tasks`).

When a batch answered every caller with a result and a full batch waits, the
slot is handed on before those callers are answered (`batch_finished_early`), so
the model starts on the next batch before they wake.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Iterator,
    Mapping,
    Sequence,
    Set,
)
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from .._errors import BatchProxyError, BatchSizeMismatch, BatchTimeout, InferenceError
from .._events import Events
from .._executors.base import Executor, LoopExecutor
from .._lifecycle import Lifecycle
from .._loops.binding import Binding
from .._oom import BatchCap
from .._options import Options
from .._scheduling.cost_model import CostModel
from .._scheduling.queue import Request
from .._scheduling.scheduler import Limits, Scheduler
from .._scheduling.sizes import batch_sizes
from .._settle import Settlement, caller_error
from .._stats import Health
from .._tasks import cancel_requested, current_batch, new_task, uncancel
from .callers import hand_over
from .keys import hand_key_over
from .reruns import call_with_reruns
from .sized import SizedExecutor

__all__ = ["HEALTHY", "ModelOutput", "RunKind", "Runner", "current_batch", "run_batch"]

logger = logging.getLogger("batchproxy")

In = TypeVar("In")
Out = TypeVar("Out")


async def run_batch(
    runner: Runner[In], binding: Binding[In], requests: list[Request[In]] | None
) -> None:
    """One plain batch, start to end: the five steps of the module docstring."""
    claimed = runner.claim(binding, requests)  # 1. claim
    if claimed is None:
        return
    requests, task = claimed
    scheduler, clock = binding.scheduler, binding.clock
    size = len(requests)
    started = clock()
    units = runner.record_start(requests, started)  # 2. record the start, arm the watchdog
    watchdog = runner.watch(binding, task, requests)
    error: BaseException | None = None
    released = False  # the slot was handed on before the callers were answered
    finished = None
    try:
        try:  # 3. call the model
            results, whole = await runner.call_model([r.item for r in requests])
        except BaseException as exc:
            error = runner.model_failure(exc, binding, task)
            if error is None:  # the event loop is ending: so does the batch
                if isinstance(exc, asyncio.CancelledError):
                    runner.settlement.fail(requests, runner.cancelled_batch_error(exc))
                raise
        else:
            late = bool(binding.overran) and task in binding.overran  # after the watchdog
            released = (
                not late
                and scheduler.queue.live > 0  # (the cheap test first: often nobody waits)
                and _clean(results, size)
                and scheduler.batch_finished_early()
            )
            finished = clock()
            error = runner.deliver(requests, results, finished)  # 4. settle
            if error is None and whole and not late:  # one timely call on the whole batch
                runner.cost_model.add(units, finished - started)
        if error is not None and not binding.abandoned(task):
            runner.batch_failed(requests, error)
    finally:  # 5. release
        if watchdog is not None:
            watchdog.cancel()
        ended = clock() if finished is None else finished
        runner.batch_ended(binding, task, size, ended - started, error, released=released)
        binding.batch_tasks.discard(task)  # (`end_task`, inline: once per batch)
        binding.members.pop(task, None)
        current_batch.set(None)
        # a model error's traceback keeps this frame: let go of it, and of the requests
        # whose futures keep it, or the batch stays in a cycle
        del error, requests, claimed


# -- the hooks every run kind uses ------------------------------------------------------

HEALTHY = Health(healthy=True, reason=None, since=None)

ModelOutput = (
    Awaitable[Sequence[Out | BaseException]]
    | Sequence[Out | BaseException]
    | AsyncIterator[Sequence[Any]]
    | Iterator[Sequence[Any]]
)
"""What `_inference` returns: one result per item (or an `Exception` for that item),
maybe awaitable; or, for streams, a generator of steps (see `stream()`)."""


@dataclass(frozen=True)
class RunKind:
    """How a proxy's batches run: the coroutine of one batch task, whether callers get
    streams, and whether the run admits queued requests itself (then the scheduler
    hands it one request at a time, and it takes the rest from the queue)."""

    run: Callable[[Runner[Any], Binding[Any], list[Request[Any]] | None], Coroutine[Any, Any, None]]
    streams: bool = False
    admits_itself: bool = False


class HoldsOptions(Protocol):
    """Where the proxy's current options are held (its `Intake`; `Proxy.configure`
    replaces them there): a runner reads them there, at each batch."""

    @property
    def options(self) -> Options: ...


class Runner(Generic[In]):
    """Runs one proxy's batches: the hooks every run kind uses."""

    def __init__(
        self,
        *,
        name: str,
        model_name: str,
        model: Callable[[list[In]], Any],
        executor: Executor,
        kind: RunKind,
        holder: HoldsOptions,
        by_cost: bool,
        group_by_cost: bool,
        lifecycle: Lifecycle,
        settlement: Settlement,
        on_cap_change: Callable[[], None],
        model_pads: bool = False,
    ) -> None:
        self.name = name
        self.model_name = model_name  # what the model is called in logs
        self.model = model
        self._holder = holder
        options = holder.options
        # with `batch_sizes`: the allowed sizes, and every model call kept to them
        self.sizes = sizes = batch_sizes(name, options, model_pads)
        if sizes is not None:
            executor = SizedExecutor(
                executor,
                sizes,
                settlement.events,
                name=name,
                filler=options.filler,
                model_pads=model_pads,
                reruns=self.reruns,
            )
        self.executor = executor
        self.kind = kind
        self.lifecycle = lifecycle
        self.settlement = settlement
        self.events: Events = settlement.events  # counts, and tells the listeners
        self.by_cost = by_cost  # requests carry a cost (a length): batches are padded
        self.group_by_cost = group_by_cost  # and batch members are picked by cost
        # changed by: configure() and the out-of-memory back-off (`_runs.reruns`)
        self.cap = BatchCap(options.batch_size)
        # fed by every batch that ran whole and in time (`run_batch`)
        self.cost_model = CostModel("token" if by_cost else "item")
        # changed by: the watchdog (unhealthy), `batch_ended` (healthy again)
        self.health = HEALTHY
        self.on_cap_change = on_cap_change
        self._task_name = f"batchproxy-{name}-batch"
        self._on_loop = type(executor) is LoopExecutor

    @property
    def options(self) -> Options:
        """The proxy's options now (held by its `Intake`: `HoldsOptions`)."""
        return self._holder.options

    # -- the scheduler's side -------------------------------------------------------------

    def limits(self) -> Limits:
        """What the scheduler is told now (`Limits`): the batch cap cut to an allowed size
        (1 for a run kind that admits requests itself), the options' delay, slots (the
        executor's capacity unless set), window, aging, bulk threshold and `predicts`."""
        options = self.options
        slots = options.max_concurrent_batches or self.executor.capacity
        size = 1 if self.kind.admits_itself else self.cap.cap
        if self.sizes is not None:
            size = self.sizes.top(size)
        return Limits(
            batch_size=size,
            max_delay=options.max_delay,
            slots=slots,
            adaptive=options.adaptive,
            aging=options.aging,
            predicts=slots > 1 or options.shed_late,
            bulk_threshold=options.bulk_threshold,
        )

    def new_scheduler(self, binding: Binding[In]) -> Scheduler[In]:
        """The scheduler of a new binding, starting this proxy's batches there."""
        return Scheduler(
            binding.loop,
            limits=self.limits(),
            start_batch=functools.partial(self.start_batch, binding),
            by_cost=self.by_cost,
            group_by_cost=self.group_by_cost,
            max_batch_tokens=self.options.max_batch_tokens,
            cost_model=self.cost_model,
            cut_to=None if self.sizes is None or self.sizes.pads else self.sizes,
            name=self.name,
        )

    # -- starting and claiming -----------------------------------------------------------

    def start_batch(self, binding: Binding[In], requests: list[Request[In]] | None) -> None:
        """The scheduler's callback: start a batch task for `requests` (None: it takes what
        is queued when it runs). The scheduler counted the batch in flight. The task is
        in `binding.batch_tasks` until its run kind ends (`end_task`), or, if it is
        cancelled before its first step, until its done callback (`never_started`)
        settles its batch."""
        run = self.kind.run(self, binding, requests)
        task = new_task(binding.loop, run, self._task_name)
        binding.batch_tasks.add(task)
        binding.members[task] = list if requests is None else requests.copy
        settle = functools.partial(self.never_started, binding, requests)
        binding.not_started[task] = settle  # until `claim` removes it, at the first step
        task.add_done_callback(settle)

    def never_started(
        self, binding: Binding[In], requests: list[Request[In]] | None, task: asyncio.Task[None]
    ) -> None:
        """The done callback of a batch task that ended without running a step (cancelled
        before its first one: "cancel every other task" at shutdown): nothing in it
        settled its batch or freed its slot, so this fails its callers and frees it."""
        del binding.not_started[task]
        self.end_task(binding, task)
        if not binding.serving:
            return  # its event loop is gone, and the slot with it
        if requests is None:  # it was to take what is queued: that batch fails instead
            requests = binding.scheduler.take_reserved()
            if not requests:
                return  # nobody left: take_reserved freed the slot
        self.settlement.fail(requests, self.cancelled_batch_error(asyncio.CancelledError()))
        binding.scheduler.batch_finished()

    def end_task(self, binding: Binding[In], task: asyncio.Task[Any]) -> None:
        """A batch task's run kind ends (its last line, however it ends): it leaves
        `binding.batch_tasks`, and its context lets go of it (`current_batch`: the task
        holds its context, so the two would stay alive, a reference cycle, until the
        garbage collector found them, one per batch)."""
        binding.batch_tasks.discard(task)
        binding.members.pop(task, None)
        current_batch.set(None)  # (in the task, or a done callback's copy: harmless there)

    def claim(
        self, binding: Binding[In], requests: list[Request[In]] | None
    ) -> tuple[list[Request[In]], asyncio.Task[Any]] | None:
        """What the batch task now taking its first step runs: its requests (taken from the
        queue now if an arrival to an idle proxy started it; None if every one left) and
        the task, made the current batch for the model."""
        task = asyncio.current_task()
        assert task is not None
        # it runs: it settles its batch and leaves `batch_tasks` itself (`end_task`), so
        # its end schedules no callback
        task.remove_done_callback(binding.not_started.pop(task))
        current_batch.set(task)  # seen by the model, on any executor
        if requests is None:
            requests = binding.scheduler.take_reserved()
            if not requests:
                self.end_task(binding, task)
                return None
            binding.members[task] = requests.copy
        if self._holder.options.caller_context and not self.kind.admits_itself:
            hand_over(requests)  # (a batch of a generation engine changes at every step)
        if requests[0].key is not None:
            hand_key_over(requests)
        return requests, task

    # -- calling the model ---------------------------------------------------------------

    def reruns(self, error: BaseException) -> bool:
        """Whether a model call that raised `error` is re-run in pieces (`_runs.reruns`):
        `isolate_errors`, or `oom_backoff` and `error` is out of memory."""
        options = self.options
        return isinstance(error, Exception) and (
            options.isolate_errors or (options.is_oom is not None and options.is_oom(error))
        )

    async def call_model(self, items: list[In]) -> tuple[Any, bool]:
        """Run the model on `items`: (its results, whether one call on all of them made
        them). With `oom_backoff` or `isolate_errors`, a raising call is re-run in pieces
        (`_runs.reruns`)."""
        options = self._holder.options  # (`options`, without a call: once per batch)
        if options.is_oom is not None or options.isolate_errors:
            return await call_with_reruns(self, items)
        if self._on_loop:  # what LoopExecutor.run does, one coroutine frame less
            return await self.model(items), True
        return await self.executor.run(self.model, items), True

    def model_failure(
        self, exc: BaseException, binding: Binding[In], batch: asyncio.Future[Any] | None
    ) -> Exception | None:
        """What a model call (or step) of `batch` that raised `exc` means for its callers:
        the error they get, or None when `exc` must propagate (the batch's event loop is
        ending: its task was cancelled from outside, or closed after the loop was)."""
        if isinstance(exc, GeneratorExit) and binding.loop.is_closed():
            return None  # the coroutine closed as garbage after its loop was closed
        if isinstance(exc, asyncio.CancelledError):
            if batch is not None and batch in binding.overran:
                uncancel(batch)  # our own watchdog cancelled it, not the event loop
                return binding.overran[batch]
            if cancel_requested():
                return None
        if not isinstance(exc, Exception):
            logger.error("%s.%s raised %r", self.name, self.model_name, exc)
        return caller_error(self.name, exc)

    def cancelled_batch_error(self, cancel: BaseException) -> InferenceError:
        """What the callers of a batch cancelled from outside get."""
        return InferenceError(
            self.name,
            cancel,
            "the batch task was cancelled from outside (the event loop ending, or every "
            "task cancelled) before this call was answered",
        )

    def result_sequence(self, results: object) -> list[Any] | tuple[Any, ...]:
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

    # -- recording and settling ----------------------------------------------------------

    def record_start(self, requests: list[Request[In]], started: float) -> int:
        """Count a batch that starts now; return the units the model computes: items,
        or padded tokens (batch x longest) when items have a length."""
        size = len(requests)
        self.events.batch_started(size, [started - request.enqueued_at for request in requests])
        if not self.by_cost:
            return size
        units = size * max(r.cost for r in requests)
        self.events.batch_padded(real=sum(r.cost for r in requests), padded=units)
        return units

    def deliver(
        self, requests: list[Request[In]], results: object, now: float
    ) -> BatchProxyError | Exception | None:
        """Hand result i to caller i; return the batch-wide error instead when the results
        cannot be matched to the callers."""
        try:
            results = self.result_sequence(results)
        except BaseException as exc:  # a sequence whose len() or iteration itself fails
            return caller_error(self.name, exc)
        if len(results) != len(requests):
            return BatchSizeMismatch(self.name, len(requests), len(results))
        self.settlement.deliver(requests, results, now)
        return None

    def batch_failed(self, requests: list[Request[In]], error: BaseException) -> None:
        """The batch failed as a whole: its callers still waiting get `error`."""
        self.settlement.fail(requests, error)
        self.events.batch_failed(error, len(requests))

    def batch_ended(
        self,
        binding: Binding[In],
        task: asyncio.Task[Any],
        size: int,
        seconds: float,
        error: BaseException | None,
        *,
        released: bool = False,
    ) -> None:
        """The model call of a batch is over: record it (not an abandoned one, counted when
        abandoned), mark the proxy healthy again if it answered in time, and free the
        batch slot (unless already handed on)."""
        if not binding.serving:
            return
        if binding.overran and binding.overran.pop(task, None) is not None:
            return  # the watchdog failed its callers and freed its slot already
        if not binding.was_cut:  # (past a drain's deadline every running batch was cut)
            self.events.batch_finished(size, seconds, error)
        if not self.health.healthy and not binding.overran and self.lifecycle.open:
            self.health = HEALTHY  # the model answers in time again
        if not released:
            binding.scheduler.batch_finished()

    # -- the watchdog --------------------------------------------------------------------

    def watch(
        self, binding: Binding[In], task: asyncio.Task[Any], requests: list[Request[In]]
    ) -> asyncio.TimerHandle | None:
        """Arm the watchdog for a batch (or step) starting now, with `batch_timeout`."""
        timeout = self._holder.options.batch_timeout_seconds
        if timeout is None:
            return None
        return binding.loop.call_later(timeout, self._overran, binding, task, requests, timeout)

    def _overran(
        self,
        binding: Binding[In],
        task: asyncio.Task[None],
        requests: list[Request[In]],
        timeout: float,
    ) -> None:
        """Watchdog: the batch ran past `batch_timeout`. Fail its callers now, free its
        slot, abandon the model call (cancel it) and mark the proxy unhealthy."""
        error = BatchTimeout(self.name, timeout, len(requests))
        binding.overran[task] = error
        self.health = Health(False, str(error), time.time())
        logger.error("%s", error)
        self.batch_failed(requests, error)  # counted now: whenever (if ever) its call ends
        self.events.batch_timed_out(len(requests), timeout)
        binding.scheduler.batch_finished()
        task.cancel()
        if self.options.stops_on_overrun and self.lifecycle.open:
            self.lifecycle.stop(error)  # new calls get ProxyClosed; so do the queued ones:
            binding.scheduler.close()
            self.settlement.fail(binding.scheduler.queue.drain(), self.lifecycle.closed_error())


BATCHES = RunKind(run_batch)
"""The run kind of a proxy whose model returns one result per item."""


def _clean(results: object, size: int) -> bool:
    """Whether `results` answers every caller with a result (no error for anyone)."""
    return (
        (type(results) is list or type(results) is tuple)  # a subclass's len() may raise
        and len(results) == size
        and not any(map(isinstance, results, itertools.repeat(BaseException, size)))  # in C
    )
