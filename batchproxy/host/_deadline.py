"""A call's deadline in the caller's process: what bounds every wait of a `RemoteProxy`
call (for the connection, to write the call, for each answer), whatever the host does.

The host applies the deadline too: its proxy's own timer, or `DeadlineExceeded` at
once for a call whose deadline passed on the way. The caller's bound comes `MARGIN`
seconds later, so that a host that runs answers first, and counts the call as its
proxy counts a call that timed out. A host that does not run (its loop blocked by
a factory's code, `SIGSTOP`, a debugger, a swap storm) still lets its caller go
then: the call ends with `DeadlineExceeded`, and is withdrawn in the host (a
`("cancel", id)` after it on the socket) if the host ever reads it.

The deadline is on `time.monotonic()`, the machine's clock that the call's options
carry to the host; each wait here is armed on the caller's loop for the time left.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from .._errors import DeadlineExceeded

__all__ = ["MARGIN", "Deadline"]

T = TypeVar("T")
W = TypeVar("W")

MARGIN = 0.05
"""Seconds a caller waits past its call's deadline for the host's own answer."""


class Deadline:
    """When a call's caller stops waiting (`at`, on `time.monotonic()`); `passed` once
    it has (and the call ended with `exceeded()`)."""

    __slots__ = ("at", "name", "passed", "timeout")

    def __init__(self, name: str, timeout: float, at: float) -> None:
        self.name = name
        self.timeout = timeout
        self.at = at
        self.passed = False

    @classmethod
    def of(cls, name: str, options: dict[str, Any]) -> Deadline | None:
        """The caller's deadline for a call with these options (`MARGIN` after the
        one it carries to the host), or None for a call with no timeout."""
        at = options.get("deadline")
        return None if at is None else cls(name, options["timeout"], at + MARGIN)

    def left(self) -> float:
        return max(0.0, self.at - time.monotonic())

    def exceeded(self) -> DeadlineExceeded:
        """The error the call ends with, as a proxy's caller gets it."""
        self.passed = True
        return DeadlineExceeded(self.name, self.timeout)

    def arm(
        self,
        loop: asyncio.AbstractEventLoop,
        put: Callable[[W, Deadline], None],
        waiter: W,
    ) -> asyncio.TimerHandle:
        """`put(waiter, self)` when this deadline passes: the call's answer queue or
        future gets it (the call's own answers before it are read first); cancel the
        handle once the call ends."""
        return loop.call_later(self.left(), put, waiter, self)

    async def bound(self, awaitable: Awaitable[T]) -> T:
        """`awaitable`'s result, or `exceeded()` raised when the deadline passes first
        (the awaitable, which must not raise `TimeoutError` itself, is then cancelled)."""
        try:
            return await asyncio.wait_for(awaitable, self.left())
        except asyncio.TimeoutError:
            pass
        raise self.exceeded()
