"""The cost curve: model seconds per batch, fitted to what `_measure` found.

Without lengths the curve goes through the measured medians (made non-decreasing by
pooling adjacent violators, joined by straight lines), so a GPU's flat start and its
steps are kept as they were measured; beyond the largest size it goes on along the
fitted line's slope.
With lengths it goes through the measured medians too: at each measured size, straight
between the lengths measured, then straight between the sizes; beyond them, along the
fitted line `fixed + per_item x size + per_token x size x longest` (a batch is padded
to its longest item). The line is a least-squares fit with no negative coefficient,
on the medians.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from ._errors import TuneError
from ._measure import Measurement

__all__ = ["CostCurve", "fit"]


@dataclass(frozen=True)
class CostCurve:
    """Model seconds for a batch of `size` items (the longest `length` long)."""

    fixed: float
    per_item: float
    per_token: float
    """0.0 without lengths."""
    by_length: bool
    sizes: tuple[int, ...] = ()
    """The measured sizes (without lengths): the curve goes through their medians."""
    seconds: tuple[float, ...] = ()
    grid: tuple[tuple[int, tuple[tuple[int, float], ...]], ...] = ()
    """With lengths: per measured size, its `(longest, median seconds)`, by length."""

    def __call__(self, size: int, length: int | None = None) -> float:
        if self.grid:
            return max(1e-9, self._on_grid(size, length or 0))
        if self.by_length or not self.sizes:
            tokens = size * (length or 0)
            return max(1e-9, self.fixed + self.per_item * size + self.per_token * tokens)
        sizes, seconds = self.sizes, self.seconds
        if size <= sizes[0]:
            return seconds[0]
        if size >= sizes[-1]:
            return seconds[-1] + self.per_item * (size - sizes[-1])
        right = bisect.bisect_left(sizes, size)
        left = right - 1
        share = (size - sizes[left]) / (sizes[right] - sizes[left])
        return seconds[left] + share * (seconds[right] - seconds[left])

    def _on_grid(self, size: int, length: int) -> float:
        grid = self.grid
        if size <= grid[0][0]:
            return self._at(0, length)
        if size >= grid[-1][0]:
            beyond = size - grid[-1][0]
            return self._at(-1, length) + beyond * (self.per_item + self.per_token * length)
        right = next(k for k, (measured, _) in enumerate(grid) if measured >= size)
        (low, _), (high, _) = grid[right - 1], grid[right]
        share = (size - low) / (high - low)
        return self._at(right - 1, length) * (1 - share) + self._at(right, length) * share

    def _at(self, index: int, length: int) -> float:
        """Seconds at the `index`th measured size for items `length` long."""
        size, row = self.grid[index]
        if length <= row[0][0]:
            return row[0][1] - (row[0][0] - length) * self.per_token * size
        if length >= row[-1][0]:
            return row[-1][1] + (length - row[-1][0]) * self.per_token * size
        right = next(k for k, (measured, _) in enumerate(row) if measured >= length)
        (low, below), (high, above) = row[right - 1], row[right]
        return below + (above - below) * (length - low) / (high - low)

    def describe(self) -> str:
        """The line in words: `2.10 ms + 0.350 ms/item (+ 1.2 µs/token)`."""
        text = f"{self.fixed * 1e3:.2f} ms + {self.per_item * 1e3:.3f} ms/item"
        if self.by_length:
            text += f" + {self.per_token * 1e6:.2f} µs/token"
        return text


def fit(measurement: Measurement) -> CostCurve:
    """The cost curve of the measured points."""
    points = measurement.points
    if not points:
        raise TuneError(f"{measurement.name}: no batch was measured")
    by_length = measurement.lengths is not None
    rows = [
        (1.0, float(p.size), float(p.units)) if by_length else (1.0, float(p.size)) for p in points
    ]
    coefficients = _nonnegative_least_squares(rows, [p.median for p in points])
    fixed, per_item = coefficients[0], coefficients[1]
    per_token = coefficients[2] if by_length else 0.0
    if by_length:
        by_size: dict[int, dict[int, list[float]]] = {}
        for point in points:
            row = by_size.setdefault(point.size, {})
            row.setdefault(point.length or 0, []).extend(point.seconds)
        grid = tuple(
            (size, tuple((length, _median(s)) for length, s in sorted(by_size[size].items())))
            for size in sorted(by_size)
        )
        return CostCurve(fixed, per_item, per_token, True, grid=grid)
    medians: dict[int, list[float]] = {}
    for point in points:
        medians.setdefault(point.size, []).extend(point.seconds)
    sizes = sorted(medians)
    seconds = _non_decreasing([_median(medians[s]) for s in sizes])
    return CostCurve(fixed, per_item, 0.0, False, tuple(sizes), tuple(seconds))


def _non_decreasing(values: list[float]) -> list[float]:
    """The closest non-decreasing sequence (least squares: pool adjacent violators), so
    one slow batch of a small size is averaged with its neighbours, not carried up."""
    blocks: list[tuple[float, int]] = []  # (mean, count)
    for value in values:
        mean, count = value, 1
        while blocks and blocks[-1][0] > mean:
            previous, weight = blocks.pop()
            mean, count = (previous * weight + mean * count) / (weight + count), weight + count
        blocks.append((mean, count))
    return [mean for mean, count in blocks for _ in range(count)]


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def _nonnegative_least_squares(rows: Sequence[Sequence[float]], ys: Sequence[float]) -> list[float]:
    """Least squares with every coefficient >= 0: the best of the fits on each subset of
    the columns whose coefficients all come out >= 0 (a few columns: exact)."""
    width = len(rows[0])
    best: tuple[float, list[float]] | None = None
    for count in range(width, 0, -1):
        for columns in itertools.combinations(range(width), count):
            solved = _least_squares([[row[c] for c in columns] for row in rows], ys)
            if solved is None or min(solved) < 0:
                continue
            full = [0.0] * width
            for column, value in zip(columns, solved, strict=True):
                full[column] = value
            residual = sum(
                (y - sum(a * x for a, x in zip(full, row, strict=True))) ** 2
                for row, y in zip(rows, ys, strict=True)
            )
            if best is None or residual < best[0] - 1e-15:
                best = (residual, full)
    return best[1] if best is not None else [0.0] * width


def _least_squares(rows: list[list[float]], ys: Sequence[float]) -> list[float] | None:
    """The normal equations solved by Gaussian elimination; None if singular."""
    width = len(rows[0])
    matrix = [
        [sum(r[i] * r[j] for r in rows) for j in range(width)]
        + [sum(r[i] * y for r, y in zip(rows, ys, strict=True))]
        for i in range(width)
    ]
    for column in range(width):
        pivot = max(range(column, width), key=lambda r: abs(matrix[r][column]))
        scale = max(1.0, *(abs(v) for v in matrix[pivot][:width]))
        if abs(matrix[pivot][column]) <= 1e-12 * scale:
            return None
        matrix[column], matrix[pivot] = matrix[pivot], matrix[column]
        for row in range(width):
            if row != column:
                factor = matrix[row][column] / matrix[column][column]
                matrix[row] = [
                    a - factor * b for a, b in zip(matrix[row], matrix[column], strict=True)
                ]
    return [matrix[i][width] / matrix[i][i] for i in range(width)]
