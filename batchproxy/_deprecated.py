"""The old spellings, kept for one release: each warns once per use with a
`DeprecationWarning` naming the new spelling, and then means what it meant.

- The flat options that only modified another (`cache_size`, `cache_ttl`,
  `pad_item`, `on_batch_timeout`) are folded into the value of the option they
  modify (`Dedup`, `BatchSizes`, `Watchdog`: `_option_values`) by `fold_options`
  and, for `configure()`, by `fold_changes`.
- Renamed methods and arguments call `warn_renamed` and go on with the new name.

The warning points at the caller's line, outside this package.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Mapping
from typing import Any

from ._option_values import BatchSizes, Dedup, Watchdog
from ._scheduling.sizes import NO_ITEM

__all__ = ["fold_changes", "fold_options", "warn_renamed"]

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
FLAT = ("cache_size", "cache_ttl", "pad_item", "on_batch_timeout")
"""The deprecated flat options."""


def warn_renamed(old: str, new: str) -> None:
    """`old` still works, for one release: say what to write instead."""
    warnings.warn(
        f"{old} is deprecated and will be removed in the next release; use {new}",
        DeprecationWarning,
        stacklevel=_outside_the_package(),
    )


def _outside_the_package() -> int:
    """The stack level of the first frame outside batchproxy (the caller's line)."""
    frame = sys._getframe(1)
    level = 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
        frame = frame.f_back  # type: ignore[assignment]  # (None ends the loop)
        level += 1
    return level


def fold_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """Constructor keywords with the deprecated flat ones folded into the value they
    modify (each warned about); a flat one given with the new value (a `TypeError`: one
    spelling at a time), or without the option it modifies (a `ValueError` naming it),
    is refused: it would mean nothing."""
    folded = dict(options)
    if not any(name in folded for name in FLAT):
        return folded
    if "cache_size" in folded or "cache_ttl" in folded:
        size, ttl = folded.pop("cache_size", None), folded.pop("cache_ttl", None)
        for name in ("cache_size", "cache_ttl"):
            if name in options:
                warn_renamed(f"{name}=", f"dedup=Dedup({name}=...)")
        dedup = folded.get("dedup", False)
        if isinstance(dedup, Dedup):
            raise TypeError(
                "cache_size= and cache_ttl= go inside Dedup(...): "
                "dedup=Dedup(cache_size=..., cache_ttl=...)"
            )
        if size is not None or ttl is not None:
            if dedup is False or dedup is None:
                raise ValueError(
                    "cache_size and cache_ttl keep results by key: they need dedup= "
                    "(write dedup=Dedup(cache_size=..., cache_ttl=...))"
                )
            if not (dedup is True or callable(dedup)):
                raise TypeError(f"dedup must be a bool or a function of the item, got {dedup!r}")
            key = None if dedup is True else dedup
            folded["dedup"] = Dedup(key=key, cache_size=size, cache_ttl=ttl)
    if "pad_item" in folded:
        pad_item = folded.pop("pad_item")
        warn_renamed("pad_item=", "batch_sizes=BatchSizes(sizes, pad_item=...)")
        sizes = folded.get("batch_sizes")
        if isinstance(sizes, BatchSizes):
            raise TypeError(
                "pad_item= goes inside BatchSizes(...): BatchSizes(sizes, pad_item=...)"
            )
        if sizes is None:  # a part without its option: a ValueError, as the others
            raise ValueError(
                "pad_item fills batches up to an allowed size: it needs batch_sizes "
                "(write batch_sizes=BatchSizes(sizes, pad_item=...))"
            )
        if pad_item is not NO_ITEM:
            folded["batch_sizes"] = BatchSizes(sizes, pad_item=pad_item)
    if "on_batch_timeout" in folded:
        on_timeout = folded.pop("on_batch_timeout")
        warn_renamed("on_batch_timeout=", "batch_timeout=Watchdog(seconds, on_timeout=...)")
        folded["batch_timeout"] = _watchdog(folded.get("batch_timeout"), on_timeout, keep=False)
    return folded


def fold_changes(changes: Mapping[str, Any], current: Watchdog | None) -> dict[str, Any]:
    """`configure()`'s changes with `on_batch_timeout` folded into `batch_timeout` (the
    one given with it, else the proxy's `current` one), warned about."""
    folded = dict(changes)
    if "on_batch_timeout" not in folded:
        return folded
    on_timeout = folded.pop("on_batch_timeout")
    warn_renamed("on_batch_timeout=", "batch_timeout=Watchdog(seconds, on_timeout=...)")
    if "batch_timeout" in folded:
        folded["batch_timeout"] = _watchdog(folded["batch_timeout"], on_timeout, keep=False)
    else:  # the proxy's watchdog, with its new reaction
        folded["batch_timeout"] = _watchdog(current, on_timeout, keep=True)
    return folded


def _watchdog(batch_timeout: object, on_timeout: object, *, keep: bool) -> Watchdog:
    """`on_batch_timeout` applied to a `batch_timeout` (seconds, or a `Watchdog`: the
    proxy's own with `keep`, else one given beside it, which says it already)."""
    if isinstance(batch_timeout, Watchdog):
        if not keep:
            raise TypeError(
                "on_batch_timeout= goes inside Watchdog(...): "
                "batch_timeout=Watchdog(seconds, on_timeout=...)"
            )
        return Watchdog(batch_timeout.seconds, on_timeout=on_timeout)  # type: ignore[arg-type]
    if batch_timeout is None or batch_timeout == float("inf"):
        raise ValueError(
            "on_batch_timeout says what to do when a batch overruns batch_timeout: it "
            "needs batch_timeout (write batch_timeout=Watchdog(seconds, on_timeout=...))"
        )
    return Watchdog(batch_timeout, on_timeout=on_timeout)  # type: ignore[arg-type]
