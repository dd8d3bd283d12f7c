"""`with proxy:` from plain code: the callable runs on the process's `with` loop inside.

`SyncScope` is the one mixin behind every callable kind's synchronous `with`
(`Proxy` and its subclasses, `@batch` and `@batch_args` functions, `RemoteProxy`),
built on their `start()` and `aclose()`:

- `__enter__` refuses a thread that runs an event loop (the drain on exit would
  block it: `async with` there) before it starts anything, then takes a lease on
  the shared `with` loop (a `BackgroundLoop` named `batchproxy-with`, started by the
  first lease) and runs `start()` there. The object then serves from that loop, so
  `inference_sync`, `submit` and `inference_many_sync` reach it from any thread.
- `__exit__` runs `aclose()` there (the drain: every accepted call gets its outcome),
  even when the body raised, and the body's exception then propagates. An interrupt
  (`KeyboardInterrupt`) while it waits for the drain stops it at once instead
  (`aclose(timeout=0)`: what is left gets `DrainDeadline`) and propagates. Then it
  gives the lease back: the last one stops the loop and joins its thread.

The `with` loop is not `BackgroundLoop.default()` (which serves plain calls to
proxies that were never entered, and lives until the interpreter exits): only
what is entered runs on it, so stopping it closes nothing of anyone else's. A
proxy that a model on it called first is bound there too; the loop's end unbinds
it, as the end of `asyncio.run` does (its next call binds anew).
"""

from __future__ import annotations

import asyncio
import atexit
import threading
from typing import Protocol, cast

from typing_extensions import Self

from .background_loop import BackgroundLoop, aclose_of, close_without_proxies

__all__ = ["SyncScope"]

_NAME = "batchproxy-with"


class _Scoped(Protocol):
    """What `SyncScope` uses of the object it is mixed into."""

    name: str

    async def start(self) -> None: ...

    async def aclose(self, *, timeout: float | None = None) -> None: ...


class _Leases:
    """The shared `with` loop and how many `with` blocks hold it (the one owner of both)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._loop: BackgroundLoop | None = None
        self._holders = 0
        self._registered = False  # `_at_exit` with atexit

    def take(self) -> BackgroundLoop:
        """The loop, started if need be, with one more holder."""
        with self.lock:
            if self._loop is None:
                self._loop = BackgroundLoop(_NAME)
                if not self._registered:  # (late, so it runs early: before the handler
                    atexit.register(self._at_exit)  # that stops worker processes, say)
                    self._registered = True
            self._holders += 1
            loop = self._loop
        try:
            loop.start()
        except BaseException:
            self.give_back(loop)
            raise
        return loop

    def give_back(self, loop: BackgroundLoop) -> None:
        """One holder fewer; the last one stops the loop (its thread joined)."""
        with self.lock:
            if loop is not self._loop:
                return  # closed at interpreter exit meanwhile
            self._holders -= 1
            if self._holders:
                return
            self._loop = None
        close_without_proxies(loop)

    def _at_exit(self) -> None:
        """A `with` still open in a daemon thread as the interpreter exits: its proxies
        drain, as the default loop's do."""
        with self.lock:
            loop, self._loop, self._holders = self._loop, None, 0
        if loop is not None:
            loop.close()


_LEASES = _Leases()


class SyncScope:
    """`with obj:` from plain code (see the module): `obj.start()` on the `with` loop,
    `obj.aclose()` there on exit."""

    # the `with` loop while entered (a `RemoteProxy` routes its plain-thread calls there),
    # and how many `with` blocks have it entered; both under the leases' lock
    _with_loop: BackgroundLoop | None = None
    _with_depth = 0

    def __enter__(self) -> Self:
        """Start it on the process's `with` loop (refused in a thread running an event
        loop: `async with` there)."""
        scoped = cast(_Scoped, self)
        # (a subclass whose __init__ forgot super().__init__() has no name: start() says so)
        refuse_running_loop(getattr(scoped, "name", type(self).__name__))
        loop = _LEASES.take()
        try:
            loop.run(scoped.start())
        except BaseException:
            _LEASES.give_back(loop)
            raise
        with _LEASES.lock:
            self._with_loop = loop
            self._with_depth += 1
        return self

    def __exit__(self, *exc_info: object) -> None:
        """Drain it (`aclose()`) on the `with` loop; the last `with` stops the loop."""
        scoped = cast(_Scoped, self)
        with _LEASES.lock:
            loop = self._with_loop
            if loop is None:
                raise RuntimeError(f"{scoped.name}: __exit__() without __enter__()")
            self._with_depth -= 1
        try:
            _drain(scoped, loop)
        finally:
            with _LEASES.lock:
                if self._with_depth == 0 and self._with_loop is loop:
                    self._with_loop = None
            _LEASES.give_back(loop)


def refuse_running_loop(name: str) -> None:
    """Raise if this thread runs an event loop, which `with` would block."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise RuntimeError(
        f"`with {name}:` was used in a thread running an event loop, which waiting for "
        f"its start and its drain would block: use `async with {name}:` there"
    )


def _drain(scoped: _Scoped, loop: BackgroundLoop) -> None:
    """`aclose()` on `loop`; interrupted (`KeyboardInterrupt`), `aclose(timeout=0)`: every
    call still waiting gets `DrainDeadline` at once, then the interrupt propagates."""
    try:
        loop.run(scoped.aclose())
    except Exception:
        raise
    except BaseException:
        loop.run(aclose_of(scoped, 0.0))
        raise
