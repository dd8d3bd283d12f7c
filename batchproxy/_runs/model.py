"""What a proxy runs and where: its run kind (batches or streams) and its executor.

Decided once, at construction, from the model callable the proxy exposes
(`Proxy._model_function`) and its `offload` argument, with the options a model of
that kind cannot honour refused there.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from .._executors.base import Executor, LoopExecutor
from .._executors.worker_thread import WorkerThread
from .._options import Options
from .._scheduling.sizes import refuse_streams
from .batches import BATCHES, RunKind
from .streams import STREAMS

__all__ = ["choose_executor", "refuse_reruns", "run_kind_of"]


def run_kind_of(name: str, model: Callable[..., Any], offload: object) -> RunKind:
    """Streams for a generator model (an async one only on the loop), batches otherwise."""
    if not (inspect.isasyncgenfunction(model) or inspect.isgeneratorfunction(model)):
        return BATCHES
    if inspect.isasyncgenfunction(model) and offload is not False:
        raise TypeError(
            f"{name}: an async generator _inference runs on the event loop; to run "
            f"its steps on a worker thread, make it a plain generator (def ... yield)"
        )
    return STREAMS


def refuse_reruns(name: str, kind: RunKind, options: Options) -> None:
    """A streaming run cannot rerun parts of a batch, nor keep its batch at an allowed
    size: refuse the options that would (at construction, and in `configure`)."""
    refuse_streams(name, kind.streams, options.batch_sizes)
    if kind.streams and (options.isolate_errors or options.is_oom is not None):
        option = "isolate_errors" if options.isolate_errors else "oom_backoff"
        raise TypeError(
            f"{name}: {option} reruns parts of a batch, which a streaming "
            f"_inference (a generator) cannot do; leave it off"
        )


def choose_executor(
    cls: str, name: str, model: Callable[..., Any], own_model: bool, offload: object
) -> tuple[Executor, bool]:
    """Where batches run, and whether the proxy owns it (and closes it): the executor
    given, a private `WorkerThread` (`offload=True`, or a plain `def` model), or the
    event loop (an `async def` model)."""
    if isinstance(offload, Executor):
        if offload.hosts_model and own_model:
            raise TypeError(
                f"{cls} implements _inference, but offload={offload!r} "
                f"runs a model of its own: use Proxy(offload=...) without a subclass, "
                f"or an executor that runs _inference (a WorkerThread)"
            )
        if not offload.hosts_model and not own_model:
            raise TypeError(no_model(cls))
        return offload, False
    if not isinstance(offload, bool):
        raise TypeError(
            f"offload must be a bool or an Executor (WorkerThread, ProcessWorkers, ...), "
            f"got {type(offload).__name__} {offload!r}"
        )
    if not own_model:
        raise TypeError(no_model(cls))
    on_loop = inspect.iscoroutinefunction(model) or inspect.isasyncgenfunction(model)
    if offload or not on_loop:
        return WorkerThread(name=f"batchproxy-{name}"), True
    return LoopExecutor(), False


def no_model(cls: str) -> str:
    return (
        f"{cls} has no model: subclass Proxy and implement _inference, or pass offload= an "
        f"executor that hosts one (ProcessWorkers, RayActors, WorkerThread(model=...))"
    )
