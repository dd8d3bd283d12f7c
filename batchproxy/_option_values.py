"""The small values an option takes when it has parts, and the per-call keywords.

An option that only modifies another is a field of that option's value, as httpx
groups `Timeout` and `Limits`, so a combination that means nothing cannot be
written: `dedup=Dedup(key=..., cache_size=..., cache_ttl=...)`,
`batch_sizes=BatchSizes((1, 2, 4, 8), pad_item=...)`,
`batch_timeout=Watchdog(2.0, on_timeout="stop")`. Each is frozen and checks its
own fields when made; `Options` checks how it fits the rest (`_options`).

`CallOptions` types the per-call keywords (`timeout`, `priority`, `tenant`, `key`)
of every call method that forwards them; `check_call` refuses a misspelt one at
run time, naming the nearest (`did_you_mean`).
"""

from __future__ import annotations

import difflib
import sys
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypedDict

from . import _validate
from ._scheduling.sizes import NO_ITEM, check_sizes

__all__ = [
    "CALL_KEYWORDS",
    "BatchSizes",
    "CallOptions",
    "Dedup",
    "UnkeyedCallOptions",
    "Watchdog",
    "check_call",
    "did_you_mean",
    "unexpected_keyword",
]


@dataclass(frozen=True, kw_only=True)
class Dedup:
    """`dedup=Dedup(...)`: identical calls in flight are computed once.

    - `key`: a function of the item giving its identity, compared with `==`
      (default: the item itself, which must then be hashable, and its type, as
      `functools.lru_cache(typed=True)` has it: `1`, `1.0` and `True` are three
      calls; the contents of a tuple are compared with `==`). Calls with equal keys
      share one slot in a batch and its result.
    - `cache_size`: also keep the results of this many recently used keys (least
      recently used out first) and answer a call with a kept key at once, without
      the queue or the model (`stats.cache_hits`). Errors are never kept.
    - `cache_ttl` (with `cache_size`): seconds a kept result stays valid (default:
      until evicted).

    `dedup=True` is `Dedup()`, `dedup=f` is `Dedup(key=f)`.
    """

    key: Callable[[Any], Hashable] | None = None
    cache_size: int | None = None
    cache_ttl: float | None = None

    def __post_init__(self) -> None:
        if self.key is not None and not callable(self.key):
            raise TypeError(f"Dedup(key=...) must be a function of the item, got {self.key!r}")
        size = _validate.optional_count("Dedup(cache_size=...)", self.cache_size)
        ttl = self.cache_ttl
        if ttl is not None:
            if size is None:
                raise ValueError(
                    "Dedup(cache_ttl=...) needs cache_size= (how many results to keep)"
                )
            ttl = _validate.duration("Dedup(cache_ttl=...)", ttl, allow_zero=False)
        object.__setattr__(self, "cache_size", size)
        object.__setattr__(self, "cache_ttl", ttl)


@dataclass(frozen=True)
class BatchSizes:
    """`batch_sizes=BatchSizes(sizes, pad_item=...)`: the only batch sizes the model is
    given (static-shape engines), e.g. `(1, 2, 4, 8)`: positive ints, no repeats,
    kept ascending.

    `pad_item`: the item that fills a batch up to an allowed size (its results are
    dropped); any value, None included. Without one, a batch is cut to an allowed
    size instead, and the sizes must include 1. A plain tuple of sizes is
    `BatchSizes(sizes)`.
    """

    sizes: tuple[int, ...]
    pad_item: Any = field(default=NO_ITEM, kw_only=True, compare=False)

    def __post_init__(self) -> None:
        checked = check_sizes(self.sizes, sys.maxsize)
        if checked is None:
            raise TypeError("BatchSizes needs its sizes, e.g. BatchSizes((1, 2, 4, 8))")
        object.__setattr__(self, "sizes", checked)

    @property
    def pads(self) -> bool:
        """Whether a filler item was given: batches are padded, not cut."""
        return self.pad_item is not NO_ITEM

    def __repr__(self) -> str:
        pad = f", pad_item={self.pad_item!r}" if self.pads else ""
        return f"BatchSizes({self.sizes!r}{pad})"


@dataclass(frozen=True)
class Watchdog:
    """`batch_timeout=Watchdog(seconds, on_timeout=...)`: a batch still running after
    `seconds` fails its callers with `BatchTimeout`, frees its slot, is cancelled
    and marks the proxy unhealthy until a later batch returns in time.

    `on_timeout`: `"serve"` (default) keeps taking calls; `"stop"` stops intake,
    like `aclose()`: queued and new calls get `ProxyClosed`. `batch_timeout=2.0` is
    `Watchdog(2.0)`.
    """

    seconds: float
    on_timeout: Literal["serve", "stop"] = field(default="serve", kw_only=True)

    def __post_init__(self) -> None:
        seconds = _validate.duration("Watchdog(seconds)", self.seconds, allow_zero=False)
        _validate.choice("Watchdog(on_timeout=...)", self.on_timeout, ("serve", "stop"))
        object.__setattr__(self, "seconds", seconds)


class UnkeyedCallOptions(TypedDict, total=False):
    """The per-call keywords of a call whose batch key is given otherwise
    (`proxy.with_args(...)`, `@batch_args`): `CallOptions` but `key`."""

    timeout: float | None
    priority: int
    tenant: Hashable | None


class CallOptions(UnkeyedCallOptions, total=False):
    """The per-call keywords of every call method: `inference`, `inference_many`,
    `stream`, `submit`, `inference_sync`, and `@batch`'s.

    - `timeout`: seconds the whole call may take (default: the proxy's `timeout`);
    - `priority`: higher goes first, FIFO within a level (default 0);
    - `tenant`: whose call it is, for fair sharing (`tenant_weights`);
    - `key`: batch it only with calls of the same key.
    """

    key: Hashable | None


CALL_KEYWORDS = frozenset(CallOptions.__annotations__)
UNKEYED_CALL_KEYWORDS = frozenset(UnkeyedCallOptions.__annotations__)


def did_you_mean(name: str, valid: Iterable[str]) -> str:
    """`"; did you mean `x`?"` for the valid name nearest `name`, or `""` if none is near."""
    close = difflib.get_close_matches(name, sorted(valid), n=1)
    return f"; did you mean `{close[0]}`?" if close else ""


def unexpected_keyword(where: str, name: str, valid: Collection[str]) -> TypeError:
    """The error for a keyword `where` does not take, naming the nearest it does."""
    hint = did_you_mean(name, valid)
    if not hint:
        hint = f"; it takes {', '.join(sorted(valid))}"
    return TypeError(f"{where} got an unexpected keyword argument {name!r}{hint}")


def check_call(where: str, call: Mapping[str, object], *, keyed: bool = True) -> None:
    """Refuse a per-call keyword that is not one (a `**call` takes anything at run time)."""
    valid = CALL_KEYWORDS if keyed else UNKEYED_CALL_KEYWORDS
    for name in call:
        if name not in valid:
            if name == "key":
                raise TypeError(
                    f"{where} takes no key=: its arguments are the batch key (with_args)"
                )
            raise unexpected_keyword(where, name, valid)
