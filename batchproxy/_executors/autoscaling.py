"""Autoscaling: a pool's replica count follows its load, with separate up and down delays.

Three parts, as Ray Serve splits them for replicas:

- `Autoscaling`, the user's configuration (frozen, checked);
- `ScalingPolicy`, the pure rules: a load sample in, a decision (or none) out;
- `Autoscaler`, the runner: a task on the running event loop that samples a
  `Scalable` target every `interval` and applies the policy's decisions.

The load is counted in full batches: the items running on the pool or queued
in the proxies it serves, over their `batch_size` (what the target's
`autoscale_load()` returns). Items, not batches: more replicas make smaller
batches, and a count of batches would read that as more load and never shrink.
It is a state, not a rate: a pool too small for its traffic grows a queue, and
so a load that keeps rising until it scales.

Each decision is one DEBUG line on the `batchproxy` logger; nothing is logged at
INFO or above unless the target raises (WARNING, once per run of the same error).
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import weakref
from dataclasses import dataclass
from typing import Literal, Protocol

from .. import _validate
from .._tasks import new_task

__all__ = [
    "Autoscaler",
    "AutoscalerStats",
    "Autoscaling",
    "HeldItems",
    "Scalable",
    "ScalingDecision",
    "ScalingPolicy",
    "autoscaler_for",
    "load_in_batches",
]

logger = logging.getLogger("batchproxy")

_LOAD_TOLERANCE = 1e-6  # in replicas: a load of 2.0000001 x target needs 2, not 3
_TIME_TOLERANCE = 1e-3  # seconds: a sample this early counts as on time

Reason = Literal["load", "idle", "bounds"]


@dataclass(frozen=True)
class Autoscaling:
    """How a pool's replica count follows its load (opt-in; pass it to the pool).

    The load is counted in full batches: the items running on the pool or
    queued in the proxies it serves, over their `batch_size`. The pool aims at
    `target_batches_per_replica` of it per replica, within its bounds, and
    changes only once the load has called for the change for a whole delay (see
    `ScalingPolicy` for the rules).

    - `max_replicas` (required, >= 1): the most replicas.
    - `min_replicas` (>= 1, default 1): the fewest. Not 0: a pool of no replicas
      gives its proxies a capacity of 0, so no batch would ever leave to show
      the load that would wake it.
    - `target_batches_per_replica` (> 0, default 1.0): the full batches of load
      per replica it aims at (0.8 leaves a fifth of headroom).
    - `upscale_delay` (seconds, >= 0, default 10): the load must call for more
      replicas for this long before replicas are added.
    - `downscale_delay` (seconds, >= 0, default 60): the same for fewer; an idle
      pool goes down to `min_replicas` after this long.
    - `interval` (seconds, > 0, default 1): how often the load is sampled.
    """

    max_replicas: int
    min_replicas: int = 1
    target_batches_per_replica: float = 1.0
    upscale_delay: float = 10.0
    downscale_delay: float = 60.0
    interval: float = 1.0

    def __post_init__(self) -> None:
        most = _validate.count("max_replicas", self.max_replicas)
        fewest = _validate.count("min_replicas", self.min_replicas)
        if fewest > most:
            raise ValueError(
                f"min_replicas must be <= max_replicas, got min_replicas={self.min_replicas!r} "
                f"and max_replicas={self.max_replicas!r}"
            )
        normal = {
            "max_replicas": most,
            "min_replicas": fewest,
            "target_batches_per_replica": _validate.finite(
                "target_batches_per_replica", self.target_batches_per_replica, allow_zero=False
            ),
            "upscale_delay": _validate.duration(
                "upscale_delay", self.upscale_delay, allow_zero=True
            ),
            "downscale_delay": _validate.duration(
                "downscale_delay", self.downscale_delay, allow_zero=True
            ),
            "interval": _validate.duration("interval", self.interval, allow_zero=False),
        }
        for name, value in normal.items():
            object.__setattr__(self, name, value)


@dataclass(frozen=True)
class ScalingDecision:
    """One change of the replica count, and why.

    `reason`: `"load"` (the load called for it), `"idle"` (down: no load at all
    for the whole delay) or `"bounds"` (the count was outside `min_replicas` ..
    `max_replicas`, e.g. set by hand). `load` is the load that justified it: the
    smallest seen over the delay going up, the largest going down (the sampled
    one for `"bounds"`); `window` how long the load called for it (seconds).
    """

    time: float
    from_replicas: int
    to_replicas: int
    load: float
    reason: Reason
    window: float

    @property
    def up(self) -> bool:
        return self.to_replicas > self.from_replicas


@dataclass
class _Window:
    """A run of samples that all called for a change the same way."""

    since: float
    replicas: int  # the smallest desired seen (up) or the largest (down)
    load: float  # the smallest load seen (up) or the largest (down)


class ScalingPolicy:
    """The rules, pure: `decide(now, load, replicas)` per sample, no clock of its own.

    - `desired = clamp(ceil(load / target_batches_per_replica), min_replicas,
      max_replicas)`, less a tolerance of 1e-6 replica before rounding up (a load
      of 2.0000001 x target needs 2); an infinite load, `max_replicas`.
    - desired > replicas: the sample opens (or extends) an "above" window. Once
      it has lasted `upscale_delay`, the count goes to the smallest desired seen
      in it: the load sustained over the whole delay. A sample with desired <=
      replicas closes it.
    - desired < replicas: the same with a "below" window and `downscale_delay`,
      to the largest desired seen in it (reason `"idle"` if the load was 0 all
      along, else `"load"`).
    - After a decision both windows are closed: the next change needs its full
      delay again, counted from the next sample that calls for it.
    - A replica count that changed since the last sample (by a decision or by
      hand) closes both windows too.
    - A count outside `min_replicas` .. `max_replicas` (set by hand) goes back to
      the nearest bound at once, without a delay: the bounds are the user's own.

    So a burst shorter than `upscale_delay` adds nothing, and a load that swings
    above and below the target within the delays never flaps the count.
    """

    def __init__(self, config: Autoscaling) -> None:
        if not isinstance(config, Autoscaling):
            raise TypeError(f"config must be an Autoscaling, got {type(config).__name__}")
        self.config = config
        self.desired: int | None = None
        """What the last sample's load called for (None before the first)."""
        self._above: _Window | None = None
        self._below: _Window | None = None
        self._replicas: int | None = None  # the count at the last sample

    def desired_replicas(self, load: float) -> int:
        """The replica count `load` calls for, within the bounds."""
        config = self.config
        if load == math.inf:
            return config.max_replicas
        wanted = math.ceil(load / config.target_batches_per_replica - _LOAD_TOLERANCE)
        return min(max(wanted, config.min_replicas), config.max_replicas)

    def decide(self, now: float, load: float, replicas: int) -> ScalingDecision | None:
        """The decision this sample makes (at time `now`, in seconds), or None.

        `load` is in batches (>= 0; NaN or negative raise `ValueError`);
        `replicas` is the count now.
        """
        if math.isnan(load) or load < 0:
            raise ValueError(f"load must be a number >= 0, got {load!r}")
        config = self.config
        desired = self.desired = self.desired_replicas(load)
        if replicas != self._replicas:
            self._above = self._below = None
            self._replicas = replicas
        bounded = min(max(replicas, config.min_replicas), config.max_replicas)
        if bounded != replicas:
            return self._decided(ScalingDecision(now, replicas, bounded, load, "bounds", 0.0))
        if desired > replicas:
            self._below = None
            above = self._above = _extend(self._above, now, desired, load, up=True)
            lasted = now - above.since
            if lasted >= config.upscale_delay - _TIME_TOLERANCE:
                return self._decided(
                    ScalingDecision(now, replicas, above.replicas, above.load, "load", lasted)
                )
        elif desired < replicas:
            self._above = None
            below = self._below = _extend(self._below, now, desired, load, up=False)
            lasted = now - below.since
            if lasted >= config.downscale_delay - _TIME_TOLERANCE:
                reason: Reason = "idle" if below.load == 0 else "load"
                return self._decided(
                    ScalingDecision(now, replicas, below.replicas, below.load, reason, lasted)
                )
        else:
            self._above = self._below = None
        return None

    def _decided(self, decision: ScalingDecision) -> ScalingDecision:
        self._above = self._below = None
        self._replicas = decision.to_replicas  # the count the target is expected to take
        return decision


def _extend(window: _Window | None, now: float, desired: int, load: float, *, up: bool) -> _Window:
    """`window` with one more sample (a new window if None): it keeps the smallest desired
    and load going up, the largest going down."""
    if window is None:
        return _Window(now, desired, load)
    keep = min if up else max
    window.replicas = keep(window.replicas, desired)
    window.load = keep(window.load, load)
    return window


class Scalable(Protocol):
    """What an `Autoscaler` drives: a pool that reports its load and changes size."""

    name: str

    @property
    def num_replicas(self) -> int:
        """The replica count asked for (not necessarily started yet)."""
        ...

    def autoscale_load(self) -> float:
        """The items running on the pool or queued for it, in full batches, now."""
        ...

    def autoscale_to(self, n: int) -> None:
        """Ask for `n` replicas; return at once (without waiting for them to start)."""
        ...


@dataclass(frozen=True)
class AutoscalerStats:
    """A snapshot of an `Autoscaler`: its decisions so far.

    `scale_ups` and `scale_downs` count the decisions applied (`"bounds"` ones
    included, by their direction); `errors` the samples where the target
    raised; `desired` is what the last sample's load called for (None before).
    """

    scale_ups: int
    scale_downs: int
    errors: int
    last_decision: ScalingDecision | None
    desired: int | None


class Autoscaler:
    """Drives `target` by `config` from a task on the running event loop (no thread).

    Every `config.interval` seconds it reads `target.autoscale_load()` and
    `target.num_replicas`, asks its `ScalingPolicy`, and applies a decision with
    `target.autoscale_to(n)`. `start()` starts the task (idempotent; needs a
    running loop), `aclose()` cancels it and waits for it (idempotent; final).

    An exception from the target does not stop it: the sample is skipped,
    counted in `stats.errors` and logged at WARNING (with its traceback; the
    same error again in a row at DEBUG only), and the next sample comes on time.
    A failed `autoscale_to` closes the policy's windows like a decision does, so
    it is retried after a full delay, not at every sample. The target is held
    weakly: a pool dropped without being closed is not kept alive by its
    autoscaler, whose task then ends.
    """

    def __init__(self, target: Scalable, config: Autoscaling) -> None:
        self.config = config
        self.policy = ScalingPolicy(config)
        self._target = weakref.ref(target)
        self._label = f"{type(target).__name__} {target.name!r}"  # in the log lines
        self._task_name = f"batchproxy-{target.name}-autoscaler"
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._scale_ups = 0
        self._scale_downs = 0
        self._errors = 0
        self._last: ScalingDecision | None = None
        self._failing: tuple[type[BaseException], str] | None = None  # the error repeating

    def __repr__(self) -> str:
        state = "closed" if self._closed else "running" if self.running else "not started"
        return f"<Autoscaler {self._label} {state}>"

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def stats(self) -> AutoscalerStats:
        return AutoscalerStats(
            self._scale_ups, self._scale_downs, self._errors, self._last, self.policy.desired
        )

    def start(self) -> None:
        """Start sampling now, on the running event loop (again: a no-op)."""
        if self._closed:
            raise RuntimeError(f"the autoscaler of {self._label} is closed")
        if self._task is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            raise RuntimeError(
                f"the autoscaler of {self._label} needs a running event loop to start"
            ) from None
        self._task = new_task(loop, self._run(), name=self._task_name)

    def stop(self) -> None:
        """Stop sampling, from any thread, without waiting (`aclose()` waits). Idempotent."""
        self._closed = True
        task = self._task
        if task is not None and not task.done():
            task.get_loop().call_soon_threadsafe(task.cancel)

    async def aclose(self) -> None:
        """Stop sampling and wait for the task to end. Idempotent."""
        self._closed = True
        task = self._task
        if task is None:
            return
        task.cancel()
        await asyncio.wait([task])  # the task's cancellation is not the caller's

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        interval = self.config.interval
        start = loop.time()
        tick = 0
        while self._sample(loop.time()):
            # the next tick on the grid start + k x interval (ticks missed are skipped)
            tick = max(tick + 1, math.floor((loop.time() - start) / interval) + 1)
            await asyncio.sleep(start + tick * interval - loop.time())

    def _sample(self, now: float) -> bool:
        """Sample the target once and apply a decision; False once the target is gone."""
        target = self._target()
        if target is None:
            return False
        try:
            load = float(target.autoscale_load())
            decision = self.policy.decide(now, load, target.num_replicas)
            if decision is not None:
                target.autoscale_to(decision.to_replicas)
                self._applied(decision)
        except Exception as exc:
            self._failed(exc)
        else:
            self._failing = None
        return True

    def _applied(self, decision: ScalingDecision) -> None:
        if decision.up:
            self._scale_ups += 1
        else:
            self._scale_downs += 1
        self._last = decision
        logger.debug(
            "%s: autoscale %d -> %d %s (%s)",
            self._label,
            decision.from_replicas,
            decision.to_replicas,
            "replica" if decision.to_replicas == 1 else "replicas",
            _why(decision, self.config),
        )

    def _failed(self, error: Exception) -> None:
        self._errors += 1
        key = (type(error), str(error))
        if key == self._failing:
            logger.debug("%s: autoscaling sample failed again: %r", self._label, error)
            return
        self._failing = key
        logger.warning(
            "%s: autoscaling sample failed (the autoscaler goes on): %r",
            self._label,
            error,
            exc_info=error,
        )


def autoscaler_for(target: Scalable, config: object, replicas: int) -> Autoscaler | None:
    """A pool's autoscaler, from its `autoscaling=` argument (None: none), checked
    against the pool's first replica count."""
    if config is None:
        return None
    if not isinstance(config, Autoscaling):
        raise TypeError(f"autoscaling must be a batchproxy.Autoscaling, got {config!r}")
    if not config.min_replicas <= replicas <= config.max_replicas:
        raise ValueError(
            f"the replica count to begin with, {replicas}, is outside the autoscaling "
            f"range [{config.min_replicas}, {config.max_replicas}]"
        )
    return Autoscaler(target, config)


class HeldItems:
    """The items a pool holds (its batches running or waiting for a worker), for its
    autoscaler's load. Safe from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items = 0
        self._largest = 0  # the largest batch seen

    def add(self, batch: int) -> None:
        with self._lock:
            self._items += batch
            self._largest = max(self._largest, batch)

    def remove(self, batch: int) -> None:
        with self._lock:
            self._items -= batch

    def in_batches(self, queued: tuple[int, int]) -> float:
        """The pool's load with `queued` from its proxies (see `load_in_batches`)."""
        with self._lock:
            items, largest = self._items, self._largest
        return load_in_batches(items, queued, largest)


def load_in_batches(items: int, queued: tuple[int, int], largest_batch: int) -> float:
    """A pool's load: `items` it runs or holds, plus `queued = (items, batch_size)`
    from its proxies (`Executor.queued_items()`), in full batches of that size (no
    proxy: the largest batch the pool has seen). Items, not batches: more replicas
    make smaller batches, which must not read as more load."""
    queued_items, batch_size = queued
    return (items + queued_items) / (batch_size or largest_batch or 1)


def _why(decision: ScalingDecision, config: Autoscaling) -> str:
    """The reason in a decision's log line."""
    if decision.reason == "bounds":
        return f"outside min_replicas {config.min_replicas}, max_replicas {config.max_replicas}"
    seconds = _number(decision.window)
    if decision.reason == "idle":
        return f"idle for {seconds} s"
    bound = "at least" if decision.up else "at most"
    return (
        f"load {bound} {_number(decision.load)} batches for {seconds} s, "
        f"target {_number(config.target_batches_per_replica)} per replica"
    )


def _number(value: float) -> str:
    """One decimal, unless that would hide the value (0.25 stays 0.25)."""
    return f"{value:.1f}" if abs(value - round(value, 1)) < 1e-9 else f"{value:.3g}"
