"""An online fit of model time per batch: `seconds = fixed + per_unit x units`.

A unit is an item, or a padded token when the proxy knows each item's length.
The fit is a weighted least-squares line over exponentially decaying sums, so
it follows a model whose speed drifts and costs O(1) per batch. It is made
robust in two ways: the first `WARMUP` batches are ignored (compilation,
caches, lazy allocation), and a batch far off the current line (more than
`CLIP` times the typical residual, e.g. a pause for garbage collection) is
pulled onto that bound before it is added, so one outlier cannot move the
line much. While every batch has had the same size the slope is unknown; the
fit then reports all the time as fixed.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CostEstimate", "CostModel"]

WARMUP = 3
DECAY = 0.98  # each batch's weight relative to the one after it (half-life ~34 batches)
CLIP = 4.0


@dataclass(frozen=True)
class CostEstimate:
    """The fitted line: a batch of `units` takes about `fixed + per_unit * units` s."""

    fixed: float
    per_unit: float
    unit: str
    """"item", or "token" (padded tokens: batch size x longest item)."""
    samples: int
    """Batches the fit has seen after warm-up."""

    def predict(self, units: float) -> float:
        return self.fixed + self.per_unit * units


class CostModel:
    """Feeds on `(units, seconds)` per batch. `line` is the current fit as
    `(fixed, per_unit)`, or None before the first batch after warm-up; `estimate()`
    is the same as a `CostEstimate`."""

    def __init__(self, unit: str = "item") -> None:
        self.unit = unit
        self.line: tuple[float, float] | None = None  # the fit as of the last batch
        self._seen = 0
        self._w = self._wx = self._wy = self._wxx = self._wxy = 0.0
        self._residual = 0.0  # exponentially weighted mean absolute residual

    def predict(self, units: float) -> float | None:
        """Seconds for a batch of `units`, by the current line (None: no line yet)."""
        line = self.line
        return None if line is None else line[0] + line[1] * units

    def add(self, units: float, seconds: float) -> None:
        self._seen += 1
        if self._seen <= WARMUP:
            return
        predicted = self.predict(units)
        if predicted is not None and self._residual > 0:
            bound = CLIP * self._residual
            seconds = min(max(seconds, predicted - bound), predicted + bound)
            self._residual = DECAY * self._residual + (1 - DECAY) * abs(seconds - predicted)
        elif predicted is not None:
            self._residual = abs(seconds - predicted) or 1e-9
        self._w = DECAY * self._w + 1
        self._wx = DECAY * self._wx + units
        self._wy = DECAY * self._wy + seconds
        self._wxx = DECAY * self._wxx + units * units
        self._wxy = DECAY * self._wxy + units * seconds
        self.line = self._fit()

    def estimate(self) -> CostEstimate | None:
        """The current line as a `CostEstimate` (for stats), or None."""
        line = self.line
        if line is None:
            return None
        return CostEstimate(line[0], line[1], self.unit, self._seen - WARMUP)

    def _fit(self) -> tuple[float, float]:
        mean_x, mean_y = self._wx / self._w, self._wy / self._w
        variance = self._wxx / self._w - mean_x * mean_x
        if variance <= 1e-12 * max(1.0, mean_x * mean_x):
            per_unit = 0.0  # one batch size so far: the slope is unknown
        else:
            per_unit = max(0.0, (self._wxy / self._w - mean_x * mean_y) / variance)
        return max(0.0, mean_y - per_unit * mean_x), per_unit
