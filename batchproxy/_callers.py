"""Each caller's context, for the model: `caller_contexts()`.

A batch runs in a fresh `contextvars` context, so the model sees none of its
callers' variables (a batch serves many callers: whose would it be?). With
`caller_context=True`, each call keeps a copy of its caller's context, and the
batch hands the model the copies of the items it is called on, in item order,
through a variable of the batch's own context: the model reads them, its own
context stays its own. A piece re-run alone (`isolate_errors`, `oom_backoff`)
sees the contexts of its own items.
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
_NONE = contextvars.Context()  # a call admitted before `caller_context` was turned on


def caller_contexts() -> list[contextvars.Context]:
    """The contexts of the callers of the items the model is called on, in item order.

    Call it inside `_inference` (or an `@batch` function) of a proxy made with
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
    """In a batch's own context: its model calls see the contexts of `requests`."""
    _callers.set([getattr(request, "context", _NONE) for request in requests])


@contextlib.contextmanager
def narrowed(start: int, stop: int) -> Iterator[None]:
    """While a piece `items[start:stop]` of the batch runs alone: its contexts only."""
    contexts = _callers.get()
    if contexts is None:  # no caller_context: nothing to narrow
        yield
        return
    token = _callers.set(contexts[start:stop])
    try:
        yield
    finally:
        _callers.reset(token)
