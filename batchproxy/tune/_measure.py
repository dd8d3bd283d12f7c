"""The model's time per batch, measured through the proxy as it is built.

Each batch size (and, for a proxy that knows its items' lengths, each of four
lengths: the sample's 10th, 50th and 90th percentile and its longest, so that the
curve reaches every length the simulation draws: a model's time may grow faster than
linearly in the length, as attention does) is sent as one
`inference_many` of that many sample items, with `batch_size` set to it for the
time (restored after): it runs on the proxy's own executor, and the proxy's
listener hook (`batch_finished`) gives the model time of each batch. The first
`warmup` batches of each shape are left out (first-shape allocations, compilation),
the next `repeats` are kept. A batch the proxy forms smaller than asked (identical
items with `dedup`) is kept under its own size.
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .._decorator import Batched
from .._listeners import Listener
from .._options import Options
from .._proxy import Proxy
from .._scheduling.sizes import NO_ITEM
from ._errors import TuneError

__all__ = ["Measurement", "Point", "measure", "sizes_to_measure"]

Progress = Callable[[int, int], None]
"""`progress(done, total)`: called after each batch measured."""

QUANTILES = (0.1, 0.5, 0.9, 1.0)


@dataclass(frozen=True)
class Point:
    """One batch shape's model times: `size` items, the longest `length` long (None
    for a proxy without lengths)."""

    size: int
    length: int | None
    seconds: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def units(self) -> int:
        """Items, or padded tokens (`size x length`)."""
        return self.size if self.length is None else self.size * self.length


@dataclass(frozen=True)
class Measurement:
    """What `measure` found: the points, and what the simulation needs of the proxy."""

    name: str
    points: tuple[Point, ...]
    options: Options
    """The proxy's options as built."""
    lanes: int
    """Batches its executor runs at once (1 for the loop or a thread)."""
    lengths: tuple[int, ...] | None
    """Each sample item's length (by the proxy's `length`); None without one."""
    pads: bool
    """It fills batches up to `batch_sizes` (a `pad_item`, or a `TensorProxy`)."""
    handoff: float = 0.0
    """Seconds a lone call takes beyond its batch's model time (the median): the
    hand-offs to the model's executor and back, and waking the caller. A call pays it
    on top of the model; with a model of a few milliseconds it is much of the wait."""

    @property
    def spread(self) -> tuple[float, ...]:
        """Each kept batch's time over the median of its shape, every shape pooled,
        sorted: how one batch's time varies around the curve (1.0 alone if nothing
        varied). The simulation draws each batch's factor from it, so that a model
        whose time varies gets the tail it shows (the median alone predicts a p99
        as if every batch took its median time)."""
        ratios = sorted(s / p.median for p in self.points for s in p.seconds if p.median > 0)
        return tuple(ratios) or (1.0,)


def sizes_to_measure(options: Options, largest: int | None = None) -> list[int]:
    """The batch sizes worth measuring: the allowed `batch_sizes` if any, else the
    powers of two and `batch_size`; up to `largest` (default: 64 or `batch_size`)."""
    top = largest if largest is not None else max(64, options.batch_size)
    if options.batch_sizes is not None:
        sizes = [size for size in options.batch_sizes.sizes if size <= top]
        return sorted(sizes) or [min(options.batch_sizes.sizes)]
    powers = [1 << k for k in range(top.bit_length()) if 1 << k <= top]
    return sorted({*powers, top, *([options.batch_size] if options.batch_size <= top else [])})


def proxy_of(made: object) -> Proxy[Any, Any]:
    """The `Proxy` behind what a factory returned (a `@batch` function's own proxy)."""
    target = made.proxy if isinstance(made, Batched) else made
    if not isinstance(target, Proxy):
        raise TuneError(
            f"the factory returned {type(made).__name__}, not a Proxy, TensorProxy or @batch "
            f"function"
        )
    if target._runner.kind.streams or target._runner.kind.admits_itself:
        raise TuneError(f"{target.name}: tune measures batch models, not streaming or generation")
    return target


async def measure(
    made: object,
    sample: Sequence[Any],
    *,
    sizes: Sequence[int] | None = None,
    repeats: int = 5,
    warmup: int = 2,
    progress: Progress | None = None,
) -> Measurement:
    """Measure the model time of the proxy `made` (a `Proxy` or `@batch` function) per
    batch size (and length), on the sample's items, on the running event loop."""
    proxy = proxy_of(made)
    if not sample:
        raise TuneError("the sample is empty: give at least one item to measure with")
    if repeats < 1 or warmup < 0:
        raise TuneError(f"repeats must be >= 1 and warmup >= 0, got {repeats} and {warmup}")
    options = proxy.options
    sizes = sorted(set(sizes or sizes_to_measure(options)))
    if options.batch_sizes is not None and sizes[0] < min(options.batch_sizes.sizes):
        raise TuneError(f"{proxy.name}: sizes must be allowed batch_sizes, got {sizes}")
    lengths = _lengths(proxy, sample)
    groups = _groups(sample, lengths, max(sizes))
    timings = _Timings()
    total, done = len(groups) * len(sizes) * (warmup + repeats), 0
    kept: dict[tuple[int, int | None], list[float]] = {}
    proxy.add_listener(timings)
    try:
        for group_items, group_lengths in groups:
            for size in sizes:
                proxy.configure(batch_size=size)
                items = [group_items[i % len(group_items)] for i in range(size)]
                longest = None
                if group_lengths is not None:
                    longest = max(group_lengths[i % len(group_lengths)] for i in range(size))
                for attempt in range(warmup + repeats):
                    timings.batches.clear()
                    await _run(proxy, items)
                    if attempt >= warmup:
                        for batch_size, seconds in timings.batches:
                            kept.setdefault((batch_size, longest), []).append(seconds)
                    done += 1
                    if progress is not None:
                        progress(done, total)
        handoff = await _handoff(proxy, groups[len(groups) // 2][0][0], timings, warmup, repeats)
    finally:
        proxy.remove_listener(timings)
        proxy.configure(batch_size=options.batch_size)
    points = tuple(
        Point(size, length, tuple(seconds))
        for (size, length), seconds in sorted(
            kept.items(), key=lambda kv: (kv[0][1] or 0, kv[0][0])
        )
    )
    return Measurement(
        name=proxy.name,
        points=points,
        options=options,
        lanes=proxy._executor.capacity,
        lengths=None if lengths is None else tuple(lengths),
        pads=proxy._pads_batch_axis or options.filler is not NO_ITEM,
        handoff=handoff,
    )


async def _handoff(
    proxy: Proxy[Any, Any], item: Any, timings: _Timings, warmup: int, repeats: int
) -> float:
    """The median of a lone call's time less its batch's model time, over `repeats`
    calls of `item` one after another (on the loop's clock, as the proxy's)."""
    loop = asyncio.get_running_loop()
    beyond: list[float] = []
    for attempt in range(warmup + 2 * repeats):  # (cheap: twice the repeats)
        timings.batches.clear()
        began = loop.time()
        await _run(proxy, [item])
        took = loop.time() - began
        if attempt >= warmup and len(timings.batches) == 1:
            beyond.append(max(0.0, took - timings.batches[0][1]))
    return statistics.median(beyond) if beyond else 0.0


async def _run(proxy: Proxy[Any, Any], items: list[Any]) -> None:
    results = await proxy.inference_many(items, return_exceptions=True)
    failed = next((r for r in results if isinstance(r, Exception)), None)
    if failed is not None:
        raise TuneError(
            f"{proxy.name}: the model failed on a batch of {len(items)} sample items: "
            f"{type(failed).__name__}: {failed}"
        ) from failed


def _lengths(proxy: Proxy[Any, Any], sample: Sequence[Any]) -> list[int] | None:
    if not proxy._intake.measures:
        return None
    try:
        return [proxy._cost(item) for item in sample]
    except TypeError as exc:
        raise TuneError(f"{proxy.name}: cannot measure the sample's items: {exc}") from exc


def _groups(
    sample: Sequence[Any], lengths: list[int] | None, largest: int
) -> list[tuple[list[Any], list[int] | None]]:
    """The items each batch is drawn from: the whole sample; or, with lengths, the
    `largest` items nearest each quantile's length (shortest first)."""
    if lengths is None:
        return [(list(sample), None)]
    ordered = sorted(lengths)
    targets = sorted({ordered[min(len(ordered) - 1, int(q * len(ordered)))] for q in QUANTILES})
    groups: list[tuple[list[Any], list[int] | None]] = []
    for target in targets:
        nearest = sorted(range(len(sample)), key=lambda i: (abs(lengths[i] - target), i))
        chosen = nearest[:largest]
        # each batch's longest item is the target's length: the one nearest it first
        groups.append(([sample[i] for i in chosen], [lengths[i] for i in chosen]))
    return groups


class _Timings(Listener):
    """Each finished batch's size and model seconds, as the proxy tells them."""

    def __init__(self) -> None:
        self.batches: list[tuple[int, float]] = []

    def batch_finished(
        self, proxy: str, size: int, model_seconds: float, error: BaseException | None
    ) -> None:
        if error is None:
            self.batches.append((size, model_seconds))
