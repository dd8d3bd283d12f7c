"""`--model gpu-sim`: a model shaped like a GPU's, on the CPU (issue 39).

On a GPU the CPU's share of a forward pass is the Python that launches the kernels:
it holds the GIL, and a thread kept off the GIL launches later. The device then
works without the GIL and without the CPU. `GpuSim.encode` does both for a padded
batch of n token-id rows:

- the launch: a pure-Python spin that holds the GIL until the calling thread has
  spent LAUNCH_S of its own CPU time (`time.thread_time`; the row vectors are
  computed inside it), so a launch that waits for the GIL takes longer;
- the device: done DEVICE_S + DEVICE_PER_ROW_S * n after the launch began, waited
  for in `time.sleep` (the GIL released, no CPU used).

Its answers, `vectors()`, are unit vectors drawn from each row's real token ids
(padding is masked out) in exact integer arithmetic, so a row's vector is
bit-identical alone and in any batch, and the benchmark's correctness check holds
as it does for MiniLM. The tokenizer stays MiniLM's (`_common.load`), so tokenizing
is real CPU work wherever each stack does it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

# The GPU that gpu-sim stands for, in ONE place: these three reproduce bert-base in
# float32 on the H200 measured on 2026-11-26 (about 232 items/s one at a time, launch-
# bound: 4 ms a batch of one, 250/s here; about 3,200 items/s in batches of 64: 1 + 0.3 *
# 64 = 20.2 ms, 3,168/s here). The Python launch of a lone bert-base batch measured 4.4-
# 4.8 ms there (benchmarks/results/gpu-lone.json). GPU issue 41 re-fits them to a card.
LAUNCH_S = 0.004  # the Python launch: CPU seconds of the calling thread, GIL held
DEVICE_S = 0.001  # the device: done this long after the launch began...
DEVICE_PER_ROW_S = 0.0003  # ...plus this per row of the batch

NAME = "gpu-sim"
DESCRIPTION = (
    f"gpu-sim: MiniLM's tokenizer, a {LAUNCH_S * 1e3:g} ms GIL-bound launch, a device done "
    f"{DEVICE_S * 1e3:g} + {DEVICE_PER_ROW_S * 1e3:g} ms/row after it began"
)
DIMENSION = 384


def _mix(values: Any) -> Any:
    """splitmix64's finaliser on a uint64 array (wrapping arithmetic: exact)."""
    with np.errstate(over="ignore"):
        z = values ^ (values >> np.uint64(30))
        z = z * np.uint64(0xBF58476D1CE4E5B9)
        z = z ^ (z >> np.uint64(27))
        z = z * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


_LANES = _mix(np.arange(1, DIMENSION + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15))


def vectors(input_ids: Any, attention_mask: Any) -> Any:
    """(n, L) token ids and mask (padding: mask 0) -> (n, DIMENSION) float32 unit vectors.

    Each row's vector depends on its real tokens only, in order: a seed is their
    position-weighted sum modulo 2**64, hashed into DIMENSION integers; the row is
    those integers over their norm (computed exactly, then one float64 division).
    No sum runs over a padded axis in floating point, so a row comes out the same
    bits whatever its batch."""
    ids = np.asarray(input_ids).astype(np.uint64)
    mask = np.asarray(attention_mask).astype(np.uint64)
    length = ids.shape[1]
    with np.errstate(over="ignore"):
        weights = _mix(np.arange(1, length + 1, dtype=np.uint64) * np.uint64(0xD1B54A32D192ED03))
        seeds = (ids * mask * weights).sum(axis=1, dtype=np.uint64)
        seeds = seeds + mask.sum(axis=1, dtype=np.uint64) * np.uint64(0x632BE59BD9B4E019)
        hashed = _mix(seeds[:, None] ^ _LANES[None, :])
    integers = (hashed >> np.uint64(48)).astype(np.int64) - (1 << 15)  # in [-2**15, 2**15)
    squares = (integers * integers).sum(axis=1)  # exact: at most 384 * 2**30
    squares = np.maximum(squares, 1)  # (all 384 zero: never, but no division by zero)
    unit = integers / np.sqrt(squares.astype(np.float64))[:, None]
    return unit.astype(np.float32)


class GpuSim:
    """The model: `encode(input_ids, attention_mask)` runs a batch as a GPU would (the
    module's docstring), on the calling thread, and returns its vectors as an
    (n, DIMENSION) float32 torch tensor.

    The clocks and the sleep are parameters for the tests; the constants are the
    module's."""

    def __init__(
        self,
        *,
        launch_s: float = LAUNCH_S,
        device_s: float = DEVICE_S,
        device_per_row_s: float = DEVICE_PER_ROW_S,
        cpu_clock: Callable[[], float] = time.thread_time,
        wall_clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.launch_s = launch_s
        self.device_s = device_s
        self.device_per_row_s = device_per_row_s
        self._cpu_clock = cpu_clock
        self._wall_clock = wall_clock
        self._sleep = sleep

    def batch_seconds(self, rows: int) -> float:
        """When the device is done with a batch of `rows`, from the launch's start."""
        return self.device_s + self.device_per_row_s * rows

    def encode(self, input_ids: Any, attention_mask: Any) -> Any:
        import torch

        began = self._wall_clock()
        launched = self._cpu_clock() + self.launch_s
        result = vectors(input_ids, attention_mask)
        while self._cpu_clock() < launched:  # the launch: Python, on the GIL
            pass
        left = began + self.batch_seconds(len(result)) - self._wall_clock()
        if left > 0:
            self._sleep(left)  # the device: no GIL, no CPU
        return torch.from_numpy(result)
