"""Where a batch runs: the executor interface and the event-loop executor.

The cut-off point: an executor receives the model callable and one batch's
items, calls it once, and returns what it returned (or raises what it raised).
It knows nothing of requests, futures, result counts or statistics; the proxy
does all of that on its own event loop.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

__all__ = ["Executor", "LoopExecutor"]

ModelFn = Callable[[list[Any]], Any]


class Executor(ABC):
    """Runs `fn(items)` for a proxy; `aclose()` releases whatever it holds."""

    @abstractmethod
    async def run(self, fn: ModelFn, items: list[Any]) -> Any:
        """Call `fn(items)` once (awaiting it when it returns an awaitable)."""

    async def aclose(self) -> None:  # noqa: B027 - optional hook, nothing to release by default
        """Release threads or processes; the default holds none."""


class LoopExecutor(Executor):
    """Awaits an `async def` model right on the proxy's event loop."""

    async def run(self, fn: ModelFn, items: list[Any]) -> Any:
        return await fn(items)
