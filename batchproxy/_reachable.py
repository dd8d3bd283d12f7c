"""Whether a full batch can ever form: `BatchSizeUnreachable` when a bound says not.

A batch leaves with at most the calls waiting in the queue, so `max_queue_size`
below `batch_size` caps every batch at `max_queue_size` (the running batches do
not count against the queue's bound: only waiting calls do). A bound on callers in
front of the proxy (a server's concurrency limit) counts every call in flight,
running or waiting: keeping `slots` batches of `batch_size` busy needs at least
`batch_size x slots` callers at once.
"""

from __future__ import annotations

import sys
import warnings

from ._errors import BatchSizeUnreachable
from ._options import Options

__all__ = ["check_callers", "check_queue_bound"]


def check_queue_bound(proxy: object, name: str, options: Options) -> None:
    """Warn if `max_queue_size` keeps every batch below `batch_size`, pointing at the
    user's line that built or configured `proxy`."""
    bound = options.max_queue_size
    if bound is not None and bound < options.batch_size:
        warnings.warn(
            f"{name}: max_queue_size={bound} is below batch_size={options.batch_size}, so "
            f"no batch can hold more than {bound} items (only waiting calls fill a batch); "
            f"raise max_queue_size to at least batch_size, or lower batch_size",
            BatchSizeUnreachable,
            stacklevel=_outside(proxy),
        )


def _outside(proxy: object) -> int:
    """The `stacklevel` of the first frame outside batchproxy and outside the methods
    of `proxy` (a subclass's `__init__` calling `super().__init__`)."""
    frame, level = sys._getframe(2), 2  # (warn's stacklevel 1: check_queue_bound)
    while frame.f_back is not None and (
        frame.f_globals.get("__name__", "").partition(".")[0] == "batchproxy"
        or frame.f_locals.get("self") is proxy
    ):
        frame, level = frame.f_back, level + 1
    return level


def check_callers(name: str, callers: int, batch_size: int, slots: int, *, stacklevel: int) -> None:
    """Warn if `callers` at once cannot fill `slots` batches of `batch_size`."""
    needed = batch_size * slots
    if callers < needed:
        reach = (
            f"no batch can hold more than {callers} items"
            if callers < batch_size
            else f"at most {callers // batch_size} of its {slots} batch slots can run full batches"
        )
        warnings.warn(
            f"{name}: the service lets {callers} calls in at once, below batch_size x "
            f"batch slots = {batch_size} x {slots} = {needed}, so {reach}; allow at least "
            f"{needed} concurrent calls (uvicorn --limit-concurrency), or lower batch_size",
            BatchSizeUnreachable,
            stacklevel=stacklevel + 1,
        )
