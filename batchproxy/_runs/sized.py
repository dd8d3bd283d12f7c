"""Every model call of an allowed batch size (`batch_sizes=`; the sizes and the
scheduling rules are `_scheduling.sizes`).

Whatever the scheduler forms, every model call goes through `SizedExecutor`, which
wraps the proxy's executor: it pads a call (pad mode) or runs it as several calls
of allowed sizes (cut mode) when it is not of an allowed size. So the re-runs of
`isolate_errors` and `oom_backoff` (halves, chunks of the lowered cap), a token
budget's short batch, and a batch whose cancelled callers left it short all reach
the model at allowed sizes, on any executor (a thread, worker processes, Ray
actors).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from .._errors import BatchSizeMismatch
from .._events import Events
from .._executors.base import Executor, ModelFn
from .._scheduling.sizes import NO_ITEM, AllowedSizes
from .callers import narrowed

__all__ = ["SizedExecutor"]


class SizedExecutor(Executor):
    """Wraps a proxy's executor so that every model call is of an allowed size (see the
    module docstring). `filler` is the pad item; with `model_pads` the model pads its
    batch axis itself (`TensorProxy`), so a short call passes through, only counted."""

    def __init__(
        self,
        inner: Executor,
        sizes: AllowedSizes,
        events: Events,
        *,
        name: str,
        filler: object = NO_ITEM,
        model_pads: bool = False,
        reruns: Callable[[BaseException], bool] = lambda error: False,
    ) -> None:
        self.name = name
        self.inner = inner
        self._reruns = reruns  # errors the proxy re-runs the whole batch for, in pieces
        self.sizes = sizes
        self._events = events
        self._filler = filler
        self._model_pads = model_pads
        self.hosts_model = inner.hosts_model

    @property
    def capacity(self) -> int:
        return self.inner.capacity

    async def run(self, fn: ModelFn, items: list[Any]) -> Any:
        sizes, n = self.sizes, len(items)
        if n in sizes.sizes and not self._model_pads:
            return await self.inner.run(fn, items)  # (the common case: a full batch)
        pieces = sizes.pieces(n)
        if len(pieces) == 1:  # one call (padded): what it raises, the batch's callers get
            return await self._run_piece(fn, items, 0, pieces[0][1])
        results: list[Any] = []
        start = 0
        for count, size in pieces:
            try:
                rows = await self._run_piece(fn, items[start : start + count], start, size)
            except Exception as error:
                if self._reruns(error):  # oom_backoff, isolate_errors: the proxy re-runs
                    raise  # the batch in pieces of its own
                # each piece is a model call of its own: the one that raised fails its own
                # callers (guarantee 4), and the pieces after it still run
                rows = [error] * count
            results.extend(rows)
            start += count
        return results

    async def _run_piece(self, fn: ModelFn, items: list[Any], start: int, size: int) -> Any:
        """One model call on `items` (from `start` in the call's items), padded to `size`
        (pad mode), seeing its own items' caller contexts and a filler's for each filler
        row; its results checked and the filler's dropped; `BatchSizeMismatch` for a
        wrong count (no telling whose result is whose)."""
        count = len(items)
        if self._model_pads:
            return await self._run_self_padded(fn, items, start)
        extra = size - count
        if extra:
            self._events.rows_padded(extra)
            items = items + [self._filler] * extra
        with narrowed(range(start, start + count), fillers=extra):
            results = await self.inner.run(fn, items)
        rows = _rows(results)
        if len(rows) != size:
            raise BatchSizeMismatch(self.name, size, len(rows))
        return rows[:count] if extra else rows

    async def _run_self_padded(self, fn: ModelFn, items: list[Any], start: int) -> Any:
        """One call of a model that pads its batch axis itself (`TensorProxy`): it pads
        the items it collates, those whose result is not an error (an invalid item gets
        its error and no row), to the smallest allowed size; its filler rows (and their
        contexts) never leave it. So the filler rows are counted from its results: the
        call's length, invalid items included, says nothing of them."""
        count = len(items)
        with narrowed(range(start, start + count)):
            results = await self.inner.run(fn, items)
        rows = _rows(results)
        if len(rows) != count:
            raise BatchSizeMismatch(self.name, count, len(rows))
        collated = sum(not isinstance(row, BaseException) for row in rows)
        if collated:
            extra = self.sizes.cover(collated) - collated
            if extra:
                self._events.rows_padded(extra)
        return rows


def _rows(results: Any) -> list[Any] | tuple[Any, ...]:
    """The model's results as a list or tuple (an array becomes its rows)."""
    if type(results) is list or type(results) is tuple:
        return results
    if not hasattr(results, "__len__") or isinstance(results, (str, bytes, Mapping)):
        raise TypeError(
            f"_inference must return a sequence with one result per item (list, tuple "
            f"or array), got {type(results).__name__}"
        )
    return list(results)
