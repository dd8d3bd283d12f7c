"""Each caller's context, for the model: `caller_contexts()`.

A batch runs in a fresh `contextvars` context, so the model sees none of its
callers' variables (a batch serves many callers: whose would it be?). With
`caller_context=True`, each call keeps a copy of its caller's context, and the
batch hands the model the copies of the items it is called on, in item order,
through a variable of the batch's own context: the model reads them, its own
context stays its own. Whatever calls the model on part of the batch says which
rows it is called on (`narrowed`): a piece re-run alone (`isolate_errors`,
`oom_backoff`), a call of an allowed size (`batch_sizes`), the rows a
`TensorProxy` collates. A filler row (`pad_item`, a `TensorProxy`'s `pad_value`
rows) has no caller: its context is a fresh, empty one (no variable is set in it).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from typing import Any

__all__ = ["caller_contexts", "hand_over", "narrowed"]

_callers: contextvars.ContextVar[Sequence[contextvars.Context] | None] = contextvars.ContextVar(
    "batchproxy_callers", default=None
)


def caller_contexts() -> list[contextvars.Context]:
    """The contexts of the callers of the items the model is called on, in item order.

    One per item the model is called on: a batch that runs as several calls
    (`batch_sizes`, the re-runs of `isolate_errors` and `oom_backoff`) gives each
    call the contexts of its own items, and a filler row (`pad_item`, or a
    `TensorProxy`'s `pad_value` rows) gets a fresh, empty context: no variable
    is set in it (`context.get(var)` is None, `context.run(var.get)` the
    variable's default). Call it inside `_inference` (or an `@batch` function) of a proxy made with
    `caller_context=True`, on any executor. Each is a copy of the context its
    caller had when it made the call: read a variable with `context.get(var)`,
    or run code in it with `context.run(function)`. A `RuntimeError` anywhere
    else, and in a `GenerationProxy` (whose batch changes at every step).
    """
    contexts = _callers.get()
    if contexts is None:
        raise RuntimeError(
            "caller_contexts() is for a model call of a proxy made with caller_context=True "
            "(Proxy(..., caller_context=True), @batch(caller_context=True) or "
            "configure(caller_context=True))"
        )
    return list(contexts)


def hand_over(requests: Sequence[Any]) -> None:
    """In a batch's own context: its model calls see the contexts of `requests` (an
    empty one for a call admitted before `caller_context` was turned on)."""
    _callers.set([_context_of(request) for request in requests])


def _context_of(request: Any) -> contextvars.Context:
    context: contextvars.Context | None = getattr(request, "context", None)
    return contextvars.Context() if context is None else context  # (an empty one is falsy)


@contextlib.contextmanager
def narrowed(rows: Sequence[int], *, fillers: int = 0) -> Iterator[None]:
    """While the model is called on `rows` of the items it would see now (positions, in
    order: a `range` for a piece), then on `fillers` filler rows: their contexts, then a
    fresh empty one each (a filler has no caller; fresh, so that a model that sets a
    variable in one changes no other). Nested calls narrow what the enclosing one gave."""
    contexts = _callers.get()
    if contexts is None:  # no caller_context: nothing to narrow
        yield
        return
    if isinstance(rows, range) and rows.step == 1:
        seen = list(contexts[rows.start : rows.stop])
    else:
        seen = [contexts[row] for row in rows]
    seen.extend(contextvars.Context() for _ in range(fillers))
    token = _callers.set(seen)
    try:
        yield
    finally:
        _callers.reset(token)
