"""Every feature in combination, against one oracle (issue 27; docs/contributing.md).

Hypothesis draws a configuration (dedup and the cache, tenants, their weights and
queue limits, batch keys as an option and per call, allowed batch sizes cut or
padded, per-batch arguments, caller contexts, `isolate_errors`, `oom_backoff`,
priorities, aging, queue limits, the executor, a unary or a streaming model, a
`Proxy` subclass or a decorated function: `@batch`, `@batch_args`; issue 38
item 3's options: `length=` with `max_batch_tokens`, `window` fixed or adaptive,
`shed_late`, and a `batch_timeout` `Watchdog` serving on or stopping, with items
that hang their model call; and the run kinds of tests/_combination_kinds.py: a
`GenerationProxy`, a `TensorProxy`, a `Proxy` on `RayActors`) and a
program of calls (`inference`, `inference_many`, `stream`, `submit` and
`inference_sync` from threads, with deadlines, cancellations, `configure()` under
load and `aclose()` mid-flight), runs it, and checks (tests/_combinations.py):

- every accepted call ends exactly once (guarantee 1 of docs/failures.md);
- its result was computed from its own item, key and arguments (results carry them;
  guarantee 2);
- every context a model call sees belongs to that call's items, in order;
- every model call has an allowed size;
- the stats add up;
- a call that only joins a queued identical call is never refused (`QueueFull`)
  nor shed;
- no model call is over its token budget (members x largest `length`; an item over
  it alone), a shed call ends with `DeadlineExceeded` whose `predicted` is past its
  timeout, and `stats.shed` counts the calls shed;
- a `BatchTimeout` goes only to callers of a batch that hung (on the virtual clock;
  in real time a loaded machine may overrun a batch), `ProxyClosed` after a
  stopping watchdog fired, `stats.timed_out_batches` counts them, and every hung
  model call was abandoned (cancelled);
- nothing is left running (tasks, threads).

A second walk drives a `Serving` (tests/_serving_walk.py): HTTP requests through
`CancelOnDisconnect` whose clients disconnect mid-call, and the drain with a
deadline, on a proxy with dedup, keys and tenants.

The loop's examples run on looptime's virtual clock; those with threads in real time.
In CI the file takes one to two minutes: 2,000 examples on the virtual clock, 200
with threads, 100 through a model host, 5 on worker processes, and 300 of the
Serving walk; the run kinds (tests/_combination_kinds.py) 100 on a
`GenerationProxy` and 60 on a `TensorProxy` on the virtual clock, 10 of each with
threads, 2 on Ray actors (about 35 s of them: Ray's start). Measured on the 2-core
machine under load (2026-11-29): 94 s without the run kinds, against 50 s before
issue 38's options (virtual clock +20 s, threads +16 s: a watchdog's 0.2 s waits
in real time, the Serving walk 4 s).
`BATCHPROXY_COMBINATIONS=20000` runs ten times as many of each. What it found
(`FOUND`) stays as regression tests; what it found in threads (`@batch_args`'
`inference_sync`, which took neither the function's arguments nor the
`with_call_options` ones) is covered in tests/calls/test_batch_args.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import threading
from collections.abc import Hashable, Iterator
from typing import Any

import looptime
import pytest
from _combination_kinds import generation_configs, ray_configs, tensor_configs, tokens
from _combinations import (
    EXAMPLES,
    Call,
    Config,
    Program,
    check,
    configs,
    item_length,
    programs,
    run,
)
from _serving_walk import (
    ServingProgram,
    run_serving,
    serving_configs,
    serving_problems,
    serving_programs,
)
from _support import threads_since
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import batchproxy

HORIZON = 0.02  # seconds: arrivals, deadlines and the close within it


WALK = 2000
"""The virtual-clock walk's examples in CI (about a minute); the real-time tests run
fewer, in proportion: BATCHPROXY_COMBINATIONS=N scales them all to N / WALK."""


GENERATION = 100
TENSORS = 60
GENERATION_THREADS = 10
TENSORS_THREADS = 10
RAY = 2
"""The run kinds' examples in CI (tests/_combination_kinds.py)."""

WITH_ENTRY = 40
"""Examples of proxies entered by `with` from a plain thread (issue 40, item 1)."""


def examples(default: int) -> int:
    return max(1, round(default * EXAMPLES / WALK)) if EXAMPLES else default


def time_limit(default: int, seconds_each: float) -> pytest.MarkDecorator:
    """pytest-timeout's limit for `examples(default)` examples of about `seconds_each`
    on a busy machine (a few times what a quiet one takes), and at least 5 minutes."""
    return pytest.mark.timeout(max(300, round(examples(default) * seconds_each)))


def combination_settings(default: int) -> settings:
    return settings(
        max_examples=examples(default),
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


class BusyLoop(BaseException):
    """An example ran past `BUSY` seconds of real time on the virtual clock: its event
    loop spins (a `BaseException`, so the library's guards let it through)."""


BUSY = 60.0


@contextlib.contextmanager
def real_time_guard() -> Iterator[None]:
    """A spinning event loop never reaches the virtual timeout: fail it after `BUSY`
    real seconds instead (where `SIGALRM` is at hand, in the main thread)."""
    if (
        not hasattr(signal, "setitimer")
        or threading.current_thread() is not threading.main_thread()
    ):
        yield
        return

    def busy(*_: object) -> None:
        raise BusyLoop(f"the event loop ran {BUSY} s of real time without ending")

    previous = signal.signal(signal.SIGALRM, busy)
    signal.setitimer(signal.ITIMER_REAL, BUSY, 1.0)  # (again each second, till it ends)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def on_virtual_clock(config: Config, program: Program) -> None:
    loop = looptime.new_event_loop(start=0.0)
    try:
        tasks_before = len(asyncio.all_tasks(loop))
        with real_time_guard():
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
    left = threads_since(threads_before)
    assert not left, f"threads left running: {left}"


@pytest.mark.virtual_clock
@time_limit(WALK, 0.15)
@combination_settings(WALK)
@given(data=st.data())
def test_every_combination_keeps_every_promise(data: st.DataObject) -> None:
    config = data.draw(configs(), label="config")
    program = data.draw(programs(config, HORIZON), label="program")
    on_virtual_clock(config, program)


@time_limit(200, 0.5)
@combination_settings(200)
@given(data=st.data())
def test_every_combination_with_threads(data: st.DataObject) -> None:
    """The same, with a `WorkerThread` and calls from plain threads, in real time."""
    config = data.draw(configs(threads=True), label="config")
    program = data.draw(programs(config, HORIZON, threads=True), label="program")
    in_real_time(config, program)


@time_limit(5, 10)
@combination_settings(5)
@given(data=st.data())
def test_every_combination_on_worker_processes(data: st.DataObject) -> None:
    """A few examples on `ProcessWorkers` (one worker process each: slow to start), with
    calls from threads; its model sees no batch key nor contexts, so none are drawn."""
    config = data.draw(configs(threads=True, processes=True), label="config")
    program = data.draw(programs(config, HORIZON, threads=True), label="program")
    in_real_time(config, program)


@time_limit(WITH_ENTRY, 0.5)
@combination_settings(WITH_ENTRY)
@given(data=st.data())
def test_every_combination_entered_with_with_from_a_thread(data: st.DataObject) -> None:
    """`with proxy:` from a plain thread (issue 40, item 1): the proxy runs on the
    process's `with` loop, plain threads call it (`submit`, `inference_sync`,
    `inference_many_sync`), `configure()` and `aclose()` come from another loop, and
    the exit drains it and stops the loop's thread; in real time."""
    config = data.draw(configs(threads=True, entry="with"), label="config")
    program = data.draw(programs(config, HORIZON, threads=True), label="program")
    in_real_time(config, program)


@pytest.mark.skipif(sys.platform == "win32", reason="Unix domain sockets")
@time_limit(100, 0.5)
@combination_settings(100)
@given(data=st.data())
def test_every_combination_through_a_model_host(data: st.DataObject) -> None:
    """The same through a `ModelHost` and a `RemoteProxy` (issue 32): the calls cross
    a socket, the options travel, errors are packed and unpacked, cancellations and
    the close go across; in real time, with calls from threads."""
    config = data.draw(configs(threads=True, remote=True), label="config")
    program = data.draw(programs(config, HORIZON, threads=True), label="program")
    in_real_time(config, program)


# -- the run kinds of tests/_combination_kinds.py (issue 38 item 3) ------------------------


@pytest.mark.virtual_clock
@time_limit(GENERATION, 0.1)
@combination_settings(GENERATION)
@given(data=st.data())
def test_every_combination_on_a_generation_proxy(data: st.DataObject) -> None:
    """Continuous batching: sequences join and leave the running batch at each step."""
    config = data.draw(generation_configs(), label="config")
    program = data.draw(programs(config, HORIZON), label="program")
    on_virtual_clock(config, program)


@pytest.mark.virtual_clock
@time_limit(TENSORS, 0.15)
@combination_settings(TENSORS)
@given(data=st.data())
def test_every_combination_on_a_tensor_proxy(data: st.DataObject) -> None:
    """Arrays and tensors, collated, padded (sequence axis, and batch axis to the allowed
    sizes), split back to each caller."""
    config = data.draw(tensor_configs(), label="config")
    program = data.draw(programs(config, HORIZON), label="program")
    on_virtual_clock(config, program)


@time_limit(GENERATION_THREADS, 0.5)
@combination_settings(GENERATION_THREADS)
@given(data=st.data())
def test_every_combination_on_a_generation_proxy_with_threads(data: st.DataObject) -> None:
    """A plain `def _step` on a `WorkerThread`, in real time."""
    config = data.draw(generation_configs(threads=True), label="config")
    program = data.draw(programs(config, HORIZON, threads=True), label="program")
    in_real_time(config, program)


@time_limit(TENSORS_THREADS, 0.5)
@combination_settings(TENSORS_THREADS)
@given(data=st.data())
def test_every_combination_on_a_tensor_proxy_with_threads(data: st.DataObject) -> None:
    """A plain `def _forward` (its stages on a worker thread) or an offloaded one, and
    calls from threads, in real time."""
    config = data.draw(tensor_configs(threads=True), label="config")
    program = data.draw(programs(config, HORIZON, threads=True), label="program")
    in_real_time(config, program)


@pytest.fixture(scope="module")
def ray_instance() -> Iterator[None]:
    """One local Ray instance for the Ray examples (seconds to start), as in
    tests/executors/test_ray.py; its actors unpickle the models by value."""
    ray = pytest.importorskip("ray")
    import _combination_kinds
    import _combinations

    for module in (_combinations, _combination_kinds):
        ray.cloudpickle.register_pickle_by_value(module)
    ray.init(num_cpus=2, include_dashboard=False, ignore_reinit_error=True, log_to_driver=False)
    yield
    ray.shutdown()


@time_limit(RAY, 20)
@combination_settings(RAY)
@given(data=st.data())
def test_every_combination_on_ray_actors(ray_instance: None, data: st.DataObject) -> None:
    """A few examples on `RayActors` (one actor each: slow to start), with calls from
    threads; its model sees no batch key nor contexts, so none are drawn."""
    config = data.draw(ray_configs(), label="config")
    program = data.draw(programs(config, HORIZON, threads=True), label="program")
    in_real_time(config, program)


# -- what the walk found on today's code: each its shrunk example, with every check on ----


def call(
    id: int,
    item: Hashable,
    *,
    at: float = 0.0,
    form: str = "inference",
    key: Hashable = None,
    tenant: Hashable = None,
) -> Call:
    return Call(id, at, form, (item,), key, "", tenant, 0, None, None)


def plain(delay: float = 0.0, *, keys: bool = False, **options: Any) -> Config:
    return Config("plain", {"max_delay_ms": 0.0, **options}, keys, False, delay)


PLAIN_TENSOR = {
    "library": "numpy",
    "padding_side": "right",
    "pad_to_multiple_of": None,
    "length_aware": False,
    "forward": "async",
}
"""A `TensorProxy`'s own options in the walk's findings: NumPy rows, right-padded."""

FOUND: dict[str, tuple[str, Config, Program]] = {
    # dedup keys a call with a batch key by (key, item), one without by its item:
    # inference("y", key="k") and inference(("k", "y")) share a slot
    "dedup-with-keys": (
        "issue 27 item 1",
        plain(0.01, keys=True, batch_size=1, dedup=True),
        Program([call(0, "x"), call(1, "y", key="k"), call(2, ("k", "y"))]),
    ),
    # ... and the cache answers the second with the first one's result
    "cache-with-keys": (
        "issue 27 item 1",
        plain(keys=True, batch_size=1, dedup=batchproxy.Dedup(cache_size=4)),
        Program([call(0, "y", key="k"), call(1, ("k", "y"), at=0.01)]),
    ),
    # a batch of 1 padded to 2 gets 1 context for 2 items
    "contexts-when-padded": (
        "issue 27 item 2",
        plain(
            batch_size=2,
            batch_sizes=batchproxy.BatchSizes((2, 4, 8), pad_item="PAD"),
            caller_context=True,
        ),
        Program([call(0, "x")]),
    ),
    # a batch of 2 (allowed: 1, 3) run as [y] and [x]: each call sees both contexts
    "contexts-when-cut": (
        "issue 27 item 2",
        plain(0.01, keys=True, batch_size=3, batch_sizes=(1, 3), caller_context=True),
        Program([call(0, "y"), call(1, "x", key="k"), call(2, "y", key="k"), call(3, "x")]),
    ),
    # inference_many(["x"]) while an "x" is queued: QueueFull, though it adds no work
    "many-joining-a-queued-call": (
        "issue 27 item 3",
        plain(0.01, batch_size=1, dedup=True, max_queue_size=1),
        Program([call(0, "y"), call(1, "x", at=0.001), call(2, "x", at=0.005, form="many")]),
    ),
    # as the walk shrank it: inference_many(["x", "x"]) beside a queued "x" wants room
    # for 2 in a queue of 2 holding 1
    "many-of-repeats-joining-a-queued-call": (
        "issue 27 item 3",
        plain(0.001, batch_size=1, dedup=True, max_queue_size=2),
        Program(
            [
                call(0, "y"),
                Call(1, 0.001, "many", ("x", "x"), None, "", None, 0, None, None),
                call(2, "x"),
            ]
        ),
    ),
    "many-joining-a-queued-call-of-its-tenant": (
        "issue 27 item 3",
        plain(0.01, batch_size=1, dedup=True, max_queue_size_per_tenant=1),
        Program([call(0, "y"), call(1, "x", at=0.001), call(2, "x", at=0.005, form="many")]),
    ),
    # not in the issue: a key's batch of 2 (allowed: 1, 3) runs as [x] and [boom]; the
    # second raises, and the caller of "x", whose model call answered, fails with it
    "an-error-in-one-cut-fails-the-other": (
        "issue 27 (found by the combination test): cut-error",
        plain(keys=True, batch_size=3, batch_sizes=(1, 3)),
        Program([call(0, "x"), call(1, "boom"), call(2, "x", key="k")]),
    ),
    # issue 38 item 3 (the walk with length=, on the code of 2026-11-29): a tenant's
    # call cancelled as aclose() begins, on a length-aware @batch: the drain's scheduler
    # found only that dead request (counted until its cancellation's callback ran) and
    # asked again for ever, spinning the event loop
    "a-caller-leaving-as-the-drain-begins": (
        "issue 38 item 3",
        Config("batch", {"batch_size": 1, "length": item_length}, False, False, 0.01),
        Program([Call(0, 0.0, "inference", ("oom",), None, "", "b", 0, None, 0.0)], close_at=0.0),
    ),
    # a queued caller of tenant "b" cancelled on a proxy with aging and `length` (a
    # TensorProxy measures every item): reading the pop order retired it behind the
    # tenants' queue's back, which then counted 1 request with no tenant: the event
    # loop spun (tests/scheduling/test_queue.py pins the cause)
    "aging-retired-a-tenants-caller-unseen": (
        "issue 38 item 3 (found by the walk on a TensorProxy)",
        Config(
            "tensor",
            {"batch_size": 4, "max_delay_ms": 0.0, "aging_ms": 1.0},
            False,
            False,
            0.0,
            kind_options=PLAIN_TENSOR,
        ),
        Program([Call(0, 0.0, "inference", ("y",), None, "", "b", 0, None, 0.0)]),
    ),
    # the oracle's own bugs (found by 1,000 examples of each): it measured a
    # TensorProxy's batch by the plain models' `length=` ("oom": 2) rather than its
    # items' shapes ("oom" travels as 1 row), so [x, oom] was "4 tokens, over 2" ...
    "a-tensor-batch-measured-by-its-shapes": (
        "issue 38 item 3 (the oracle; found by the walk on a TensorProxy with threads)",
        Config(
            "tensor",
            {"batch_size": 2, "max_delay_ms": 0.0, "max_batch_tokens": 2},
            False,
            False,
            0.0,
            kind_options=PLAIN_TENSOR,
        ),
        Program([call(0, "x"), call(1, "oom")]),
    ),
    # ... and a GenerationProxy's step by members x the largest, though its budget is
    # the sum of its sequences' tokens: [x, y] (1 + 2) was "4 tokens, over 3"
    "a-generation-step-measured-by-its-sum": (
        "issue 38 item 3 (the oracle; found by the walk on a GenerationProxy)",
        Config(
            "generation",
            {"batch_size": 2, "max_batch_tokens": 3, "length": tokens},
            False,
            False,
            0.0,
        ),
        Program([call(0, "x", form="stream"), call(1, "y", form="stream")]),
    ),
}
"""Failures found by the walk on the code of 2026-11-26, each minimal: regression
tests now that they are fixed (why: the issue item each one found)."""


@pytest.mark.virtual_clock
@pytest.mark.parametrize(
    ("config", "program"),
    [pytest.param(config, program, id=name) for name, (why, config, program) in FOUND.items()],
)
def test_what_the_walk_found(config: Config, program: Program) -> None:
    loop = looptime.new_event_loop(start=0.0)
    try:
        with real_time_guard():
            result = loop.run_until_complete(asyncio.wait_for(run(config, program), timeout=3600))
    finally:
        loop.close()
    check(result)


# -- the Serving walk (issue 38 item 3) ----------------------------------------------------

SERVING_WALK = 300
SERVING_HORIZON = 0.1  # seconds: arrivals and the drain's deadline, beside WATCH_AFTER (50 ms)
"""The Serving walk's examples in CI (virtual clock; about 4 s here)."""


@pytest.mark.virtual_clock
@time_limit(SERVING_WALK, 0.15)
@combination_settings(SERVING_WALK)
@given(data=st.data())
def test_serving_with_disconnects_and_a_drain_deadline_keeps_every_promise(
    data: st.DataObject,
) -> None:
    """A `Serving` of a proxy drawn with dedup (and the cache), keys and tenants; HTTP
    requests through `CancelOnDisconnect` (FastAPI's middleware) whose clients may
    disconnect mid-call; the drain with a deadline (`drain_timeout`) cutting off calls
    still queued or running, hung ones among them (tests/_serving_walk.py). Every call
    ends once, with its own result or the documented error (`DrainDeadline` only at
    the deadline), a disconnect cancels it and counts it as disconnected, and
    nothing is left running."""
    config = data.draw(serving_configs(), label="config")
    program = data.draw(serving_programs(config, SERVING_HORIZON), label="program")
    on_virtual_clock_serving(config, program)


def on_virtual_clock_serving(config: Config, program: ServingProgram) -> None:
    loop = looptime.new_event_loop(start=0.0)
    try:
        tasks_before = len(asyncio.all_tasks(loop))
        result, exchanges = loop.run_until_complete(
            asyncio.wait_for(run_serving(config, program), timeout=3600)
        )
        left = [t for t in asyncio.all_tasks(loop) if not t.done()]
        assert len(left) <= tasks_before, f"tasks left running: {left}"
    finally:
        loop.close()
    problems = list(serving_problems(result, exchanges))
    assert not problems, "\n".join(problems)
    check(result)
