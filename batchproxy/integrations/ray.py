"""`RayActors`: batches run on a pool of Ray actors (the ``ray`` extra).

```python
import ray
from batchproxy import Proxy
from batchproxy.integrations.ray import RayActors

def load():                            # picklable, no arguments; runs once in each actor
    model = build_model()
    def run(items: list) -> list:      # one batch in, one result per item out
        return model(items)
    return run

ray.init()                             # one machine; a cluster: ray.init(address="ray://head:10001")
async with RayActors(load, num_replicas=2, num_gpus=1) as actors:
    async with Proxy(offload=actors, batch_size=32) as proxy:
        y = await proxy.inference(x)   # the batch runs as load()(items) in an actor
        await actors.scale(3)          # the proxy now keeps 3 batches in flight
```

Call `ray.init()` before first use. Without it Ray starts a private local
instance at the first actor creation, blocking the event loop for seconds; it
never joins a cluster by itself. The actors import batchproxy, so install it on
every node of a cluster (or ship it with a runtime environment).

Each replica is one actor that calls `factory()` once, when it starts, and then
`model(items)` once per batch (awaiting the result if it is awaitable). A plain
`def` model runs on the actor's event loop, so one actor runs one batch at a time.

- `capacity` is the replica count (`num_replicas`, then `scale()`): a proxy that
  follows it keeps that many batches in flight. `run` sends a batch to the
  least-loaded replica (fewest batches in flight; a replica still loading its
  model counts as holding one; ties: the lowest index); it awaits the Ray
  `ObjectRef` and never blocks the event loop.
- The model raising: the batch fails with the model's own exception, unwrapped
  from Ray's `RayTaskError` (which becomes its `__cause__`, remote traceback
  included). Exceptions returned in the result list are plain values.
- `factory()` raising: the batches sent to that replica fail with its exception,
  and so does `start()`/`scale()`; the replica is dropped and a new one is tried
  at the next batch.
- A replica dying (its process killed or crashed, its node lost: Ray's
  `RayActorError`) while it holds a batch: that batch fails with
  `batchproxy.WorkerDied`, or with `retry_on_crash=True` it runs once more on the
  least-loaded replica and the caller gets its result (beware models with side
  effects). The dead replica is replaced by a new actor at once; Ray queues the
  batches sent to it until its model is loaded.
- `scale(n)`: new replicas take batches at once; removed ones (the most idle)
  take no more and are killed when their in-flight batches end.
- A `run` cancelled: the actor task is cancelled with `ray.cancel` (an `async`
  model stops at its next `await`; a plain `def` model runs to its end).
- `aclose()`: new batches are refused with `RuntimeError` at once; batches in
  flight get `timeout` seconds (default 10) to end, then every actor is killed
  and a batch still running fails with `RuntimeError`. Idempotent; no task or
  actor is left behind. (A pool dropped unclosed: Ray kills its actors once
  their handles are garbage-collected.)
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import math
import numbers
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from .. import _validate
from .._errors import WorkerDied
from .._executor import ModelFactory, ModelFn, PoolExecutor
from .._validate import count, flag

__all__ = ["RayActors"]

logger = logging.getLogger("batchproxy")


class _ReplicaActor:
    """What runs in each actor: the model built once from the factory, then batches."""

    def __init__(self, factory: ModelFactory) -> None:
        self._error: Exception | None = None
        try:
            self._model: ModelFn | None = factory()
        except Exception as exc:  # kept, so the caller gets the factory's own error type
            self._model, self._error = None, exc

    async def ready(self) -> None:
        """Return once the model is built; raise what `factory()` raised."""
        if self._error is not None:
            raise self._error

    async def run(self, items: list[Any]) -> Any:
        if self._model is None:
            assert self._error is not None
            raise self._error
        result = self._model(items)
        if inspect.isawaitable(result):
            result = await result
        return result


class _Replica:
    """One actor as the executor sees it."""

    __slots__ = ("handle", "in_flight", "number", "ready", "retired", "started")

    def __init__(self, number: int, handle: Any, started: asyncio.Future[Any]) -> None:
        self.number = number
        self.handle = handle
        self.started = started  # resolves when factory() has returned in the actor
        self.ready = False
        self.in_flight = 0
        self.retired = False  # out of rotation: killed once its last batch ends

    def label(self) -> str:
        actor_id = getattr(self.handle, "_actor_id", None)
        return f"{self.number}" if actor_id is None else f"{self.number} (actor {actor_id.hex()})"


class RayActors(PoolExecutor):
    """A pool of Ray actors, each running the model that `factory()` builds.

    Pass it as `Proxy(offload=RayActors(factory, num_replicas))`, without a
    subclass. `num_cpus` and `num_gpus` are each actor's Ray resources. The
    actors start at the first batch, or at `await start()`; close the pool
    yourself (`await aclose()` or `async with`). See the module docstring for
    failures, scaling and shutdown.
    """

    hosts_model = True

    def __init__(
        self,
        factory: ModelFactory,
        num_replicas: int = 1,
        *,
        num_cpus: float = 1,
        num_gpus: float = 0,
        retry_on_crash: bool = False,
        name: str = "RayActors",
    ) -> None:
        if not callable(factory):
            raise TypeError(
                f"factory must be a callable that returns the model, got "
                f"{type(factory).__name__} {factory!r}"
            )
        flag("retry_on_crash", retry_on_crash)
        if not isinstance(name, str) or not name:
            raise TypeError(f"name must be a non-empty str, got {name!r}")
        self.name = name
        self._factory = factory
        self._target = count("num_replicas", num_replicas)
        self._num_cpus = _resource("num_cpus", num_cpus)
        self._num_gpus = _resource("num_gpus", num_gpus)
        self._retry = retry_on_crash
        self._actor_class: Any = None
        self._started = False
        self._rotation: list[_Replica] = []  # the replicas that take batches
        self._retired: set[_Replica] = set()  # out of rotation, batches still running
        self._created = 0
        self._in_flight = 0
        self._idle: asyncio.Event | None = None  # set by the last batch to end, once closing
        self._closed = False
        self._close_done = asyncio.Event()

    def __repr__(self) -> str:
        if self._closed:
            state = "closed"
        elif not self._started:
            state = "not started"
        else:
            ready = sum(replica.ready for replica in self._rotation)
            state = f"{ready} ready, {self._in_flight} batches in flight"
        return f"<RayActors {self.name!r} num_replicas={self._target} {state}>"

    @property
    def capacity(self) -> int:
        """The replica count: how many batches a following proxy keeps in flight."""
        return self._target

    @property
    def num_replicas(self) -> int:
        """The replica count asked for (the constructor's, then `scale()`'s)."""
        return self._target

    @property
    def closed(self) -> bool:
        return self._closed

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Create the actors (if not yet) and wait until each has built its model.

        Optional: the first batch creates them. Raises what a `factory()` raised.
        """
        self._check_open()
        self._fill()
        await self._wait_started()

    async def scale(self, num_replicas: int) -> None:
        """Change the replica count; return once the new replicas have built their models.

        Removed replicas (the most idle first) take no new batch at once and are
        killed when their running batches end. Before the first batch this only
        sets how many actors will start. Raises what a new replica's `factory()` raised.
        """
        target = count("num_replicas", num_replicas)
        self._check_open()
        changed, self._target = target != self._target, target
        if self._started:
            surplus = len(self._rotation) - target
            if surplus > 0:
                idle_first = sorted(self._rotation, key=lambda r: (r.in_flight, r.ready, -r.number))
                for replica in idle_first[:surplus]:
                    self._retire(replica)
            self._fill()
        if changed:
            self._capacity_changed()
        if self._started:
            await self._wait_started()

    async def aclose(self, *, timeout: float | None = 10.0) -> None:
        """Refuse new batches, give running ones `timeout` seconds, then kill every actor.

        Batches still running after `timeout` (None: no limit) fail with
        `RuntimeError`. Idempotent: a second call waits for the first to finish.
        """
        timeout = _validate.timeout("timeout", timeout)
        if self._closed:
            await self._close_done.wait()
            return
        self._closed = True
        try:
            if self._in_flight:
                self._idle = asyncio.Event()
                with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
                    await asyncio.wait_for(self._idle.wait(), timeout)
        finally:
            for replica in [*self._rotation, *self._retired]:
                self._kill(replica)
            self._rotation.clear()
            self._retired.clear()
            self._close_done.set()

    # -- batches -----------------------------------------------------------------------

    async def run(self, fn: ModelFn, items: list[Any]) -> Any:
        """Run `items` on the least-loaded replica's model (`fn` is not used)."""
        del fn
        self._check_open()
        self._fill()
        try:
            return await self._call(self._pick(), items)
        except WorkerDied:
            if not self._retry or self._closed:
                raise
        logger.warning("%s: retrying a batch of %d on another replica", self.name, len(items))
        self._fill()
        return await self._call(self._pick(), items)

    async def _call(self, replica: _Replica, items: list[Any]) -> Any:
        replica.in_flight += 1
        self._in_flight += 1
        ref = None
        try:
            ref = replica.handle.run.remote(items)
            return await ref
        except RayTaskError as exc:  # the model (or the factory) raised in the actor
            raise _unwrap(exc) from exc
        except RayActorError as exc:
            self._lost(replica, exc)
            if self._closed:
                raise RuntimeError(f"{self.name} was closed while it ran this batch") from exc
            raise WorkerDied(self.name, replica.label(), len(items), _short(exc)) from exc
        except asyncio.CancelledError:
            if ref is not None:
                with contextlib.suppress(Exception):  # already finished, or the actor is gone
                    ray.cancel(ref)
            raise
        finally:
            replica.in_flight -= 1
            self._in_flight -= 1
            if replica.retired and replica.in_flight == 0:
                self._kill(replica)
            if self._in_flight == 0 and self._idle is not None:
                self._idle.set()

    def _pick(self) -> _Replica:
        """The replica with the fewest batches (a loading one counts one); ties: the oldest."""
        return min(self._rotation, key=lambda r: (r.in_flight + (not r.ready), not r.ready))

    # -- replicas ----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self.name} is closed and runs no more batches")

    def _fill(self) -> None:
        """Create actors until the rotation holds the replica count."""
        self._started = True
        while len(self._rotation) < self._target:
            self._rotation.append(self._create())

    def _create(self) -> _Replica:
        if self._actor_class is None:
            remote: Any = ray.remote(num_cpus=self._num_cpus, num_gpus=self._num_gpus)
            self._actor_class = remote(_ReplicaActor)
        handle = self._actor_class.remote(self._factory)
        started = asyncio.wrap_future(handle.ready.remote().future())
        replica = _Replica(self._created, handle, started)
        self._created += 1
        started.add_done_callback(functools.partial(self._on_started, replica))
        return replica

    def _on_started(self, replica: _Replica, started: asyncio.Future[Any]) -> None:
        if started.cancelled():
            return
        error = started.exception()
        if error is None:
            replica.ready = True
            return
        if replica.retired or self._closed:
            return
        if isinstance(error, RayTaskError):
            error = _unwrap(error)
        logger.error("%s: replica %s failed to start: %r", self.name, replica.label(), error)
        self._retire(replica)  # the next batch tries a new one

    async def _wait_started(self) -> None:
        replicas = list(self._rotation)
        await asyncio.wait([replica.started for replica in replicas])
        for replica in replicas:
            if replica.started.cancelled():  # killed meanwhile (died, scaled down, closed)
                continue
            error = replica.started.exception()
            if error is not None:
                raise _unwrap(error) if isinstance(error, RayTaskError) else error

    def _lost(self, replica: _Replica, error: RayActorError) -> None:
        """`replica`'s actor died: kill it for certain and put a new one in its place."""
        if replica in self._rotation and not self._closed:
            logger.warning("%s: replica %s died: %s", self.name, replica.label(), _short(error))
            self._rotation[self._rotation.index(replica)] = self._create()
            replica.retired = True
        self._kill(replica)

    def _retire(self, replica: _Replica) -> None:
        """Take `replica` out of rotation; kill it now if idle, else after its last batch."""
        if replica in self._rotation:
            self._rotation.remove(replica)
        replica.retired = True
        if replica.in_flight:
            self._retired.add(replica)
        else:
            self._kill(replica)

    def _kill(self, replica: _Replica) -> None:
        self._retired.discard(replica)
        replica.started.cancel()
        with contextlib.suppress(Exception):  # already dead, or Ray is shut down
            ray.kill(replica.handle, no_restart=True)


def _resource(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    number = float(value)
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return number


def _unwrap(error: RayTaskError) -> BaseException:
    """The exception the model raised, out of Ray's wrapper."""
    cause = error.cause
    return cause if isinstance(cause, BaseException) else error


def _short(error: BaseException) -> str:
    """A one-line reason out of Ray's many-line actor error."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    reason = next((line for line in lines if line.startswith("The actor is dead because")), "")
    reason = (reason or (lines[0] if lines else "")).split(". ")[0].rstrip(".")
    return f"{type(error).__name__}: {reason}" if reason else type(error).__name__
