"""One Ray actor of a `RayActors` pool: what runs in it, how the pool tracks it, and
the actor options it is created with."""

from __future__ import annotations

import asyncio
import inspect
import numbers
from collections.abc import Mapping
from typing import Any

import ray
from ray.exceptions import RayTaskError

from .._executors.base import ModelFactory, ModelFn
from .._validate import finite

# Options the pool sets itself, or that would break it: named or detached actors
# outlive the pool or collide between replicas; the resource counts have arguments.
_REFUSED = {
    "num_cpus": "pass num_cpus= to RayActors",
    "num_gpus": "pass num_gpus= to RayActors",
    "name": "replicas are anonymous actors (a name would collide between them)",
    "namespace": "replicas are anonymous actors",
    "get_if_exists": "replicas are anonymous actors",
    "lifetime": "replicas live and die with their pool (a detached actor would outlive it)",
    "concurrency_groups": "not supported by Ray in .options()",
}


class ReplicaActor:
    """What runs in each actor: the model built once from the factory, then batches."""

    def __init__(self, factory: ModelFactory) -> None:
        self._error: Exception | None = None
        # The results of each batch until Ray has serialized them (see `_Sent`).
        self._unsent: dict[int, Any] = {}
        try:
            self._model: ModelFn | None = factory()
        except Exception as exc:  # kept, so the caller gets the factory's own error type
            self._model, self._error = None, exc

    async def ready(self) -> str:
        """The actor's node id once the model is built; raise what `factory()` raised.
        Also the health probe."""
        if self._error is not None:
            raise self._error
        return str(ray.get_runtime_context().get_node_id())

    async def run(self, items: list[Any], token: int) -> list[Any]:
        """`[results, None]`. The results stay held until Ray has serialized them:
        if that fails, `salvage(token)` sends back those that can travel."""
        if self._model is None:
            assert self._error is not None
            raise self._error
        result = self._model(items)
        if inspect.isawaitable(result):
            result = await result
        self._unsent[token] = result
        return [result, _Sent(self._unsent, token)]

    async def salvage(self, token: int) -> list[Any] | None:
        """The results of batch `token` that Ray could not send back, each one that
        cannot travel replaced by a TypeError; None if its results were sent (the
        batch failed for another reason)."""
        if token not in self._unsent:
            return None
        results = self._unsent.pop(token)
        if isinstance(results, (str, bytes)) or not hasattr(results, "__len__"):
            return None
        portable = list(results)
        for index, result in enumerate(portable):
            error = refusal(result, "the result", "to return from its Ray actor")
            if error is not None:
                portable[index] = error
        return portable


class _Sent:
    """The last value of `run`'s reply. Ray's serializer reaches it only after the
    results have been serialized: it then drops them from the actor (a signal that
    costs one tiny object per batch, and no second serialization of the results)."""

    __slots__ = ("held", "token")

    def __init__(self, held: dict[int, Any], token: int) -> None:
        self.held, self.token = held, token

    def __reduce__(self) -> tuple[Any, ...]:
        self.held.pop(self.token, None)
        return type(None), ()


def refusal(value: object, what: str, where: str) -> TypeError | None:
    """None if Ray can serialize `value`, else the TypeError for its caller."""
    try:
        _serialize(value)
    except Exception as exc:
        error = TypeError(
            f"{what} (a {type(value).__module__}.{type(value).__qualname__}) could not be "
            f"serialized by Ray {where}: {exc!r}"
        )
        error.__cause__ = exc
        return error
    return None


def _serialize(value: object) -> None:
    """Serialize `value` as Ray does for an argument or a result (its serialization
    context: no copy into the object store), and drop it."""
    try:
        worker = ray._private.worker.global_worker
        context = worker.get_serialization_context()  # type: ignore[no-untyped-call]
    except AttributeError:  # a Ray without this private path: the public one
        ray.put(value)
        return
    context.serialize(value)


class Replica:
    """One actor as the pool sees it. Its states, in order:

    - pending: created, `started` not done (Ray has not placed it yet, or its
      `factory()` runs). `overdue` once it has been pending for `start_timeout`.
    - ready: `started` succeeded. Takes batches unless `unavailable`.
    - unavailable: ready, but Ray called it temporarily unavailable or a health
      probe went unanswered; takes no batch until a probe is answered again.
    - retired: out of the pool's rotation for good (scaled down, lost, failed to
      start); killed once `in_flight` is 0.
    """

    __slots__ = (
        "failed_probes",
        "handle",
        "in_flight",
        "node",
        "number",
        "overdue",
        "ready",
        "retired",
        "started",
        "timer",
        "unavailable",
    )

    def __init__(self, number: int, handle: Any, started: asyncio.Future[Any]) -> None:
        self.number = number
        self.handle = handle
        self.started = started  # resolves with the node id when factory() has returned
        self.ready = False
        self.unavailable = False
        self.failed_probes = 0  # probes in a row not answered (reset by an answer)
        self.overdue = False
        self.timer: asyncio.TimerHandle | None = None  # the start deadline, while pending
        self.node: str | None = None  # the Ray node id, once ready
        self.in_flight = 0
        self.retired = False

    def stop_timer(self) -> None:
        """Cancel the start deadline (started, or killed)."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    @property
    def usable(self) -> bool:
        """Takes a batch now."""
        return self.ready and not self.unavailable and not self.retired

    def label(self) -> str:
        actor_id = getattr(self.handle, "_actor_id", None)
        return f"{self.number}" if actor_id is None else f"{self.number} (actor {actor_id.hex()})"


def actor_options(
    num_cpus: float, num_gpus: float, options: Mapping[str, Any] | None
) -> dict[str, Any]:
    """Ray's `.options(...)` for every replica: `options` checked now (Ray would refuse
    them only at the first actor), with replicas spread over nodes unless
    `scheduling_strategy` says otherwise."""
    if options is None:
        options = {}
    if not isinstance(options, Mapping):
        raise TypeError(f"actor_options must be a dict, got {type(options).__name__} {options!r}")
    merged: dict[str, Any] = {"scheduling_strategy": "SPREAD"}
    for key, value in options.items():
        if not isinstance(key, str):
            raise TypeError(f"actor_options keys are Ray option names (str), got {key!r}")
        if key in _REFUSED:
            raise ValueError(f"actor_options cannot set {key!r}: {_REFUSED[key]}")
        merged[key] = value
    if merged.get("scheduling_strategy") is None:
        merged["scheduling_strategy"] = "DEFAULT"
    _check_known(merged)
    merged.update(num_cpus=num_cpus, num_gpus=num_gpus)
    # Ray's own checks of names, types and resource quantities, now rather than later
    ray.remote(ReplicaActor).options(**merged)
    return merged


def _check_known(options: dict[str, Any]) -> None:
    """The options Ray accepts here but fails on only when it places the actor."""
    strategy = options["scheduling_strategy"]
    if isinstance(strategy, str) and strategy not in ("DEFAULT", "SPREAD"):
        raise ValueError(
            f"actor_options['scheduling_strategy'] must be 'DEFAULT', 'SPREAD' or a Ray "
            f"scheduling strategy object, got {strategy!r}"
        )
    resources = options.get("resources")
    if resources is not None:
        if not isinstance(resources, Mapping):
            raise TypeError(f"actor_options['resources'] must be a dict, got {resources!r}")
        for name, quantity in resources.items():
            finite(f"actor_options['resources'][{name!r}]", quantity, allow_zero=True)
        options["resources"] = dict(resources)
    memory = options.get("memory")
    if memory is not None and (
        isinstance(memory, bool) or not isinstance(memory, numbers.Real) or memory <= 0
    ):
        raise ValueError(f"actor_options['memory'] must be a number of bytes > 0, got {memory!r}")
    restarts = options.get("max_restarts")
    if restarts is not None and (
        isinstance(restarts, bool) or not isinstance(restarts, int) or restarts < -1
    ):
        raise ValueError(
            f"actor_options['max_restarts'] must be an int >= -1 (-1: without end), "
            f"got {restarts!r}"
        )
    runtime_env = options.get("runtime_env")
    if runtime_env is not None:
        if not isinstance(runtime_env, Mapping):
            raise TypeError(f"actor_options['runtime_env'] must be a dict, got {runtime_env!r}")
        from ray.runtime_env import RuntimeEnv

        try:  # parses every field: a bad one fails here, not in the actor's node
            RuntimeEnv(**runtime_env)
        except Exception as exc:
            raise ValueError(f"actor_options['runtime_env'] is not valid: {exc}") from exc


def demand(options: Mapping[str, Any]) -> dict[str, float]:
    """The resources one replica asks a node for."""
    wanted = {"CPU": float(options["num_cpus"]), "GPU": float(options["num_gpus"])}
    wanted.update({name: float(q) for name, q in (options.get("resources") or {}).items()})
    if options.get("memory"):
        wanted["memory"] = float(options["memory"])
    return {name: q for name, q in wanted.items() if q > 0}


def room_for(wanted: Mapping[str, float]) -> bool | None:
    """Whether any live node of the cluster has `wanted` in total (None: unknown)."""
    try:
        nodes = [node for node in ray.nodes() if node.get("Alive")]  # type: ignore[no-untyped-call]
    except Exception:  # Ray not initialized, or the GCS unreachable
        return None
    return any(
        all(node.get("Resources", {}).get(name, 0.0) >= q for name, q in wanted.items())
        for node in nodes
    )


def unwrap(error: BaseException) -> BaseException:
    """The exception the model (or factory) raised, out of Ray's wrapper."""
    if not isinstance(error, RayTaskError):
        return error
    cause = error.cause
    return cause if isinstance(cause, BaseException) else error


def short(error: BaseException) -> str:
    """A one-line reason out of Ray's many-line actor error."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    reason = next((line for line in lines if line.startswith("The actor is dead because")), "")
    reason = (reason or (lines[0] if lines else "")).split(". ")[0].rstrip(".")
    return f"{type(error).__name__}: {reason}" if reason else type(error).__name__
