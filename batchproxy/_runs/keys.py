"""Batch keys: a proxy's requests batched only with requests of the same key.

A call's key is its `key=` argument, else the proxy's `key` option applied to its
item, else None. The first call with a key turns the binding's queue into a
`KeyedQueue` (the requests queued so far become key None's; `_scheduling.placement`): a
proxy whose calls never have a key keeps its plain queue and pays nothing. The
model reads its batch's key with `batch_key()`.
"""

from __future__ import annotations

import contextvars
from collections.abc import Hashable, Sequence
from typing import Any

from .._tasks import current_batch

__all__ = ["batch_key", "hand_key_over"]

_key: contextvars.ContextVar[Hashable] = contextvars.ContextVar("batchproxy_batch_key")


def batch_key() -> Hashable:
    """The key of the batch the model is called on: every item in it has this key.

    Call it inside `_inference` (or an `@batch` function) on the event loop or the
    proxy's worker thread. None for a batch of calls without a key (and in a proxy
    that uses no keys); a `RuntimeError` outside a model call.
    """
    if current_batch.get() is None:
        raise RuntimeError(
            "batch_key() is for a model call: inside _inference or an @batch function"
        )
    return _key.get(None)


def hand_key_over(requests: Sequence[Any]) -> None:
    """In a batch's own context: the model sees the key of `requests` (one key for all)."""
    _key.set(requests[0].key)
