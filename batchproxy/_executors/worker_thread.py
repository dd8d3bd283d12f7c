"""`WorkerThread`: one dedicated thread (the "GPU thread") that runs batches.

The thread owns an event loop of its own, so it runs plain `def` models (called
directly, blocking only that thread: one batch at a time, in submission order)
and `async def` models (awaited on that loop, so they overlap where they await)
alike. Idle, it waits on a queue, not on its loop: handing it a batch wakes the
thread, with no self-pipe write, poll or loop iteration on it (about 35 µs of the
thread's CPU a batch on a 2-core VM). It runs its loop only while an `async def`
model's batch is in flight there, and a batch submitted then wakes the loop.
Several proxies may share one `WorkerThread` to put several models on one device,
where plain `def` models then never run at the same time.

With `model=factory` it hosts a model of its own instead: `factory()` runs on
the thread before the first batch (again on the next batch if it raised), and
every batch calls what it returned; a proxy then needs no `_inference`
(`Proxy(offload=WorkerThread(model=load))`), like on `ProcessWorkers`.

Nothing is lost at shutdown: a batch submitted to a closing thread, or still
running when it stops, fails with a `RuntimeError` in its caller instead of
hanging. The thread is a daemon and is started lazily on first use. A model
call runs in a copy of the submitting task's `contextvars` context, as it would
on the submitter's own loop.

With `device="cuda:0"` the thread is bound to that GPU: it makes the device
current and runs every call on a CUDA stream of its own (`stream`), so its work
does not queue behind other threads' on the default stream. With `overlap=True`
(off by default, device or not) a `StagedModel` (what a `TensorProxy` with a
plain `def _forward` runs) is pipelined: while the model thread computes one
batch, a second thread of its own (with its own stream) prepares the next
(collate, pad, copy to the device) and finishes the one before (waits
for the device, splits the outputs), so the GPU does not wait for Python
between batches. A batch that finds the thread idle runs its stages in a row on
the model thread: a lone request pays no extra hand-off.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import queue
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import TYPE_CHECKING, Any

from typing_extensions import Self

from .._fork import forget_threads_in_forked_children
from .base import Executor, ModelFactory, ModelFn
from .devices import torch_device
from .reply import Reply
from .staged import StagedModel

if TYPE_CHECKING:
    import torch

__all__ = ["WorkerThread"]


class _Raised:
    """A `BaseException` carried back to the caller's loop as a plain value.

    Delivering `KeyboardInterrupt` or `CancelledError` through a future would make
    asyncio treat it as a loop-stopping or cancelling event; the caller re-raises
    it inside its own `try` instead.
    """

    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


_Call = tuple[ModelFn, list[Any], contextvars.Context]
"""The model, the batch's items, and the submitting task's context to call it in."""


class _Job:
    """A batch for the thread: its call, until answered, and where the answer goes."""

    __slots__ = ("call", "future", "loop")

    def __init__(
        self,
        fn: ModelFn,
        items: list[Any],
        loop: asyncio.AbstractEventLoop,
        future: Reply,
    ) -> None:
        self.call: _Call | None = (fn, items, contextvars.copy_context())
        self.loop = loop
        self.future = future

    def reply(self, outcome: Any) -> None:
        """Hand the outcome to the caller's loop (from the worker thread)."""
        # let go of the model (and, through the context, the batch) first: once answered,
        # the caller may drop its proxy and gc.collect() before this thread has returned
        self.call = None
        _answer(self.loop, self.future, outcome)


def _answer(loop: asyncio.AbstractEventLoop, future: Reply, outcome: Any) -> None:
    """Resolve `future` with `outcome` on `loop`, from another thread; nothing if that
    loop is closed (nobody waits any more)."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(_resolve, future, outcome)


def _resolve(future: Reply, outcome: Any) -> None:
    if not future.done():  # (not abandoned meanwhile: its task cancelled)
        # a result wakes its task here, an error next iteration (`Reply.set_result`)
        future.set_result(outcome, wake_now=type(outcome) is not _Raised)


class WorkerThread(Executor):
    """A dedicated thread that runs model calls off the event loop.

    Pass `offload=WorkerThread(name="gpu0")` to several proxies to share it; close
    it yourself (`close()`, `await aclose()`, or `with`/`async with`) when they are
    done. A proxy created with `offload=True` owns a private one and closes it in
    its own `aclose()`.

    - `device`: a CUDA device (`"cuda"`, `"cuda:1"`, a `torch.device`) the thread
      binds: current device and a stream of its own for every call (torch is
      imported only then). A device this machine lacks fails each batch with the
      reason.
    - `overlap`: pipeline the stages of a `StagedModel` (prepare and finish on a
      second thread, compute on this one): two batches in flight (`capacity`
      2). Off by default: the second slot sends batches out earlier, so smaller,
      which costs more than it gains where the model's launches are the
      bottleneck (docs: scaling-out, "On a GPU").
    """

    def __init__(
        self,
        name: str = "batchproxy-worker",
        *,
        model: ModelFactory | None = None,
        device: str | torch.device | None = None,
        overlap: bool = False,
    ) -> None:
        if not isinstance(name, str):
            raise TypeError(f"WorkerThread name must be a str, got {name!r}")
        if model is not None and not callable(model):
            raise TypeError(f"model must be a callable that builds the model, got {model!r}")
        self.device = torch_device("device", device)
        if self.device is not None and self.device.type != "cuda":
            raise ValueError(
                f"WorkerThread {name!r}: device must be a CUDA device ('cuda', 'cuda:1'), "
                f"got {device!r}; leave it unset for a thread that runs on the CPU"
            )
        if not isinstance(overlap, bool):
            raise TypeError(f"overlap must be a bool, got {overlap!r}")
        self.overlap = overlap
        self.stream: torch.cuda.Stream | None = None
        """The thread's CUDA stream (with a `device`), made when the thread starts."""
        self._bind_error: BaseException | None = None  # the device could not be bound
        # the second thread of an overlapping one: prepare and finish stages
        self._stages = (
            WorkerThread(f"{name}-stages", device=device, overlap=False) if self.overlap else None
        )
        self._in_flight = 0  # batches in run(), under _lock: a lone one is not pipelined
        self.name = name
        self.hosts_model = model is not None
        self._factory = model
        self._hosted: ModelFn | None = None  # built by the factory, on the thread
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # the batches submitted and not started, in order; None: stop (`_request_stop`)
        self._inbox: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        # whether the thread runs its loop now (an async model's batch in flight), so a
        # batch submitted must wake the loop, not only the queue; changed by the thread
        # alone, under _lock, which submitters read it under as they put a batch
        self._looping = False
        # the async batches in flight on the loop: their task, job and model's awaitable
        self._running: dict[asyncio.Task[None], tuple[_Job, Awaitable[Any]]] = {}
        self._closed = False
        self._exited = False
        self._exit_callbacks: list[Callable[[], None]] = []
        forget_threads_in_forked_children(self)

    def __repr__(self) -> str:
        state = "closed" if self._closed else "running" if self._thread else "idle"
        return f"<WorkerThread {self.name!r} {state}>"

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def capacity(self) -> int:
        """2 when overlapping (one batch computes while the next is prepared), else 1."""
        return 2 if self.overlap else 1

    @property
    def started(self) -> bool:
        """Whether the thread has been started (it may have stopped since)."""
        return self._thread is not None

    # -- lifecycle -----------------------------------------------------------------

    def start(self) -> None:
        """Start the thread if it is not running yet (thread-safe, idempotent)."""
        with self._lock:
            self._start_locked()

    def _start_locked(self) -> asyncio.AbstractEventLoop:
        if self._closed:
            raise RuntimeError(f"WorkerThread {self.name!r} is closed")
        if self._loop is None:
            ready = threading.Event()
            thread = threading.Thread(target=self._main, args=(ready,), name=self.name, daemon=True)
            thread.start()
            ready.wait()
            self._thread = thread
        assert self._loop is not None
        return self._loop

    def _after_fork_in_child(self) -> None:
        """In a forked child: the parent's thread, its loop and its batches are gone; a
        new thread starts on the next batch (a hosted model is built anew there)."""
        self._lock = threading.Lock()
        self._loop = self._thread = None
        self._inbox, self._running, self._looping = queue.SimpleQueue(), {}, False
        self._hosted = None
        self._exited, self._exit_callbacks = False, []
        self.stream, self._bind_error, self._in_flight = None, None, 0

    def close(self, *, wait: bool = True) -> None:
        """Stop the thread and (unless `wait=False`) wait for it; batches still in it
        fail. A model call running there finishes first: with `wait=False` the thread
        (a daemon) ends when it does. Idempotent."""
        thread = self._request_stop()
        if self._stages is not None:
            self._stages.close(wait=wait)
        if wait and thread is not None and thread is not threading.current_thread():
            thread.join()

    async def aclose(self) -> None:
        """Stop the thread without blocking the event loop. Idempotent."""
        thread = self._request_stop()
        if self._stages is not None:
            await self._stages.aclose()
        if thread is None or thread is threading.current_thread():
            return
        loop = asyncio.get_running_loop()
        exited = Reply(loop)

        def notify() -> None:
            _answer(loop, exited, None)

        with self._lock:
            if self._exited:
                exited.set_result(None)
            else:
                self._exit_callbacks.append(notify)
        await exited
        thread.join()

    def _request_stop(self) -> threading.Thread | None:
        with self._lock:
            self._closed = True  # (no batch is put after this: `_start_locked` refuses)
            loop, thread, looping = self._loop, self._thread, self._looping
            self._inbox.put(None)  # after every batch submitted before the stop
        if looping and loop is not None:  # (else the thread finds the None: queue or loop)
            with contextlib.suppress(RuntimeError):  # already closed
                loop.call_soon_threadsafe(loop.stop)
        return thread

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def __aenter__(self) -> Self:
        self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # -- running batches -------------------------------------------------------------

    def run(self, fn: ModelFn, items: list[Any]) -> Coroutine[Any, Any, Any]:
        # (a plain function handing over `_run_here`'s coroutine: a batch's way to this
        # thread and back goes through one coroutine frame less)
        stages = self._stages
        if stages is None or self.hosts_model or not isinstance(fn, StagedModel):
            return self._run_here(fn, items)
        return self._run_stages(stages, fn, items)

    async def _run_stages(self, stages: WorkerThread, fn: StagedModel, items: list[Any]) -> Any:
        """A `StagedModel`'s batch with `overlap`: its stages on the two threads."""
        with self._lock:
            lone = self._in_flight == 0
            self._in_flight += 1
        try:
            if lone:  # nothing to overlap with: the stages in a row here, one hand-off
                return await self._run_here(fn, items)
            # the prepare stage runs while this thread computes the batch before; the
            # compute stages keep the order of their prepares (both threads are FIFO)
            prepared = await stages._run_here(fn.prepare, items)
            computed = await self._run_here(fn.compute, prepared)
            return await stages._run_here(fn.finish, computed)
        finally:
            with self._lock:
                self._in_flight -= 1

    async def _run_here(self, fn: ModelFn, items: Any) -> Any:
        """Call `fn(items)` on this thread and await its outcome."""
        loop = asyncio.get_running_loop()
        future = Reply(loop)  # wakes this task in the answer's own callback (`_resolve`)
        job = _Job(fn, items, loop, future)
        with self._lock:
            thread_loop = self._start_locked()
            self._inbox.put(job)
            looping = self._looping
        if looping:  # the thread runs its loop, not waiting on the queue: wake the loop
            with contextlib.suppress(RuntimeError):  # stopping: the shutdown path answers it
                thread_loop.call_soon_threadsafe(self._take_inbox)
        outcome = await future
        if type(outcome) is not _Raised:
            return outcome
        del job, future  # (they lead to the error, whose traceback will keep this frame)
        try:
            raise outcome.exc
        finally:
            del outcome

    # -- on the worker thread -----------------------------------------------------------

    def _main(self, ready: threading.Event) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        if self.device is not None:
            self._bind_device(self.device)
        ready.set()
        try:
            self._serve(loop)
        finally:
            self._shut_down(loop)

    def _serve(self, loop: asyncio.AbstractEventLoop) -> None:
        """Run the batches in order until stopped: idle, wait on the queue; while an
        async model's batch is in flight, run the loop (`_run_loop`)."""
        inbox = self._inbox
        while True:
            job = inbox.get()  # (the GIL released while it waits)
            if job is None:
                return
            self._start_job(job)
            del job  # (not kept alive by this frame until the next batch)
            if self._running and not self._run_loop(loop):
                return

    def _run_loop(self, loop: asyncio.AbstractEventLoop) -> bool:
        """Run the loop while an async batch is in flight; False if stopped meanwhile."""
        with self._lock:
            if self._closed:  # `_request_stop` saw the thread not looping: its None is queued
                return False
            self._looping = True
        try:
            # the batches put before the flag was set sent no wake-up: take them now
            loop.call_soon(self._take_inbox)
            while True:
                loop.run_forever()  # until the last async batch ends (`_batch_done`), or a stop
                if self._closed:
                    return False
                if not self._running:  # (a late wake-up may have started one as it stopped)
                    return True
        finally:
            with self._lock:
                self._looping = False

    def _bind_device(self, device: torch.device) -> None:
        """Make `device` current on this thread, with a stream of the thread's own."""
        import torch

        try:
            index = torch.cuda.current_device() if device.index is None else device.index
            torch.cuda.set_device(index)
            self.stream = torch.cuda.Stream(index)  # type: ignore[no-untyped-call]
            torch.cuda.set_stream(self.stream)  # this thread's current stream, for every call
        except Exception as exc:  # no CUDA, no such device: each batch says why
            self._bind_error = exc

    def _take_inbox(self) -> None:
        """Start the batches queued (on the loop, while it runs); a None stops the loop.
        A wake-up may come late, after the loop has stopped and run again: then it finds
        the queue empty, or batches that no wake-up was sent for, which are due anyway."""
        for job in self._queued():
            if job is None:
                asyncio.get_running_loop().stop()
                return
            self._start_job(job)
            del job  # (an error's traceback keeps this frame: not the job through it)

    def _queued(self) -> Iterator[_Job | None]:
        """What the queue holds, taken out in order until it is empty."""
        while True:
            try:
                yield self._inbox.get_nowait()
            except queue.Empty:
                return

    def _start_job(self, job: _Job) -> None:
        if job.future.cancelled():  # its batch was abandoned before it started
            return
        assert job.call is not None  # answered only once started, or at shutdown
        fn, items, context = job.call
        try:
            if self._bind_error is not None:
                raise RuntimeError(
                    f"WorkerThread {self.name!r} could not bind {self.device}: {self._bind_error}"
                ) from self._bind_error
            if self._factory is not None:
                if self._hosted is None:
                    self._hosted = context.run(self._factory)
                fn = self._hosted
            outcome = context.run(fn, items)
            if inspect.isawaitable(outcome):
                assert self._loop is not None  # the task copies the job's context:
                task = context.run(self._loop.create_task, self._finish(job, outcome))
                self._running[task] = (job, outcome)
                task.add_done_callback(self._batch_done)
                return
        except BaseException as exc:
            outcome = _Raised(exc)
        del fn, items, context  # like reply(): this frame is still here after the answer
        job.reply(outcome)
        del job, outcome  # an error's traceback keeps this frame: no cycle through them

    def _batch_done(self, task: asyncio.Task[None]) -> None:
        """An async model's batch ended: the last one in flight stops the loop, and the
        thread waits on its queue again (`_serve`)."""
        del self._running[task]
        if not self._running and self._looping:  # (not at shutdown: `_shut_down` runs them)
            task.get_loop().stop()

    @staticmethod
    async def _finish(job: _Job, awaitable: Awaitable[Any]) -> None:
        try:
            outcome = await awaitable
        except BaseException as exc:
            outcome = _Raised(exc)
        job.reply(outcome)
        del job, outcome  # an error's traceback keeps this frame: no cycle through them

    def _shut_down(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._lock:
            self._closed = True
        jobs = [job for job in self._queued() if job is not None]  # (none put once closed)
        running = list(self._running.values())
        jobs.extend(job for job, _ in running)
        error = _Raised(RuntimeError(f"WorkerThread {self.name!r} was closed before the batch ran"))
        for job in jobs:
            job.reply(error)
        tasks = list(self._running)
        for task in tasks:
            task.cancel()
        if tasks:
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        for _, awaitable in running:  # a task cancelled before its first step never awaited
            if inspect.iscoroutine(awaitable):  # it: close it (no "never awaited" warning)
                awaitable.close()
        loop.close()
        with self._lock:
            self._exited = True
            callbacks, self._exit_callbacks = self._exit_callbacks, []
        for callback in callbacks:
            callback()
