"""The soak of `benchmarks/soak/soak.py`, short: 20,000 requests through one proxy with random
cancellations, deadlines, per-item and batch errors and reconfigurations.

Every call ends exactly once, the callers' count of each outcome equals
`proxy.stats`'s, and nothing is left behind: the live tasks, futures and
batchproxy requests after the load are those before it. (RSS is not asserted
here: too noisy for 20,000 requests; the full soak reports it.)

And `--deadlines` (`soak.STEADY`), short: 20,000 calls, each with a deadline and
a 10 KB result, while the queue never empties (issue 16.1: served requests stayed
in the queue, and their results with them, until it emptied). There the live
requests are asserted flat at every checkpoint, and RSS too: the leak was about
200 MB at this size, and a healthy run grows by under 1 MB, so a 30 MB bound
holds the noise of this machine with room and still catches it.
"""

from __future__ import annotations

import asyncio
import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # (the benchmarks package)
from benchmarks.soak import _mix as soak  # (the load of soak.py)

REQUESTS = 20_000


@pytest.fixture(scope="module")
def result() -> soak.Result:
    return asyncio.run(soak.soak(soak.Config(requests=REQUESTS)))


def assert_every_call_ended_once(result: soak.Result) -> None:
    """Every call ended once, with its own outcome, as `proxy.stats` counts it too."""
    tally = result.tally
    assert tally.issued == tally.ended() == REQUESTS
    assert tally.wrong == 0  # no caller got another's result or another's error
    assert tally.unexpected == []
    for outcome, (callers, stats) in result.agreement().items():
        assert callers == stats, f"{outcome}: callers counted {callers}, proxy.stats {stats}"


def assert_left_as_found(result: soak.Result) -> None:
    """The live tasks, futures and requests after the load and after `aclose()` are
    those before it."""
    before = result.before
    for census in (result.after, result.closed):
        assert (census.tasks, census.futures, census.requests) == (
            before.tasks,
            before.futures,
            before.requests,
        )
        assert census.pending_futures == 0


def test_every_call_ended_once_and_the_callers_agree_with_the_stats(result: soak.Result) -> None:
    assert_every_call_ended_once(result)
    tally = result.tally
    assert result.stats["shed"] == 0
    assert (result.stats["queue_depth"], result.stats["in_flight"]) == (0, 0)
    # the chaos happened: every kind of ending, failed batches, reconfigurations
    assert min(tally.succeeded, tally.failed, tally.cancelled, tally.rejected, tally.timed_out)
    assert result.stats["failed_batches"] > 0
    assert result.reconfigurations > 0


def test_nothing_is_left_behind(result: soak.Result) -> None:
    assert_left_as_found(result)
    before = result.before
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


@pytest.fixture(scope="module")
def steady() -> soak.Result:
    return asyncio.run(soak.soak(replace(soak.STEADY, requests=REQUESTS)))


def test_deadlines_under_a_steady_backlog_every_call_got_its_own_result(
    steady: soak.Result,
) -> None:
    assert_every_call_ended_once(steady)
    assert steady.tally.succeeded == REQUESTS
    # the queue never emptied between the warm-up and the last call (the hooks' count
    # is exact here: requests leave the queue in batches alone)
    assert steady.min_queue_depth is not None
    assert steady.min_queue_depth > 0


def test_deadlines_under_a_steady_backlog_leave_nothing_behind(steady: soak.Result) -> None:
    assert_left_as_found(steady)
    concurrency = steady.config.concurrency
    assert len(steady.checkpoints) == steady.config.checkpoints
    for checkpoint in steady.checkpoints:  # flat: bounded by the callers, not the calls
        # each caller's call (queued, or in the one running batch) and dead entries, at
        # most as many as the live ones (or 64): requests ≤ queue depth + calls in flight
        assert checkpoint.unqueued <= concurrency, checkpoint
        assert checkpoint.requests <= 2 * concurrency, checkpoint
    assert steady.rss_growth_mb <= 30.0, [c.rss_mb for c in steady.checkpoints]
