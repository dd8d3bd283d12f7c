"""Section 0 of `scaleout.py`: the machine, without batchproxy (the model's time per batch,
and what bare processes do side by side).
"""

from __future__ import annotations

import multiprocessing
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from benchmarks.scaleout import _gil_model
from benchmarks.scaleout._setup import BATCH_SIZE, WORKERS, Config

# -- 0. the machine ------------------------------------------------------------------------


@dataclass(frozen=True)
class MachineResult:
    work: int  # loop iterations per item
    item_ms: float  # median over batches of 16, in this process
    item_ms_min: float
    item_ms_max: float
    one_process_items_per_s: float
    two_processes_items_per_s: float
    ceiling: float  # two / one
    ceiling_rounds: list[float]


def calibrate(batches: int) -> list[float]:
    """Milliseconds per item, batch after batch of 16, in this process."""
    items = list(range(BATCH_SIZE))
    costs = []
    for _ in range(batches):
        started = time.perf_counter()
        _gil_model.busy(_gil_model.WORK, items)
        costs.append((time.perf_counter() - started) / BATCH_SIZE * 1e3)
    return costs


def bare_rate(pool: ProcessPoolExecutor, processes: int, seconds: float) -> float:
    """Items/s of `processes` bare processes running the model at once, summed."""
    futures = [pool.submit(_gil_model.spin, _gil_model.WORK, seconds) for _ in range(processes)]
    done: list[tuple[int, float]] = [future.result() for future in futures]
    return sum(items / elapsed for items, elapsed in done)


def measure_machine(config: Config) -> MachineResult:
    costs = calibrate(config.calibration_batches)
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(WORKERS, mp_context=context) as pool:
        bare_rate(pool, WORKERS, 0.3)  # both processes up and warm
        one: list[float] = []
        two: list[float] = []
        for index in range(config.ceiling_rounds):
            if index % 2:
                two.append(bare_rate(pool, 2, config.ceiling_seconds))
                one.append(bare_rate(pool, 1, config.ceiling_seconds))
            else:
                one.append(bare_rate(pool, 1, config.ceiling_seconds))
                two.append(bare_rate(pool, 2, config.ceiling_seconds))
    return MachineResult(
        work=_gil_model.WORK,
        item_ms=statistics.median(costs),
        item_ms_min=min(costs),
        item_ms_max=max(costs),
        one_process_items_per_s=statistics.fmean(one),
        two_processes_items_per_s=statistics.fmean(two),
        ceiling=sum(two) / sum(one),
        ceiling_rounds=[b / a for a, b in zip(one, two, strict=True)],
    )
