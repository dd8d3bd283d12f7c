"""`Options`: how a proxy batches, as one frozen, validated value.

The constructor builds it from its keyword arguments, `configure()` evolves it
(`Options.evolve`), and `proxy.options` shows it. Every check lives here (and,
for an option with parts, in its value's own: `Dedup`, `BatchSizes`, `Watchdog`
in `_option_values`), so an `Options` that exists is valid, and a `configure()`
call with one bad value changes nothing. Adding an option touches this module
only: a field of `Options` (checked in `__post_init__`) and the same key in
`ProxyOptions`, which types the keyword arguments of `Proxy(...)`, `@batch(...)`
and `configure(...)`. `options_for` reads those keywords: a misspelt one is
refused naming the nearest, a deprecated one is folded into its new spelling
(`_deprecated`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal, TypedDict

from . import _validate
from ._deprecated import fold_changes, fold_options, warn_renamed
from ._oom import OomPredicate, is_out_of_memory
from ._option_values import BatchSizes, Dedup, Watchdog, unexpected_keyword
from ._scheduling.sizes import NO_ITEM, check_sizes

__all__ = ["CONFIGURABLE", "Options", "ProxyOptions", "check_keywords", "options_for"]


class _Changeable(TypedDict, total=False):
    """The options that may also change at run time (`configure`), but `batch_size`."""

    max_delay_ms: float
    max_queue_size: int | None
    timeout: float | None
    max_concurrent_batches: int | None
    window: Literal["adaptive", "fixed"]
    aging_ms: float | None
    bulk_threshold: int | None
    shed_late: bool
    isolate_errors: bool
    batch_timeout: float | Watchdog | None
    on_batch_timeout: Literal["serve", "stop"]  # deprecated: Watchdog(on_timeout=...)
    stream_buffer: int | None
    caller_context: bool
    tenant_weights: Mapping[Hashable, float] | None
    max_queue_size_per_tenant: int | None


class ProxyOptions(_Changeable, total=False):
    """The keyword arguments of `Proxy(...)` and `@batch(...)` (see `Options`)."""

    length: Callable[[Any], int] | None
    max_batch_tokens: int | None
    oom_backoff: bool | OomPredicate
    dedup: bool | Callable[[Any], Hashable] | Dedup | None
    batch_sizes: Sequence[int] | BatchSizes | None
    key: Callable[[Any], Hashable] | None
    # deprecated for one release (a DeprecationWarning names the new spelling)
    cache_size: int | None  # Dedup(cache_size=...)
    cache_ttl: float | None  # Dedup(cache_ttl=...)
    pad_item: Any  # BatchSizes(sizes, pad_item=...)


class ConfigurableOptions(_Changeable, total=False):
    """The keyword arguments of `configure(...)`: the options that may change at run time."""

    batch_size: int


CONFIGURABLE = frozenset(ConfigurableOptions.__annotations__)
"""What `configure()` may change; the rest shapes the proxy and is fixed at construction."""

CONSTRUCTOR = frozenset(ProxyOptions.__annotations__) | {"batch_size", "offload", "name"}
"""The keywords of `Proxy(...)` and `@batch(...)`."""


def check_keywords(
    where: str, names: Collection[str], valid: Collection[str] = CONSTRUCTOR
) -> None:
    """Refuse a keyword `where` does not take, naming the nearest one it does."""
    for name in names:
        if name not in valid:
            raise unexpected_keyword(where, name, valid)


def options_for(where: str, batch_size: int, keywords: Mapping[str, Any]) -> Options:
    """`Proxy(...)`'s options from its keywords: each known (else an error naming the
    nearest), the deprecated ones folded into their new spelling, all checked."""
    check_keywords(where, keywords)
    return Options(batch_size=batch_size, **fold_options(keywords))


@dataclass(frozen=True)
class Options:
    """A proxy's options, checked and normalised: `proxy.options`.

    Given as keywords to `Proxy(...)` (or `@batch(...)`); the run-time ones change
    with `proxy.configure(...)`. Durations are clamped to what the platform can
    wait; `timeout=math.inf` is stored as None.

    - `batch_size`: the most items in one `_inference` call.
    - `max_delay_ms`: the longest a request waits for company once a batch slot
      is free (a lone request on an idle proxy does not wait; see the scheduler).
    - `max_queue_size`: refuse calls with `QueueFull` beyond this many waiting
      requests (default: unbounded).
    - `timeout`: default deadline in seconds for every call (default: none).
    - `max_concurrent_batches`: how many batches may run at once (default: the
      executor's capacity, 1 for a thread, n for n worker processes or actors).
    - `length`: a per-item cost (e.g. sequence length). When given, batches are
      formed from requests of similar cost (little padding), `max_batch_tokens`
      is enforced, and `stats.padding_waste` is tracked.
    - `max_batch_tokens`: the most padded tokens in one batch: members x largest
      cost (default cost: `batchproxy.tensors.length`). An item over it runs alone.
    - `oom_backoff` (opt-in): `True` (or your predicate of what counts as out of
      memory) reruns a batch whose `_inference` ran out of memory (`MemoryError`,
      `torch.cuda.OutOfMemoryError`, ...) in smaller chunks and lowers the batch
      cap for a while. Off by default: an exception then fails the whole batch.
    - `window`: how long a partial batch waits for company when a slot is free:
      `"adaptive"` (default) leaves as soon as waiting stops paying, by the
      arrival rate and the cost model; `"fixed"` waits out `max_delay_ms`. Under
      both, a request arriving to an idle proxy goes at once.
    - `aging_ms` (opt-in): starvation guard. Levels are served by their oldest
      request's arrival minus `aging_ms` per level of priority, and a level whose
      oldest request has waited `aging_ms` goes oldest first; so no request is
      overtaken by one Δp levels higher that came more than Δp x `aging_ms`
      after it. Off: strict priority, then earliest deadline first.
    - `bulk_threshold`: a call of more items than this (an `inference_many`) is a
      bulk call: within its priority, small calls' requests go before its own,
      but for one batch place in `BULK_EVERY` (8) kept for bulk requests while
      small ones wait, so a query is not stuck behind a reindex and the reindex
      is never starved. None: every call is ranked alike (arrival order).
    - `shed_late` (opt-in): refuse a call with a deadline at once, with
      `DeadlineExceeded`, when the cost model predicts it cannot be answered in
      time even at full speed (counted in `stats.shed`), instead of letting it
      wait to fail.
    - `isolate_errors` (opt-in): when `_inference` raises an `Exception`, run each
      half of the batch again on its own, down to single items, so only the items
      that make it raise fail (with what the model raised for them) and the others
      get their results. At most 2n - 2 extra model calls for a batch of n, about
      2 log2(n) for one bad item; counted in `stats.isolation_splits`.
    - `batch_timeout` (opt-in): a `Watchdog(seconds, on_timeout=...)`, or the
      seconds alone (`Watchdog(seconds)`). A batch still running after this long
      fails its callers with `BatchTimeout`, frees its slot, is cancelled (a model
      on a thread or in a process cannot be interrupted: it runs on there) and
      marks the proxy unhealthy (`proxy.health`) until a later batch returns in
      time. `on_timeout`: `"serve"` (default) keeps taking calls; `"stop"` stops
      intake, like `aclose()`: queued and new calls get `ProxyClosed`. In
      `configure()`, seconds alone keep the watchdog's `on_timeout`.
    - `stream_buffer` (streams only): the most chunks a stream may hold unread. A
      consumer that stops reading without closing its stream (a `break` while it
      still holds the iterator) is dropped from its batch at that point with
      `StreamBufferFull`, instead of chunks piling up; None: no bound.
    - `batch_sizes` (opt-in): `BatchSizes(sizes, pad_item=...)`, or the sizes
      alone: the only batch sizes the model is given (static-shape engines:
      TensorRT, CUDA graphs, compiled models), e.g. `(1, 2, 4, 8)`: positive, no
      repeats, the smallest no larger than `batch_size`; sizes above `batch_size`
      are not used (the largest batch formed is the largest allowed size <=
      `batch_size`). With a filler (`pad_item`, or a `TensorProxy`, which
      pads with `pad_value` rows) a batch of n runs padded to the smallest allowed
      size >= n, and the filler's results are dropped (`stats.padded_rows`);
      without one the sizes must include 1, and a batch leaves cut to the largest
      allowed size that fits, the rest waiting for the next batch (or it waits
      for the next allowed size when the missing requests are expected before
      its window closes). Not for streaming models. `pad_item`: the item that
      fills a batch up to an allowed size; its results are dropped.
    - `caller_context` (opt-in): keep a copy of each caller's `contextvars`
      context with its call, for the model to read with
      `batchproxy.caller_contexts()` (request ids, the user, the trace). The
      model still runs in a fresh context of its own.
    - `dedup` (opt-in): `Dedup(key=..., cache_size=..., cache_ttl=...)`, `True`
      (`Dedup()`) or a function of the item (`Dedup(key=f)`): identical calls in
      flight are computed once. Calls with equal (hashable) items of the same
      type (`1`, `1.0` and `True` are three calls, as with
      `functools.lru_cache(typed=True)`), or equal keys, share one slot in a
      batch and its result. Each caller keeps its own
      deadline and cancellation; an `Exception` in the slot fails each of them.
      Counted in `stats.deduplicated`. Not for streaming proxies. `cache_size`:
      also keep the results of this many recent keys (least recently used out
      first) and answer a call with a kept key at once, without the queue or the
      model (`stats.cache_hits`); errors are never kept. `cache_ttl`: seconds a
      result is kept (default: until evicted).
    - `key`: a function of the item giving its batch key (a model or adapter id,
      a language): requests are batched only with requests of the same key, the
      keys taking turns (see "Batches by key"); the model reads its batch's key
      with `batchproxy.batch_key()`. A call's own `key=` wins over it.
    - `tenant_weights`: fair sharing between the tenants calls name
      (`inference(x, tenant=...)`): batch places go to the tenants with waiting
      requests in proportion to their weight (weighted fair queuing; default
      weight 1, calls without a tenant are tenant None). See the guide's "Fair
      sharing" page.
    - `max_queue_size_per_tenant`: refuse a tenant's calls with `QueueFull`
      beyond this many of its requests waiting (tenant None included), so a
      flooding tenant is refused and the others are not; `max_queue_size` still
      bounds the total.
    """

    batch_size: int = 64
    max_delay_ms: float = 5.0
    max_queue_size: int | None = None
    timeout: float | None = None
    max_concurrent_batches: int | None = None
    """None: the executor's capacity, followed as it changes."""
    length: Callable[[Any], int] | None = None
    max_batch_tokens: int | None = None
    oom_backoff: bool | OomPredicate = False
    window: Literal["adaptive", "fixed"] = "adaptive"
    aging_ms: float | None = None
    bulk_threshold: int | None = 64
    shed_late: bool = False
    isolate_errors: bool = False
    batch_timeout: Watchdog | None = None
    """Given as a `Watchdog` or its seconds (`math.inf`: none)."""
    stream_buffer: int | None = 1024
    caller_context: bool = False
    dedup: Dedup | None = None
    """Given as a `Dedup`, `True` (`Dedup()`), a function (`Dedup(key=f)`) or `False`."""
    batch_sizes: BatchSizes | None = None
    """Given as a `BatchSizes` or the sizes alone."""
    key: Callable[[Any], Hashable] | None = None
    tenant_weights: Mapping[Hashable, float] | None = None
    max_queue_size_per_tenant: int | None = None

    # derived, in the units the machinery works in (not arguments)
    max_delay: float = field(init=False, repr=False, compare=False)
    """`max_delay_ms` in seconds."""
    aging: float | None = field(init=False, repr=False, compare=False)
    """`aging_ms` in seconds."""
    is_oom: OomPredicate | None = field(init=False, repr=False, compare=False)
    """What counts as out of memory, with `oom_backoff`; None without."""

    def __post_init__(self) -> None:
        normal = {
            "batch_size": _validate.count("batch_size", self.batch_size),
            "max_delay_ms": _milliseconds("max_delay_ms", self.max_delay_ms, allow_zero=True),
            "max_queue_size": _validate.optional_count("max_queue_size", self.max_queue_size),
            "timeout": _validate.timeout("timeout", self.timeout),
            "max_concurrent_batches": _validate.optional_count(
                "max_concurrent_batches", self.max_concurrent_batches
            ),
            "length": _callable_or_none("length", self.length),
            "max_batch_tokens": _validate.optional_count("max_batch_tokens", self.max_batch_tokens),
            "window": _validate.choice("window", self.window, ("adaptive", "fixed")),
            "aging_ms": (
                None
                if self.aging_ms is None
                else _milliseconds("aging_ms", self.aging_ms, allow_zero=False)
            ),
            "bulk_threshold": _validate.optional_count("bulk_threshold", self.bulk_threshold),
            "shed_late": _validate.flag("shed_late", self.shed_late),
            "isolate_errors": _validate.flag("isolate_errors", self.isolate_errors),
            "batch_timeout": _watchdog(self.batch_timeout),
            "stream_buffer": _validate.optional_count("stream_buffer", self.stream_buffer),
            "caller_context": _validate.flag("caller_context", self.caller_context),
            "dedup": _dedup(self.dedup),
            "batch_sizes": _batch_sizes(self.batch_sizes, self.batch_size),
            "key": _callable_or_none("key", self.key),
            "tenant_weights": _weights(self.tenant_weights),
            "max_queue_size_per_tenant": _validate.optional_count(
                "max_queue_size_per_tenant", self.max_queue_size_per_tenant
            ),
        }
        oom = self.oom_backoff
        if not (isinstance(oom, bool) or callable(oom)):
            raise TypeError(f"oom_backoff must be a bool or a predicate, got {oom!r}")
        normal["is_oom"] = (is_out_of_memory if oom is True else oom) or None
        normal["max_delay_ms"], normal["max_delay"] = normal["max_delay_ms"]
        aging = normal["aging_ms"]
        normal["aging_ms"], normal["aging"] = (None, None) if aging is None else aging
        for name, value in normal.items():
            object.__setattr__(self, name, value)

    @property
    def adaptive(self) -> bool:
        return self.window == "adaptive"

    @property
    def stops_on_overrun(self) -> bool:
        return self.batch_timeout is not None and self.batch_timeout.on_timeout == "stop"

    @property
    def batch_timeout_seconds(self) -> float | None:
        """The watchdog's seconds; None without one."""
        return None if self.batch_timeout is None else self.batch_timeout.seconds

    @property
    def filler(self) -> Any:
        """`batch_sizes`' `pad_item`; `NO_ITEM` without one."""
        return NO_ITEM if self.batch_sizes is None else self.batch_sizes.pad_item

    # The old flat fields, read for one release (each warns, naming the new place).
    @property
    def cache_size(self) -> int | None:
        warn_renamed("options.cache_size", "options.dedup.cache_size")
        return None if self.dedup is None else self.dedup.cache_size

    @property
    def cache_ttl(self) -> float | None:
        warn_renamed("options.cache_ttl", "options.dedup.cache_ttl")
        return None if self.dedup is None else self.dedup.cache_ttl

    @property
    def pad_item(self) -> Any:
        warn_renamed("options.pad_item", "options.batch_sizes.pad_item")
        return self.filler

    @property
    def on_batch_timeout(self) -> str:
        warn_renamed("options.on_batch_timeout", "options.batch_timeout.on_timeout")
        return "serve" if self.batch_timeout is None else self.batch_timeout.on_timeout

    def evolve(self, **changes: Any) -> Options:
        """These options with `changes` (each checked; `...` keeps a value), or an error
        naming a change that is not allowed at run time."""
        changes = {name: value for name, value in changes.items() if value is not ...}
        for name in changes:
            if name not in CONFIGURABLE:
                if name not in ProxyOptions.__annotations__:
                    raise unexpected_keyword("configure()", name, CONFIGURABLE)
                raise TypeError(
                    f"configure() got an option fixed at construction {name!r}; it takes "
                    f"{', '.join(sorted(CONFIGURABLE))}"
                )
        changes = fold_changes(changes, self.batch_timeout)
        seconds = changes.get("batch_timeout")
        if seconds is not None and not isinstance(seconds, Watchdog) and self.batch_timeout:
            # seconds alone change the watchdog's seconds; what it does stays
            timeout = _validate.timeout("batch_timeout", seconds)
            on_timeout = self.batch_timeout.on_timeout
            changes["batch_timeout"] = timeout and Watchdog(timeout, on_timeout=on_timeout)
        return dataclasses.replace(self, **changes)


def _milliseconds(name: str, value: object, *, allow_zero: bool) -> tuple[float, float]:
    """A duration given in milliseconds, checked like every duration: (as given, as a
    float; in seconds, clamped as `_validate.duration` clamps)."""
    seconds = _validate.duration(name, value, allow_zero=allow_zero, milliseconds=True)
    return float(value), seconds  # type: ignore[arg-type]  # a finite Real, checked above


def _weights(value: object) -> Mapping[Hashable, float] | None:
    """Tenant weights: a mapping of hashable tenants to finite weights > 0, copied
    (read-only) so a later change to the caller's dict bypasses no check."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise TypeError(f"tenant_weights must be a mapping of tenant to weight, got {value!r}")
    weights = {
        _validate.hashable("tenant_weights' tenant", tenant): _validate.finite(
            f"tenant_weights[{tenant!r}]", weight, allow_zero=False
        )
        for tenant, weight in value.items()
    }
    return MappingProxyType(weights)


def _watchdog(value: object) -> Watchdog | None:
    """`batch_timeout`: a `Watchdog`, or its seconds (None or infinity: none)."""
    if value is None or isinstance(value, Watchdog):
        return value
    seconds = _validate.timeout("batch_timeout", value)
    return None if seconds is None else Watchdog(seconds)


def _dedup(value: object) -> Dedup | None:
    """`dedup`: a `Dedup`, `True` (`Dedup()`), a function of the item (its key), or off."""
    if value is None or value is False:
        return None
    if isinstance(value, Dedup):
        return value
    if value is True:
        return Dedup()
    if callable(value) and not isinstance(value, bool):
        return Dedup(key=value)
    raise TypeError(f"dedup must be a Dedup, a bool or a function of the item, got {value!r}")


def _batch_sizes(value: object, batch_size: int) -> BatchSizes | None:
    """`batch_sizes`: a `BatchSizes` or the sizes alone, the smallest within `batch_size`."""
    if value is None:
        return None
    sizes = value if isinstance(value, BatchSizes) else BatchSizes(value)  # type: ignore[arg-type]
    check_sizes(sizes.sizes, batch_size)
    return sizes


def _callable_or_none(name: str, value: object) -> Any:
    if value is not None and not callable(value):
        raise TypeError(f"{name} must be a callable or None, got {value!r}")
    return value
