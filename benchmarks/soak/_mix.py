"""The soak's load (`soak.py`): a proxy that fails, stalls and reconfigures itself at
random (`Chaotic`), the callers' mix of calls, cancellations and deadlines (`Load`), and
what they count (`Tally`, `Census`, `Result`). `soak(config)` runs it; `soak_host.py`
runs the same `Load` through a model host.
"""

from __future__ import annotations

import asyncio
import gc
import os
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from typing_extensions import override

import batchproxy

TARGET_RSS_GROWTH_MB = 20.0
STATS = [
    *("requests", "succeeded", "errors", "timed_out", "cancelled", "rejected", "shed"),
    *("batches", "failed_batches", "items", "queue_depth", "in_flight"),
]
"""The counters of `proxy.stats` the report keeps."""


@dataclass(frozen=True)
class Config:
    requests: int = 1_000_000
    concurrency: int = 1_000
    seed: int = 7
    checkpoints: int = 10  # one per tenth of the calls; the first ends the warm-up
    cancel_rate: float = 0.05
    deadline_rate: float = 0.10
    bad_rate: float = 0.03  # an Exception in the job's slot
    boom_rate: float = 0.0005  # the model raises for the job's batch
    short_rate: float = 0.0002  # the model returns one result too few
    slow_batch_rate: float = 0.2  # batches that take slow_batch_ms instead of a loop turn
    slow_batch_ms: tuple[float, float] = (0.2, 3.0)
    priorities: int = 3  # 0 to 2
    reconfigure_every_ms: tuple[float, float] | None = (5.0, 50.0)  # None: never
    rejected_backoff_ms: tuple[float, float] = (5.0, 20.0)  # a caller refused waits this long
    unavailable_backoff_ms: tuple[float, float] = (1000.0, 2000.0)  # after HostUnavailable
    timeout: float | None = None  # every call's deadline (deadline_rate's replace it)
    result_bytes: int = 0  # each result carries a fresh bytes object of this size
    # record the smallest queue depth at a batch start, told by listener hooks: exact
    # only while requests leave the queue in batches alone (no cancellations, deadlines)
    watch_depth: bool = False
    # the proxy
    batch_size: int = 64
    max_delay_ms: float = 2.0
    max_concurrent_batches: int | None = None
    max_queue_size: int | None = 1_000


FULL = Config()
QUICK = replace(FULL, requests=20_000)
STEADY = Config(
    concurrency=256,
    cancel_rate=0.0,
    deadline_rate=0.0,
    bad_rate=0.0,
    boom_rate=0.0,
    short_rate=0.0,
    priorities=1,  # as in issue 16 (the leak was slower with three: each level emptied at times)
    # every batch takes 1 to 2 ms (at least a tick of uvloop's millisecond timers): a model
    # answering in one loop turn keeps pace with its callers' way back to the queue, and
    # then the queue empties or not as the loop orders its callbacks (on uvloop it did)
    slow_batch_rate=1.0,
    slow_batch_ms=(1.0, 2.0),
    reconfigure_every_ms=None,
    timeout=30.0,
    result_bytes=10_000,
    watch_depth=True,
    max_concurrent_batches=1,
)
"""Issue 16: every call with a deadline, none missed, the queue never empty."""
STEADY_QUICK = replace(STEADY, requests=QUICK.requests)


class Job:
    """One call's item."""

    __slots__ = ("kind", "n")

    def __init__(self, n: int, kind: str) -> None:
        self.n = n
        self.kind = kind


Answer = tuple[int, bytes]
"""Job n's result: n, and `result_bytes` bytes."""


class Chaotic(batchproxy.Proxy[Job, Answer]):
    """Answers job n with (n, payload), after a loop turn or a few ms; fails jobs and
    batches as their kinds say."""

    def __init__(self, config: Config) -> None:
        super().__init__(
            batch_size=config.batch_size,
            max_delay_ms=config.max_delay_ms,
            max_concurrent_batches=config.max_concurrent_batches,
            max_queue_size=config.max_queue_size,
            name="soak",
        )
        self.config = config
        self.random = random.Random(config.seed + 1)

    @override
    async def _inference(self, items: list[Job]) -> list[Answer | Exception]:
        if self.random.random() < self.config.slow_batch_rate:
            await asyncio.sleep(self.random.uniform(*self.config.slow_batch_ms) / 1e3)
        else:
            await asyncio.sleep(0)
        kinds = {job.kind for job in items}
        if "boom" in kinds:
            raise RuntimeError("boom")
        size = self.config.result_bytes
        results: list[Answer | Exception] = [
            ValueError(job.n) if job.kind == "bad" else (job.n, b"r" * size) for job in items
        ]
        return results[:-1] if "short" in kinds else results


@dataclass
class Tally:
    """How the calls ended, as their callers saw it."""

    issued: int = 0
    succeeded: int = 0
    failed: int = 0
    cancelled: int = 0
    rejected: int = 0
    timed_out: int = 0
    unavailable: int = 0  # HostUnavailable: through a model host that is down or died
    wrong: int = 0  # got a result that was not its own (cross-talk); must stay 0
    unexpected: list[str] = field(default_factory=list)  # errors of no expected kind

    def ended(self) -> int:
        return (
            self.succeeded
            + self.failed
            + self.cancelled
            + self.rejected
            + self.timed_out
            + self.unavailable
        )


@dataclass(frozen=True)
class Census:
    """What is alive at one moment."""

    issued: int
    seconds: float
    rss_mb: float
    tasks: int
    futures: int  # asyncio futures that are not tasks
    pending_futures: int
    requests: int  # batchproxy requests (one per accepted call not yet forgotten)
    queue_depth: int  # the live requests in the queue (proxy.stats.queue_depth)

    @property
    def unqueued(self) -> int:
        """The requests not live in the queue: in batches, or dead entries left in it."""
        return self.requests - self.queue_depth


def rss_mb() -> float:
    """Resident set size now, in MB (peak RSS where /proc is missing)."""
    try:
        with open("/proc/self/statm") as statm:
            pages = int(statm.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 1e6
    except (OSError, ValueError):  # not Linux: the peak is the best there is
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / 1e6 if sys.platform == "darwin" else peak / 1e3


def census(issued: int, started: float, queue_depth: int) -> Census:
    gc.collect()
    tasks = futures = pending = requests = 0
    for thing in gc.get_objects():
        kind = type(thing)  # not isinstance: that reads __class__, which lazy modules warn on
        if issubclass(kind, asyncio.Task):
            tasks += 1
        elif issubclass(kind, asyncio.Future):
            futures += 1
            pending += not thing.done()
        elif kind.__module__ == "batchproxy._scheduling.queue" and kind.__name__ == "Request":
            requests += 1
    seconds = time.perf_counter() - started
    return Census(issued, seconds, rss_mb(), tasks, futures, pending, requests, queue_depth)


@dataclass
class Result:
    config: Config
    seconds: float
    tally: Tally
    stats: dict[str, Any]
    before: Census
    checkpoints: list[Census]
    after: Census
    closed: Census
    reconfigurations: int
    min_queue_depth: int | None  # at a batch start, from the warm-up to the last call

    @property
    def rss_growth_mb(self) -> float:
        """The highest RSS after the warm-up checkpoint, minus RSS at it."""
        warm, *later = self.checkpoints
        return max((c.rss_mb for c in later), default=warm.rss_mb) - warm.rss_mb

    def agreement(self) -> dict[str, tuple[int, int]]:
        """Each outcome as (counted by the callers, counted by proxy.stats)."""
        t, s = self.tally, self.stats
        return {
            "succeeded": (t.succeeded, s["succeeded"]),
            "failed": (t.failed, s["errors"]),
            "cancelled": (t.cancelled, s["cancelled"]),
            "rejected": (t.rejected, s["rejected"]),
            "timed out": (t.timed_out, s["timed_out"]),
            "issued": (t.issued, s["requests"] + s["rejected"] + s["shed"]),
        }


def plan(rng: random.Random, config: Config, n: int) -> tuple[Job, float | None, float | None, int]:
    """Job n: (the job, its timeout, when to cancel its caller, its priority)."""
    roll = rng.random()
    if roll < config.boom_rate:
        kind = "boom"
    elif roll < config.boom_rate + config.short_rate:
        kind = "short"
    elif roll < config.boom_rate + config.short_rate + config.bad_rate:
        kind = "bad"
    else:
        kind = "ok"
    timeout, cancel_after = config.timeout, None
    if rng.random() < config.deadline_rate:
        timeout = 0.0002 * 100 ** rng.random()  # 0.2 to 20 ms, log-uniform
    if rng.random() < config.cancel_rate:
        cancel_after = rng.uniform(0.00005, 0.003)
    return Job(n, kind), timeout, cancel_after, rng.randrange(config.priorities)


class Load(batchproxy.Listener):
    """The callers, the canceller and the reconfigurer around one proxy (and, as its
    listener, the watcher of its queue depth at batch starts)."""

    def __init__(self, config: Config, proxy: Chaotic, *, progress: bool) -> None:
        self.config = config
        self.proxy = proxy
        self.progress = progress
        self.rng = random.Random(config.seed)
        self.tally = Tally()
        self.checkpoints: list[Census] = []
        self.every = max(1, config.requests // config.checkpoints)
        self.reconfigurations = 0
        self.queue_depth = 0  # as the hooks tell it, when watched (watch_depth)
        self.min_queue_depth: int | None = None
        self.started = time.perf_counter()

    async def run(self) -> float:
        """Every caller until `requests` calls are made and ended; the seconds it took."""
        self.started = time.perf_counter()
        reconfigurer = asyncio.create_task(self.reconfigure())
        await asyncio.gather(*(self.caller() for _ in range(self.config.concurrency)))
        seconds = time.perf_counter() - self.started
        reconfigurer.cancel()
        await asyncio.wait([reconfigurer])
        return seconds

    def census(self) -> Census:
        stats = getattr(self.proxy, "stats", None)  # (a RemoteProxy has none: its host does)
        return census(self.tally.issued, self.started, 0 if stats is None else stats.queue_depth)

    @override
    def request_queued(self, proxy: str, queue_depth: int) -> None:
        self.queue_depth = queue_depth

    @override
    def batch_started(self, proxy: str, size: int, queue_waits: Sequence[float]) -> None:
        # the queue less the batch: exact while requests leave the queue only in batches
        # (none cancelled or timed out); from the warm-up to the last call, as the queue
        # fills from empty and drains after
        self.queue_depth -= size
        if 0 < len(self.checkpoints) < self.config.checkpoints:
            low = self.min_queue_depth
            self.min_queue_depth = min(self.queue_depth, self.queue_depth if low is None else low)

    async def caller(self) -> None:
        """Call after call; count how each ended."""
        config, tally, rng = self.config, self.tally, self.rng
        loop = asyncio.get_running_loop()
        while tally.issued < config.requests:
            job, timeout, cancel_after, priority = plan(rng, config, tally.issued)
            tally.issued += 1
            if tally.issued % self.every == 0:
                self.checkpoint()
            call = asyncio.create_task(
                self.proxy.inference(job, timeout=timeout, priority=priority)
            )
            canceller = None
            if cancel_after is not None:
                # armed once the call has taken its first step (reached the proxy): a due
                # timer may run before a new task's first step (uvloop runs timers first),
                # and a call cancelled before it starts never reaches the proxy to count
                await asyncio.sleep(0)
                canceller = loop.call_later(cancel_after, call.cancel)
            try:
                outcome = await self.ended(call, job)
            finally:
                if canceller is not None:
                    canceller.cancel()
            if outcome == "rejected":  # as a client told to retry later would, not at once
                await asyncio.sleep(rng.uniform(*config.rejected_backoff_ms) / 1e3)
            elif outcome == "unavailable":  # (a model host down: a web worker's 503, Retry-After)
                await asyncio.sleep(rng.uniform(*config.unavailable_backoff_ms) / 1e3)

    async def ended(self, call: asyncio.Task[Answer], job: Job) -> str:
        """Await one call; count and return how it ended."""
        tally = self.tally
        try:
            got = await call
        except asyncio.CancelledError:
            if not call.cancelled():
                raise  # this caller itself is being cancelled
            tally.cancelled += 1
            return "cancelled"
        except batchproxy.QueueFull:
            tally.rejected += 1
            return "rejected"
        except batchproxy.DeadlineExceeded:
            tally.timed_out += 1
            return "timed out"
        except batchproxy.HostUnavailable:
            tally.unavailable += 1
            return "unavailable"
        except batchproxy.BatchSizeMismatch:
            tally.failed += 1  # a batch with a "short" job
            return "failed"
        except ValueError as exc:
            tally.failed += 1  # a "bad" job: its own slot, carrying its own number
            tally.wrong += exc.args != (job.n,)
            return "failed"
        except Exception as exc:
            tally.failed += 1  # a batch with a "boom" job, or something unexpected
            if not (type(exc) is RuntimeError and exc.args == ("boom",)):
                tally.unexpected.append(repr(exc))
            return "failed"
        if got[0] != job.n:
            tally.wrong += 1
            return "wrong"
        tally.succeeded += 1
        return "succeeded"

    async def reconfigure(self) -> None:
        rng = self.rng
        if self.config.reconfigure_every_ms is None:
            return
        low, high = self.config.reconfigure_every_ms
        while True:
            await asyncio.sleep(rng.uniform(low, high) / 1e3)
            self.proxy.configure(
                batch_size=rng.choice([8, 16, 32, 64, 128]),
                max_delay_ms=rng.choice([0.0, 0.5, 1.0, 2.0, 5.0]),
                max_concurrent_batches=rng.choice([1, 1, 2, 4]),
                max_queue_size=rng.choice([None, None, 300, 600, 1_000, 2_000]),
            )
            self.reconfigurations += 1

    def checkpoint(self) -> None:
        last = self.census()
        self.checkpoints.append(last)
        if self.progress:
            print(
                f"  {last.issued:>9,} calls  {last.seconds:6.1f} s  RSS {last.rss_mb:6.1f} MB  "
                f"tasks {last.tasks:,}  futures {last.futures:,}  requests {last.requests:,}  "
                f"queued {last.queue_depth:,}",
                file=sys.stderr,
            )


async def soak(config: Config, *, progress: bool = False) -> Result:
    """Run the load on a fresh proxy; census before, during, after, and after `aclose()`."""
    proxy = Chaotic(config)
    await proxy.start()
    load = Load(config, proxy, progress=progress)
    if config.watch_depth:
        proxy.add_listener(load)
    before = load.census()
    seconds = await load.run()
    await asyncio.sleep(0)  # a fresh loop turn: the callback that woke us is let go
    stats = proxy.stats
    after = load.census()
    await proxy.aclose()
    closed = load.census()
    return Result(
        config=config,
        seconds=seconds,
        tally=load.tally,
        stats={key: getattr(stats, key) for key in STATS},
        before=before,
        checkpoints=load.checkpoints,
        after=after,
        closed=closed,
        reconfigurations=load.reconfigurations,
        min_queue_depth=load.min_queue_depth,
    )
