"""`BackgroundLoop`: an event loop in a daemon thread of its own, for code that has none.

Threaded apps (Flask, Django sync views, scripts) reach proxies through it:
`proxy.inference_sync(item)` or `proxy.submit(item)` on a proxy that runs in no
event loop starts it on the process-wide `BackgroundLoop.default()`. That loop is
created on first use and closed at interpreter exit through `atexit`, after it
has closed its proxies, so every accepted call still gets its result. Its thread
is a daemon because non-daemon threads are joined before `atexit` handlers run.

A proxy's `Binder` uses a background loop through `LoopHost` (`host_of(loop)`,
`default_host()`): it adopts the proxies bound to it and routes calls to them.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import inspect
import logging
import os
import threading
import weakref
from collections.abc import Callable, Coroutine
from typing import Any, ClassVar, Protocol, TypeVar

from typing_extensions import Self

from .. import _validate
from .._fork import forget_threads_in_forked_children
from .bridge import LoopBridge

__all__ = [
    "BackgroundLoop",
    "LoopHost",
    "aclose_of",
    "close_without_proxies",
    "default_host",
    "host_of",
]

logger = logging.getLogger("batchproxy")

T = TypeVar("T")


class _Closable(Protocol):
    """A proxy, as a `BackgroundLoop` closes it."""

    name: str

    async def aclose(self, *, timeout: float | None = None) -> None: ...


class BackgroundLoop:
    """An asyncio event loop running in a daemon thread, for plain threads to use.

    `run(coro)` blocks for a coroutine's result; `submit(coro)` returns a
    `concurrent.futures.Future`. The thread starts on first use (or `start()`).
    `close()`, or leaving `with`, closes the proxies bound to this loop (their
    accepted calls finish), cancels what is left, stops the thread and closes the
    loop.
    """

    _default: ClassVar[BackgroundLoop | None] = None
    _default_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, name: str = "batchproxy-loop") -> None:
        if not isinstance(name, str):
            raise TypeError(f"BackgroundLoop name must be a str, got {name!r}")
        self.name = name
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self._proxies: weakref.WeakSet[_Closable] = weakref.WeakSet()  # bound here now
        self._closes_proxies = True  # close() closes them (`close_without_proxies`: not)
        self._bridge: LoopBridge | None = None  # for calls to proxies not bound here yet
        forget_threads_in_forked_children(self)

    def __repr__(self) -> str:
        state = "closed" if self._closed else "running" if self._thread else "idle"
        return f"<BackgroundLoop {self.name!r} {state}>"

    @staticmethod
    def default() -> BackgroundLoop:
        """The process-wide loop behind `Proxy.inference_sync`: created on first use
        (anew if it was closed), closed at interpreter exit."""
        with BackgroundLoop._default_lock:
            default = BackgroundLoop._default
            if default is None:  # registered late, so it runs early: before the handler
                atexit.register(_close_default)  # that stops worker processes, say
            if default is None or default.closed:
                default = BackgroundLoop._default = BackgroundLoop()
            return default

    @property
    def closed(self) -> bool:
        return self._closed

    def start(self) -> None:
        """Start the thread and its loop if they are not running yet (thread-safe, idempotent)."""
        with self._lock:
            self._start_locked()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule `coro` on the loop (from any thread); cancel the future to cancel it.

        A proxy that `coro` calls binds to this loop, and `close()` closes it."""
        with self._lock:
            try:
                loop = self._start_locked()
            except BaseException:
                coro.close()  # never awaited, and never warned about
                raise
            return asyncio.run_coroutine_threadsafe(coro, loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run `coro` on the loop and block the calling thread for its result.

        Raises `TimeoutError` after `timeout` seconds; the coroutine is then
        cancelled, as it is when the wait is interrupted (`KeyboardInterrupt`).
        """
        if self._on_loop_thread():
            coro.close()
            raise RuntimeError(
                f"BackgroundLoop {self.name!r}: run() was called on the loop's own thread, "
                f"where it would wait for itself; await the coroutine there instead"
            )
        try:
            timeout = _validate.timeout("timeout", timeout)
        except BaseException:
            coro.close()
            raise
        future = self.submit(coro)
        if not _block_on(future, timeout):
            raise TimeoutError(f"BackgroundLoop {self.name!r}: no result within {timeout} s")
        return future.result()

    def close(self, timeout: float | None = 10.0) -> None:
        """Close the proxies bound to this loop, giving their accepted calls up to `timeout`
        seconds to finish (their drain's deadline, `aclose(timeout=...)`: the calls
        still waiting then get `DrainDeadline`); then cancel what is left, stop the
        thread (waiting up to `timeout` again) and close the loop. Idempotent."""
        if self._on_loop_thread():
            raise RuntimeError(
                f"BackgroundLoop {self.name!r}: close() was called on the loop's own thread, "
                f"where it would wait for itself; call it from another thread"
            )
        timeout = _validate.timeout("timeout", timeout)
        with self._lock:
            loop, thread, first = self._loop, self._thread, not self._closed
            self._closed = True
        if loop is None or thread is None:
            return
        if first:
            try:
                closing = asyncio.run_coroutine_threadsafe(_close_proxies_of(self, timeout), loop)
                # (a margin: the drains' deadline settles their calls, then they return)
                if not _block_on(closing, None if timeout is None else timeout + _CLOSE_MARGIN):
                    logger.warning(
                        "%r: calls still running %s s into close(); cancelling them", self, timeout
                    )
            finally:
                loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout)
        if thread.is_alive():
            logger.warning("%r: the thread did not stop within %s s; left running", self, timeout)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _start_locked(self) -> asyncio.AbstractEventLoop:
        if self._closed:
            raise RuntimeError(f"BackgroundLoop {self.name!r} is closed")
        if self._loop is None:
            loop = asyncio.new_event_loop()
            running = threading.Event()
            thread = threading.Thread(
                target=self._main, args=(loop, running), name=self.name, daemon=True
            )
            try:
                thread.start()
            except BaseException:
                loop.close()
                raise
            running.wait()
            self._loop, self._thread = loop, thread
        return self._loop

    def _after_fork_in_child(self) -> None:
        """In a forked child: the parent's thread and loop are gone; a new thread
        starts on next use (unless this loop was closed)."""
        self._lock = threading.Lock()
        self._loop = self._thread = None
        self._proxies = weakref.WeakSet()
        if self._bridge is not None:
            self._bridge.forget()
        self._bridge = None

    def _on_loop_thread(self) -> bool:
        return self._thread is not None and threading.current_thread() is self._thread

    def _main(self, loop: asyncio.AbstractEventLoop, running: threading.Event) -> None:
        _owners[loop] = self
        asyncio.set_event_loop(loop)

        def serving() -> None:
            self._bridge = LoopBridge(loop)  # on the loop's thread, as it runs
            running.set()

        loop.call_soon(serving)
        try:
            loop.run_forever()
        finally:
            running.set()
            with self._lock:
                self._closed = True
            try:
                _cancel_all(loop)
                loop.run_until_complete(loop.shutdown_asyncgens())
                # at exit Python 3.12+ starts no thread to join the executor with; its
                # threads were joined before atexit handlers ran anyway
                with contextlib.suppress(RuntimeError):
                    loop.run_until_complete(loop.shutdown_default_executor())
            finally:
                asyncio.set_event_loop(None)
                loop.close()


class LoopHost:
    """What a proxy's `Binder` uses of a `BackgroundLoop` (not its public surface): the
    loop adopts the proxies bound to it (its `close()` closes them) and routes calls
    from plain threads to proxies not bound yet. Handed over by `host_of` and
    `default_host`; any thread."""

    __slots__ = ("_background",)

    def __init__(self, background: BackgroundLoop) -> None:
        self._background = background

    def adopt(self, proxy: _Closable) -> None:
        """`proxy` bound itself to this loop: `close()` closes it too."""
        background = self._background
        with background._lock:
            background._proxies.add(proxy)

    def release(self, proxy: _Closable) -> None:
        """`proxy` left this loop (it ended, or the proxy moved on)."""
        background = self._background
        with background._lock:
            background._proxies.discard(proxy)

    def on_loop_thread(self) -> bool:
        """Whether this is the loop's own thread (where waiting for it would deadlock)."""
        return self._background._on_loop_thread()

    def route(
        self, make: Callable[[], Coroutine[Any, Any, T]], ended_error: Callable[[], BaseException]
    ) -> tuple[concurrent.futures.Future[T], LoopBridge] | None:
        """`LoopBridge.route` to this loop, started if need be (a proxy's call that binds
        the proxy here): the future and the bridge. None if the loop ended meanwhile; a
        `RuntimeError` if it was closed before."""
        background = self._background
        with background._lock:
            background._start_locked()
            bridge = background._bridge
        if bridge is None:  # its thread failed to start serving
            return None
        future = bridge.route(make, ended_error)
        return None if future is None else (future, bridge)


_owners: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, BackgroundLoop] = (
    weakref.WeakKeyDictionary()
)
"""The `BackgroundLoop` running each loop, for proxies that bind to one to find it."""


def host_of(loop: asyncio.AbstractEventLoop) -> LoopHost | None:
    """What a binding uses of the `BackgroundLoop` that runs `loop`, if one does."""
    background = _owners.get(loop)
    return None if background is None else LoopHost(background)


def default_host() -> LoopHost:
    """What a binding uses of `BackgroundLoop.default()`, where a proxy that runs in no
    loop is bound by a call from a plain thread."""
    return LoopHost(BackgroundLoop.default())


def _forget_default_lock_in_child() -> None:
    """In a forked child: a thread that held the default loop's lock during the fork
    (creating the default loop, say) is gone, and would hold it for ever."""
    BackgroundLoop._default_lock = threading.Lock()


if hasattr(os, "register_at_fork"):  # not on Windows, which has no fork
    os.register_at_fork(after_in_child=_forget_default_lock_in_child)


def _close_default() -> None:
    with BackgroundLoop._default_lock:
        default = BackgroundLoop._default
    if default is not None:
        default.close()


_CLOSE_MARGIN = 1.0
"""Seconds `close()` waits past its `timeout` for the proxies' drains, cut at it, to return."""


async def _close_proxies_of(background: BackgroundLoop, timeout: float | None) -> None:
    """`aclose(timeout=timeout)` the proxies bound to its loop (a proxy is released when
    it moves on). Run on that loop, after what was submitted before: those calls have
    bound theirs."""
    with background._lock:
        proxies = list(background._proxies) if background._closes_proxies else []
    outcomes = await asyncio.gather(
        *(aclose_of(proxy, timeout) for proxy in proxies), return_exceptions=True
    )
    for proxy, outcome in zip(proxies, outcomes, strict=True):
        if isinstance(outcome, Exception):
            logger.error("closing %s raised %r", proxy.name, outcome)


def aclose_of(proxy: _Closable, timeout: float | None) -> Coroutine[Any, Any, None]:
    """`proxy.aclose(timeout=timeout)`; without the timeout where a subclass's `aclose()`
    takes none (it was written before it existed)."""
    takes = "timeout" in inspect.signature(proxy.aclose).parameters
    return proxy.aclose(timeout=timeout) if takes and timeout is not None else proxy.aclose()


def close_without_proxies(background: BackgroundLoop, timeout: float | None = 10.0) -> None:
    """`background.close(timeout)` that closes none of the proxies bound to its loop: they
    leave it as they leave an `asyncio.run` loop that returns (what is still queued gets
    the "loop ended" error; the next call binds anew)."""
    with background._lock:
        background._closes_proxies = False
    background.close(timeout)


def _cancel_all(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel every task left on `loop` and let each end (tasks they start too)."""
    while tasks := asyncio.all_tasks(loop):
        for task in tasks:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))


def _block_on(future: concurrent.futures.Future[Any], timeout: float | None) -> bool:
    """Wait for `future` up to `timeout` seconds; whether it is done. A wait that ends
    without it (timed out, or interrupted by `KeyboardInterrupt` and the like, which
    propagates) cancels it, so the call is withdrawn rather than left queued."""
    if timeout is not None:
        timeout = min(timeout, _validate.MAX_WAIT)  # a caller's margin may push it past
    try:
        done, _ = concurrent.futures.wait([future], timeout)
    except BaseException:
        future.cancel()
        raise
    return bool(done) or not future.cancel()  # cancel() fails only if it just finished
