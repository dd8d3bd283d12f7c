"""`ProcessWorkers`: run batches in worker processes, one model per process.

For models whose Python work holds the GIL, where threads do not add speed.
Each worker is a `spawn`ed process (safe with CUDA) that builds its model once
from a picklable factory; the proxy keeps forming batches in its event loop and
sends each to the least-loaded worker. Inside this process every worker has a
thread of its own that starts its process, sends it batches over a local pipe
(`_ipc`: pickle protocol 5, NumPy and torch buffers out of band) and waits for
the reply, so the event loop never blocks on a pipe. No socket is opened.

Failure, written down:

- The model raises: that batch's callers get the exception (its traceback in
  the worker as `__cause__`); per-item exceptions reach only their callers.
- A batch or its results cannot be pickled: that batch fails with a TypeError.
- A worker process dies (killed, segfault, `os._exit`): exactly the batch it
  held fails with `WorkerDied`, or with `retry_on_crash=True` is rerun once on
  another worker; the worker is restarted and batches queued for it wait. A
  worker holds a batch once the first bytes of it are written to its pipe: a
  death after that, while it reads the batch (out of memory for its arrays,
  say) or runs it, cannot be told from one the batch caused. That includes a
  death a moment before, while the process is still being torn down.
- A worker process dies holding no batch: no batch fails. It is found dead
  before its next batch is written (its process is checked, and a pipe that
  refuses the first write is a death too), reaped, logged and replaced; that
  batch goes to another worker that is up and idle, else waits for the new
  process.
- The factory raises in a worker: that worker takes no batches; when no worker
  is left, every batch fails at once with the factory's error.
- `aclose()` (or `close()`): batches already handed over run to the end, then
  each worker is told to stop, joined, and terminated or killed if it does not
  exit within `stop_timeout` (at most about 24.8 days: longer is cut to that).
  Workers still open when the interpreter exits are closed the same way, and a
  worker whose parent dies exits on its own (its pipe closes). No process is
  left running or unreaped, even if stopping one raises.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import logging
import multiprocessing
import pickle
import queue
import signal
import threading
import weakref
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from . import _ipc, _validate
from ._errors import WorkerDied
from ._executor import ModelFactory, ModelFn, PoolExecutor
from ._worker_process import serve
from ._worker_thread import _answer, _Raised

__all__ = ["ProcessWorkers"]

logger = logging.getLogger("batchproxy")

_STOP = None

# The longest `process.join` can wait: it polls the process's sentinel with
# `select.poll`, which takes a C int of milliseconds (longer: OverflowError).
_JOIN_MAX = (2**31 - 1) // 1000  # seconds, about 24.8 days


class _RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker process, as text."""

    def __str__(self) -> str:
        return str(self.args[0])


class _Job:
    __slots__ = ("abandoned", "future", "items", "loop", "retried", "served_by")

    def __init__(self, items: list[Any], loop: asyncio.AbstractEventLoop) -> None:
        self.items = items
        self.loop = loop
        self.future: asyncio.Future[Any] = loop.create_future()
        self.retried = False
        self.abandoned = False  # its caller was cancelled (under the owner's lock)
        self.served_by: _Worker | None = None  # the worker whose process runs it now

    def reply(self, outcome: Any) -> None:
        """Hand the outcome to the caller's loop (from a worker's thread)."""
        _answer(self.loop, self.future, outcome)

    def fail(self, error: BaseException) -> None:
        self.reply(_Raised(error))


class ProcessWorkers(PoolExecutor):
    """`n` worker processes, each running the model `factory()` builds in it.

    Use as `Proxy(offload=ProcessWorkers(factory, n))`; the proxy then keeps up to
    `n` batches in flight. `factory` must be picklable (a module-level function
    or class) and return `model(items) -> results` (a plain or `async def`
    callable). Start the workers ahead of traffic with `await workers.start()`
    (or `async with`), which also reports a failing factory; stop them with
    `await workers.aclose()`.
    """

    hosts_model = True

    def __init__(
        self,
        factory: ModelFactory,
        n: int = 2,
        *,
        retry_on_crash: bool = False,
        name: str = "ProcessWorkers",
        stop_timeout: float = 5.0,
    ) -> None:
        if not callable(factory):
            raise TypeError(f"factory must be callable, got {type(factory).__name__} {factory!r}")
        try:
            pickle.dumps(factory)
        except Exception as exc:
            raise TypeError(
                f"factory must be picklable to reach a worker process (a module-level "
                f"function or class, or a functools.partial of one), got {factory!r}: {exc}"
            ) from exc
        _validate.flag("retry_on_crash", retry_on_crash)
        if not isinstance(name, str) or not name:
            raise TypeError(f"name must be a non-empty str, got {name!r}")
        self.name = name
        self.retry_on_crash = retry_on_crash
        self._factory = factory
        # Clamped rather than refused: a stop_timeout beyond what a join can wait means
        # "let the batches finish", which about 24.8 days serves just as well.
        self._stop_timeout = min(
            _validate.duration("stop_timeout", stop_timeout, allow_zero=True), _JOIN_MAX
        )
        self._lock = threading.Lock()
        self._workers = [_Worker(self, i) for i in range(_validate.count("n", n))]
        self._closed = False
        self._started = False

    def __repr__(self) -> str:
        state = "closed" if self._closed else "running" if self._started else "idle"
        return f"<ProcessWorkers {self.name!r} n={len(self._workers)} {state}>"

    @property
    def capacity(self) -> int:
        return len(self._workers)

    @property
    def pids(self) -> list[int | None]:
        """Each worker's process id (None while it starts or after it stopped)."""
        return [worker.pid for worker in self._workers]

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Start every worker and wait until each has built its model. Raises the
        factory's error if no worker could."""
        self._start_threads()
        loop = asyncio.get_running_loop()
        waits = [asyncio.wrap_future(worker.ready, loop=loop) for worker in self._workers]
        await asyncio.gather(*waits)
        self._raise_if_broken()

    def _start_threads(self) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name} is closed")
            if self._started:
                return
            self._started = True
        _open_executors.add(self)
        for worker in self._workers:
            worker.thread.start()

    async def aclose(self) -> None:
        """Finish the batches handed over, then stop every worker. Idempotent."""
        threads = self._request_stop()
        if not threads:
            return
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(asyncio.wrap_future(w.exited, loop=loop) for w in self._workers))
        for thread in threads:
            thread.join()

    def close(self) -> None:
        """`aclose()` for synchronous code: blocks until every worker has stopped."""
        for thread in self._request_stop():
            thread.join()

    def _request_stop(self) -> list[threading.Thread]:
        with self._lock:
            self._closed = True
            started = self._started
        _open_executors.discard(self)
        if not started:
            return []
        for worker in self._workers:
            worker.jobs.put(_STOP)
        return [w.thread for w in self._workers if w.thread is not threading.current_thread()]

    # -- running batches -------------------------------------------------------------------

    async def run(self, fn: ModelFn, items: list[Any]) -> Any:
        """Run one batch on the least-loaded worker (`fn` is ignored: the workers'
        own model runs)."""
        self._start_threads()
        job = _Job(items, asyncio.get_running_loop())
        self._dispatch(job)
        try:
            outcome = await job.future
        except asyncio.CancelledError:
            self._abandon(job)
            raise
        if type(outcome) is _Raised:
            raise outcome.exc
        return outcome

    def _abandon(self, job: _Job) -> None:
        """The batch was cancelled (the proxy's watchdog gave up on it, or its event loop
        is ending). Not started yet: it never will. Running in a worker: kill that
        worker's process, so a model that hangs cannot keep the worker; it is restarted
        before the worker's next batch."""
        with self._lock:
            job.abandoned = True
            worker = job.served_by
            if worker is not None:
                worker.kill()

    def _dispatch(self, job: _Job, avoid: _Worker | None = None) -> None:
        with self._lock:
            if self._closed and avoid is None:
                raise RuntimeError(f"{self.name} is closed")
            usable = [w for w in self._workers if w.broken is None and not w.stopped]
            if not usable:
                broken = self._workers[0].broken
                raise broken or RuntimeError(f"{self.name} is closed")
            if avoid is not None and len(usable) > 1:
                usable = [w for w in usable if w is not avoid]
            worker = min(usable, key=lambda w: (w.starting, w.load))
            worker.load += 1
        worker.jobs.put(job)

    def _pass_on(self, job: _Job, source: _Worker) -> bool:
        """Hand `job` to a worker other than `source` that is up and idle, if there is
        one, rather than have it wait for `source`'s new process."""
        with self._lock:
            if self._closed:  # it could land behind that worker's stop and fail
                return False
            for worker in self._workers:
                if worker is not source and worker.idle:
                    worker.load += 1
                    worker.jobs.put(job)  # under the lock: before any stop put there
                    return True
        return False

    def _raise_if_broken(self) -> None:
        with self._lock:
            if all(w.broken is not None for w in self._workers):
                broken = self._workers[0].broken
                assert broken is not None
                raise broken


class _Worker:
    """One worker process and the thread in this process that talks to it."""

    def __init__(self, owner: ProcessWorkers, index: int) -> None:
        self.owner = owner
        self.index = index
        self.jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.load = 0  # jobs handed to this worker and not answered (under owner._lock)
        self.broken: BaseException | None = None  # the factory failed here
        self.starting = True  # its process is starting: take another worker if one is up
        self.stopped = False  # told to stop: takes no more jobs
        self.pid: int | None = None
        self.ready: concurrent.futures.Future[None] = concurrent.futures.Future()  # first start
        self.exited: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._process: BaseProcess | None = None
        self._conn: Connection | None = None
        self.thread = threading.Thread(
            target=self._main, name=f"batchproxy-{owner.name}-{index}", daemon=True
        )

    def _main(self) -> None:
        try:
            while True:
                if self._process is None and self.broken is None:
                    self._start_process()
                job = self.jobs.get()
                if job is _STOP:
                    self._refuse_left_over()
                    return
                try:
                    self._take(job)
                finally:
                    with self.owner._lock:
                        self.load -= 1
        finally:
            try:
                self._stop_process()
            finally:  # even if that raised: `start()` and `aclose()` wait for these
                _set(self.ready)
                _set(self.exited)

    @property
    def idle(self) -> bool:
        """Up and holding no job (under the owner's lock)."""
        return not (self.load or self.starting or self.stopped) and self.broken is None

    def _take(self, job: _Job) -> None:
        """Run `job` on this worker's process, or pass it on if this worker cannot."""
        while self.broken is None:
            if job.future.cancelled() or self._serve(job):  # cancelled: abandoned meanwhile
                return
            # The process had died before the batch reached it, and is stopped: the
            # batch goes to a worker that is up, or waits here for a new process (it
            # comes round again only if that one, too, dies before it is written to).
            if self.owner._pass_on(job, self):
                return
            self._start_process()
        self._reroute(job)

    def _refuse_left_over(self) -> None:
        """After the stop: a job that still came in (a crashed batch's rerun) fails."""
        with self.owner._lock:
            self.stopped = True
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job.fail(RuntimeError(f"{self.owner.name} closed before the batch could run"))

    def _reroute(self, job: _Job) -> None:
        """A job queued here before this worker's factory failed: to a working one."""
        try:
            self.owner._dispatch(job, avoid=self)
        except BaseException as exc:
            job.fail(exc)

    def _start_process(self) -> None:
        self.starting = True
        context = multiprocessing.get_context("spawn")
        ours, theirs = context.Pipe(duplex=True)
        process = context.Process(
            target=serve,
            args=(theirs, self.owner._factory),
            name=f"batchproxy-{self.owner.name}-{self.index}",
        )
        try:
            process.start()
        except Exception as exc:  # e.g. spawned from an unguarded __main__ while importing
            ours.close()
            message: tuple[Any, ...] = ("not started", exc)
        else:
            self._process, self._conn = process, ours
            message = ()
        theirs.close()  # so that our end sees EOF when the worker dies
        if not message:
            try:
                message = _ipc.decode(_ipc.receive(ours))
            except (EOFError, OSError):
                message = ("died", self._reap())
        if message[0] == "ready":
            self.pid = message[1]
        else:
            logger.warning(
                "%s: worker %d cannot serve: %r", self.owner.name, self.index, message[1]
            )
            if message[0] == "failed":
                error: BaseException = RuntimeError(
                    f"{self.owner.name}: the model factory raised in worker {self.index}: "
                    f"{message[1]!r}"
                )
                error.__cause__ = _remote(message[1], message[2])
            elif message[0] == "not started":
                error = RuntimeError(
                    f"{self.owner.name}: worker {self.index} could not be started: {message[1]}"
                )
                error.__cause__ = message[1]
            else:
                error = RuntimeError(
                    f"{self.owner.name}: worker {self.index} died while building its model "
                    f"({message[1]})"
                )
            with self.owner._lock:
                self.broken = error
            self._stop_process()
        self.starting = False
        _set(self.ready)

    def _serve(self, job: _Job) -> bool:
        """Run `job` on the process and answer it. False if the process turned out to
        have died before the batch reached it (it is then reaped and stopped): the
        batch is still to run."""
        process, conn = self._process, self._conn
        assert process is not None
        assert conn is not None
        try:
            frames = _ipc.encode(job.items)
        except Exception as exc:
            job.fail(TypeError(f"{self.owner.name}: the batch could not be pickled: {exc!r}"))
            return True
        if not process.is_alive():  # it died while idle (nothing reads its pipe then)
            self._died_idle()
            return False
        with self.owner._lock:
            if job.abandoned:
                return True
            job.served_by = self
        try:
            _ipc.send(conn, frames)
            frames = _ipc.receive(conn)
        except _ipc.Unsent:
            # It died after that check, before any of the batch was written: it never
            # held it. (A death after the first write may have come from reading it.)
            if self._finish_serving(job):
                return True  # killed for it: nobody waits for it
            self._died_idle()
            return False
        except (EOFError, OSError):
            if not self._finish_serving(job):  # else killed for it: nobody waits for it
                self._died(job)
            return True
        if self._finish_serving(job):
            return True  # killed, or about to be, for nobody: the next batch gets a new process
        try:
            reply = _ipc.decode(frames)
        except Exception as exc:
            job.fail(TypeError(f"{self.owner.name}: the results could not be unpickled: {exc!r}"))
            return True
        if reply[0] == "ok":
            job.reply(reply[1])
        else:
            job.fail(_remote(reply[1], reply[2]))
        return True

    def _finish_serving(self, job: _Job) -> bool:
        """The process is done with `job`; True (its process stopped) if it was abandoned
        meanwhile, and so may have been killed."""
        with self.owner._lock:
            job.served_by = None
            abandoned = job.abandoned
        if abandoned:
            self._stop_process()
        return abandoned

    def kill(self) -> None:
        """Kill the process (under the owner's lock, while it serves an abandoned job)."""
        process = self._process
        if process is not None:
            logger.warning(
                "%s: killing worker %d (pid %s): its batch was abandoned while it ran",
                self.owner.name, self.index, self.pid,
            )  # fmt: skip
            with contextlib.suppress(OSError, ValueError):
                process.kill()

    def _died(self, job: _Job) -> None:
        """The worker died holding `job`: fail it or rerun it once elsewhere; the
        process is restarted before this worker takes its next batch."""
        pid, detail = self._bury()
        owner = self.owner
        if owner.retry_on_crash and not job.retried:
            job.retried = True
            with contextlib.suppress(BaseException):
                owner._dispatch(job, avoid=self)
                return
        job.fail(WorkerDied(owner.name, f"{self.index} (pid {pid})", len(job.items), detail))

    def _died_idle(self) -> None:
        pid, detail = self._bury()
        logger.warning(
            "%s: worker %d (pid %s) died while idle (%s); starting a new one",
            self.owner.name, self.index, pid, detail,
        )  # fmt: skip

    def _bury(self) -> tuple[int | None, str]:
        """Reap the dead process and close its pipe; its pid and how it ended."""
        pid, detail = self.pid, self._reap()
        self.starting = True  # `_dispatch` prefers workers that are up meanwhile
        self._stop_process()
        return pid, detail

    def _reap(self) -> str:
        """Wait for a dead process; describe how it ended."""
        process = self._process
        if process is None:
            return "no process"
        process.join(timeout=5)
        code = process.exitcode
        if code is None:
            return "its pipe closed but the process still runs"
        if code < 0:
            with contextlib.suppress(ValueError):
                return f"killed by signal {signal.Signals(-code).name}"
        return f"exit code {code}"

    def _stop_process(self) -> None:
        process, conn = self._process, self._conn
        self._process = self._conn = None
        self.pid = None
        if conn is not None:
            with contextlib.suppress(OSError):
                _ipc.send(conn, _ipc.encode(_STOP))
            conn.close()
        if process is None:
            return
        try:
            process.join(self.owner._stop_timeout)
        finally:  # even if that wait raised: no process is left running or unreaped
            if process.exitcode is None:
                process.terminate()
                process.join(1.0)
            if process.exitcode is None:
                process.kill()
                process.join()
            process.close()


def _remote(exc: BaseException, text: str) -> BaseException:
    exc.__cause__ = _RemoteTraceback(f"\n\nIn the worker process:\n{text}")
    return exc


def _set(future: concurrent.futures.Future[Any]) -> None:
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        future.set_result(None)


_open_executors: weakref.WeakSet[ProcessWorkers] = weakref.WeakSet()


@atexit.register
def _close_at_exit() -> None:
    """Stop the workers of executors nobody closed (their threads are daemons)."""
    for executor in list(_open_executors):
        executor.close()
