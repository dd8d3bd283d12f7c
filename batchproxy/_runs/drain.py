"""The drain's deadline (`aclose(timeout=...)`): what becomes of the calls still waiting.

`Binding.drain` arms the deadline; when it passes, `cut_drain` settles every call
still queued or running, as the watchdog settles an overrunning batch's callers,
and the drain returns without waiting for the batches it abandoned.
"""

from __future__ import annotations

import logging
from typing import TypeVar

from .._errors import DrainDeadline
from .._loops.binding import Binding
from .batches import Runner

__all__ = ["cut_drain"]

logger = logging.getLogger("batchproxy")

In = TypeVar("In")


def cut_drain(runner: Runner[In], binding: Binding[In], timeout: float) -> None:
    """A drain's deadline passed: the calls still queued get `DrainDeadline`
    (running=False); the callers of each batch still running get it (running=True)
    now, and the batch is abandoned: its task cancelled (which stops a model on the
    event loop; one on a thread or in a process runs on, its result dropped). Streams
    and the sequences of a `GenerationProxy` end with it too."""
    if not binding.serving:
        return
    scheduler = binding.scheduler
    scheduler.close()
    queued = scheduler.queue.drain()
    runner.settlement.fail(queued, DrainDeadline(runner.name, timeout, running=False))
    error = DrainDeadline(runner.name, timeout, running=True)
    abandoned = 0
    for task in list(binding.batch_tasks):
        if task in binding.overran:
            continue  # the watchdog failed its callers already
        members = binding.members.get(task)
        requests = [] if members is None else [r for r in members() if not r.future.done()]
        if requests:
            runner.batch_failed(requests, error)
        abandoned += 1
        task.cancel()
    if queued or abandoned:
        logger.warning(
            "%s: the drain deadline (timeout=%.3g s) passed: %d queued calls refused, "
            "%d running batches abandoned",
            runner.name,
            timeout,
            len(queued),
            abandoned,
        )
