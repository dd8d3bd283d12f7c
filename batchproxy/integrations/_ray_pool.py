"""The replicas of a `RayActors` pool: creating, routing, probing and replacing them.

Fields and their invariants:

- `rotation`: the replicas that may take batches, `target` of them once `fill()`
  ran (pending, ready or unavailable; see `Replica`). Only `fill`, `retire` and
  `lost` change it.
- `retired`: out of rotation with batches still running; each is killed by the
  `release` of its last batch. A replica is never in both.
- `changed`: an event set, and replaced by a fresh one, by `notify()` at every
  change a batch waiting in `acquire()` may use (a replica ready, freed, lost,
  unavailable or back; the pool closed). `notify()` is also the one place that
  keeps `unready_since`, the time since no replica is ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import weakref
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, RayActorError

from .._errors import PoolUnavailable
from .._executors.base import ModelFactory
from ._ray_replica import Replica, ReplicaActor, demand, room_for, short, unwrap

logger = logging.getLogger("batchproxy")

PROBES_MISSED = 3
"""Probes in a row without an answer after which a replica is replaced."""


class Replicas:
    """A pool's actors. Everything here runs on the pool's event loop."""

    def __init__(
        self,
        name: str,
        factory: ModelFactory,
        options: dict[str, Any],
        start_timeout: float | None,
        probe_period: float | None,
    ) -> None:
        self.name = name
        self._factory = factory
        self.options = options
        self.demand = demand(options)  # what one replica asks a node for
        self.start_timeout = start_timeout
        self._probe_period = probe_period
        self._actor_class: Any = None
        self.rotation: list[Replica] = []
        self.retired: set[Replica] = set()
        self._created = 0
        self.in_flight = 0  # batches running on replicas
        self.waiting = 0  # batches in acquire()
        self.lost_count = 0
        self.start_error: BaseException | None = None  # the last factory() error
        self._changed = asyncio.Event()
        self.unready_since: float | None = None
        self.started = False
        self.closed = False
        self._prober: asyncio.Task[None] | None = None

    # -- routing -----------------------------------------------------------------------

    async def acquire(self) -> Replica:
        """A ready replica for one batch, counted in flight until `release`: the least
        busy, once one is free or no other replica is coming up."""
        loop = asyncio.get_running_loop()
        deadline: float | None = None
        self.waiting += 1
        try:
            while True:
                if self.closed:
                    raise RuntimeError(f"{self.name} is closed and runs no more batches")
                usable = [r for r in self.rotation if r.usable]
                coming = any(not r.usable for r in self.rotation)
                if usable:
                    best = min(usable, key=lambda r: (r.in_flight, r.number))
                    # Race: a busy replica would queue this batch in its actor, while a
                    # replica still starting might never start (no room on the
                    # cluster). Wait for whichever frees or starts first instead.
                    if best.in_flight == 0 or not coming:
                        best.in_flight += 1
                        self.in_flight += 1
                        return best
                    deadline = None  # a busy replica frees in time: no deadline on that
                elif not coming:  # every replica failed to start
                    error = self.start_error
                    raise error if error is not None else RuntimeError(f"{self.name}: no replica")
                elif deadline is None and self.start_timeout is not None:
                    deadline = loop.time() + self.start_timeout
                elif deadline is not None and loop.time() >= deadline:
                    assert self.start_timeout is not None
                    raise PoolUnavailable(self.name, self.start_timeout, self.not_ready())
                changed = self._changed
                timeout = None if deadline is None else max(0.0, deadline - loop.time())
                with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
                    await asyncio.wait_for(changed.wait(), timeout)
        finally:
            self.waiting -= 1

    def release(self, replica: Replica) -> None:
        """One batch on `replica` ended (whatever its outcome)."""
        replica.in_flight -= 1
        self.in_flight -= 1
        if replica.retired and replica.in_flight == 0:
            self.kill(replica)
        self.notify()

    def tally(self) -> tuple[int, int, int, int]:
        """The replicas in rotation that are ready (usable), pending, overdue (pending
        past `start_timeout`) and unavailable."""
        rotation = self.rotation
        return (
            sum(r.usable for r in rotation),
            sum(not r.ready for r in rotation),
            sum(r.overdue and not r.ready for r in rotation),
            sum(r.ready and r.unavailable for r in rotation),
        )

    def not_ready(self) -> str:
        """Why batches wait: "2 pending, 0 unavailable"."""
        _, pending, _, unavailable = self.tally()
        return f"{pending} pending, {unavailable} unavailable"

    def notify(self) -> None:
        """Wake the batches waiting in `acquire`; keep `unready_since`."""
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
        if any(r.usable for r in self.rotation) or not self.started:
            self.unready_since = None
        elif self.unready_since is None:
            self.unready_since = time.time()

    # -- the replica count -------------------------------------------------------------

    def fill(self, target: int, on_first: Callable[[], None]) -> None:
        """Create actors until the rotation holds `target`; at the very first call
        also start the health probes and call `on_first()`."""
        if not self.started:
            self.started = True
            if self._probe_period is not None:
                self._prober = asyncio.get_running_loop().create_task(
                    _probe_forever(weakref.ref(self), self._probe_period),
                    name=f"{self.name} health probes",
                )
            on_first()
        grew = len(self.rotation) < target
        while len(self.rotation) < target:
            self.rotation.append(self._create())
        if grew:
            self.notify()

    def shrink(self, target: int) -> None:
        """Retire replicas down to `target`: pending and unavailable ones first, then
        the most idle, the newest first."""
        surplus = len(self.rotation) - target
        if surplus > 0:
            idle_first = sorted(self.rotation, key=lambda r: (r.in_flight, r.usable, -r.number))
            for replica in idle_first[:surplus]:
                self.retire(replica)

    async def wait_started(self) -> None:
        """Wait until every replica in rotation is ready; raise a factory's error, or
        `TimeoutError` after `start_timeout`."""
        replicas = list(self.rotation)
        if not replicas:
            return
        done, pending = await asyncio.wait(
            [replica.started for replica in replicas], timeout=self.start_timeout
        )
        for replica in replicas:
            started = replica.started
            if started in done and not started.cancelled():
                error = started.exception()
                if error is not None:
                    raise unwrap(error)
        if pending:
            raise TimeoutError(
                f"{self.name}: {len(pending)} of {len(replicas)} replicas not started after "
                f"{self.start_timeout:g} s (the cluster may have no room for "
                f"{self.demand}); they stay pending and take batches once placed"
            )

    async def close(self) -> None:
        """Refuse batches from now on (the waiting ones fail) and stop the probes."""
        self.closed = True
        self.notify()
        if self._prober is not None:
            self._prober.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._prober

    def kill_all(self) -> None:
        for replica in [*self.rotation, *self.retired]:
            self.kill(replica)
        self.rotation.clear()
        self.retired.clear()

    # -- one replica -------------------------------------------------------------------

    def _create(self) -> Replica:
        if self._actor_class is None:
            self._actor_class = ray.remote(ReplicaActor).options(**self.options)
            if room_for(self.demand) is False:
                logger.warning(
                    "%s: no node of the Ray cluster has %s for a replica; replicas "
                    "stay pending until one joins",
                    self.name,
                    self.demand,
                )
        handle = self._actor_class.remote(self._factory)
        started = asyncio.wrap_future(handle.ready.remote().future())
        replica = Replica(self._created, handle, started)
        self._created += 1
        started.add_done_callback(functools.partial(self._on_started, replica))
        if self.start_timeout is not None:
            replica.timer = asyncio.get_running_loop().call_later(
                self.start_timeout, self._overdue, replica
            )
        return replica

    def _on_started(self, replica: Replica, started: asyncio.Future[Any]) -> None:
        replica.stop_timer()
        if started.cancelled():
            return
        error = started.exception()
        if error is None:
            replica.ready, replica.node = True, started.result()
            self.notify()
            return
        if replica.retired or self.closed:
            return
        error = unwrap(error)
        logger.error("%s: replica %s failed to start: %r", self.name, replica.label(), error)
        self.start_error = error
        self.retire(replica)  # the next batch tries a new one
        self.notify()

    def _overdue(self, replica: Replica) -> None:
        replica.timer = None
        if replica.ready or replica.retired or self.closed:
            return
        replica.overdue = True
        logger.warning(
            "%s: replica %s not started after %g s (the cluster may have no room for %s); "
            "it stays pending and takes batches once placed",
            self.name,
            replica.label(),
            self.start_timeout,
            self.demand,
        )
        self.notify()

    def unavailable(self, replica: Replica, reason: str | BaseException) -> None:
        """Ray cannot reach `replica` for now: no batches until a probe is answered
        (without probes, nothing would bring it back: it is replaced)."""
        if self._probe_period is None:
            self.lost(replica, reason)
        elif not replica.unavailable and not replica.retired:
            logger.warning(
                "%s: replica %s unavailable, out of rotation until it answers: %s",
                self.name,
                replica.label(),
                _why(reason),
            )
            replica.unavailable = True
            self.notify()

    def _available(self, replica: Replica) -> None:
        replica.failed_probes = 0
        if replica.unavailable:
            replica.unavailable = False
            logger.info("%s: replica %s answers again", self.name, replica.label())
            self.notify()

    def lost(self, replica: Replica, reason: str | BaseException) -> None:
        """`replica` died or stays unreachable: kill it for certain, replace it."""
        if replica in self.rotation and not self.closed:
            logger.warning("%s: replica %s lost: %s", self.name, replica.label(), _why(reason))
            self.lost_count += 1
            self.rotation[self.rotation.index(replica)] = self._create()
            replica.retired = True
            self.notify()
        self.kill(replica)

    def retire(self, replica: Replica) -> None:
        """Take `replica` out of rotation; kill it now if idle, else after its last batch."""
        if replica in self.rotation:
            self.rotation.remove(replica)
        replica.retired = True
        if replica.in_flight:
            self.retired.add(replica)
        else:
            self.kill(replica)

    def kill(self, replica: Replica) -> None:
        self.retired.discard(replica)
        replica.started.cancel()
        replica.stop_timer()
        with contextlib.suppress(Exception):  # already dead, or Ray is shut down
            ray.kill(replica.handle, no_restart=True)

    async def probe(self, replica: Replica, period: float) -> None:
        """Ask one replica to answer within `period`; act on what Ray says."""
        try:
            answer = asyncio.wrap_future(replica.handle.ready.remote().future())
            await asyncio.wait_for(answer, period)
        except (TimeoutError, asyncio.TimeoutError, ActorUnavailableError) as exc:
            if replica.in_flight and not isinstance(exc, RayActorError):
                return  # a batch arrived meanwhile: a plain `def` model holds the actor
            replica.failed_probes += 1
            if replica.failed_probes >= PROBES_MISSED:
                self.lost(replica, f"{replica.failed_probes} health probes unanswered")
            else:
                self.unavailable(replica, exc if isinstance(exc, RayActorError) else "no answer")
            return
        except RayActorError as exc:  # Ray says it died
            self.lost(replica, exc)
            return
        except Exception:  # it answers, with its factory's error: reachable
            pass
        self._available(replica)


def _why(reason: str | BaseException) -> str:
    return short(reason) if isinstance(reason, BaseException) else reason


async def _probe_forever(replicas_ref: weakref.ref[Replicas], period: float) -> None:
    """Probe the idle and unavailable replicas every `period` seconds, until the pool
    is closed or collected (only a weak reference is held between rounds)."""
    while True:
        await asyncio.sleep(period)
        replicas = replicas_ref()
        if replicas is None or replicas.closed:
            return
        due = [r for r in replicas.rotation if r.ready and (r.in_flight == 0 or r.unavailable)]
        await asyncio.gather(*(replicas.probe(r, period) for r in due))
        del replicas, due
