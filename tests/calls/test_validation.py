"""Bad arguments get a clear TypeError/ValueError naming the argument and the bad value."""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np
import pytest
from _support import Recorder
from typing_extensions import override

import batchproxy

NAN = float("nan")
INF = float("inf")


def bad(name: str, value: object) -> str:
    """A `match` pattern: the message names the argument and shows the bad value."""
    return rf"{name} must .*{re.escape(repr(value))}"


# -- constructor -------------------------------------------------------------------------------

CONSTRUCTOR_CASES: list[tuple[str, object, type[Exception]]] = [
    # batch_size: an int >= 1
    ("batch_size", 0, ValueError),
    ("batch_size", -3, ValueError),
    ("batch_size", 2.0, TypeError),
    ("batch_size", "8", TypeError),
    ("batch_size", None, TypeError),
    ("batch_size", True, TypeError),
    ("batch_size", NAN, TypeError),
    ("batch_size", INF, TypeError),
    # max_delay_ms: a finite number >= 0
    ("max_delay_ms", -1, ValueError),
    ("max_delay_ms", -0.5, ValueError),
    ("max_delay_ms", NAN, ValueError),
    ("max_delay_ms", INF, ValueError),
    ("max_delay_ms", "5", TypeError),
    ("max_delay_ms", None, TypeError),
    ("max_delay_ms", True, TypeError),
    # max_queue_size: None or an int >= 1
    ("max_queue_size", 0, ValueError),
    ("max_queue_size", -1, ValueError),
    ("max_queue_size", 1.5, TypeError),
    ("max_queue_size", INF, TypeError),
    ("max_queue_size", "10", TypeError),
    ("max_queue_size", True, TypeError),
    # timeout: None or a number > 0 (inf: no deadline)
    ("timeout", 0, ValueError),
    ("timeout", -1.0, ValueError),
    ("timeout", NAN, ValueError),
    ("timeout", "1", TypeError),
    ("timeout", True, TypeError),
    # max_concurrent_batches: an int >= 1
    ("max_concurrent_batches", 0, ValueError),
    ("max_concurrent_batches", -2, ValueError),
    ("max_concurrent_batches", 1.0, TypeError),
    ("max_concurrent_batches", False, TypeError),
    ("max_concurrent_batches", INF, TypeError),
    # offload: a bool or a WorkerThread
    ("offload", 1, TypeError),
    ("offload", None, TypeError),
    ("offload", "yes", TypeError),
    # name: a str or None
    ("name", 5, TypeError),
    ("name", b"model", TypeError),
    ("name", "", ValueError),
]


@pytest.mark.parametrize(
    ("name", "value", "error"),
    CONSTRUCTOR_CASES,
    ids=[f"{name}={value!r}" for name, value, _ in CONSTRUCTOR_CASES],
)
def test_bad_constructor_argument_is_refused(name, value, error):
    with pytest.raises(error, match=bad(name, value)):
        Recorder(**{name: value})


@pytest.mark.parametrize("value", [0, -1, 1.5, "x", True])
def test_bad_positional_batch_size_is_refused(value):
    class Model(batchproxy.Proxy[int, int]):
        def __init__(self, size: Any) -> None:
            super().__init__(size)

        @override
        async def _inference(self, items: list[int]) -> list[int]:
            return items

    with pytest.raises((TypeError, ValueError), match=bad("batch_size", value)):
        Model(value)


@pytest.mark.parametrize(
    "options",
    [
        {"batch_size": 1},
        {"batch_size": np.int64(4)},
        {"max_delay_ms": 0},
        {"max_delay_ms": 2},
        {"max_delay_ms": np.float32(1.5)},
        {"max_queue_size": None},
        {"max_queue_size": 1},
        {"timeout": None},
        {"timeout": math.inf},
        {"timeout": 0.001},
        {"max_concurrent_batches": 3},
        {"offload": False},
        {"name": "embedder"},
        {"name": None},
    ],
    ids=repr,
)
async def test_good_constructor_arguments_are_accepted(options):
    async with Recorder(**options) as p:
        if "timeout" in options:  # kept as the default deadline (inf: none, as None)
            timeout = options["timeout"]
            assert p.options.timeout == (None if timeout == math.inf else timeout)
        # the call bounds itself: with the 1 ms default it would race its own deadline,
        # which a loaded CI machine on uvloop (1 ms timer granularity) lost once
        assert await p.inference(1, timeout=math.inf) == ("out", 1)


async def test_offload_accepts_a_worker_thread(no_leftovers):
    worker = batchproxy.WorkerThread(name="validation-worker")
    async with worker, Recorder(offload=worker) as p:
        assert await p.inference(1) == ("out", 1)


def test_failed_construction_starts_no_thread(no_leftovers):
    with pytest.raises(TypeError):
        Recorder(offload=True, name=5)
    with pytest.raises(ValueError):
        Recorder(offload=True, batch_size=0)


async def test_name_shows_up_in_repr_stats_and_errors():
    async with Recorder(lambda items: [], name="embedder") as p:
        assert p.name == "embedder"
        assert "embedder" in repr(p)
        assert p.stats.name == "embedder"
        with pytest.raises(batchproxy.BatchSizeMismatch, match="embedder"):
            await p.inference(1)


# -- per call ----------------------------------------------------------------------------------

TIMEOUT_CASES: list[tuple[object, type[Exception]]] = [
    (0, ValueError),
    (-1, ValueError),
    (-0.001, ValueError),
    (NAN, ValueError),
    ("1", TypeError),
    (True, TypeError),
    ([1], TypeError),
]


@pytest.mark.parametrize(("value", "error"), TIMEOUT_CASES, ids=repr)
async def test_bad_per_call_timeout_is_refused(value, error):
    async with Recorder() as p:
        with pytest.raises(error, match=bad("timeout", value)):
            await p.inference(1, timeout=value)
        with pytest.raises(error, match=bad("timeout", value)):
            await p.inference_many([1, 2], timeout=value)
        assert p.stats.requests == 0
        assert p.batches == []
        assert await p.inference(2) == ("out", 2)  # the proxy is fine


PRIORITY_CASES: list[object] = [1.5, "1", True, None, NAN]


@pytest.mark.parametrize("value", PRIORITY_CASES, ids=repr)
async def test_bad_per_call_priority_is_refused(value):
    async with Recorder() as p:
        with pytest.raises(TypeError, match=bad("priority", value)):
            await p.inference(1, priority=value)
        with pytest.raises(TypeError, match=bad("priority", value)):
            await p.inference_many([1, 2], priority=value)
        assert p.stats.requests == 0
        assert p.batches == []


@pytest.mark.parametrize("priority", [-(2**40), -1, 0, 7, np.int32(3)], ids=repr)
async def test_any_int_priority_is_accepted(priority):
    async with Recorder() as p:
        assert await p.inference(1, priority=priority) == ("out", 1)


# -- subclassing mistakes ----------------------------------------------------------------------


def test_subclass_without_inference_cannot_be_instantiated():
    class NoModel(batchproxy.Proxy[int, int]):
        pass

    with pytest.raises(TypeError, match=r"NoModel has no model: .* implement _inference"):
        NoModel()
    with pytest.raises(TypeError, match="has no model"):
        NoModel(offload=batchproxy.WorkerThread())


def test_proxy_itself_needs_an_executor_that_hosts_a_model():
    with pytest.raises(TypeError, match=r"Proxy has no model: .*ProcessWorkers"):
        batchproxy.Proxy()


class Forgetful(batchproxy.Proxy[int, int]):
    """Its __init__ forgets super().__init__()."""

    def __init__(self) -> None:
        self.model = "loaded"

    @override
    async def _inference(self, items: list[int]) -> list[int]:
        return items


async def test_missing_super_init_gives_a_clear_error_on_inference():
    with pytest.raises(RuntimeError, match=r"Forgetful.__init__ must call super\(\).__init__\(\)"):
        await Forgetful().inference(1)


async def test_missing_super_init_gives_a_clear_error_on_inference_many():
    with pytest.raises(RuntimeError, match=r"super\(\).__init__\(\)"):
        await Forgetful().inference_many([1])


async def test_missing_super_init_gives_a_clear_error_on_start():
    with pytest.raises(RuntimeError, match=r"super\(\).__init__\(\)"):
        async with Forgetful():
            pass


# -- the decorator -----------------------------------------------------------------------------


def test_batch_decorator_without_parentheses_is_a_clear_type_error():
    with pytest.raises(TypeError, match=r"@batch\(\).*parentheses"):

        @batchproxy.batch  # type: ignore[arg-type]
        async def double(items: list[int]) -> list[int]:
            return [x * 2 for x in items]


def test_batch_decorator_checks_its_options():
    async def double(items: list[int]) -> list[int]:
        return [x * 2 for x in items]

    with pytest.raises(ValueError, match=bad("batch_size", 0)):
        batchproxy.batch(batch_size=0)(double)
    with pytest.raises(ValueError, match=bad("max_delay_ms", -1)):
        batchproxy.batch(max_delay_ms=-1)(double)
    with pytest.raises(TypeError, match=bad("timeout", "1")):
        batchproxy.batch(timeout="1")(double)  # type: ignore[arg-type]


def test_batch_decorator_refuses_a_non_callable():
    with pytest.raises(TypeError, match="function or method"):
        batchproxy.batch()(42)  # type: ignore[call-overload]


# -- durations beyond what the platform can wait (issue 16.7) ----------------------------------

HUGE = [1e10, 10**30, 1e300]  # seconds, or ms: each beyond threading.TIMEOUT_MAX


@pytest.mark.parametrize("value", HUGE, ids=repr)
def test_a_huge_timeout_is_clamped_for_sync_callers(value):
    proxy = Recorder()
    try:
        assert proxy.inference_sync(1, timeout=value) == ("out", 1)  # was an OverflowError
        assert proxy.submit(2, timeout=value).result(10) == ("out", 2)
    finally:
        batchproxy.BackgroundLoop.default().close()


@pytest.mark.parametrize("value", HUGE, ids=repr)
async def test_huge_durations_are_accepted_and_clamped(value):
    options = {"timeout": value, "batch_timeout": value, "max_delay_ms": value, "aging_ms": value}
    async with Recorder(**options) as p:
        assert await p.inference(1, timeout=value) == ("out", 1)
        p.configure(**options)
        assert await p.inference_many([2, 3], timeout=value) == [("out", 2), ("out", 3)]
    limit = batchproxy._validate.MAX_WAIT
    options = p.options
    assert options.batch_timeout is not None
    assert options.timeout == options.batch_timeout.seconds == limit
    assert options.max_delay == options.aging == min(value / 1e3, limit)  # these are in ms


def test_background_loop_waits_clamp_huge_timeouts():
    async def answer() -> int:
        return 7

    with batchproxy.BackgroundLoop(name="huge-timeouts") as loop:
        assert loop.run(answer(), timeout=1e10) == 7
    loop.close(timeout=1e10)
