"""The host's side of the soak through a model host: `host_proxy`, the factory the host
process imports (`python -m batchproxy.host benchmarks.soak._host:host_proxy`), a
`Chaotic` proxy counting what it accepts and answers into its counters file.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

from typing_extensions import override

import batchproxy
from benchmarks.soak import _mix
from benchmarks.soak._counters import HOST, Counters

# -- the host ------------------------------------------------------------------------------


class HostCounts(batchproxy.Listener):
    """The host proxy's counts, in `Counters` (read after a `SIGKILL` too)."""

    def __init__(self, counters: Counters) -> None:
        self.counters = counters

    @override
    def request_queued(self, proxy: str, queue_depth: int) -> None:
        self.counters.add("accepted")

    @override
    def request_rejected(self, proxy: str, count: int) -> None:
        self.counters.add("rejected", count)

    @override
    def request_shed(self, proxy: str) -> None:
        self.counters.add("shed")

    @override
    def request_finished(self, proxy: str, outcome: str, seconds: float) -> None:
        self.counters.add(outcome)


class HostChaotic(_mix.Chaotic):
    """`_mix.Chaotic` that reconfigures itself, as `_mix.Load.reconfigure` does (a client
    cannot), and writes its final `stats` to `final` when it closes."""

    def __init__(self, config: _mix.Config, counters: Counters, final: str) -> None:
        super().__init__(config)
        self.counters = counters
        self.final = final
        self.add_listener(HostCounts(counters))
        self._reconfigurer: asyncio.Task[None] | None = None

    @override
    async def start(self) -> None:
        await super().start()
        if self._reconfigurer is None:
            self._reconfigurer = asyncio.get_running_loop().create_task(self._reconfigure())

    async def _reconfigure(self) -> None:
        rng = random.Random(self.config.seed + 2)
        assert self.config.reconfigure_every_ms is not None
        low, high = self.config.reconfigure_every_ms
        while True:
            await asyncio.sleep(rng.uniform(low, high) / 1e3)
            self.configure(
                batch_size=rng.choice([8, 16, 32, 64, 128]),
                max_delay_ms=rng.choice([0.0, 0.5, 1.0, 2.0, 5.0]),
                max_concurrent_batches=rng.choice([1, 1, 2, 4]),
                max_queue_size=rng.choice([None, None, 300, 600, 1_000, 2_000]),
            )
            self.counters.add("reconfigurations")

    @override
    async def aclose(self, *, timeout: float | None = None) -> None:
        reconfigurer, self._reconfigurer = self._reconfigurer, None
        if reconfigurer is not None:
            reconfigurer.cancel()
            await asyncio.wait([reconfigurer])
        await super().aclose(timeout=timeout)
        stats = self.stats
        write_json(self.final, {key: getattr(stats, key) for key in _mix.STATS})


def write_json(path: str | Path, document: Any) -> None:
    Path(path).write_text(json.dumps(document))


def host_proxy() -> HostChaotic:
    """The factory `python -m batchproxy.host soak_host:host_proxy` calls (its files and
    seed in `$SOAK_COUNTERS`, `$SOAK_FINAL`, `$SOAK_SEED`)."""
    counters = Counters(os.environ["SOAK_COUNTERS"], HOST)
    config = replace(_mix.FULL, seed=int(os.environ["SOAK_SEED"]))
    return HostChaotic(config, counters, os.environ["SOAK_FINAL"])
