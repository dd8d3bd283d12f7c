"""Shared fixtures."""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
from collections.abc import AsyncIterator, Iterator

import pytest
from _suites import SuiteCheck
from _support import threads_since

VIRTUAL_CLOCK_WORKS = sys.version_info >= (3, 11)
"""looptime's virtual clock stalls on Python 3.10 once tasks are cancelled (seen with
looptime 0.7, the newest there); the library itself supports 3.10."""

LOOPTIME_STALLS = "looptime's virtual clock stalls on Python 3.10"

NO_VIRTUAL_CLOCK_ON_UVLOOP = "looptime's virtual clock runs on asyncio's own loop only"
"""With `--loop=uvloop`: looptime makes time virtual by replacing the selector of
asyncio's `BaseEventLoop`, which uvloop's loop (libuv in C) does not have; those tests
run on the asyncio pass, where their clock is exact."""

LOOPS = ("asyncio", "uvloop")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--suite",
        choices=("core", "full"),
        default=None,
        help="check the run as `make test` does (tests/_suites.py): core (no torch, Ray, "
        "transformers or servers installed) or full (every extra installed)",
    )
    parser.addoption(
        "--loop",
        choices=LOOPS,
        default="asyncio",
        help="the event loop every test runs on: asyncio's own (the default) or uvloop "
        "(set as the event loop policy: pytest-asyncio's loops, asyncio.run and "
        "BackgroundLoop's thread all get one); virtual-clock tests are skipped on uvloop",
    )


def pytest_configure(config: pytest.Config) -> None:
    loop = config.getoption("loop")
    if loop == "uvloop":
        try:
            import uvloop
        except ImportError as error:
            raise pytest.UsageError(f"--loop=uvloop: {error} (pip install uvloop)") from error
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    suite = config.getoption("suite")
    if suite is not None:
        skip = _virtual_clock_skip(config)
        allowed = () if skip is None else (skip,)
        config.pluginmanager.register(SuiteCheck(suite, allowed, loop), "batchproxy-suite-check")


def pytest_unconfigure(config: pytest.Config) -> None:
    if config.getoption("loop") == "uvloop":
        asyncio.set_event_loop_policy(None)


def _virtual_clock_skip(config: pytest.Config) -> str | None:
    """Why this run skips the virtual-clock tests, if it does."""
    if not VIRTUAL_CLOCK_WORKS:
        return LOOPTIME_STALLS
    if config.getoption("loop") == "uvloop":
        return NO_VIRTUAL_CLOCK_ON_UVLOOP
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = _virtual_clock_skip(config)
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
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
    new_threads = threads_since(threads_before)
    assert not new_threads, f"threads left running: {new_threads}"


@pytest.fixture
def python_sigint() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt (Python's default handler) inside: a test that
    sends it. A run started in the background inherits SIGINT ignored (a shell's `&`):
    the default is set for the test and the ignore put back; any other handler is a
    test's left over, and fails."""
    handler = signal.getsignal(signal.SIGINT)
    assert handler in (signal.default_int_handler, signal.SIG_IGN), (
        f"SIGINT's handler is {handler!r}, not Python's default: a test before this one "
        f"left its own"
    )
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)
