"""Every feature in combination, against one oracle (DESIGN §4; issue 27).

Hypothesis draws a configuration (dedup and the cache, tenants, their weights and
queue limits, batch keys as an option and per call, allowed batch sizes cut or
padded, per-batch arguments, caller contexts, `isolate_errors`, `oom_backoff`,
priorities, aging, queue limits, the executor, a unary or a streaming model) and a
program of calls (`inference`, `inference_many`, `stream`, `submit` and
`inference_sync` from threads, with deadlines, cancellations, `configure()` under
load and `aclose()` mid-flight), runs it, and checks (tests/_combinations.py):

- every accepted call ends exactly once;
- its result was computed from its own item, key and arguments (results carry them);
- every context a model call sees belongs to that call's items, in order;
- every model call has an allowed size;
- the stats add up;
- a call that only joins a queued identical call is never refused (`QueueFull`);
- nothing is left running (tasks, threads).

The loop's examples run on looptime's virtual clock; those with threads in real time.
`BATCHPROXY_COMBINATIONS=2000` runs that many examples of each (CI: a couple of
minutes in all).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Hashable
from typing import Any

import looptime
import pytest
from _combinations import EXAMPLES, Call, Config, Program, check, configs, programs, run
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

HORIZON = 0.02  # seconds: arrivals, deadlines and the close within it


def combination_settings(default: int) -> settings:
    return settings(
        max_examples=EXAMPLES or default,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


def on_virtual_clock(config: Config, program: Program) -> None:
    loop = looptime.new_event_loop(start=0.0)
    try:
        tasks_before = len(asyncio.all_tasks(loop))
        result = loop.run_until_complete(
            asyncio.wait_for(run(config, program), timeout=3600)  # virtual: a hang fails fast
        )
        left = [t for t in asyncio.all_tasks(loop) if not t.done()]
        assert len(left) <= tasks_before, f"tasks left running: {left}"
    finally:
        loop.close()
    check(result)


def in_real_time(config: Config, program: Program) -> None:
    threads_before = set(threading.enumerate())
    result = asyncio.run(asyncio.wait_for(run(config, program), timeout=30))
    check(result)
    left = [t for t in set(threading.enumerate()) - threads_before if t.is_alive()]
    assert not left, f"threads left running: {left}"


@pytest.mark.virtual_clock
@combination_settings(300)
@given(data=st.data())
def test_every_combination_keeps_every_promise(data: st.DataObject) -> None:
    config = data.draw(configs(), label="config")
    program = data.draw(programs(config, HORIZON), label="program")
    on_virtual_clock(config, program)


@combination_settings(40)
@given(data=st.data())
def test_every_combination_with_threads(data: st.DataObject) -> None:
    """The same, with a `WorkerThread` and calls from plain threads, in real time."""
    config = data.draw(configs(threads=True), label="config")
    program = data.draw(programs(config, HORIZON, threads=True), label="program")
    in_real_time(config, program)
