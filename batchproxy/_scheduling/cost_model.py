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

Paid for when used: `add` only notes a batch; the fit takes in the noted batches,
in order, when someone reads it (`line`, `predict`, `estimate`), or once
`_FOLD_EVERY` are waiting. The result is the same as fitting each batch at once.
"""

from __future__ import annotations

from .._stats import CostEstimate

__all__ = ["CostModel"]

WARMUP = 3
_FOLD_EVERY = 16  # batches noted before the fit takes them in unasked (a short pause)
DECAY = 0.98  # each batch's weight relative to the one after it (half-life ~34 batches)
CLIP = 4.0


class CostModel:
    """Feeds on `(units, seconds)` per batch. `line` is the current fit as
    `(fixed, per_unit)`, or None before the first batch after warm-up; `estimate()`
    is the same as a `CostEstimate`."""

    def __init__(self, unit: str = "item") -> None:
        self.unit = unit
        self._line: tuple[float, float] | None = None  # the fit as of the last batch taken in
        self._noted: list[tuple[float, float]] = []  # batches not taken in yet
        self._seen = 0
        self._w = self._wx = self._wy = self._wxx = self._wxy = 0.0
        self._residual = 0.0  # exponentially weighted mean absolute residual

    @property
    def line(self) -> tuple[float, float] | None:
        """The fit as `(fixed, per_unit)`, every batch noted taken in; None before the
        first batch after warm-up."""
        if self._noted:
            self._fold()
        return self._line

    def predict(self, units: float) -> float | None:
        """Seconds for a batch of `units`, by the current line (None: no line yet)."""
        line = self.line
        return None if line is None else line[0] + line[1] * units

    def add(self, units: float, seconds: float) -> None:
        """Note a batch of `units` that took `seconds`."""
        noted = self._noted
        noted.append((units, seconds))
        if len(noted) >= _FOLD_EVERY:
            self._fold()

    def _fold(self) -> None:
        """Take in the noted batches, in order, each against the line the ones before it
        made (in local variables: this runs once per batch of the proxy)."""
        noted, self._noted = self._noted, []
        seen, line, residual = self._seen, self._line, self._residual
        w, wx, wy, wxx, wxy = self._w, self._wx, self._wy, self._wxx, self._wxy
        for units, took in noted:
            seen += 1
            seconds = took
            if seen <= WARMUP:
                continue
            if line is not None:
                predicted = line[0] + line[1] * units
                if residual > 0:
                    bound = CLIP * residual
                    seconds = min(max(seconds, predicted - bound), predicted + bound)
                    residual = DECAY * residual + (1 - DECAY) * abs(seconds - predicted)
                else:
                    residual = abs(seconds - predicted) or 1e-9
            w = DECAY * w + 1
            wx = DECAY * wx + units
            wy = DECAY * wy + seconds
            wxx = DECAY * wxx + units * units
            wxy = DECAY * wxy + units * seconds
            line = _fit(w, wx, wy, wxx, wxy)
        self._seen, self._line, self._residual = seen, line, residual
        self._w, self._wx, self._wy, self._wxx, self._wxy = w, wx, wy, wxx, wxy

    def estimate(self) -> CostEstimate | None:
        """The current line as a `CostEstimate` (for stats), or None."""
        line = self.line  # (takes in what was noted, counting it in `_seen`)
        if line is None:
            return None
        return CostEstimate(line[0], line[1], self.unit, self._seen - WARMUP)


def _fit(w: float, wx: float, wy: float, wxx: float, wxy: float) -> tuple[float, float]:
    """The weighted least-squares line `(fixed, per_unit)` of the sums."""
    mean_x, mean_y = wx / w, wy / w
    variance = wxx / w - mean_x * mean_x
    if variance <= 1e-12 * max(1.0, mean_x * mean_x):
        per_unit = 0.0  # one batch size so far: the slope is unknown
    else:
        per_unit = max(0.0, (wxy / w - mean_x * mean_y) / variance)
    return max(0.0, mean_y - per_unit * mean_x), per_unit
