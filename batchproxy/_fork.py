"""After `os.fork()` the child has only the thread that forked: every thread the parent
started (a `BackgroundLoop`'s, a `WorkerThread`'s) is gone, and an event loop running
in one of them will never run a callback again. Objects that own such a thread
register here; in the child they forget it, and start a new one when next used,
instead of handing work to a thread that is not there (which would hang the caller).
A `gunicorn --preload` server that warmed a proxy up in its master forks like this.
"""

from __future__ import annotations

import os
import weakref
from typing import Protocol

__all__ = ["forget_threads_in_forked_children"]


class _OwnsThreads(Protocol):
    def _after_fork_in_child(self) -> None:
        """Forget the threads, locks and event loops inherited from the parent."""


_owners: weakref.WeakSet[_OwnsThreads] = weakref.WeakSet()


def forget_threads_in_forked_children(owner: _OwnsThreads) -> None:
    """Have `owner._after_fork_in_child()` called in the child of every later fork."""
    _owners.add(owner)


def _after_fork_in_child() -> None:
    for owner in list(_owners):
        owner._after_fork_in_child()


if hasattr(os, "register_at_fork"):  # not on Windows, which has no fork
    os.register_at_fork(after_in_child=_after_fork_in_child)
