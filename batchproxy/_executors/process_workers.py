"""`ProcessWorkers`: run batches in worker processes, one model per process.

For models whose Python work holds the GIL, where threads do not add speed.
Each worker is a `spawn`ed process (safe with CUDA) that builds its model once
from a picklable factory; the proxy keeps forming batches in its event loop and
sends each to the least-loaded worker. Inside this process every worker has a
thread of its own that starts its process, sends it batches over a local pipe
(`_executors.ipc`: pickle protocol 5, NumPy and torch buffers out of band) and waits for
the reply, so the event loop never blocks on a pipe. No socket is opened.

Failure, written down:

- The model raises: that batch's callers get the exception (its traceback in
  the worker as `__cause__`); per-item exceptions reach only their callers.
- An item that cannot be pickled fails its own caller with a TypeError; the
  rest of its batch runs without it. A result that cannot be pickled back fails
  its own caller so too. A batch the worker cannot unpickle (a class it cannot
  import), or results that are not a sequence and cannot be pickled, fail that
  batch with a TypeError; the worker stays up.
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
- A worker's process is not up within `start_timeout` (its factory hangs or is
  slow; on a first start, a `scale()` or a restart after a death): it is
  terminated and that worker is broken as above, with a `TimeoutError`.
- `scale(n)` (or the autoscaler, with `autoscaling=Autoscaling(...)`): new
  workers take batches once their process is up; removed ones (broken or
  starting first, then the least loaded) take no new batch, run the batches
  already handed to them, and stop.
- `aclose()` (or `close()`): batches already handed over run to the end, then
  each worker is told to stop, joined, and terminated or killed if it does not
  exit within `stop_timeout` (at most about 24.8 days: longer is cut to that).
  A worker still in its factory is stopped the same way without waiting for
  its factory (the batches handed to it fail: it never started), so `aclose()`
  is bounded by `stop_timeout` whatever state the workers are in; a worker
  scaled away while it starts is stopped so too (its batches go to the others).
  Workers still open when the interpreter exits are closed the same way, and a
  worker whose parent dies exits on its own, at once, even in its factory or a
  batch (a thread in it watches the parent). No process is left running or
  unreaped, even if stopping one raises.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import pickle
import threading
import weakref
from dataclasses import dataclass
from typing import Any

from .. import _validate
from .autoscaling import AutoscalerStats, Autoscaling, HeldItems, autoscaler_for
from .base import ModelFactory, ModelFn, PoolExecutor
from .process_worker import STOP, Job, Worker
from .worker_thread import _Raised

__all__ = ["ProcessWorkers", "WorkersStats"]

logger = logging.getLogger("batchproxy")


# The longest `process.join` can wait: it polls the process's sentinel with
# `select.poll`, which takes a C int of milliseconds (longer: OverflowError).
_JOIN_MAX = (2**31 - 1) // 1000  # seconds, about 24.8 days


@dataclass(frozen=True)
class WorkersStats:
    """`workers.stats`: a snapshot of a `ProcessWorkers` pool."""

    replicas: int
    """The worker count (the constructor's `n`, then `scale()`'s or the autoscaler's)."""
    ready: int
    """Workers whose process is up (idle or running a batch)."""
    pending: int
    """Workers whose process is starting (or restarting after a death)."""
    broken: int
    """Workers whose factory failed: they take no batch."""
    retiring: int
    """Workers scaled away that still run the batches handed to them."""
    in_flight: int
    """Batches handed to the workers and not answered yet (running or queued there)."""
    autoscaler: AutoscalerStats | None
    """Scaling decisions, with `autoscaling=`; else None."""


class ProcessWorkers(PoolExecutor):
    """`n` worker processes, each running the model `factory()` builds in it.

    Use as `Proxy(offload=ProcessWorkers(factory, n))`; the proxy then keeps up to
    `n` batches in flight. `factory` must be picklable (a module-level function
    or class) and return `model(items) -> results` (a plain or `async def`
    callable). Start the workers ahead of traffic with `await workers.start()`
    (or `async with`), which also reports a failing factory, or one that did not
    return within `start_timeout` seconds (None: no limit) with `TimeoutError`;
    stop them with `await workers.aclose()`.
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
        start_timeout: float | None = 600.0,
        autoscaling: Autoscaling | None = None,
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
        start_timeout = _validate.timeout("start_timeout", start_timeout)
        self._start_timeout = None if start_timeout is None else min(start_timeout, _JOIN_MAX)
        self._lock = threading.Lock()
        self._workers = [Worker(self, i) for i in range(_validate.count("n", n))]
        self._retiring: list[Worker] = []  # scaled away, finishing their batches
        self._created = len(self._workers)
        self._held = HeldItems()  # the items of the batches in run()
        self._closed = False
        self._started = False
        self._autoscaler = autoscaler_for(self, autoscaling, len(self._workers))

    def __repr__(self) -> str:
        state = "closed" if self._closed else "running" if self._started else "idle"
        return f"<ProcessWorkers {self.name!r} n={len(self._workers)} {state}>"

    @property
    def capacity(self) -> int:
        return len(self._workers)

    @property
    def num_replicas(self) -> int:
        """The worker count (the constructor's `n`, then `scale()`'s or the autoscaler's)."""
        return len(self._workers)

    @property
    def stats(self) -> WorkersStats:
        """A snapshot of the workers and the batches handed to them."""
        with self._lock:
            workers = list(self._workers)
            retiring = [w for w in self._retiring if not w.exited.done()]
            in_flight = sum(w.load for w in (*workers, *retiring))
        return WorkersStats(
            replicas=len(workers),
            ready=sum(w.broken is None and not w.starting and not w.stopped for w in workers),
            pending=sum(w.broken is None and w.starting for w in workers),
            broken=sum(w.broken is not None for w in workers),
            retiring=len(retiring),
            in_flight=in_flight,
            autoscaler=None if self._autoscaler is None else self._autoscaler.stats,
        )

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
            workers = list(self._workers)
        _open_executors.add(self)
        for worker in workers:
            worker.thread.start()
        if self._autoscaler is not None:
            self._autoscaler.start()

    async def scale(self, n: int) -> None:
        """Change the worker count; return once new workers are up (raising the
        factory's error if none could build the model). Removed workers take no new
        batch and stop after the batches handed to them."""
        self._resize(_validate.count("n", n))
        if self._started:
            await self.start()

    def autoscale_load(self) -> float:
        """The autoscaler's load: the items handed over or queued in the proxies this
        pool serves, in full batches of their largest `batch_size`."""
        return self._held.in_batches(self.queued_items())

    def autoscale_to(self, n: int) -> None:
        """The autoscaler's resize: like `scale()`, without waiting for new workers."""
        self._resize(n)

    def _resize(self, n: int) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name} is closed")
            workers = self._workers
            self._retiring = [w for w in self._retiring if not w.exited.done()]
            surplus = sorted(
                workers, key=lambda w: (w.broken is None, not w.starting, w.load, -w.index)
            )[: max(0, len(workers) - n)]
            for worker in surplus:
                workers.remove(worker)
                if self._started:  # else its thread never runs: nothing to stop
                    self._retiring.append(worker)
                    worker.jobs.put(STOP)  # after the jobs handed to it
                    worker.stop_starting(f"{self.name}: worker {worker.index} was scaled away")
            added = [Worker(self, self._created + i) for i in range(max(0, n - len(workers)))]
            self._created += len(added)
            workers.extend(added)
            started = self._started
        if started:
            for worker in added:
                worker.thread.start()
        if surplus or added:
            self._capacity_changed()

    async def aclose(self) -> None:
        """Finish the batches handed over, then stop every worker. Idempotent."""
        if self._autoscaler is not None:
            await self._autoscaler.aclose()
        threads = self._request_stop()
        if not threads:
            return
        loop = asyncio.get_running_loop()
        workers = [*self._workers, *self._retiring]
        await asyncio.gather(*(asyncio.wrap_future(w.exited, loop=loop) for w in workers))
        for thread in threads:
            thread.join()

    def close(self) -> None:
        """`aclose()` for synchronous code: blocks until every worker has stopped."""
        if self._autoscaler is not None:
            self._autoscaler.stop()
        for thread in self._request_stop():
            thread.join()

    def _request_stop(self) -> list[threading.Thread]:
        with self._lock:
            self._closed = True
            started = self._started
            workers = [*self._workers, *self._retiring]
            if started:
                for worker in workers:
                    worker.jobs.put(STOP)  # a second one to a retiring worker is never read
                    worker.stop_starting(f"{self.name} closed")
        _open_executors.discard(self)
        if not started:
            return []
        return [w.thread for w in workers if w.thread is not threading.current_thread()]

    # -- running batches -------------------------------------------------------------------

    async def run(self, fn: ModelFn, items: list[Any]) -> Any:
        """Run one batch on the least-loaded worker (`fn` is ignored: the workers'
        own model runs)."""
        self._start_threads()
        job = Job(items, asyncio.get_running_loop())
        self._dispatch(job)
        self._held.add(len(items))
        try:
            outcome = await job.future
        except asyncio.CancelledError:
            self._abandon(job)
            raise
        finally:
            self._held.remove(len(items))
        if type(outcome) is _Raised:
            raise outcome.exc
        return outcome

    def _abandon(self, job: Job) -> None:
        """The batch was cancelled (the proxy's watchdog gave up on it, or its event loop
        is ending). Not started yet: it never will. Running in a worker: kill that
        worker's process, so a model that hangs cannot keep the worker; it is restarted
        before the worker's next batch."""
        with self._lock:
            job.abandoned = True
            worker = job.served_by
            if worker is not None:
                worker.kill()

    def _dispatch(self, job: Job, avoid: Worker | None = None) -> None:
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
            worker.jobs.put(job)  # under the lock: before a stop that scale() puts there

    def _pass_on(self, job: Job, source: Worker) -> bool:
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


_open_executors: weakref.WeakSet[ProcessWorkers] = weakref.WeakSet()


@atexit.register
def _close_at_exit() -> None:
    """Stop the workers of executors nobody closed (their threads are daemons)."""
    for executor in list(_open_executors):
        executor.close()
