"""Shared fixtures."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

import pytest


@pytest.fixture
async def no_leftovers() -> AsyncIterator[None]:
    """Fail the test if it leaves new tasks or threads running."""
    tasks_before = set(asyncio.all_tasks())
    threads_before = set(threading.enumerate())
    yield
    await asyncio.sleep(0)
    left = {t for t in asyncio.all_tasks() - tasks_before if not t.done()}
    left.discard(asyncio.current_task())  # type: ignore[arg-type]
    assert not left, f"tasks left running: {left}"
    new_threads = [t for t in set(threading.enumerate()) - threads_before if t.is_alive()]
    assert not new_threads, f"threads left running: {new_threads}"
