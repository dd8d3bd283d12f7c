"""What the scheduling benchmark runs: the model's cost, the workloads and targets, the
run's sizes (`Config`), and the yardsticks (the minimal hand-written batcher, a tally
of batches).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from typing_extensions import Self, override

from batchproxy import Listener

# -- workloads and targets -------------------------------------------------------------


def cost(n: int) -> float:
    """Seconds the simulated model takes for a batch of n."""
    return 0.010 + 0.0002 * n


SWEEP_BATCH = 32
SWEEP_LOADS = (0.30, 0.60, 0.90)
FIXED_DELAYS_MS = (0.0, 1.0, 2.0, 5.0, 10.0)
ADAPTIVE_DELAYS_MS = (5.0, 10.0)
DEFAULT_DELAY_MS = 5.0  # the adaptive setting held to the targets
TIE = 0.001  # throughputs within 0.1 % of the best count as equal

CLOSED_CALLERS = 150
CLOSED_BATCH = 64

CPU_BATCH = 64
IDLE_DELAY_MS = 5.0
IDLE_GAP_S = 0.020  # the quiet spell the target is judged at
IDLE_QUIET_S = (0.001, 0.005, IDLE_GAP_S)

TARGET_THROUGHPUT_VS_BEST = 0.98
TARGET_CLOSED_SHARE = 0.97
TARGET_MINIMAL_RATIO = 1.3  # batchproxy's CPU per request / the no-window minimal batcher's
TARGET_IDLE_FLOOR_RATIO = 2.0  # idle added p50 / the no-window minimal batcher's (20 ms quiet)
NO_WINDOW = "minimal batcher, no window"


@dataclass(frozen=True)
class Config:
    sweep_seconds: float
    closed_sim_seconds: float
    closed_real_seconds: float
    cpu_repetitions: int
    cpu_rounds: int  # rounds of CALLERS concurrent requests per repetition
    cpu_warmup_rounds: int
    idle_samples: int
    idle_warmup: int


FULL = Config(
    sweep_seconds=20.0,
    closed_sim_seconds=10.0,
    closed_real_seconds=5.0,
    cpu_repetitions=9,
    cpu_rounds=20,
    cpu_warmup_rounds=5,
    idle_samples=200,
    idle_warmup=20,
)
QUICK = Config(
    sweep_seconds=3.0,
    closed_sim_seconds=2.0,
    closed_real_seconds=1.0,
    cpu_repetitions=3,
    cpu_rounds=3,
    cpu_warmup_rounds=1,
    idle_samples=30,
    idle_warmup=5,
)


# -- models and batchers ---------------------------------------------------------------

BatchModel = Callable[[list[Any]], Awaitable[list[Any]]]


class MinimalBatcher:
    """A hand-written batcher, as one would write it: callers append to a deque and
    set an event; one collector task takes up to `batch_size`, waits up to
    `max_delay_ms` (from when it starts a batch) for the rest, calls the model and
    sets each caller's future."""

    def __init__(self, model: BatchModel, batch_size: int, max_delay_ms: float) -> None:
        self._model = model
        self._batch_size = batch_size
        self._max_delay = max_delay_ms / 1e3
        self._pending: deque[tuple[Any, asyncio.Future[Any]]] = deque()
        self._arrived = asyncio.Event()
        self._collector: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Self:
        self._collector = asyncio.create_task(self._collect())
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._collector is not None:
            self._collector.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._collector

    async def inference(self, item: Any) -> Any:
        future = asyncio.get_running_loop().create_future()
        self._pending.append((item, future))
        self._arrived.set()
        return await future

    async def _collect(self) -> None:
        loop = asyncio.get_running_loop()
        pending = self._pending
        while True:
            while not pending:
                self._arrived.clear()
                await self._arrived.wait()
            deadline = loop.time() + self._max_delay
            while len(pending) < self._batch_size and (left := deadline - loop.time()) > 0:
                self._arrived.clear()
                try:
                    await asyncio.wait_for(self._arrived.wait(), left)
                except asyncio.TimeoutError:
                    break
            batch = [pending.popleft() for _ in range(min(len(pending), self._batch_size))]
            results = await self._model([item for item, _ in batch])
            for (_, future), result in zip(batch, results, strict=True):
                if not future.done():
                    future.set_result(result)


class Tally(Listener):
    """A listener that does a little: counts batches and finished requests."""

    def __init__(self) -> None:
        self.batches = 0
        self.finished = 0

    @override
    def batch_started(self, proxy: str, size: int, queue_waits: Sequence[float]) -> None:
        self.batches += 1

    @override
    def request_finished(self, proxy: str, outcome: str, seconds: float) -> None:
        self.finished += 1
