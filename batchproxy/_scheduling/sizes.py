"""Preferred batch sizes (opt-in: `Proxy(batch_sizes=(1, 2, 4, 8))`): the model sees
only these sizes.

For static-shape engines (TensorRT, CUDA graphs, compiled models) that run only
certain batch sizes. Two modes, fixed at construction:

- pad (a filler exists: `pad_item=` is given, or the proxy pads its batch axis
  itself, as `TensorProxy` does with `pad_value` rows): a batch of n runs padded
  to the smallest allowed size >= n; the filler rows' results are dropped.
- cut (no filler; the sizes must then include 1, so that any request can run):
  a batch leaves with the largest allowed size that the queue fills, the rest
  wait for the next batch. A partial batch that would be cut waits for the next
  allowed size instead when the missing requests are expected (by the
  scheduler's arrival gap) before its window closes and before its deadline
  rule sends it; the scheduler asks `AllowedSizes.wait_until`.

The model calls of allowed sizes are made by `SizedExecutor` (`_runs.sized`).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from typing import Any

__all__ = [
    "NO_ITEM",
    "AllowedSizes",
    "Cut",
    "batch_sizes",
    "check_sizes",
    "cut_limit",
    "refuse_streams",
]

Cut = Callable[[int], int]
"""Cut mode (`AllowedSizes.fit`): the size of a batch that may draw from n requests,
the largest allowed size <= n. The queues take it (`Queue.pop_batch`), so that a
batch is sized from the requests (with batch keys, the key) it is taken from."""


def cut_limit(limit: int, live: int, cut: Cut | None) -> int:
    """The most requests a batch that may draw from `live` takes: `limit`, or with
    `cut` the allowed size for `min(live, limit)` (at least 1: cut mode allows 1)."""
    return limit if cut is None else max(1, cut(min(live, limit)))


class _NoItem:
    """`pad_item` not given: no filler item."""

    def __repr__(self) -> str:
        return "<no pad_item>"


NO_ITEM: Any = _NoItem()


def check_sizes(sizes: object, batch_size: int) -> tuple[int, ...] | None:
    """`batch_sizes` checked, sorted ascending: positive ints, no duplicates, the
    smallest no larger than `batch_size`. (Whether 1 is needed depends on the proxy:
    `batch_sizes`, below.)"""
    if sizes is None:
        return None
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence | set | frozenset):
        raise TypeError(f"batch_sizes must be a sequence of ints or None, got {sizes!r}")
    checked = []
    for size in sizes:
        if isinstance(size, bool) or not isinstance(size, int):
            raise TypeError(f"batch_sizes must hold ints, got {size!r} in {sizes!r}")
        if size < 1:
            raise ValueError(f"batch_sizes must hold positive ints, got {size!r} in {sizes!r}")
        checked.append(size)
    if not checked:
        raise ValueError("batch_sizes must hold at least one size (or be None)")
    if len(set(checked)) != len(checked):
        raise ValueError(f"batch_sizes must not repeat a size, got {sizes!r}")
    ordered = tuple(sorted(checked))
    if ordered[0] > batch_size:
        raise ValueError(
            f"batch_size={batch_size} is below the smallest of batch_sizes={ordered}: "
            f"no batch could be formed"
        )
    return ordered


def refuse_streams(name: str, streams: bool, sizes: object) -> None:
    """A streaming run (a generator `_inference`, a `GenerationProxy`) cannot keep its
    batch at an allowed size: its batch shrinks as streams end."""
    if streams and sizes is not None:
        raise TypeError(
            f"{name}: batch_sizes is not supported for streaming models (a generator "
            f"_inference or a GenerationProxy): their batch shrinks as streams end; leave "
            f"it off"
        )


def batch_sizes(name: str, options: Any, model_pads: bool) -> AllowedSizes | None:
    """A proxy's allowed sizes and mode (None without `batch_sizes`); cut mode needs 1
    among the sizes, or a lone request could never run."""
    allowed = options.batch_sizes  # a `BatchSizes` value (`_option_values`), or None
    if allowed is None:
        return None
    sizes = allowed.sizes
    pads = model_pads or allowed.pad_item is not NO_ITEM
    if not pads and sizes[0] != 1:
        raise ValueError(
            f"{name}: batch_sizes={sizes} without pad_item must include 1, or a request "
            f"with no company could never run; add 1, or pad batches with "
            f"batch_sizes=BatchSizes({sizes}, pad_item=...)"
        )
    return AllowedSizes(sizes, pads=pads)


class AllowedSizes:
    """The allowed sizes (ascending) and the mode: `pads` (a filler exists) or cut."""

    __slots__ = ("largest", "pads", "sizes")

    def __init__(self, sizes: tuple[int, ...], *, pads: bool) -> None:
        self.sizes = sizes
        self.largest = sizes[-1]
        self.pads = pads

    def top(self, cap: int) -> int:
        """The largest batch to form under a cap (`batch_size`, or lower after running
        out of memory): the largest allowed size <= cap, never below the smallest."""
        return max(self.fit(cap), self.sizes[0])

    def fit(self, n: int) -> int:
        """The largest allowed size <= n (0 if none)."""
        index = bisect.bisect_right(self.sizes, n)
        return self.sizes[index - 1] if index else 0

    def cover(self, n: int) -> int:
        """The smallest allowed size >= n (n itself above the largest)."""
        index = bisect.bisect_left(self.sizes, n)
        return self.sizes[index] if index < len(self.sizes) else n

    def pieces(self, n: int) -> list[tuple[int, int]]:
        """How a call on n items runs: (items, size the model sees) per model call, in
        order. Pad: pieces of the largest size, the last padded; cut: greedy, largest
        allowed size first."""
        out = []
        while n:
            if self.pads:
                count = min(n, self.largest)
                out.append((count, self.cover(count)))
            else:
                count = self.fit(n)
                out.append((count, count))
            n -= count
        return out

    def wait_until(
        self,
        live: int,
        *,
        last_arrival: float | None,
        gap: float,
        closes: float,
        deadline_start: float | None,
    ) -> float | None:
        """Cut mode: when to send a partial batch of `live` requests that is due now, if
        waiting for the next allowed size pays: the missing requests are expected (one
        per `gap` after the last arrival) before the window `closes` and no later than
        the deadline rule's latest start. None: send it now, cut."""
        if self.pads or live >= self.largest or self.fit(live) == live:
            return None
        if last_arrival is None or gap == math.inf:
            return None
        expected = last_arrival + (self.cover(live) - live) * gap
        if expected >= closes or (deadline_start is not None and expected > deadline_start):
            return None
        return expected
