"""Shared fixtures."""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import AsyncIterator

import pytest
from _suites import SuiteCheck

VIRTUAL_CLOCK_WORKS = sys.version_info >= (3, 11)
"""looptime's virtual clock stalls on Python 3.10 once tasks are cancelled (seen with
looptime 0.7, the newest there); the library itself supports 3.10."""

LOOPTIME_STALLS = "looptime's virtual clock stalls on Python 3.10"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--suite",
        choices=("core", "full"),
        default=None,
        help="check the run as `make test` does (tests/_suites.py): core (no torch, Ray, "
        "transformers or servers installed) or full (every extra installed)",
    )


def pytest_configure(config: pytest.Config) -> None:
    suite = config.getoption("suite")
    if suite is not None:
        allowed = () if VIRTUAL_CLOCK_WORKS else (LOOPTIME_STALLS,)
        config.pluginmanager.register(SuiteCheck(suite, allowed), "batchproxy-suite-check")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if VIRTUAL_CLOCK_WORKS:
        return
    skip = pytest.mark.skip(reason=LOOPTIME_STALLS)
    for item in items:
        if item.get_closest_marker("looptime") or item.get_closest_marker("virtual_clock"):
            item.add_marker(skip)


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
