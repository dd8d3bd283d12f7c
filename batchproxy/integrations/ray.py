"""`RayActors`: batches run on a pool of Ray actors (the ``ray`` extra).

```python
import ray
from batchproxy import Autoscaling, Proxy
from batchproxy.integrations.ray import RayActors

def load():                            # picklable, no arguments; runs once in each actor
    model = build_model()
    def run(items: list) -> list:      # one batch in, one result per item out
        return model(items)
    return run

ray.init()                             # one machine; a cluster: ray.init(address="auto")
async with RayActors(load, num_replicas=2, num_gpus=1) as actors:
    async with Proxy(offload=actors, batch_size=32) as proxy:
        y = await proxy.inference(x)   # the batch runs as load()(items) in an actor
        await actors.scale(3)          # the proxy now keeps 3 batches in flight
```

Call `ray.init()` before first use. Without it Ray starts a private local
instance at the first actor creation, blocking the event loop for seconds; it
never joins a cluster by itself. The actors import batchproxy, so install it on
every node of a cluster (or ship it with `actor_options={"runtime_env": ...}`).

Each replica is one actor that calls `factory()` once, when it starts, and then
`model(items)` once per batch (awaiting the result if it is awaitable). A plain
`def` model runs on the actor's event loop, so one actor runs one batch at a time.

Placement: `actor_options` go to Ray's `.options(...)` for every replica
(`resources`, `memory`, `runtime_env`, `scheduling_strategy`, `max_restarts`,
and Ray's other actor options; `num_cpus`/`num_gpus` are arguments). They are
checked when the pool is built. Replicas spread over the cluster's nodes
(`scheduling_strategy="SPREAD"`) unless you give a strategy, so a node lost
takes only its share of the pool.

- `capacity` is the replica count (`num_replicas`, then `scale()` or the
  autoscaler): a proxy that follows it keeps that many batches in flight.
- Routing: a batch goes to a ready replica with the fewest batches in flight
  (ties: the oldest). When every ready replica is busy and another one is still
  starting, the batch waits for whichever comes first (a replica freed, one
  ready) rather than queueing on a replica that may never start. With no replica
  ready for `start_timeout` seconds the batch fails with `PoolUnavailable`.
- The model raising: the batch fails with the model's own exception, unwrapped
  from Ray's `RayTaskError` (which becomes its `__cause__`, remote traceback
  included). Exceptions returned in the result list are plain values.
- An item Ray cannot serialize (a lock, a socket): its own caller fails with
  `TypeError` naming its type, and the rest of the batch runs without it (each
  item is probed alone only once the whole batch has failed to serialize). A
  result the actor cannot send back: its own caller fails with `TypeError`, the
  others get theirs (the actor holds a batch's results until Ray has serialized
  them, and sends back on request those that can travel).
- `factory()` raising: `start()`/`scale()` raise its exception, and so do the
  batches waiting when no other replica can start; the replica is dropped and a
  new one is tried at the next batch.
- A replica dying (its process killed or crashed, its node lost: Ray's
  `ActorDiedError`) while it holds a batch: that batch fails with
  `batchproxy.WorkerDied`, or with `retry_on_crash=True` runs once more on
  another replica and the caller gets its result (beware models with side
  effects). Ray's `ActorUnavailableError` (the actor unreachable for now; the
  batch may or may not have run) is handled the same way for the batch, but the
  replica is only taken out of rotation, not replaced, until a probe says.
- Health probes: every `health_check_period` seconds each idle or unavailable
  replica is asked to answer within that time. An answer puts an unavailable
  replica back; Ray saying it died replaces it; three probes in a row without an
  answer replace it too. So a replica lost while idle leaves the rotation within
  about one period, before a batch is sent to it.
- Start deadline: `start()` and `scale()` raise `TimeoutError` when replicas are
  not ready after `start_timeout` seconds (the cluster has no room, say). Those
  replicas stay pending and join when Ray places them. A replacement or an
  autoscaled replica that overruns logs a warning instead. `stats.pending` and
  `repr` count them; `health` is unhealthy while no replica is ready, so a proxy
  on the pool is too (a readiness route then answers 503).
- `scale(n)`: new replicas take batches once ready; removed ones (the most idle)
  take no more and are killed when their in-flight batches end.
- `autoscaling=Autoscaling(...)`: the pool follows its load between
  `min_replicas` and `max_replicas` (see `batchproxy.Autoscaling`); the load is
  the items running on the pool or waiting for a replica plus those queued in
  the proxies it serves, counted in full batches.
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
import itertools
import logging
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError

from .. import _validate
from .._errors import WorkerDied
from .._executors.autoscaling import AutoscalerStats, Autoscaling, HeldItems, autoscaler_for
from .._executors.base import ModelFactory, ModelFn, PoolExecutor, put_back_refused
from .._stats import Health
from .._validate import count, finite, flag
from ._ray_pool import Replicas
from ._ray_replica import actor_options, refusal, short, unwrap

__all__ = ["PoolStats", "RayActors"]

logger = logging.getLogger("batchproxy")


@dataclass(frozen=True)
class PoolStats:
    """`actors.stats`: a snapshot of the pool's replicas and batches."""

    replicas: int
    """The replica count asked for (the constructor's, `scale()`'s or the autoscaler's)."""
    ready: int
    """Replicas that take batches now."""
    pending: int
    """Replicas created and not ready yet: waiting for room on a node, or building their model."""
    overdue: int
    """Of those, pending for longer than `start_timeout`."""
    unavailable: int
    """Ready replicas out of rotation until a health probe is answered."""
    in_flight: int
    """Batches running on the replicas."""
    waiting: int
    """Batches waiting in the pool for a replica."""
    lost: int
    """Replicas lost since the pool started (died, or unreachable for good), each replaced."""
    retried: int
    """Batches run again after their replica died (`retry_on_crash`)."""
    nodes: Mapping[str, int]
    """Ready replicas per Ray node id."""
    autoscaler: AutoscalerStats | None
    """Scaling decisions, with `autoscaling=`; else None."""


class RayActors(PoolExecutor):
    """A pool of Ray actors, each running the model that `factory()` builds.

    Pass it as `Proxy(offload=RayActors(factory, num_replicas))`, without a
    subclass. `num_cpus` and `num_gpus` are each actor's Ray resources;
    `actor_options` any other option of Ray's `.options(...)`. `start_timeout`
    (seconds; None: no deadline) bounds how long `start()`, `scale()` and a
    batch wait for replicas to come up; `health_check_period` (seconds; None: no
    probes) is how often idle replicas are probed; `autoscaling` lets the
    replica count follow the load. The actors start at the first batch, or at
    `await start()`; close the pool yourself (`await aclose()` or `async with`).
    See the module docstring for placement, failures, scaling and shutdown.
    """

    hosts_model = True

    def __init__(
        self,
        factory: ModelFactory,
        num_replicas: int = 1,
        *,
        num_cpus: float = 1,
        num_gpus: float = 0,
        actor_options: Mapping[str, Any] | None = None,
        retry_on_crash: bool = False,
        start_timeout: float | None = 60.0,
        health_check_period: float | None = 5.0,
        autoscaling: Autoscaling | None = None,
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
        self._target = count("num_replicas", num_replicas)
        self._retry = retry_on_crash
        self._replicas = Replicas(
            name,
            factory,
            _ray_options(num_cpus, num_gpus, actor_options),
            _validate.timeout("start_timeout", start_timeout),
            _validate.timeout("health_check_period", health_check_period),
        )
        self._autoscaler = autoscaler_for(self, autoscaling, self._target)
        self._retried = 0
        self._tokens = itertools.count()  # names each batch's results in its actor
        self._batches = 0  # in run(): waiting for a replica, running, or retried
        self._held = HeldItems()  # the items of those batches
        self._idle: asyncio.Event | None = None  # set by the last batch to end, once closing
        self._closed = False
        self._close_done = asyncio.Event()

    def __repr__(self) -> str:
        if self._closed:
            state = "closed"
        elif not self._replicas.started:
            state = "not started"
        else:
            stats = self.stats
            state = f"{stats.ready} ready, {stats.pending} pending"
            if stats.unavailable:
                state += f", {stats.unavailable} unavailable"
            state += f", {stats.in_flight} batches in flight"
        return f"<RayActors {self.name!r} num_replicas={self._target} {state}>"

    @property
    def capacity(self) -> int:
        """The replica count: how many batches a following proxy keeps in flight."""
        return self._target

    @property
    def num_replicas(self) -> int:
        """The replica count asked for (the constructor's, then `scale()`'s or the autoscaler's)."""
        return self._target

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def stats(self) -> PoolStats:
        """A snapshot of replicas (ready, pending, unavailable) and batches."""
        replicas = self._replicas
        rotation = replicas.rotation
        ready, pending, overdue, unavailable = replicas.tally()
        return PoolStats(
            replicas=self._target,
            ready=ready,
            pending=pending,
            overdue=overdue,
            unavailable=unavailable,
            in_flight=replicas.in_flight,
            waiting=replicas.waiting,
            lost=replicas.lost_count,
            retried=self._retried,
            nodes=dict(Counter(r.node for r in rotation if r.usable and r.node)),
            autoscaler=None if self._autoscaler is None else self._autoscaler.stats,
        )

    @property
    def health(self) -> Health:
        """Unhealthy while the pool is started and no replica is ready (or once closed)."""
        if self._closed:
            return Health(False, f"{self.name} is closed", None)
        since = self._replicas.unready_since
        if since is None:
            return Health(True, None, None)
        reason = f"{self.name}: no replica ready ({self._replicas.not_ready()}, of {self._target})"
        return Health(False, reason, since)

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Create the actors (if not yet) and wait until each has built its model.

        Optional: the first batch creates them. Raises what a `factory()` raised,
        or `TimeoutError` when replicas are still pending after `start_timeout`.
        """
        self._check_open()
        self._fill()
        await self._replicas.wait_started()

    async def scale(self, num_replicas: int) -> None:
        """Change the replica count; return once the new replicas have built their models.

        Removed replicas (the most idle first) take no new batch at once and are
        killed when their running batches end. Before the first batch this only
        sets how many actors will start. Raises what a new replica's `factory()`
        raised, or `TimeoutError` after `start_timeout`.
        """
        target = count("num_replicas", num_replicas)
        self._check_open()
        self._resize(target)
        if self._replicas.started:
            await self._replicas.wait_started()

    def autoscale_load(self) -> float:
        """The autoscaler's load: the items running here or waiting for a replica,
        plus those queued in the proxies this pool serves, in full batches."""
        return self._held.in_batches(self.queued_items())

    def autoscale_to(self, num_replicas: int) -> None:
        """The autoscaler's resize: like `scale()`, without waiting for the replicas."""
        if not self._closed:
            self._resize(num_replicas)

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
        replicas = self._replicas
        try:
            if self._autoscaler is not None:
                await self._autoscaler.aclose()
            if self._batches:
                self._idle = asyncio.Event()
                with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
                    await asyncio.wait_for(self._idle.wait(), timeout)
        finally:
            await replicas.close()  # batches still waiting for a replica fail now
            replicas.kill_all()
            self._close_done.set()

    # -- batches -----------------------------------------------------------------------

    async def run(self, fn: ModelFn, items: list[Any]) -> Any:
        """Run `items` on a ready replica's model (`fn` is not used)."""
        del fn
        self._check_open()
        self._fill()
        self._batches += 1
        self._held.add(len(items))
        try:
            try:
                return await self._call(items)
            except WorkerDied:
                if not self._retry or self._closed:
                    raise
            logger.warning("%s: retrying a batch of %d on another replica", self.name, len(items))
            self._retried += 1
            self._fill()
            return await self._call(items)
        finally:
            self._batches -= 1
            self._held.remove(len(items))
            if self._batches == 0 and self._idle is not None:
                self._idle.set()

    async def _call(self, items: list[Any]) -> Any:
        replicas = self._replicas
        replica = await replicas.acquire()
        ref = None
        token = next(self._tokens)
        refused: dict[int, TypeError] = {}
        try:
            try:
                ref = replica.handle.run.remote(items, token)
            except Exception as exc:  # an item Ray cannot serialize
                refused = self._refused(items, exc)
                if len(refused) == len(items):
                    return [refused[i] for i in range(len(items))]
                sent = [item for index, item in enumerate(items) if index not in refused]
                ref = replica.handle.run.remote(sent, token)
            try:
                results = (await ref)[0]
            except RayTaskError as exc:  # the model raised, or its results cannot travel
                salvaged = None
                with contextlib.suppress(Exception):  # the actor gone: the batch's error stands
                    salvaged = await replica.handle.salvage.remote(token)
                if salvaged is None:
                    raise unwrap(exc) from exc
                results = salvaged
            return put_back_refused(results, refused, len(items))
        except RayActorError as exc:
            if isinstance(exc, ActorUnavailableError):  # may come back: a probe decides
                replicas.unavailable(replica, exc)
            else:
                replicas.lost(replica, exc)
            if self._closed:
                raise RuntimeError(f"{self.name} was closed while it ran this batch") from exc
            raise WorkerDied(self.name, replica.label(), len(items), short(exc)) from exc
        except asyncio.CancelledError:
            if ref is not None:
                with contextlib.suppress(Exception):  # already finished, or the actor is gone
                    ray.cancel(ref)
            raise
        finally:
            replicas.release(replica)

    def _refused(self, items: list[Any], exc: Exception) -> dict[int, TypeError]:
        """A TypeError by index for each item Ray cannot serialize (probed one by one,
        only once the batch has failed to); raise `exc` as a TypeError if they all can."""
        refused = {}
        for index, item in enumerate(items):
            error = refusal(item, f"{self.name}: the item", "to reach a Ray actor")
            if error is not None:
                refused[index] = error
        if not refused:
            raise TypeError(f"{self.name}: the batch could not be serialized: {exc!r}") from exc
        return refused

    # -- the replica count -------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self.name} is closed and runs no more batches")

    def _resize(self, target: int) -> None:
        changed, self._target = target != self._target, target
        if self._replicas.started:
            self._replicas.shrink(target)
            self._fill()
        if changed:
            self._capacity_changed()

    def _fill(self) -> None:
        self._replicas.fill(self._target, self._start_autoscaler)

    def _start_autoscaler(self) -> None:
        if self._autoscaler is not None:
            self._autoscaler.start()


def _ray_options(
    num_cpus: object, num_gpus: object, options: Mapping[str, Any] | None
) -> dict[str, Any]:
    cpus = finite("num_cpus", num_cpus, allow_zero=True)
    return actor_options(cpus, finite("num_gpus", num_gpus, allow_zero=True), options)
