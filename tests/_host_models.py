"""Proxies for the model-host tests, importable by a host process started with
`python -m batchproxy.host _host_models:NAME --socket PATH` (tests/ on its path).

`Tagged` answers each item `(item, batch id, batch size, host pid)`: a caller can
check it got its own item back and see which calls shared a batch. Its `delay`
(seconds per batch, `$HOST_MODEL_DELAY` for the factory) makes calls queue.
`Echo` answers each item with itself (large arrays: the shared-memory tests).
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import os
from typing import Any

from typing_extensions import override

import batchproxy


def refuse_to_unpickle() -> Any:
    raise RuntimeError("this object cannot be unpickled here")


class Unreadable:
    """Pickles fine; unpickling it raises (as a class one side cannot import does)."""

    def __reduce__(self) -> tuple[Any, ...]:
        return refuse_to_unpickle, ()


class Tagged(batchproxy.Proxy[Any, Any]):
    def __init__(self, delay: float = 0.0, **options: Any) -> None:
        options.setdefault("max_delay_ms", 2.0)
        super().__init__(64, **options)
        self.delay = delay
        self.seen: list[list[Any]] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self._batches = itertools.count()

    @override
    async def _inference(self, items: list[Any]) -> list[Any]:
        self.seen.append(list(items))
        await self.gate.wait()
        if self.delay:
            await asyncio.sleep(self.delay)
        batch = next(self._batches)
        out: list[Any] = []
        for item in items:
            if item == "bad":
                out.append(batchproxy.InvalidItem("cannot tag 'bad'"))
            elif item == "boom":
                out.append(ValueError("the model refused 'boom'"))
            elif item == "unsendable":
                out.append(lambda: None)  # a result that cannot be pickled
            elif item == "unreadable":
                out.append(Unreadable())  # a result the caller cannot unpickle
            else:
                out.append((item, batch, len(items), os.getpid()))
        return out


def tagged() -> Tagged:
    """The factory `python -m batchproxy.host` calls."""
    return Tagged(delay=float(os.environ.get("HOST_MODEL_DELAY", "0")))


class Counting(batchproxy.Proxy[Any, Any]):
    """A streaming model: each item's chunks `(item, 0)`, `(item, 1)`, ... up to its
    `steps` (an int item is its own step count, else 3); "boom" fails at step 1. Each
    step waits for `gate`, so a test can hold a stream mid-way; `steps_run` counts
    the steps taken."""

    def __init__(self, **options: Any) -> None:
        options.setdefault("max_delay_ms", 2.0)
        super().__init__(64, **options)
        self.gate = asyncio.Event()
        self.gate.set()
        self.seen: list[list[Any]] = []
        self.steps_run = 0

    @override
    async def _inference(self, items: list[Any]) -> Any:
        self.seen.append(list(items))
        live = list(items)
        step = 0
        while live:
            await self.gate.wait()
            self.steps_run += 1
            chunks: list[Any] = []
            for item in live:
                last = (item if isinstance(item, int) else 3) - 1
                if item == "boom" and step == 1:
                    chunks.append(ValueError("the model refused 'boom' at step 1"))
                elif step >= last:
                    chunks.append(batchproxy.Last((item, step)))
                else:
                    chunks.append((item, step))
            keep = yield chunks
            live = [live[i] for i in keep]
            step += 1


def counting() -> Counting:
    """The factory `python -m batchproxy.host` calls for a streaming model."""
    return Counting()


class Echo(batchproxy.Proxy[Any, Any]):
    """Answers each item with itself; `("unsendable", x)` with `(x, a lambda)` and
    `("unreadable", x)` with `(x, Unreadable())`. For each item with data (an array, a
    tensor) it notes in `shared` whether that arrived in shared memory."""

    def __init__(self, delay: float = 0.0, **options: Any) -> None:
        options.setdefault("max_delay_ms", 2.0)
        super().__init__(16, **options)
        self.delay = delay
        self.shared: list[bool] = []
        self.gate = asyncio.Event()
        self.gate.set()

    @override
    async def _inference(self, items: list[Any]) -> list[Any]:
        await self.gate.wait()
        if self.delay:
            await asyncio.sleep(self.delay)
        out: list[Any] = []
        for item in items:
            if isinstance(item, tuple) and item[0] == "unsendable":
                out.append((item[1], lambda: None))
            elif isinstance(item, tuple) and item[0] == "unreadable":
                out.append((item[1], Unreadable()))
            else:
                if hasattr(item, "__array_interface__") or hasattr(item, "data_ptr"):
                    self.shared.append(in_shared_memory(item))
                out.append(item)
        return out


def echo() -> Echo:
    """The factory `python -m batchproxy.host` calls."""
    return Echo(delay=float(os.environ.get("HOST_MODEL_DELAY", "0")))


def in_shared_memory(data: Any) -> bool:
    """Whether `data`'s memory (a NumPy array's, a torch tensor's) lies in a mapping of
    one of batchproxy's shared-memory segments in this process (Linux's maps)."""
    address = data.data_ptr() if hasattr(data, "data_ptr") else data.__array_interface__["data"][0]
    with open("/proc/self/maps", encoding="utf-8") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/dev/shm/bp-"):
                start, end = (int(bound, 16) for bound in fields[0].split("-"))
                if start <= address < end:
                    return True
    return False


def broken() -> Tagged:
    """A factory whose load fails."""
    raise OSError("weights not found")


class Units(batchproxy.Proxy[Any, Any]):
    """Takes a per-batch argument (`with_args(unit=...)`): answers `f"{item}{unit}"`,
    and records each batch as `(items, unit)`."""

    def __init__(self) -> None:
        super().__init__(16, max_delay_ms=5.0)
        self.batches: list[tuple[list[Any], str]] = []

    @override
    async def _inference(self, items: list[Any], /, *, unit: str = "x") -> list[str]:
        self.batches.append((list(items), unit))
        return [f"{item}{unit}" for item in items]


class FreezeCount(batchproxy.Proxy[Any, Any]):
    """Answers each item with `gc.get_freeze_count()` in the host (`--freeze-gc`)."""

    def __init__(self) -> None:
        super().__init__(8, max_delay_ms=1.0)

    @override
    async def _inference(self, items: list[Any]) -> list[int]:
        return [gc.get_freeze_count() for _ in items]


def freeze_count() -> FreezeCount:
    return FreezeCount()
