"""`Options`: how a proxy batches, as one frozen, validated value.

The constructor builds it from its keyword arguments, `configure()` evolves it
(`Options.evolve`), and `proxy.options` shows it. Every check lives here, so an
`Options` that exists is valid, and a `configure()` call with one bad value
changes nothing. Adding an option touches this module only: a field of `Options`
(checked in `__post_init__`) and the same key in `ProxyOptions`, which types the
keyword arguments of `Proxy(...)`, `@batch(...)` and `configure(...)`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypedDict

from . import _validate
from ._oom import OomPredicate, is_out_of_memory

__all__ = ["CONFIGURABLE", "Options", "ProxyOptions"]


class _Changeable(TypedDict, total=False):
    """The options that may also change at run time (`configure`), but `batch_size`."""

    max_delay_ms: float
    max_queue_size: int | None
    timeout: float | None
    max_concurrent_batches: int | None
    window: Literal["adaptive", "fixed"]
    aging_ms: float | None
    shed_late: bool
    isolate_errors: bool
    batch_timeout: float | None
    on_batch_timeout: Literal["serve", "stop"]
    stream_buffer: int | None


class ProxyOptions(_Changeable, total=False):
    """The keyword arguments of `Proxy(...)` and `@batch(...)` (see `Options`)."""

    length: Callable[[Any], int] | None
    max_batch_tokens: int | None
    oom_backoff: bool | OomPredicate


class ConfigurableOptions(_Changeable, total=False):
    """The keyword arguments of `configure(...)`: the options that may change at run time."""

    batch_size: int


CONFIGURABLE = frozenset(ConfigurableOptions.__annotations__)
"""What `configure()` may change; the rest shapes the proxy and is fixed at construction."""


@dataclass(frozen=True)
class Options:
    """A proxy's options (see `Proxy` for what each means), checked and normalised.

    Read it as `proxy.options`; change it with `proxy.configure(...)`. Durations are
    clamped to what the platform can wait; `timeout=math.inf` is stored as None.
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
    shed_late: bool = False
    isolate_errors: bool = False
    batch_timeout: float | None = None
    on_batch_timeout: Literal["serve", "stop"] = "serve"
    stream_buffer: int | None = 1024

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
            "max_delay_ms": _finite_ms("max_delay_ms", self.max_delay_ms, allow_zero=True),
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
                else _finite_ms("aging_ms", self.aging_ms, allow_zero=False)
            ),
            "shed_late": _validate.flag("shed_late", self.shed_late),
            "isolate_errors": _validate.flag("isolate_errors", self.isolate_errors),
            "batch_timeout": _validate.timeout("batch_timeout", self.batch_timeout),
            "on_batch_timeout": _validate.choice(
                "on_batch_timeout", self.on_batch_timeout, ("serve", "stop")
            ),
            "stream_buffer": _validate.optional_count("stream_buffer", self.stream_buffer),
        }
        oom = self.oom_backoff
        if not (isinstance(oom, bool) or callable(oom)):
            raise TypeError(f"oom_backoff must be a bool or a predicate, got {oom!r}")
        normal["is_oom"] = (is_out_of_memory if oom is True else oom) or None
        normal["max_delay"] = _seconds(normal["max_delay_ms"])
        aging = normal["aging_ms"]
        normal["aging"] = None if aging is None else _seconds(aging)
        for name, value in normal.items():
            object.__setattr__(self, name, value)

    @property
    def adaptive(self) -> bool:
        return self.window == "adaptive"

    @property
    def stops_on_overrun(self) -> bool:
        return self.on_batch_timeout == "stop"

    def evolve(self, **changes: Any) -> Options:
        """These options with `changes` (each checked; `...` keeps a value), or an error
        naming a change that is not allowed at run time."""
        changes = {name: value for name, value in changes.items() if value is not ...}
        for name in changes:
            if name not in CONFIGURABLE:
                what = (
                    "an option fixed at construction"
                    if name in ProxyOptions.__annotations__
                    else "an unexpected keyword argument"
                )
                raise TypeError(
                    f"configure() got {what} {name!r}; it takes {', '.join(sorted(CONFIGURABLE))}"
                )
        return dataclasses.replace(self, **changes)


def _finite_ms(name: str, value: object, *, allow_zero: bool) -> float:
    """A duration in milliseconds: checked like every duration (so finite), kept in ms."""
    _validate.duration(name, value, allow_zero=allow_zero, milliseconds=True)
    return float(value)  # type: ignore[arg-type]  # a finite Real, checked just above


def _seconds(milliseconds: float) -> float:
    return min(milliseconds / 1e3, _validate.MAX_WAIT)


def _callable_or_none(name: str, value: object) -> Any:
    if value is not None and not callable(value):
        raise TypeError(f"{name} must be a callable or None, got {value!r}")
    return value
