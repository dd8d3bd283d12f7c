"""The parent's side of one `ProcessWorkers` worker: the thread that starts its process,
hands it batches over a pipe, reads the replies, and replaces the process when it dies.

The failure rules are `ProcessWorkers`'s (see its module): a process that died
while it held a batch fails that batch (`WorkerDied`, or one rerun elsewhere with
`retry_on_crash`); one that died idle fails nothing, and is found before the next
batch is written to it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import multiprocessing
import queue
import signal
import threading
import time
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, Protocol

from .._errors import WorkerDied
from . import ipc
from .base import ModelFactory, put_back_refused
from .reply import Reply
from .worker_process import serve
from .worker_thread import _answer, _Raised

__all__ = ["STOP", "Job", "Worker"]

logger = logging.getLogger("batchproxy")

STOP = None
"""In a worker's job queue: stop after the jobs before it."""


class _Pool(Protocol):
    """What a worker needs of its `ProcessWorkers`."""

    name: str
    retry_on_crash: bool
    _lock: threading.Lock
    _factory: ModelFactory
    _stop_timeout: float
    _start_timeout: float | None

    def _dispatch(self, job: Job, avoid: Worker | None = None) -> None: ...

    def _pass_on(self, job: Job, source: Worker) -> bool: ...


class _RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker process, as text."""

    def __str__(self) -> str:
        return str(self.args[0])


class Job:
    __slots__ = ("abandoned", "future", "items", "loop", "retried", "served_by")

    def __init__(self, items: list[Any], loop: asyncio.AbstractEventLoop) -> None:
        self.items = items
        self.loop = loop
        self.future = Reply(loop)  # wakes `run`'s task in the answer's own callback
        self.retried = False
        self.abandoned = False  # its caller was cancelled (under the owner's lock)
        self.served_by: Worker | None = None  # the worker whose process runs it now

    def reply(self, outcome: Any) -> None:
        """Hand the outcome to the caller's loop (from a worker's thread)."""
        _answer(self.loop, self.future, outcome)

    def fail(self, error: BaseException) -> None:
        self.reply(_Raised(error))


class Worker:
    """One worker process and the thread in this process that talks to it."""

    def __init__(self, owner: _Pool, index: int) -> None:
        self.owner = owner
        self.index = index
        self.jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self.load = 0  # jobs handed to this worker and not answered (under owner._lock)
        self.broken: BaseException | None = None  # the factory failed here
        self.starting = True  # its process is starting: take another worker if one is up
        self.stopped = False  # told to stop: takes no more jobs
        self.pid: int | None = None
        self.ready: concurrent.futures.Future[None] = concurrent.futures.Future()  # first start
        self.exited: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._process: BaseProcess | None = None
        self._conn: Connection | None = None
        # Why this worker must stop starting (closed, scaled away), and the pipe that
        # wakes its thread while it waits for a process to start (under owner._lock).
        self._stop_reason: str | None = None
        self._wake: Connection | None = None
        self.thread = threading.Thread(
            target=self._main, name=f"batchproxy-{owner.name}-{index}", daemon=True
        )

    def stop_starting(self, reason: str) -> None:
        """Stop waiting for a process that is still starting: it is stopped and this
        worker is broken with `reason` (under the owner's lock; a started one keeps
        serving until it reads its stop)."""
        if self._stop_reason is None:
            self._stop_reason = reason
        if self._wake is not None:
            with contextlib.suppress(OSError):
                self._wake.send_bytes(b"")

    def _main(self) -> None:
        try:
            while True:
                if self._process is None and self.broken is None:
                    self._start_process()
                job = self.jobs.get()
                if job is STOP:
                    self._refuse_left_over()
                    return
                try:
                    self._take(job)
                except Exception as exc:  # a bug here: its callers get it, not a hang
                    self._lost(job, exc)
                finally:
                    with self.owner._lock:
                        self.load -= 1
        finally:
            try:
                self._stop_process()
            finally:  # even if that raised: `start()` and `aclose()` wait for these
                _set(self.ready)
                _set(self.exited)

    def _lost(self, job: Job, error: Exception) -> None:
        """Serving `job` raised where nothing should: it fails with that error, and
        the process, in a state nobody knows, is stopped (the next job starts a new one)."""
        with self.owner._lock:
            job.served_by = None
        job.fail(error)
        with contextlib.suppress(Exception):
            self._stop_process(grace=0.0)

    @property
    def idle(self) -> bool:
        """Up and holding no job (under the owner's lock)."""
        return not (self.load or self.starting or self.stopped) and self.broken is None

    def _take(self, job: Job) -> None:
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

    def _reroute(self, job: Job) -> None:
        """A job queued here before this worker's factory failed: to a working one."""
        try:
            self.owner._dispatch(job, avoid=self)
        except BaseException as exc:
            job.fail(exc)

    def _start_process(self) -> None:
        self.starting = True
        with self.owner._lock:
            reason = self._stop_reason
        message = self._spawn() if reason is None else ("stopped", reason)
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
            elif message[0] == "stopped":
                error = RuntimeError(
                    f"{message[1]} while worker {self.index} was starting (its model "
                    f"factory had not returned)"
                )
            elif message[0] == "overdue":
                error = TimeoutError(
                    f"{self.owner.name}: the model factory did not return within "
                    f"{self.owner._start_timeout:g} s in worker {self.index} (start_timeout); "
                    f"its process was stopped"
                )
            else:
                error = RuntimeError(
                    f"{self.owner.name}: worker {self.index} died while building its model "
                    f"({message[1]})"
                )
            with self.owner._lock:
                self.broken = error
            # A factory past its start_timeout is not waited for; one still running at
            # a stop gets the stop_timeout that any worker gets.
            self._stop_process(grace=0.0 if message[0] == "overdue" else None)
        self.starting = False
        _set(self.ready)

    def _spawn(self) -> tuple[Any, ...]:
        """Start a process; its first message (ready or failed), or why there is none."""
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
            theirs.close()
            return ("not started", exc)
        self._process, self._conn = process, ours
        theirs.close()  # so that our end sees EOF when the worker dies
        return self._await_ready(ours)

    def _await_ready(self, conn: Connection) -> tuple[Any, ...]:
        """The process's first message (ready or failed), or why there is none: it died,
        it was told to stop meanwhile, or its factory ran past `start_timeout`."""
        timeout = self.owner._start_timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        awake, wake = multiprocessing.get_context("spawn").Pipe(duplex=False)
        try:
            with self.owner._lock:
                reason = self._stop_reason
                self._wake = wake
            while reason is None:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                ready = wait([conn, awake], left)
                if conn in ready:
                    try:
                        return tuple(ipc.decode(ipc.receive(conn)))
                    except (EOFError, OSError):
                        return ("died", self._reap())
                if not ready:
                    return ("overdue", f"its factory ran past start_timeout={timeout:g} s")
                with self.owner._lock:
                    reason = self._stop_reason
            return ("stopped", reason)
        finally:
            with self.owner._lock:
                self._wake = None
            awake.close()
            wake.close()

    def _serve(self, job: Job) -> bool:
        """Run `job` on the process and answer it. False if the process turned out to
        have died before the batch reached it (it is then reaped and stopped): the
        batch is still to run."""
        process, conn = self._process, self._conn
        assert process is not None
        assert conn is not None
        try:
            frames, refused = self._encode(job.items)
        except Exception as exc:
            job.fail(TypeError(f"{self.owner.name}: the batch could not be pickled: {exc!r}"))
            return True
        if frames is None:  # no item of it can travel: each caller has its error
            job.reply([refused[i] for i in range(len(job.items))])
            return True
        if not process.is_alive():  # it died while idle (nothing reads its pipe then)
            self._died_idle()
            return False
        with self.owner._lock:
            if job.abandoned:
                return True
            job.served_by = self
        try:
            ipc.send(conn, frames)
            frames = ipc.receive(conn)
        except ipc.Unsent:
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
            reply = ipc.decode(frames)
        except Exception as exc:
            job.fail(TypeError(f"{self.owner.name}: the results could not be unpickled: {exc!r}"))
            return True
        if reply[0] == "ok":
            job.reply(put_back_refused(reply[1], refused, len(job.items)))
        else:
            job.fail(_remote(reply[1], reply[2]))
        return True

    def _encode(self, items: list[Any]) -> tuple[ipc.Frames | None, dict[int, BaseException]]:
        """The frames of the batch, less the items that cannot be pickled (None if that
        is all of them), and a TypeError for each of those by its index: an item that
        cannot travel fails its own caller only. Raises if the items pickle one by one
        but not together."""
        try:
            return ipc.encode(items), {}
        except Exception:
            pass
        refused: dict[int, BaseException] = {}
        for index, item in enumerate(items):
            try:
                ipc.encode(item)
            except Exception as exc:
                refused[index] = error = TypeError(
                    f"{self.owner.name}: the item could not be pickled to reach a worker "
                    f"process: {exc!r}"
                )
                error.__cause__ = exc
        if not refused:
            return ipc.encode(items), refused  # raises again: the batch fails
        sent = [item for index, item in enumerate(items) if index not in refused]
        return (ipc.encode(sent) if sent else None), refused

    def _finish_serving(self, job: Job) -> bool:
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

    def _died(self, job: Job) -> None:
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

    def _stop_process(self, grace: float | None = None) -> None:
        """Tell the process to stop, give it `grace` seconds (default: the stop_timeout),
        then terminate it, and kill it if that does not end it either."""
        process, conn = self._process, self._conn
        self._process = self._conn = None
        self.pid = None
        if conn is not None:
            with contextlib.suppress(OSError):
                ipc.send(conn, ipc.encode(STOP))
            conn.close()
        if process is None:
            return
        try:
            process.join(self.owner._stop_timeout if grace is None else grace)
        finally:  # even if that wait raised: no process is left running or unreaped
            if process.exitcode is None:
                process.terminate()
                process.join(1.0)
            if process.exitcode is None:
                process.kill()
                process.join()
            # Still "running" after a kill and a wait only if another thread's waitpid
            # took its exit status first: multiprocessing's `_cleanup`, run by any
            # `Process.start()` (another worker's restart) or `active_children()`, races
            # ours. It is gone, and `close()` would raise; its pipe fd goes with it.
            if process.exitcode is not None:
                process.close()


def _remote(exc: BaseException, text: str) -> BaseException:
    exc.__cause__ = _RemoteTraceback(f"\n\nIn the worker process:\n{text}")
    return exc


def _set(future: concurrent.futures.Future[Any]) -> None:
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        future.set_result(None)
