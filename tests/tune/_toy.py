"""Toy models of known cost for the tuner's tests (importable as `_toy` by the CLI when
the tests put this folder on the path)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import batchproxy

FIXED = 0.004
PER_ITEM = 0.0005


def cost(size: int) -> float:
    return FIXED + PER_ITEM * size


def sleeping(batch_size: int = 16, **options: Any) -> batchproxy.Batched[Any, Any]:
    """A model on the event loop: an `asyncio.sleep` of `cost(n)` (exact on a virtual clock)."""

    @batchproxy.batch(batch_size=batch_size, **options)
    async def model(items: list[Any]) -> list[Any]:
        await asyncio.sleep(cost(len(items)))
        return items

    return model


def on_a_thread() -> batchproxy.Batched[Any, Any]:
    """A plain `def` model on the proxy's worker thread: a `time.sleep` of 2 ms + 2 ms/item."""

    @batchproxy.batch(batch_size=16)
    def model(items: list[Any]) -> list[Any]:
        time.sleep(0.002 + 0.002 * len(items))
        return items

    return model


async def loading() -> batchproxy.Batched[Any, Any]:
    """A factory that awaits (loading weights, say) before it returns the proxy."""
    await asyncio.sleep(0)
    return sleeping()


def failing() -> batchproxy.Batched[Any, Any]:
    @batchproxy.batch(batch_size=8)
    async def model(items: list[Any]) -> list[Any]:
        raise ValueError("this model cannot take these items")

    return model


def not_a_proxy() -> str:
    return "a proxy it is not"


def numbers(proxy: object) -> Iterator[int]:
    """A sample callable given the proxy: it may prepare items with it."""
    assert proxy is not None
    yield from range(100)


def nothing() -> list[int]:
    return []


FREEZE_COUNTS: list[int] = []
"""`gc.get_freeze_count()` at each batch of `freeze_counting`'s model."""


def freeze_counting() -> batchproxy.Batched[Any, Any]:
    """`sleeping`, noting how many objects are frozen out of the collector's passes."""
    import gc

    @batchproxy.batch(batch_size=16)
    async def model(items: list[Any]) -> list[Any]:
        FREEZE_COUNTS.append(gc.get_freeze_count())
        await asyncio.sleep(cost(len(items)))
        return items

    return model
