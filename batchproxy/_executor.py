"""Where a batch runs: the executor interface and the event-loop executor.

The cut-off point: an executor receives the model callable and one batch's
items, calls it once, and returns what it returned (or raises what it raised).
It knows nothing of requests, futures, result counts or statistics; the proxy
does all of that on its own event loop.

Two things an executor tells the proxy:

- `capacity`: how many batches it runs at once (a thread: 1; a pool of n
  workers: n). A proxy created without `max_concurrent_batches` keeps that many
  batches in flight, and follows the capacity when it changes (a pool resized
  at run time calls `_capacity_changed()`).
- `hosts_model`: whether it holds a model of its own, built from a factory in
  each of its workers (processes, Ray actors). A proxy on such an executor has
  no `_inference`; `run` ignores the callable it is given and calls its own model.
"""

from __future__ import annotations

import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, TypeVar

from typing_extensions import Self

__all__ = ["Executor", "LoopExecutor", "ModelFactory", "ModelFn", "PoolExecutor"]

ModelFn = Callable[[list[Any]], Any]
ModelFactory = Callable[[], ModelFn]
"""Builds a model in a worker, once: returns the callable that runs one batch."""


class Executor(ABC):
    """Runs `fn(items)` for a proxy; `aclose()` releases whatever it holds."""

    hosts_model: bool = False
    """True: the executor runs a model of its own, built from its factory, not `fn`."""

    @property
    def capacity(self) -> int:
        """How many batches this executor runs at once (default 1)."""
        return 1

    @abstractmethod
    async def run(self, fn: ModelFn, items: list[Any]) -> Any:
        """Call `fn(items)` once (awaiting it when it returns an awaitable)."""

    async def aclose(self) -> None:  # noqa: B027 - optional hook, nothing to release by default
        """Release threads or processes; the default holds none."""

    # -- capacity watchers (the proxies that follow this executor's capacity) ------------

    def watch_capacity(self, callback: Callable[[int], None]) -> None:
        """Call `callback(capacity)` whenever the capacity changes (from any thread)."""
        with _watchers_lock:
            self.__dict__.setdefault("_capacity_watchers", []).append(callback)

    def unwatch_capacity(self, callback: Callable[[int], None]) -> None:
        with _watchers_lock:
            watchers: list[Callable[[int], None]] = self.__dict__.get("_capacity_watchers", [])
            if callback in watchers:
                watchers.remove(callback)

    def _capacity_changed(self) -> None:
        """Tell every watcher the new capacity; subclasses call it after a resize."""
        with _watchers_lock:
            watchers = list(self.__dict__.get("_capacity_watchers", []))
        capacity = self.capacity
        for callback in watchers:
            callback(capacity)


_watchers_lock = threading.Lock()

_T = TypeVar("_T")


def weak_callback(owner: _T, method: Callable[[_T, int], None]) -> Callable[[int], None]:
    """A capacity callback calling `method(owner, capacity)` that does not keep `owner`
    alive (an executor may outlive the proxies that watch it)."""
    ref = weakref.ref(owner)

    def changed(capacity: int) -> None:
        target = ref()
        if target is not None:
            method(target, capacity)

    return changed


class PoolExecutor(Executor):
    """An executor whose workers start with `await start()` (optional: the first batch
    starts them); `async with` starts it and closes it."""

    @abstractmethod
    async def start(self) -> None:
        """Start the workers now, so the first batch does not wait for them."""

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


class LoopExecutor(Executor):
    """Awaits an `async def` model right on the proxy's event loop."""

    async def run(self, fn: ModelFn, items: list[Any]) -> Any:
        return await fn(items)
