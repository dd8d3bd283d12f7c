"""Listeners: hooks into a proxy's life (`Listener`, public) and the proxy's typed,
guarded way of calling them (`Listeners`).

Hooks are called in the middle of settling calls, so nothing a hook raises may
cut that short or reach a caller: `Listeners` logs and drops every
`BaseException` (a `CancelledError` or `GeneratorExit` from a hook is not the
proxy's own), and raises a `KeyboardInterrupt` or `SystemExit` again from a
callback of its own on the event loop, once the settling is done. A proxy with
no listener pays one attribute test per event (`if listeners.on:`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

__all__ = ["Listener", "Listeners"]

logger = logging.getLogger("batchproxy")


class Listener:
    """Base class for hooks into a proxy's life; override the methods you need.

    Hooks run on the proxy's event loop and must be quick. What a hook raises is
    logged (logger ``batchproxy``) and otherwise ignored, `CancelledError` and
    `GeneratorExit` included: it never reaches a caller, changes an outcome or
    stops the proxy. A `KeyboardInterrupt` or `SystemExit` still stops the event
    loop, from a callback of its own once the calls being settled have their
    outcomes. Register with `proxy.add_listener(listener)`.
    """

    def request_queued(self, proxy: str, queue_depth: int) -> None:
        """A call was accepted; `queue_depth` includes it."""

    def request_rejected(self, proxy: str, count: int) -> None:
        """`count` requests were refused with `QueueFull` (never accepted)."""

    def request_shed(self, proxy: str) -> None:
        """A call was refused at once: it was predicted to miss its deadline."""

    def request_deduplicated(self, proxy: str, cached: bool) -> None:
        """A call (accepted, `request_queued` told) costs the model nothing (`dedup`): it
        joined an identical call in flight, or, `cached`, was answered from the cache."""

    def request_disconnected(self, proxy: str) -> None:
        """A call is cancelled because its HTTP client disconnected (the FastAPI and
        aiohttp helpers tell); `request_finished` follows with "cancelled"."""

    def batch_started(self, proxy: str, size: int, queue_waits: Sequence[float]) -> None:
        """A batch of `size` items goes to the model; seconds each waited in the queue."""

    def batch_finished(
        self, proxy: str, size: int, model_seconds: float, error: BaseException | None
    ) -> None:
        """The model returned (or raised `error`) after `model_seconds`. Not called for a
        batch abandoned by the watchdog (`batch_timed_out`) or at a drain's deadline:
        `error` tells of it when it is abandoned, and its `model_seconds` would be no
        model time (`stats.model_time` leaves it out too)."""

    def request_finished(self, proxy: str, outcome: str, seconds: float) -> None:
        """A call ended: `outcome` is succeeded, error, timed_out or cancelled.

        Called once per call, when the proxy settles it. A caller cancelled in the
        instant after that, before it resumed, sees `CancelledError`: `stats` then
        counts the call as cancelled, but this hook is not called again.
        """

    def error(self, proxy: str, error: BaseException, size: int) -> None:
        """A batch of `size` failed as a whole with `error`."""

    def batch_timed_out(self, proxy: str, size: int, timeout: float) -> None:
        """A batch of `size` ran past `batch_timeout` (`timeout` seconds): the watchdog
        failed its callers with `BatchTimeout` and marked the proxy unhealthy."""

    def batch_split(self, proxy: str, size: int, reason: str) -> None:
        """A model call on `size` items raised and is re-run in pieces: `reason` is
        "oom" (`oom_backoff`) or "isolation" (`isolate_errors`)."""


class Listeners:
    """The listeners of one proxy, each hook called through a typed method of its own."""

    __slots__ = ("_listeners", "on", "proxy")

    def __init__(self, proxy: str) -> None:
        self.proxy = proxy
        self._listeners: list[Listener] = []
        self.on = False  # any listener: callers test this, not a method, per event

    def add(self, listener: Listener) -> None:
        if not isinstance(listener, Listener):
            raise TypeError(f"listener must be a batchproxy.Listener, got {listener!r}")
        self._listeners.append(listener)
        self.on = True

    def remove(self, listener: Listener) -> None:
        self._listeners.remove(listener)
        self.on = bool(self._listeners)

    def request_queued(self, queue_depth: int) -> None:
        self._each("request_queued", lambda hook: hook.request_queued(self.proxy, queue_depth))

    def request_rejected(self, count: int) -> None:
        self._each("request_rejected", lambda hook: hook.request_rejected(self.proxy, count))

    def request_shed(self) -> None:
        self._each("request_shed", lambda hook: hook.request_shed(self.proxy))

    def request_deduplicated(self, cached: bool) -> None:
        self._each(
            "request_deduplicated", lambda hook: hook.request_deduplicated(self.proxy, cached)
        )

    def request_disconnected(self) -> None:
        self._each("request_disconnected", lambda hook: hook.request_disconnected(self.proxy))

    def batch_started(self, size: int, queue_waits: Sequence[float]) -> None:
        self._each("batch_started", lambda hook: hook.batch_started(self.proxy, size, queue_waits))

    def batch_finished(self, size: int, seconds: float, error: BaseException | None) -> None:
        self._each(
            "batch_finished", lambda hook: hook.batch_finished(self.proxy, size, seconds, error)
        )

    def request_finished(self, outcome: str, seconds: float) -> None:
        self._each(
            "request_finished", lambda hook: hook.request_finished(self.proxy, outcome, seconds)
        )

    def error(self, error: BaseException, size: int) -> None:
        self._each("error", lambda hook: hook.error(self.proxy, error, size))

    def batch_timed_out(self, size: int, timeout: float) -> None:
        self._each("batch_timed_out", lambda hook: hook.batch_timed_out(self.proxy, size, timeout))

    def batch_split(self, size: int, reason: str) -> None:
        self._each("batch_split", lambda hook: hook.batch_split(self.proxy, size, reason))

    def _each(self, name: str, call: Callable[[Listener], None]) -> None:
        for listener in self._listeners:
            try:
                call(listener)
            except (KeyboardInterrupt, SystemExit) as exc:
                logger.error("batchproxy listener %r raised %r in %s", listener, exc, name)
                _raise_soon(exc)
            except BaseException:
                logger.exception("batchproxy listener %r failed in %s", listener, name)


def _raise_soon(exc: BaseException) -> None:
    """Raise `exc` from a callback of its own on the running loop (it leaves the loop,
    as a `KeyboardInterrupt` in any callback does), or at once with no loop running."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        raise exc from None

    def reraise() -> None:
        raise exc

    loop.call_soon(reraise)
