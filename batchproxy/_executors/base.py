"""Where a batch runs: the executor interface and the event-loop executor.

The cut-off point: an executor receives the model callable and one batch's
items, calls it once, and returns what it returned (or raises what it raised).
It knows nothing of requests, futures, result counts or statistics; the proxy
does all of that on its own event loop.

What an executor tells the proxy:

- `capacity`: how many batches it runs at once (a thread: 1; a pool of n
  workers: n). A proxy created without `max_concurrent_batches` keeps that many
  batches in flight, and follows the capacity when it changes (a pool resized
  at run time calls `_capacity_changed()`).
- `hosts_model`: whether it holds a model of its own, built from a factory in
  each of its workers (processes, Ray actors). A proxy on such an executor has
  no `_inference`; `run` ignores the callable it is given and calls its own model.
- `health`: None, or whether it can run a batch now (a pool with no worker
  ready cannot); a proxy's `health` includes it.

And what it learns of its proxies: `queued_items()`, the items they hold queued
and their batch size (an autoscaling pool's load), through the same watchers as
the capacity (`WeakWatcher`, which holds each proxy weakly).
"""

from __future__ import annotations

import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from typing_extensions import Self

if TYPE_CHECKING:
    from .._stats import Health

__all__ = [
    "Executor",
    "LoopExecutor",
    "ModelFactory",
    "ModelFn",
    "PoolExecutor",
    "put_back_refused",
]

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

    @property
    def health(self) -> Health | None:
        """Whether the executor can run a batch now (a pool with no worker ready cannot);
        None: nothing to say. A proxy's `health` includes it."""
        return None

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

    def queued_items(self) -> tuple[int, int]:
        """The items queued in the proxies that watch this executor, and the largest
        `batch_size` among them (0 without any): what an autoscaler adds to the
        items it runs."""
        with _watchers_lock:
            watchers = list(self.__dict__.get("_capacity_watchers", []))
        items = size = 0
        for callback in watchers:
            queued, batch_size = getattr(callback, "queued_items", _nothing)()
            items, size = items + queued, max(size, batch_size)
        return items, size

    def _capacity_changed(self) -> None:
        """Tell every watcher the new capacity; subclasses call it after a resize."""
        with _watchers_lock:
            watchers = list(self.__dict__.get("_capacity_watchers", []))
        capacity = self.capacity
        for callback in watchers:
            callback(capacity)


_watchers_lock = threading.Lock()

_T = TypeVar("_T")


def _nothing() -> tuple[int, int]:
    return 0, 0


class WeakWatcher(Generic[_T]):
    """A capacity callback calling `changed(owner, capacity)` that does not keep `owner`
    alive (an executor may outlive the proxies that watch it); `queued_items()`
    asks the owner for its queued items and its batch size."""

    __slots__ = ("_changed", "_queued", "_ref")

    def __init__(
        self,
        owner: _T,
        changed: Callable[[_T, int], None],
        queued: Callable[[_T], tuple[int, int]],
    ) -> None:
        self._ref, self._changed, self._queued = weakref.ref(owner), changed, queued

    def __call__(self, capacity: int) -> None:
        owner = self._ref()
        if owner is not None:
            self._changed(owner, capacity)

    def queued_items(self) -> tuple[int, int]:
        owner = self._ref()
        return (0, 0) if owner is None else self._queued(owner)


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


def put_back_refused(results: Any, refused: Mapping[int, BaseException], size: int) -> Any:
    """For an executor that sends a batch elsewhere without the items that could not
    travel (`refused`, by index: each one's error): the results of the items sent,
    each refused item's error put back in its place, for a batch of `size`. Results
    that are not one per item sent are left as they are: the proxy reports them."""
    if not refused:
        return results
    try:
        restored = list(results)
    except TypeError:
        return results
    if len(restored) != size - len(refused):
        return results
    for index in sorted(refused):
        restored.insert(index, refused[index])
    return restored
