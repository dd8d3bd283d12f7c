"""The soak of `benchmarks/soak.py`, short: 20,000 requests through one proxy with random
cancellations, deadlines, per-item and batch errors and reconfigurations.

Every call ends exactly once, the callers' count of each outcome equals
`proxy.stats`'s, and nothing is left behind: the live tasks, futures and
batchproxy requests after the load are those before it. (RSS is not asserted
here: too noisy for 20,000 requests; the full soak reports it.)
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import soak

REQUESTS = 20_000


@pytest.fixture(scope="module")
def result() -> soak.Result:
    return asyncio.run(soak.soak(soak.Config(requests=REQUESTS)))


def test_every_call_ended_once_and_the_callers_agree_with_the_stats(result: soak.Result) -> None:
    tally = result.tally
    assert tally.issued == tally.ended() == REQUESTS
    assert tally.wrong == 0  # no caller got another's result or another's error
    assert tally.unexpected == []
    for outcome, (callers, stats) in result.agreement().items():
        assert callers == stats, f"{outcome}: callers counted {callers}, proxy.stats {stats}"
    assert result.stats["shed"] == 0
    assert (result.stats["queue_depth"], result.stats["in_flight"]) == (0, 0)
    # the chaos happened: every kind of ending, failed batches, reconfigurations
    assert min(tally.succeeded, tally.failed, tally.cancelled, tally.rejected, tally.timed_out)
    assert result.stats["failed_batches"] > 0
    assert result.reconfigurations > 0


def test_nothing_is_left_behind(result: soak.Result) -> None:
    before, after, closed = result.before, result.after, result.closed
    assert (after.tasks, after.futures, after.requests) == (
        before.tasks,
        before.futures,
        before.requests,
    )
    assert (closed.tasks, closed.futures, closed.requests) == (
        before.tasks,
        before.futures,
        before.requests,
    )
    assert after.pending_futures == closed.pending_futures == 0
    concurrency = result.config.concurrency
    assert len(result.checkpoints) == result.config.checkpoints
    for checkpoint in result.checkpoints:  # bounded by the load while it runs, not the total
        # the calls in flight, at most as many dead queue entries (the queue compacts
        # beyond that), the members of running batches whose callers have moved on
        assert checkpoint.requests <= 3 * concurrency
        assert checkpoint.futures <= 3 * concurrency
        # each caller, its call (or its last one, while it backs off after QueueFull),
        # calls held by cancel timers already cancelled (asyncio drops those lazily),
        # the reconfigurer, a few batches
        assert checkpoint.tasks <= before.tasks + 3 * concurrency
