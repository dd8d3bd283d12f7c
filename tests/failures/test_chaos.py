"""Property test of the guarantees of docs/failures.md under chaos, on a virtual clock.

Random arrivals, priorities, deadlines, caller cancellations, per-item errors,
batch errors (Exception, BaseException, a stray CancelledError), wrong result
counts, a bounded queue, and `aclose()` mid-stream; and from outside the proxy,
batch tasks cancelled at random moments (also before their first step, as
"cancel every other task" does) and listeners that raise (`Exception`,
`CancelledError`, `GeneratorExit`) from every hook. Whatever happens, every call
ends exactly once, with its own result or an error its batch explains; nothing
is dispatched after its caller left; nothing hangs; nothing is left running; the
counters add up.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import looptime
import pytest
from _support import RaisingListener, Recorder, batch_tasks, cancel_batches_before_they_run
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from typing_extensions import override

import batchproxy

KINDS = ["ok"] * 6 + ["bad", "boom", "stop", "cancel", "count"]


EPS = 2e-6  # looptime rounds the virtual clock to 1 µs
NEVER_CALLED = "cancelled before calling"


class Stop(BaseException):
    """A BaseException that is not an Exception, raised by the model."""


@dataclass(frozen=True)
class Call:
    id: int
    at: float
    kind: str
    priority: int
    timeout: float | None
    cancel_after: float | None


class ThreadedModel(batchproxy.Proxy[Call, Any]):
    """A plain-`def` model: runs on the proxy's worker thread, sleeping for real."""

    def __init__(self, *, delay: float, **options: Any) -> None:
        super().__init__(**options)
        self.delay = delay
        self.batches: list[list[Call]] = []
        self.started_at: list[float] = []

    @override
    def _inference(self, items: list[Call]) -> Sequence[Any]:
        self.batches.append(list(items))
        self.started_at.append(time.monotonic())
        time.sleep(self.delay)
        return respond(items)


Model = Recorder | ThreadedModel


def respond(items: list[Call]) -> Sequence[Any]:
    kinds = {c.kind for c in items}
    if "boom" in kinds:
        raise RuntimeError("boom")
    if "stop" in kinds:
        raise Stop
    if "cancel" in kinds:
        raise asyncio.CancelledError
    if "count" in kinds:
        return [("out", c.id) for c in items][:-1]
    return [ValueError(c.id) if c.kind == "bad" else ("out", c.id) for c in items]


def batch_error(batch: list[Call]) -> type[BaseException] | None:
    """The error every caller of this batch gets, if the batch fails as a whole."""
    kinds = {c.kind for c in batch}
    for kind, error in [
        ("boom", RuntimeError),
        ("stop", batchproxy.InferenceError),
        ("cancel", batchproxy.InferenceError),
        ("count", batchproxy.BatchSizeMismatch),
    ]:
        if kind in kinds:
            return error
    return None


@dataclass(frozen=True)
class Sabotage:
    """What happens to the proxy from outside: a listener that raises `listener` from
    every hook; the batch tasks started `cancel_starts`-th (0-based) cancelled before
    their first step; every batch task in flight cancelled at `cancel_at` seconds."""

    listener: type[BaseException] | None = None
    cancel_starts: frozenset[int] = frozenset()
    cancel_at: tuple[float, ...] = ()

    @property
    def cancels_batches(self) -> bool:
        return bool(self.cancel_starts or self.cancel_at)


NO_SABOTAGE = Sabotage()


@dataclass(frozen=True)
class Case:
    """One chaos run: the calls, the proxy's options, the model's delay, when to close,
    and what is done to the proxy from outside."""

    calls: list[Call]
    options: dict[str, Any]
    model_delay: float
    close_at: float | None
    sabotage: Sabotage = NO_SABOTAGE


def cases(horizon: float, max_calls: int, delays: list[float]) -> st.SearchStrategy[Case]:
    """Calls arriving within `horizon` seconds, with deadlines and cancellations on the
    same scale, against random proxy options, and maybe a close mid-stream."""
    call = st.tuples(
        st.floats(0, horizon),
        st.sampled_from(KINDS),
        st.integers(0, 2),
        st.none() | st.floats(0.001, horizon / 2),
        st.none() | st.floats(0, horizon / 2),
    )
    options = st.fixed_dictionaries(
        {
            "batch_size": st.integers(1, 8),
            "max_delay_ms": st.sampled_from([0.0, 1.0, 5.0, 20.0]),
            "max_concurrent_batches": st.integers(1, 3),
            "max_queue_size": st.none() | st.integers(1, 20),
            "window": st.sampled_from(["adaptive", "fixed"]),
            "aging_ms": st.none() | st.sampled_from([1.0, 10.0]),
            "shed_late": st.booleans(),
        }
    )
    sabotage = st.builds(
        Sabotage,
        st.sampled_from([None, RuntimeError, asyncio.CancelledError, GeneratorExit]),
        st.frozensets(st.integers(0, 10), max_size=3),
        st.lists(st.floats(0, horizon * 1.5), max_size=3).map(tuple),
    )
    return st.builds(
        Case,
        st.lists(call, min_size=1, max_size=max_calls).map(
            lambda raw: [Call(i, *fields) for i, fields in enumerate(raw)]
        ),
        options,
        st.sampled_from(delays),
        st.none() | st.floats(0, horizon * 1.5),
        st.just(NO_SABOTAGE) | sabotage,
    )


def chaos_settings(examples_variable: str, default: int) -> settings:
    return settings(
        max_examples=int(os.environ.get(examples_variable, str(default))),
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )


@pytest.mark.virtual_clock
@chaos_settings("CHAOS_EXAMPLES", 200)
@given(case=cases(horizon=0.2, max_calls=60, delays=[0.0, 0.001, 0.01, 0.05]))
def test_every_call_ends_once_with_its_own_outcome(case: Case) -> None:
    loop = looptime.new_event_loop(start=0.0)
    try:
        proxy, outcomes, closed_at = loop.run_until_complete(
            asyncio.wait_for(
                scenario(
                    case.calls,
                    Recorder(respond, delay=case.model_delay, **case.options),
                    case.close_at,
                    case.sabotage,
                ),
                timeout=3600,  # virtual seconds: a hang fails here, fast
            )
        )
    finally:
        loop.close()
    check(case.calls, proxy, outcomes, closed_at, case.options["batch_size"], case.sabotage)


def sabotage_proxy(proxy: Model, sabotage: Sabotage) -> None:
    """Add the listener and the cancellations before first steps (before the proxy
    binds: the scheduler keeps the `_start_batch` it finds then)."""
    if sabotage.listener is not None:
        proxy.add_listener(RaisingListener(sabotage.listener))
    if sabotage.cancel_starts:
        cancel_batches_before_they_run(proxy, sabotage.cancel_starts.__contains__)


async def scenario(
    calls: list[Call], proxy: Model, close_at: float | None, sabotage: Sabotage = NO_SABOTAGE
) -> tuple[Model, dict[int, list[Any]], float | None]:
    loop = asyncio.get_running_loop()
    start = loop.time()
    tasks_before = asyncio.all_tasks()
    outcomes: dict[int, list[Any]] = {c.id: [] for c in calls}
    closed_at: list[float] = []
    sabotage_proxy(proxy, sabotage)

    async def caller(call: Call) -> None:
        try:
            await asyncio.sleep(call.at)
        except asyncio.CancelledError:
            outcomes[call.id].append(NEVER_CALLED)
            raise
        try:
            result = await proxy.inference(call, timeout=call.timeout, priority=call.priority)
        except BaseException as exc:
            outcomes[call.id].append(exc)
            if not isinstance(exc, Exception):
                raise
        else:
            outcomes[call.id].append(result)

    async def canceller(task: asyncio.Task[None], after: float) -> None:
        await asyncio.sleep(after)
        task.cancel()

    async def closer(at: float) -> None:
        await asyncio.sleep(at)
        closed_at.append(loop.time() - start)
        await proxy.aclose()

    async def batch_canceller(at: float) -> None:
        await asyncio.sleep(at)
        for task in batch_tasks(proxy):
            task.cancel()  # running, or not started yet

    tasks = []
    helpers = []
    for call in calls:
        task = asyncio.create_task(caller(call))
        tasks.append(task)
        if call.cancel_after is not None:
            helpers.append(asyncio.create_task(canceller(task, call.at + call.cancel_after)))
    if close_at is not None:
        helpers.append(asyncio.create_task(closer(close_at)))
    helpers += [asyncio.create_task(batch_canceller(at)) for at in sabotage.cancel_at]
    await asyncio.gather(*tasks, *helpers, return_exceptions=True)
    await proxy.aclose()
    leftover = asyncio.all_tasks() - tasks_before
    assert not leftover, leftover
    proxy.started_at = [t - start for t in proxy.started_at]
    return proxy, outcomes, closed_at[0] if closed_at else None


def check(
    calls: list[Call],
    proxy: Model,
    outcomes: dict[int, list[Any]],
    closed_at: float | None,
    batch_size: int,
    sabotage: Sabotage = NO_SABOTAGE,
    *,
    exact_clock: bool = True,
) -> None:
    """The guarantees, checked from the outside. `exact_clock`: times are virtual, so
    "never dispatched after its deadline / its caller left / the close" is exact."""
    batch_of: dict[int, int] = {}
    for index, batch in enumerate(proxy.batches):
        assert 1 <= len(batch) <= batch_size
        for call in batch:
            assert call.id not in batch_of, "an item was sent to the model twice"
            batch_of[call.id] = index

    for call in calls:
        assert len(outcomes[call.id]) == 1, f"call {call.id} ended {len(outcomes[call.id])} times"
        outcome = outcomes[call.id][0]
        index = batch_of.get(call.id)
        if index is not None and exact_clock:
            started = proxy.started_at[index]
            if call.timeout is not None:  # never dispatched after its deadline
                assert started <= call.at + call.timeout + EPS
            if call.cancel_after is not None:  # never dispatched after its caller left
                assert started <= call.at + call.cancel_after + EPS
            if closed_at is not None:
                assert call.at <= closed_at + EPS  # accepted before the close
        if outcome is NEVER_CALLED:
            assert index is None
        elif cancelled_from_outside(outcome, sabotage):
            pass  # its batch task was cancelled from outside, maybe before it ran
        elif isinstance(outcome, tuple):
            assert outcome == ("out", call.id), "cross-talk"
            assert index is not None
            assert batch_error(proxy.batches[index]) is None
            assert call.kind == "ok"
        elif isinstance(outcome, (asyncio.CancelledError, batchproxy.DeadlineExceeded)):
            assert (
                call.cancel_after if isinstance(outcome, asyncio.CancelledError) else call.timeout
            ) is not None
        elif isinstance(outcome, (batchproxy.QueueFull, batchproxy.ProxyClosed)):
            assert index is None
            if isinstance(outcome, batchproxy.ProxyClosed):
                assert closed_at is not None
                if exact_clock:
                    assert call.at >= closed_at - EPS
        else:
            assert index is not None, f"call {call.id} failed with {outcome!r} but never ran"
            expected = batch_error(proxy.batches[index])
            if expected is None:
                assert call.kind == "bad"
                assert isinstance(outcome, ValueError)
                assert outcome.args == (call.id,)
            else:
                assert type(outcome) is expected

    check_stats(proxy.stats, outcomes, len(calls), len(batch_of), sabotage)


def cancelled_from_outside(outcome: object, sabotage: Sabotage) -> bool:
    """Whether `outcome` is what a caller gets when its batch task is cancelled from
    outside: "the batch task was cancelled". (Python 3.10 cannot tell that cancellation
    from a model raising `CancelledError` on its own: the message then says so.)"""
    if not (isinstance(outcome, batchproxy.InferenceError) and sabotage.cancels_batches):
        return False
    if not isinstance(outcome.__cause__, asyncio.CancelledError):
        return False
    return "batch task was cancelled" in str(outcome) or sys.version_info < (3, 11)


def check_stats(
    stats: batchproxy.ProxyStats,
    outcomes: dict[int, list[Any]],
    calls: int,
    items_run: int,
    sabotage: Sabotage,
) -> None:
    """The counters add up to what the callers saw."""
    assert stats.queue_depth == 0
    assert stats.in_flight == 0
    assert stats.requests == stats.succeeded + stats.errors + stats.timed_out + stats.cancelled
    refused = sum(
        o[0] is NEVER_CALLED
        or isinstance(o[0], (batchproxy.QueueFull, batchproxy.ProxyClosed))
        or (isinstance(o[0], batchproxy.DeadlineExceeded) and o[0].predicted is not None)
        for o in outcomes.values()
    )
    assert stats.requests + refused == calls
    event("some calls shed" if stats.shed else "none shed")
    assert stats.shed == sum(
        isinstance(o[0], batchproxy.DeadlineExceeded) and o[0].predicted is not None
        for o in outcomes.values()
    )
    if sabotage.cancels_batches:  # a batch cancelled while its items wait for the thread
        assert stats.items >= items_run  # was sent, though the model never saw them
    else:
        assert stats.items == items_run


@chaos_settings("CHAOS_EXAMPLES_THREADED", 25)
@given(case=cases(horizon=0.03, max_calls=30, delays=[0.0, 0.001, 0.005]))
def test_every_call_ends_once_with_a_model_on_the_worker_thread(case: Case) -> None:
    """The same chaos in real time, through the worker thread (cross-thread replies,
    BaseExceptions carried back, shutdown of the owned thread)."""
    model = ThreadedModel(delay=case.model_delay, name="chaos-threaded", **case.options)
    proxy, outcomes, closed_at = asyncio.run(
        asyncio.wait_for(scenario(case.calls, model, case.close_at, case.sabotage), timeout=30)
    )
    check(
        case.calls,
        proxy,
        outcomes,
        closed_at,
        case.options["batch_size"],
        case.sabotage,
        exact_clock=False,
    )
    assert not [t for t in threading.enumerate() if t.name == "batchproxy-chaos-threaded"]
