"""Re-runs of a batch whose model call raised, for the two opt-in defences.

- `oom_backoff`: the call ran out of memory. Lower the batch cap (`BatchCap`) and
  run the items in chunks of the cap, each chunk lowering it further if need be;
  after enough batches succeed at the cap it creeps back up.
- `isolate_errors`: the call raised. Run each half on its own, down to single
  items, so only the items that make the model raise fail (at most 2n - 2 extra
  calls for a batch of n; about 2 log2(n) for one bad item).

Either way an item that fails alone gets the error in its own slot, so only its
caller fails. Only a proxy with one of these options on comes here
(`Runner.call_model`).
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable
from typing import Any, Protocol

from .._events import Events
from .._executors.base import Executor
from .._oom import BatchCap
from .._options import Options
from .callers import narrowed

__all__ = ["call_with_reruns"]

logger = logging.getLogger("batchproxy")


class _Runner(Protocol):
    """What a re-run needs of the proxy's `Runner`."""

    name: str
    model: Callable[[list[Any]], Any]
    executor: Executor
    cap: BatchCap
    events: Events
    on_cap_change: Callable[[], None]

    @property
    def options(self) -> Options: ...

    def result_sequence(self, results: object) -> list[Any] | tuple[Any, ...]: ...

    def reruns(self, error: BaseException) -> bool: ...


async def call_with_reruns(
    runner: _Runner, items: list[Any], *, top: bool = True
) -> tuple[Any, bool]:
    """Run the model on `items`: (its results, whether one call on all of them made
    them, as opposed to calls on pieces)."""
    options, cap = runner.options, runner.cap
    try:
        results = await runner.executor.run(runner.model, items)
    except Exception as exc:
        if not runner.reruns(exc):
            raise
        oom = options.is_oom is not None and options.is_oom(exc)
        # the traceback holds the failed call's finished frames, and through their locals
        # what it had allocated (a forward pass's activations, on a GPU): let go of them
        # now, not after the re-runs below, which would otherwise run short of memory too
        traceback.clear_frames(exc.__traceback__)
        if len(items) == 1:
            return [exc], False
        half = (len(items) + 1) // 2
        if oom:
            _back_off(runner, len(items), exc)
        elif top:
            logger.warning(
                "%s: a batch of %d raised %r; re-running it in halves to find the "
                "items that fail", runner.name, len(items), exc,
            )  # fmt: skip
        runner.events.batch_split(len(items), "oom" if oom else "isolation")
        pieces: list[Any] = []
        start = 0
        while start < len(items):  # by index: a piece answered with a wrong count
            piece = cap.cap if oom else half  # the cap may drop meanwhile
            chunk = items[start : start + piece]  # shows up as a mismatch
            with narrowed(range(start, start + len(chunk))):  # its callers' contexts, for the model
                results, _ = await call_with_reruns(runner, chunk, top=False)
            pieces.extend(runner.result_sequence(results))
            start += len(chunk)
        return pieces, False
    if cap.cap < cap.limit and cap.succeeded(len(items)):  # backed off: creep back up
        runner.on_cap_change()
    return results, True


def _back_off(runner: _Runner, size: int, exc: Exception) -> None:
    """A batch of `size` ran out of memory: lower the cap."""
    runner.cap.out_of_memory(size)
    runner.on_cap_change()
    logger.warning(
        "%s: out of memory on a batch of %d (%r); retrying in chunks of %d",
        runner.name, size, exc, runner.cap.cap,
    )  # fmt: skip
