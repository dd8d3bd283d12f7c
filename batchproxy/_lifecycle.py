"""A proxy's lifecycle: one state, and the transitions allowed between states.

    UNINITIALIZED ──__init__──▶ OPEN ──aclose()──▶ DRAINING ──drained──▶ CLOSED
                                  │                                       ▲
                                  └─ a batch overran, on_batch_timeout="stop" ─▶ STOPPED ─┘ aclose()

- UNINITIALIZED: the class default, seen only by a subclass whose `__init__`
  forgot `super().__init__()`: every use raises a clear `RuntimeError`.
- OPEN: takes calls, from whichever event loop calls it (loop binding is its
  own concern: `_loops.binding`).
- DRAINING: `aclose()` has begun: new calls get `ProxyClosed`; every accepted
  call still runs to its outcome (or, with `aclose(timeout=...)`, gets
  `DrainDeadline` at the deadline: `_runs.drain`).
- STOPPED: the proxy closed itself after a batch overran its `batch_timeout`
  with `on_batch_timeout="stop"`: new and queued calls get `ProxyClosed` naming
  that `cause`. `aclose()` still releases the worker.
- CLOSED: every accepted call has its outcome and the worker is released (for a
  STOPPED proxy, once `aclose()` has run).

Who changes it: `Proxy.__init__` (to OPEN), `Proxy.aclose` (to DRAINING, then
CLOSED; from any thread: `aclose()` may run on another loop), the watchdog (to
STOPPED, on the proxy's loop). Every other piece only reads it. No transition
goes back to OPEN.
"""

from __future__ import annotations

import enum

from ._errors import BatchProxyError, ProxyClosed

__all__ = ["Lifecycle", "State"]


class State(enum.Enum):
    UNINITIALIZED = "uninitialized"
    OPEN = "open"
    DRAINING = "draining"
    STOPPED = "stopped"
    CLOSED = "closed"


class Lifecycle:
    """The state of one proxy, and why it stopped if it stopped itself."""

    __slots__ = ("cause", "name", "open", "state")

    def __init__(self, name: str, state: State = State.OPEN) -> None:
        self.name = name
        self.state = state
        self.open = state is State.OPEN  # `state is OPEN`, kept beside it: read per call
        self.cause: BatchProxyError | None = None  # set with STOPPED, kept after

    def drain(self) -> None:
        """`aclose()` began (idempotent; a STOPPED proxy stays STOPPED until released)."""
        if self.state is State.OPEN:
            self._move(State.DRAINING)

    def stop(self, cause: BatchProxyError) -> None:
        """The proxy stops itself because of `cause` (only from OPEN)."""
        if self.state is State.OPEN:
            self.cause = cause
            self._move(State.STOPPED)

    def close(self) -> None:
        """`aclose()` is done: every accepted call has its outcome."""
        self._move(State.CLOSED)

    def _move(self, state: State) -> None:
        self.state, self.open = state, False  # no transition leads back to OPEN

    def closed_error(self) -> ProxyClosed:
        """What a call to a proxy that is not OPEN gets: why it stopped, if it did."""
        cause = self.cause
        error = ProxyClosed(self.name, None if cause is None else str(cause))
        error.__cause__ = cause
        return error
