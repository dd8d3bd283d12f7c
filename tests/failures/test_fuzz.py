"""Bad input fuzzing (issue 7, part 6) across the public API.

Wrong types, None, NaN and infinities, huge and empty inputs, results that are not
a list, of the wrong length or that raise while being read: each must end in a
clear error (a `TypeError`/`ValueError` naming what is wrong, or the documented
batchproxy error) for the caller concerned only, or for the whole batch when the
batch as a whole is malformed. Nothing hangs (virtual clock or real timeouts),
nothing reaches the loop's exception handler, and the proxy serves a normal call
afterwards. NaN and infinities inside tensors are data: they pass through.

Each test computes what should happen from the documented rules (an oracle) and
compares; none only checks that "something was raised".
"""

from __future__ import annotations

import asyncio
import collections
import math
import numbers
import re
import sys
import warnings
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction
from typing import Any, TypeVar

import looptime
import numpy as np
import pytest
from _support import Recorder, ThreadRecorder, assert_settled
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from typing_extensions import override

import batchproxy
from batchproxy import TensorProxy, tensors
from batchproxy.tensors import Collated

torch = pytest.importorskip("torch")

T = TypeVar("T")

NAN = float("nan")
INF = float("inf")

fuzz = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def few(examples: int) -> settings:
    return settings(fuzz, max_examples=examples)


def run_virtual(make: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run a scenario on a fresh looptime loop (a hang fails within 3600 virtual
    seconds, at once); fail if anything reached the loop's exception handler (a
    crashed batch task, an exception nobody retrieved)."""
    loop = looptime.new_event_loop(start=0.0)
    seen: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: seen.append(context))
    try:
        result = loop.run_until_complete(asyncio.wait_for(make(), timeout=3600))
    finally:
        loop.close()
    assert not seen, seen
    return result


def run_real(make: Callable[[], Coroutine[Any, Any, T]], seconds: float = 10.0) -> T:
    """`run_virtual` on a real loop, for models on a worker thread."""
    seen: list[dict[str, Any]] = []

    async def main() -> T:
        asyncio.get_running_loop().set_exception_handler(lambda _l, c: seen.append(c))
        return await asyncio.wait_for(make(), seconds)

    result = asyncio.run(main())
    assert not seen, seen
    return result


def assert_names(error: BaseException, *fragments: str) -> None:
    message = str(error)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


def own(item: Any) -> Any:
    return ("out", item)


def default(items: list[Any]) -> list[Any]:
    return [own(item) for item in items]


def one(_item: object) -> int:
    """A valid `length` (and, being callable, a valid `oom_backoff` predicate)."""
    return 1


# -- values of every wrong kind -------------------------------------------------------------

ODD_VALUES: list[object] = [
    None, True, False, 0, 1, -1, 3, 10**30, -(10**30), 10**400, -(10**400), 2**63,
    0.0, -0.0, 0.5, 2.0, -2.5, 1e308, -1e308, 5e-324, NAN, INF, -INF,
    "", "8", "fixed", "adaptive", "nan", b"8", bytearray(b"8"), 1j,
    Fraction(3, 2), Fraction(10**400, 3), Fraction(-(10**400), 3), Decimal("2"), Decimal("NaN"),
    np.int64(4), np.int64(-4), np.uint8(0), np.float64(NAN), np.float32(2.5), np.float64(INF),
    np.bool_(True), np.array(3), np.array([1, 2]),
    [], [4], (4,), {"batch_size": 4}, {4}, range(4), object(), one, Ellipsis,
]  # fmt: skip

odd_values = (
    st.sampled_from(ODD_VALUES)
    | st.integers()
    | st.floats()
    | st.text(max_size=3)
    | st.sampled_from([None, NAN, INF, -INF, -1, 0])
)

Expected = tuple[type[Exception], ...]
"""The exception types a value may raise; `()` when the value is valid."""


def count_rule(value: object, *, optional: bool = False) -> Expected:
    """An int >= 1 (bool refused); `None` too when optional."""
    if optional and value is None:
        return ()
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return (TypeError,)
    return (ValueError,) if value < 1 else ()


def seconds_rule(value: object, *, zero: bool, inf: bool, optional: bool) -> Expected:
    """A real number (bool refused), not NaN, >= 0 (> 0 unless `zero`), finite unless
    `inf`; an int beyond any float counts as infinite. `None` too when optional."""
    if optional and value is None:
        return ()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return (TypeError,)
    try:
        number = float(value)
    except OverflowError:
        number = -INF if value < 0 else INF
    if math.isnan(number) or number < 0 or (number == 0 and not zero):
        return (ValueError,)
    if number == INF and not inf:
        return (ValueError,)
    return ()


def strict_bool_rule(value: object) -> Expected:
    return () if isinstance(value, bool) else (TypeError,)


def window_rule(value: object) -> Expected:
    if isinstance(value, str):
        return () if value in ("adaptive", "fixed") else (ValueError,)
    return (TypeError, ValueError)  # a wrong kind of value: either names it


def name_rule(value: object) -> Expected:
    if value is None:
        return ()
    if not isinstance(value, str):
        return (TypeError,)
    return () if value else (ValueError,)


OPTION_RULES: dict[str, Callable[[object], Expected]] = {
    "batch_size": count_rule,
    "max_delay_ms": lambda v: seconds_rule(v, zero=True, inf=False, optional=False),
    "max_queue_size": lambda v: count_rule(v, optional=True),
    "timeout": lambda v: seconds_rule(v, zero=False, inf=True, optional=True),
    "max_concurrent_batches": lambda v: count_rule(v, optional=True),
    "offload": strict_bool_rule,  # or an Executor, which odd_values never holds
    "name": name_rule,
    "length": lambda v: () if v is None or callable(v) else (TypeError,),
    "max_batch_tokens": lambda v: count_rule(v, optional=True),
    "oom_backoff": lambda v: () if isinstance(v, bool) or callable(v) else (TypeError,),
    "window": window_rule,
    "aging_ms": lambda v: seconds_rule(v, zero=False, inf=False, optional=True),
    "shed_late": strict_bool_rule,
}


def keeping(rule: Callable[[object], Expected]) -> Callable[[object], Expected]:
    """A configure() rule: `...` keeps the current value."""
    return lambda value: () if value is ... else rule(value)


CONFIGURE_RULES: dict[str, Callable[[object], Expected]] = {
    name: keeping(OPTION_RULES[name])
    for name in ("batch_size", "max_delay_ms", "max_concurrent_batches", "max_queue_size")
}


def timeout_rule(value: object) -> Expected:
    return OPTION_RULES["timeout"](value)


def seconds(value: Any) -> float:
    """A valid timeout as a float (an int beyond any float is infinite)."""
    try:
        return float(value)
    except OverflowError:
        return INF


def priority_rule(value: object) -> Expected:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return (TypeError,)
    return ()


def check_refusal(
    error: BaseException, values: dict[str, object], rules: dict[str, Callable[[object], Expected]]
) -> None:
    """`error` was raised for `values`, of which some are invalid: it must be of a type
    one of the invalid ones calls for and name that argument and show its value."""
    candidates = [
        (name, value, rules[name](value)) for name, value in values.items() if rules[name](value)
    ]
    assert candidates, f"{error!r} raised for valid values {values!r}"
    for name, value, kinds in candidates:
        if isinstance(error, kinds) and name in str(error) and repr(value) in str(error):
            return
    raise AssertionError(f"{error!r} names none of the bad arguments {candidates!r}")


TIMER_TICK = 0.001
"""uvloop's timers count whole milliseconds: a deadline closer than that is due at the
next loop turn, whose timers run before the callback that dispatches the call."""


async def serves(proxy: batchproxy.Proxy[Any, Any]) -> None:
    """A normal call on `proxy` succeeds (then it is closed); with a default deadline
    under a timer's tick it may miss it instead (on uvloop it does)."""
    async with proxy:
        try:
            assert await asyncio.wait_for(proxy.inference(7), 10) == own(7)
        except batchproxy.DeadlineExceeded:
            timeout = proxy.options.timeout
            if timeout is None or timeout >= TIMER_TICK:
                raise


async def double(items: list[Any]) -> list[Any]:
    return default(items)


# -- constructor and configure() ------------------------------------------------------------


@fuzz
@given(option=st.sampled_from(sorted(OPTION_RULES)), value=odd_values)
@example(option="timeout", value=1e-9)  # valid: a call may miss it (uvloop's timers)
def test_a_bad_option_is_refused_by_name_by_proxy_and_decorator(option: str, value: object):
    options = {option: value}
    expected = OPTION_RULES[option](value)
    if expected:
        with pytest.raises(expected) as raised:
            Recorder(**options)
        check_refusal(raised.value, options, OPTION_RULES)
        with pytest.raises(expected) as raised:
            batchproxy.batch(**options)(double)  # type: ignore[call-overload]
        if option == "batch_size" and callable(value):  # @batch used without parentheses
            assert_names(raised.value, "use @batch() or @batch(batch_size=...)")
        else:
            check_refusal(raised.value, options, OPTION_RULES)
    else:
        run_real(lambda: serves(Recorder(**options)))


@fuzz
@given(options=st.dictionaries(st.sampled_from(sorted(OPTION_RULES)), odd_values, max_size=5))
def test_several_options_at_once_name_a_bad_one(options: dict[str, object]):
    if any(OPTION_RULES[name](value) for name, value in options.items()):
        with pytest.raises((TypeError, ValueError)) as raised:
            Recorder(**options)
        check_refusal(raised.value, options, OPTION_RULES)
    else:
        run_real(lambda: serves(Recorder(**options)))


def limits(proxy: batchproxy.Proxy[Any, Any]) -> tuple[Any, ...]:
    return (proxy.options, proxy.stats.max_in_flight, proxy.stats.batch_cap)


@pytest.mark.virtual_clock
@fuzz
@given(
    changes=st.dictionaries(
        st.sampled_from(sorted(CONFIGURE_RULES)),
        odd_values | st.integers(1, 16) | st.sampled_from([None, 0.0, 2.5]),
        min_size=1,
    )
)
def test_a_bad_configure_changes_nothing(changes: dict[str, object]):
    bad = any(CONFIGURE_RULES[name](value) for name, value in changes.items())

    async def scenario() -> None:
        p = Recorder(
            delay=1.0, batch_size=4, max_delay_ms=2.0, max_queue_size=50, max_concurrent_batches=2
        )
        running = [asyncio.create_task(p.inference(i)) for i in range(6)]
        await asyncio.sleep(0.5)  # a batch runs, requests wait
        before = limits(p)
        if bad:
            with pytest.raises((TypeError, ValueError)) as raised:
                p.configure(**changes)  # type: ignore[arg-type]
            check_refusal(raised.value, changes, CONFIGURE_RULES)
            assert limits(p) == before
        else:
            p.configure(**changes)  # type: ignore[arg-type]
            size = changes.get("batch_size", ...)
            assert p.stats.batch_cap == (4 if size is ... else size)
            queue = changes.get("max_queue_size", ...)
            assert p.options.max_queue_size == (50 if queue is ... else queue)
            delay = changes.get("max_delay_ms", ...)
            expected = 0.002 if delay is ... else float(delay) / 1e3  # type: ignore[arg-type]
            assert p.options.max_delay == min(expected, batchproxy._validate.MAX_WAIT)  # clamped
            slots = changes.get("max_concurrent_batches", ...)
            assert p.stats.max_in_flight == {...: 2, None: 1}.get(slots, slots)  # type: ignore[call-overload]
        assert await asyncio.gather(*running) == [own(i) for i in range(6)]
        assert await p.inference("after") == own("after")
        await p.aclose()
        assert_settled(p.stats)

    run_virtual(scenario)


def test_configure_refuses_an_unknown_option_by_name():
    p = Recorder()
    with pytest.raises(TypeError, match="max_batch_tokens"):
        p.configure(max_batch_tokens=100)  # type: ignore[call-arg]  # fixed at construction


@pytest.mark.looptime
async def test_regression_configure_raises_the_batch_size_at_once():
    """Regression: a larger `batch_size` from configure() was ignored (the cap only
    followed it down) and crept up by one every 8 full batches, as after running out
    of memory."""
    p = Recorder(batch_size=2, delay=1.0, max_delay_ms=1)
    assert await p.inference("first") == own("first")
    p.configure(batch_size=4)
    assert p.stats.batch_cap == 4
    assert await asyncio.gather(*(p.inference(i) for i in range(8))) == default(list(range(8)))
    assert [len(batch) for batch in p.batches] == [1, 4, 4]
    await p.aclose()


@pytest.mark.parametrize("huge", [10**400, Fraction(10**400, 3)], ids=["int", "Fraction"])
async def test_regression_an_int_beyond_any_float_is_infinite_not_an_overflow(huge):
    """Regression: such a value raised a bare OverflowError naming nothing."""
    with pytest.raises(ValueError, match=r"max_delay_ms must be finite"):
        Recorder(max_delay_ms=huge)
    with pytest.raises(ValueError, match=r"max_delay_ms must be >= 0"):
        Recorder(max_delay_ms=-huge)
    async with Recorder(timeout=huge) as p:  # like math.inf: no deadline
        assert await p.inference(1, timeout=huge) == own(1)
        with pytest.raises(ValueError, match=r"timeout must be > 0"):
            await p.inference(1, timeout=-huge)


# -- per-call arguments ---------------------------------------------------------------------


@pytest.mark.virtual_clock
@fuzz
@given(
    via=st.sampled_from(["inference", "inference_many"]),
    timeout=odd_values | st.floats(0.01, 10.0),
    priority=odd_values | st.integers(-5, 5),
)
def test_bad_call_arguments_fail_that_caller_only(via: str, timeout: object, priority: object):
    """Three callers are waiting (one batch runs 0-1 s, they are queued behind it) when
    a fourth calls with fuzzed arguments at 0.1 s: bad ones fail that call at once and
    nobody else; good ones are served in the second batch (done at 2.0 s) or time out."""
    arguments: dict[str, Any] = {"timeout": timeout, "priority": priority}
    rules = {"timeout": timeout_rule, "priority": priority_rule}
    bad = any(rule(arguments[name]) for name, rule in rules.items())

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        p = Recorder(delay=1.0, batch_size=8, max_delay_ms=0)
        first = asyncio.create_task(p.inference("first"))
        await asyncio.sleep(0)
        others = [asyncio.create_task(p.inference(("other", i), priority=i)) for i in range(3)]
        await asyncio.sleep(0.1)
        mine: Any = None
        try:
            if via == "inference":
                mine = await p.inference("mine", **arguments)
            else:
                mine = await p.inference_many(["mine", "also mine"], **arguments)
        except Exception as exc:
            mine = exc
        ended = loop.time()
        if bad:
            assert isinstance(mine, (TypeError, ValueError)), mine
            check_refusal(mine, arguments, rules)
            assert ended == pytest.approx(0.1)  # at once
        elif isinstance(mine, batchproxy.DeadlineExceeded):
            assert timeout is not None
            assert seconds(timeout) <= 1.9 + 1e-3
        else:
            assert timeout is None or seconds(timeout) >= 1.9 - 1e-3
            assert mine == (own("mine") if via == "inference" else default(["mine", "also mine"]))
        assert await first == own("first")
        assert await asyncio.gather(*others) == [own(("other", i)) for i in range(3)]
        assert await p.inference("after") == own("after")
        assert p.stats.requests == 5 + (0 if bad else 1 if via == "inference" else 2)
        await p.aclose()
        assert_settled(p.stats)
        sent = "mine" in [item for batch in p.batches for item in batch]
        if bad:
            assert not sent
        elif isinstance(mine, batchproxy.DeadlineExceeded):  # queued until 1.0 s, then sent
            assert sent or seconds(timeout) <= 0.9 + 1e-3
            assert not sent or seconds(timeout) >= 0.9 - 1e-3
        else:
            assert sent

    run_virtual(scenario)


ITERABLE_KINDS = [
    "list", "tuple", "generator", "iterator", "set", "frozenset", "range", "ndarray", "deque",
    "dict_keys", "dict", "str", "bytes", "bytearray", "None", "int", "float", "object",
    "raising generator",
]  # fmt: skip


def make_items(kind: str, base: list[int]) -> tuple[Any, list[Any] | type[Exception], str]:
    """The `items` argument of this kind built from `base`: (items, the items it yields
    or the error it must raise, a fragment that error names)."""
    if kind == "list":
        return list(base), list(base), ""
    if kind == "tuple":
        return tuple(base), list(base), ""
    if kind == "generator":
        return (x for x in base), list(base), ""
    if kind == "iterator":
        return iter(base), list(base), ""
    if kind in ("set", "frozenset", "dict_keys"):
        built: Any = {"set": set, "frozenset": frozenset}.get(kind, dict.fromkeys)(base)
        built = built.keys() if kind == "dict_keys" else built
        return built, list(built), ""
    if kind == "range":
        return range(len(base)), list(range(len(base))), ""
    if kind == "ndarray":
        array = np.array(base, dtype=np.int64)
        return array, list(array), ""
    if kind == "deque":
        return collections.deque(base), list(base), ""
    if kind == "raising generator":

        def source() -> Iterator[int]:
            yield from base
            raise LookupError("the item source failed")

        return source(), LookupError, "the item source failed"
    refused = {
        "dict": (dict.fromkeys(base), "dict"),
        "str": ("".join(chr(97 + x % 26) for x in base), "str"),
        "bytes": (bytes(x % 256 for x in base), "bytes"),
        "bytearray": (bytearray(x % 256 for x in base), "bytearray"),
    }
    if kind in refused:
        value, type_name = refused[kind]
        return value, TypeError, f"inference_many takes an iterable of items, got {type_name}"
    value = {"None": None, "int": len(base), "float": 1.5, "object": object()}[kind]
    return value, TypeError, f"'{type(value).__name__}' object is not iterable"


@pytest.mark.virtual_clock
@fuzz
@given(
    kind=st.sampled_from(ITERABLE_KINDS),
    base=st.lists(st.integers(0, 99), max_size=6, unique=True),
    batch_size=st.integers(1, 4),
)
def test_inference_many_takes_any_iterable_of_items_and_refuses_the_rest(
    kind: str, base: list[int], batch_size: int
):
    items, expected, fragment = make_items(kind, base)

    async def scenario() -> None:
        p = Recorder(delay=1.0, batch_size=batch_size)
        other = asyncio.create_task(p.inference("other"))
        await asyncio.sleep(0.1)
        if isinstance(expected, list):
            assert await p.inference_many(items) == default(expected)
            sent = [item for batch in p.batches for item in batch if item != "other"]
            assert sorted(sent, key=repr) == sorted(expected, key=repr)  # each sent once
            if not expected:
                assert p.stats.requests == 1  # only "other": the model is not touched
        else:
            with pytest.raises(expected) as raised:
                await p.inference_many(items)
            assert_names(raised.value, fragment)
            assert p.stats.requests == 1  # nothing of it was accepted
        assert await other == own("other")
        assert await p.inference("after") == own("after")
        await p.aclose()
        assert_settled(p.stats)

    run_virtual(scenario)


@pytest.mark.virtual_clock
@fuzz
@given(timeout=odd_values, priority=odd_values)
def test_inference_many_checks_its_arguments_even_for_no_items(timeout: object, priority: object):
    arguments = {"timeout": timeout, "priority": priority}
    rules = {"timeout": timeout_rule, "priority": priority_rule}
    bad = any(rule(arguments[name]) for name, rule in rules.items())

    async def scenario() -> None:
        p = Recorder()
        consumed: list[int] = []
        source = (consumed.append(x) or x for x in range(3))
        if bad:
            with pytest.raises((TypeError, ValueError)) as raised:
                await p.inference_many([], timeout=timeout, priority=priority)  # type: ignore[arg-type]
            check_refusal(raised.value, arguments, rules)
            with pytest.raises((TypeError, ValueError)):
                await p.inference_many(source, timeout=timeout, priority=priority)  # type: ignore[arg-type]
            assert consumed == []  # refused before a single item was taken
        else:
            assert await p.inference_many([], timeout=timeout, priority=priority) == []  # type: ignore[arg-type]
        assert p.batches == []
        assert await p.inference("after") == own("after")
        await p.aclose()

    run_virtual(scenario)


def picky_length(item: Any) -> int:
    if item == "unmeasurable":
        raise ValueError("cannot measure 'unmeasurable'")
    return 1


@pytest.mark.virtual_clock
@fuzz
@given(
    good=st.integers(1, 10),
    data=st.data(),
    batch_size=st.integers(1, 4),
    return_exceptions=st.booleans(),
)
def test_inference_many_refused_midway_sends_none_of_its_items(
    good: int, data: st.DataObject, batch_size: int, return_exceptions: bool
):
    """Regression: an item whose cost cannot be measured used to fail the call while
    the items queued before it still ran in the model, their results thrown away; and
    then (found by the combination walk on a `TensorProxy`, issue 38) counted those
    items as calls accepted, then cancelled, though the caller saw its list refused."""
    at = data.draw(st.integers(0, good))
    items: list[Any] = [("many", i) for i in range(good)]
    items.insert(at, "unmeasurable")

    async def scenario() -> None:
        p = Recorder(delay=1.0, batch_size=batch_size, length=picky_length)
        others = [asyncio.create_task(p.inference(("other", i))) for i in range(3)]
        await asyncio.sleep(0)
        with pytest.raises(ValueError, match="cannot measure 'unmeasurable'"):
            await p.inference_many(items, return_exceptions=return_exceptions)
        assert (p.stats.requests, p.stats.cancelled) == (3, 0)  # the others alone
        assert await asyncio.gather(*others) == [own(("other", i)) for i in range(3)]
        sent = [item for batch in p.batches for item in batch]
        assert not [item for item in sent if item in items], "a refused call's item ran"
        assert await p.inference_many(items[:at]) == default(items[:at])
        await p.aclose()
        assert_settled(p.stats)

    run_virtual(scenario)


async def test_a_huge_list_is_refused_whole_when_it_does_not_fit(no_leftovers):
    async with Recorder(batch_size=64, max_queue_size=1000) as p:
        other = asyncio.create_task(p.inference("other"))
        with pytest.raises(batchproxy.QueueFull):
            await p.inference_many(range(50_000))
        assert p.stats.rejected == 50_000
        assert p.stats.queue_depth <= 1
        assert await other == own("other")
        assert await p.inference("after") == own("after")
    assert_settled(p.stats)


async def test_a_huge_list_is_served_in_batches(no_leftovers):
    items = list(range(5_000))
    async with Recorder(batch_size=512) as p:
        assert await p.inference_many(items) == default(items)
        assert max(len(batch) for batch in p.batches) <= 512
    assert_settled(p.stats)


# -- what the model returns -----------------------------------------------------------------


class Stop(BaseException):
    """A BaseException that is not an Exception."""


EXCEPTIONS: list[Callable[[], Exception]] = [
    lambda: ValueError("bad item"),
    lambda: RuntimeError("model"),
    lambda: TimeoutError("slow"),
    lambda: StopIteration("stop"),
    lambda: StopAsyncIteration("stop async"),
    lambda: TypeError("type"),
    lambda: batchproxy.QueueFull("another proxy", 3),
]
BASE_EXCEPTIONS: list[Callable[[], BaseException]] = [
    lambda: KeyboardInterrupt("ctrl-c"),
    lambda: SystemExit(3),
    GeneratorExit,
    lambda: asyncio.CancelledError("stray"),
    lambda: Stop("stop"),
]
ERRORS = EXCEPTIONS + BASE_EXCEPTIONS


class LenRaisesList(list):  # type: ignore[type-arg]
    def __init__(self, values: list[Any], error: BaseException) -> None:
        super().__init__(values)
        self.error = error

    def __len__(self) -> int:
        raise self.error


class IterRaisesList(LenRaisesList):
    def __len__(self) -> int:
        return list.__len__(self)

    def __iter__(self) -> Iterator[Any]:
        raise self.error


class LenRaises:
    """Sequence-like (has `__len__`, `__iter__`), not a list: `__len__` raises."""

    def __init__(self, values: list[Any], error: BaseException) -> None:
        self.values = values
        self.error = error

    def __len__(self) -> int:
        raise self.error

    def __iter__(self) -> Iterator[Any]:
        return iter(self.values)


class IterRaises(LenRaises):
    def __len__(self) -> int:
        return len(self.values)

    def __iter__(self) -> Iterator[Any]:
        raise self.error


NOT_SEQUENCES: dict[str, Callable[[list[Any]], Any]] = {
    "NoneType": lambda items: None,
    "int": len,
    "float": lambda items: 1.5,
    "str": lambda items: "x" * len(items),  # the right length, still not results
    "bytes": lambda items: b"x" * len(items),
    "dict": lambda items: dict(enumerate(default(items))),
    "set": lambda items: set(default(items)),
    "frozenset": lambda items: frozenset(default(items)),
    "dict_keys": lambda items: dict.fromkeys(default(items)).keys(),
    "generator": lambda items: (own(x) for x in items),
    "list_iterator": lambda items: iter(default(items)),
    "ndarray": lambda items: np.array(float(len(items))),  # model(x).sum(): 0-d
    "Tensor": lambda items: torch.tensor(float(len(items))),
    "object": lambda items: object(),
}

CONTAINERS: dict[str, Callable[[list[Any]], Any]] = {
    "list": list,
    "tuple": tuple,
    "deque": collections.deque,
    "ndarray": lambda values: np.array(values, dtype=np.int64),
    "Tensor": lambda values: torch.tensor(values, dtype=torch.int64),
}


@dataclass(frozen=True)
class Answer:
    """How the model answers one batch of int items, and what each caller must get."""

    kind: str  # ok | not-a-sequence | count | slots | raise | len | iter
    container: str = "list"
    delta: int = 0
    errors: tuple[int | None, ...] = ()  # per slot (kind "slots"): an index in ERRORS or None
    error: int = 0  # kind raise/len/iter: an index in ERRORS
    sequence: str = "list subclass"  # kind len/iter: a list subclass or a sequence-like


answers = st.one_of(
    st.builds(Answer, st.just("ok"), st.sampled_from(sorted(CONTAINERS))),
    st.builds(Answer, st.just("not-a-sequence"), st.sampled_from(sorted(NOT_SEQUENCES))),
    st.builds(
        Answer,
        st.just("count"),
        st.sampled_from(sorted(CONTAINERS)),
        st.integers(-8, 3).filter(bool),
    ),
    st.builds(
        Answer,
        st.just("slots"),
        errors=st.lists(st.none() | st.integers(0, len(ERRORS) - 1), min_size=8, max_size=8).map(
            tuple
        ),
    ),
    st.builds(
        Answer,
        st.sampled_from(["raise", "len", "iter"]),
        error=st.integers(0, len(ERRORS) - 1),
        sequence=st.sampled_from(["list subclass", "sequence-like"]),
    ),
)


class Answering:
    """A `respond` function for one Answer: remembers the errors it made."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.made: dict[int, BaseException] = {}  # slot (or -1: the batch) -> error

    def __call__(self, items: list[int]) -> Any:
        answer = self.answer
        values = [x * 10 for x in items]
        if answer.kind == "ok":
            return CONTAINERS[answer.container](values)
        if answer.kind == "not-a-sequence":
            return NOT_SEQUENCES[answer.container](items)
        if answer.kind == "count":
            size = max(0, len(items) + answer.delta)
            return CONTAINERS[answer.container]((values * 2 + [0] * 8)[:size])
        if answer.kind == "slots":
            results: list[Any] = []
            for slot, value in enumerate(values):
                index = answer.errors[slot]
                if index is None:
                    results.append(value)
                else:
                    self.made[slot] = ERRORS[index]()
                    results.append(self.made[slot])
            return results
        error = self.made[-1] = ERRORS[answer.error]()
        if answer.kind == "raise":
            raise error
        if answer.kind == "len":
            return (LenRaisesList if answer.sequence == "list subclass" else LenRaises)(
                values, error
            )
        return (IterRaisesList if answer.sequence == "list subclass" else IterRaises)(values, error)


def value_of(result: Any) -> Any:
    if isinstance(result, (np.generic, torch.Tensor)):
        assert result.shape == ()
        return int(result)
    return result


def check_wrapped(got: BaseException | None, raised: BaseException, proxy: str) -> None:
    """An error from the model reached a caller as documented: an Exception as it is, a
    StopIteration in a RuntimeError (a future cannot carry one; Python does the same for
    a StopIteration raised in a coroutine), any other BaseException in InferenceError."""
    assert got is not None
    if isinstance(raised, StopIteration):
        assert type(got) is RuntimeError
        assert got.__cause__ is raised
        assert_names(got, "StopIteration")
    elif isinstance(raised, Exception):
        assert got is raised
    else:
        assert isinstance(got, batchproxy.InferenceError)
        assert got.__cause__ is raised
        assert_names(got, proxy, type(raised).__name__)


def check_outcomes(
    answer: Answer, made: dict[int, BaseException], items: list[int], tasks: list[Any], proxy: str
) -> int:
    """Every caller's outcome against the answer; returns how many callers failed."""
    n = len(items)
    failed = 0
    for slot, (item, task) in enumerate(zip(items, tasks, strict=True)):
        assert task.done()
        assert not task.cancelled(), "a caller was cancelled by a stray CancelledError"
        got = task.exception()
        failed += got is not None
        kind = answer.kind
        if kind == "ok":
            assert got is None
            assert value_of(task.result()) == item * 10, "cross-talk"
        elif kind == "not-a-sequence":
            assert type(got) is TypeError
            assert_names(got, f"{proxy}._inference must return a sequence", answer.container)
        elif kind == "count":
            assert isinstance(got, batchproxy.BatchSizeMismatch)
            assert (got.expected, got.got) == (n, max(0, n + answer.delta))
            assert_names(got, f"returned {got.got} results for a batch of {n} items")
        elif kind == "slots":
            if slot in made:
                check_wrapped(got, made[slot], proxy)
            else:
                assert got is None
                assert task.result() == item * 10
        elif kind == "raise":
            raised = made[-1]
            if isinstance(raised, StopIteration):  # PEP 479, inside the model's coroutine
                assert type(got) is RuntimeError
                assert got.__cause__ is raised
            else:
                check_wrapped(got, raised, proxy)
        else:  # the results raise while they are read: len() or iter()
            raised = made[-1]
            if isinstance(raised, TypeError) and kind == "len":
                assert got is None  # list() falls back on iterating, which works
                assert task.result() == item * 10
            elif isinstance(raised, TypeError):  # not iterable after all
                assert type(got) is TypeError
                assert got.__cause__ is raised
                assert_names(got, f"{proxy}._inference must return a sequence")
            else:
                check_wrapped(got, raised, proxy)
    return failed


async def answer_scenario(p: Recorder | ThreadRecorder, answer: Answer, n: int) -> None:
    respond = Answering(answer)
    p.respond = respond
    items = list(range(1, n + 1))
    tasks = [asyncio.ensure_future(p.inference(item)) for item in items]
    await asyncio.wait(tasks)
    assert p.batches == [items]  # one batch: its behaviour is the answer's
    failed = check_outcomes(answer, respond.made, items, tasks, p.name)
    stats = p.stats
    batch_wide = answer.kind in ("not-a-sequence", "count", "raise") or (
        answer.kind in ("len", "iter") and failed
    )
    assert stats.failed_batches == (1 if batch_wide else 0)
    assert (stats.errors, stats.succeeded) == (failed, n - failed)
    p.respond = default  # the proxy keeps serving
    assert await asyncio.gather(p.inference(98), p.inference(99)) == [own(98), own(99)]
    await p.aclose()
    assert_settled(p.stats)


@pytest.mark.virtual_clock
@few(100)
@given(answer=answers, n=st.integers(1, 6))
def test_every_caller_gets_one_clear_outcome_whatever_the_model_returns(answer: Answer, n: int):
    run_virtual(lambda: answer_scenario(Recorder(batch_size=8, name="fuzzed"), answer, n))


@few(30)
@given(answer=answers, n=st.integers(1, 4))
def test_the_same_from_a_plain_def_model_on_a_worker_thread(answer: Answer, n: int):
    run_real(lambda: answer_scenario(ThreadRecorder(batch_size=8, name="fuzzed-sync"), answer, n))


@pytest.mark.parametrize("make", [lambda: StopIteration("done"), KeyboardInterrupt])
async def test_regression_unsettable_errors_in_results_do_not_hang_callers(make, no_leftovers):
    """Regression: a StopIteration in a result slot made `set_exception` raise inside the
    batch task, and a BaseException from reading the results escaped it: the callers of
    that batch hung forever. Now they get a RuntimeError / InferenceError."""
    error = make()
    p = Recorder(lambda items: [error, *default(items[1:])], batch_size=4)
    results = await asyncio.wait_for(
        asyncio.gather(*(p.inference(i) for i in range(3)), return_exceptions=True), 10
    )
    check_wrapped(results[0], error, "Recorder")
    assert results[1:] == [own(1), own(2)]
    p.respond = lambda items: LenRaises(default(items), error)
    results = await asyncio.wait_for(
        asyncio.gather(*(p.inference(i) for i in range(3)), return_exceptions=True), 10
    )
    for result in results:
        check_wrapped(result, error, "Recorder")
    p.respond = default
    assert await p.inference(5) == own(5)
    await p.aclose()


# -- tensors: collate, split, validate ------------------------------------------------------

FLOAT_DTYPES = ["float16", "float32", "float64"]


@st.composite
def float_batches(draw: st.DrawFn) -> tuple[list[np.ndarray], str]:
    """1-5 float arrays, ragged on axis 0 (0 to 6 long), any values: NaN, inf, -0.0."""
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    hidden = draw(st.sampled_from([(), (1,), (3,)]))
    lengths = draw(st.lists(st.integers(0, 6), min_size=1, max_size=5))
    width = {"float16": 16, "float32": 32, "float64": 64}[dtype]
    elements = st.floats(width=width, allow_nan=True, allow_infinity=True)  # type: ignore[arg-type]
    items = [
        draw(hnp.arrays(np.dtype(dtype), (length, *hidden), elements=elements))
        for length in lengths
    ]
    library = draw(st.sampled_from(["numpy", "torch"]))
    return items, library


def to_numpy(value: Any) -> np.ndarray:
    return value.numpy() if isinstance(value, torch.Tensor) else np.asarray(value)


def same(got: Any, want: np.ndarray) -> None:
    got = to_numpy(got)
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    assert np.array_equal(got, want, equal_nan=True)


@fuzz
@given(
    batch=float_batches(),
    data=st.data(),
    side=st.sampled_from(["right", "left"]),
    multiple=st.none() | st.integers(1, 4),
)
def test_nan_and_inf_are_data_they_pass_collate_and_split_unchanged(
    batch: tuple[list[np.ndarray], str], data: st.DataObject, side: str, multiple: int | None
):
    arrays, library = batch
    width = arrays[0].dtype.itemsize * 8  # a pad value the dtype holds: NaN, inf, anything
    pad_value = data.draw(st.floats(width=width, allow_nan=True, allow_infinity=True))  # type: ignore[arg-type]
    items = [torch.from_numpy(a) if library == "torch" else a for a in arrays]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no cast warnings either
        collated = tensors.collate(
            items,
            pad_value=pad_value,
            padding_side=side,  # type: ignore[arg-type]
            pad_to_multiple_of=multiple,
        )
        back = tensors.split(collated.data, collated)
    assert tensors.validate(items) == [None] * len(items)
    assert collated.lengths == [len(a) for a in arrays]
    for item, part in zip(arrays, back, strict=True):
        same(part, item)
    batched = to_numpy(collated.data)
    if collated.mask is not None:
        mask = to_numpy(collated.mask)
        assert mask.sum(axis=1).tolist() == collated.lengths
        padding = batched[~mask]
        assert np.array_equal(padding, np.full_like(padding, pad_value), equal_nan=True), (
            "padding is pad_value, NaN included"
        )


class Identity(TensorProxy[Any, Any]):
    """`_forward` returns the padded batch itself and a per-item NaN count."""

    def __init__(self, **options: Any) -> None:
        self.seen: list[Collated] = []
        super().__init__(**options)

    @override
    async def _forward(self, batch: Collated, /) -> Any:
        self.seen.append(batch)
        n = len(batch.lengths)
        if isinstance(batch.data, dict):
            return batch.data, np.zeros(n)
        data = to_numpy(batch.data)
        nans = np.isnan(data).reshape(n, -1).sum(axis=1) if data.dtype.kind == "f" else np.zeros(n)
        return batch.data, nans


@pytest.mark.virtual_clock
@fuzz
@given(batch=float_batches())
def test_nan_and_inf_pass_through_a_tensor_proxy_to_their_own_caller(
    batch: tuple[list[np.ndarray], str],
):
    arrays, library = batch
    items = [torch.from_numpy(a) if library == "torch" else a for a in arrays]

    async def scenario() -> None:
        p = Identity(batch_size=8, pad_value=0)
        results = await asyncio.gather(*(p.inference(item) for item in items))
        for array, (echo, nans) in zip(arrays, results, strict=True):
            same(echo, array)
            assert int(nans) == int(np.isnan(array).sum())
        await p.aclose()
        assert_settled(p.stats)

    run_virtual(scenario)


def np_item(dtype: str, rank: int) -> Callable[[int], Any]:
    return lambda n: np.full((n, 2)[:rank] if rank else (), 0.5, dtype=dtype)


def torch_item(dtype: str) -> Callable[[int], Any]:
    return lambda n: torch.full((n,), 1, dtype=getattr(torch, dtype))


ARRAY_KINDS: dict[str, tuple[tuple[str, int, str], Callable[[int], Any]]] = {
    # name: ((library, rank, dtype), make(length))
    "np f64 1d": (("numpy", 1, "float64"), np_item("float64", 1)),
    "np f32 1d": (("numpy", 1, "float32"), np_item("float32", 1)),
    "np i64 1d": (("numpy", 1, "int64"), np_item("int64", 1)),
    "np f64 2d": (("numpy", 2, "float64"), np_item("float64", 2)),
    "np f64 0d": (("numpy", 0, "float64"), np_item("float64", 0)),
    "torch f32 1d": (("torch", 1, "float32"), torch_item("float32")),
    "torch i64 1d": (("torch", 1, "int64"), torch_item("int64")),
}
# measured (length) but not batchable: (item, error type, message fragment)
UNBATCHABLE: dict[str, tuple[Any, type[Exception], str]] = {
    "float": (3.5, TypeError, "cannot batch a float"),
    "empty tuple": ((), ValueError, "an empty tuple has nothing to batch"),
    "empty dict": ({}, ValueError, "an empty dict has nothing to batch"),
}
# not even measurable: the call itself fails at once (what validate() says about it)
UNMEASURABLE: dict[str, tuple[Any, str, str]] = {
    "None": (None, "cannot measure a NoneType", "cannot batch a NoneType"),
    "str": ("token ids", "cannot measure a str", "cannot batch a str"),
    "list of str": (["a", "b"], "cannot measure a list", "cannot batch a list"),
    "list of int": ([1, 2, 3], "cannot measure a list", "cannot batch a list"),
    "dict of list": ({"ids": [1, 2]}, "cannot measure a list", "key 'ids' holds a list"),
}


def mismatch(
    got: tuple[str, int, str], want: tuple[str, int, str]
) -> tuple[type[Exception], tuple[str, ...]]:
    """The error type and message fragments for an array of signature `got` in a batch
    of `want` arrays."""
    if got[0] != want[0]:
        return TypeError, ("got a torch tensor" if got[0] == "torch" else "got a NumPy array",)
    if got[1] != want[1]:
        return ValueError, (f"expected rank {want[1]} like the other", f"got rank {got[1]}:")
    return TypeError, (f"expected dtype {want[2]} like the other", f"of dtype {got[2]} and")


@st.composite
def mixed_batches(draw: st.DrawFn) -> tuple[str, list[tuple[str, int]]]:
    """A strict majority of one array kind, the rest of any kind: (majority, [(kind,
    length)]), shuffled."""
    majority = draw(st.sampled_from(sorted(ARRAY_KINDS)))
    everything = sorted(ARRAY_KINDS) + sorted(UNBATCHABLE) + sorted(UNMEASURABLE)
    odd = draw(st.lists(st.sampled_from(everything), max_size=4))
    count = draw(st.integers(len(odd) + 1, len(odd) + 3))
    kinds = [majority] * count + odd
    lengths = draw(st.lists(st.integers(0, 5), min_size=len(kinds), max_size=len(kinds)))
    order = draw(st.permutations(list(zip(kinds, lengths, strict=True))))
    return majority, order


def build(kind: str, length: int) -> Any:
    if kind in ARRAY_KINDS:
        return ARRAY_KINDS[kind][1](length)
    if kind in UNBATCHABLE:
        return UNBATCHABLE[kind][0]
    return UNMEASURABLE[kind][0]


@fuzz
@given(batch=mixed_batches())
def test_validate_fails_exactly_the_items_that_cannot_join_the_majority(
    batch: tuple[str, list[tuple[str, int]]],
):
    majority, members = batch
    want = ARRAY_KINDS[majority][0]
    items = [build(kind, length) for kind, length in members]
    errors = tensors.validate(items)
    assert len(errors) == len(items)
    for index, ((kind, _), error) in enumerate(zip(members, errors, strict=True)):
        if kind in ARRAY_KINDS:
            got = ARRAY_KINDS[kind][0]
            if got == want:
                assert error is None
            else:
                kinds, fragments = mismatch(got, want)
                assert type(error) is kinds
                assert_names(error, f"item {index}:", *fragments)
        elif kind in UNBATCHABLE:
            _, kinds, fragment = UNBATCHABLE[kind]
            assert type(error) is kinds
            assert_names(error, f"item {index}:", fragment)
        else:
            assert type(error) is TypeError
            assert_names(error, f"item {index}: {UNMEASURABLE[kind][2]}")


@pytest.mark.virtual_clock
@fuzz
@given(batch=mixed_batches())
def test_a_tensor_proxy_fails_only_the_callers_of_odd_items(
    batch: tuple[str, list[tuple[str, int]]],
):
    majority, members = batch
    want = ARRAY_KINDS[majority][0]
    items = [build(kind, length) for kind, length in members]

    async def scenario() -> list[Any]:
        p = Identity(batch_size=16)

        async def call(item: Any) -> Any:
            try:
                return await p.inference(item)
            except Exception as exc:
                return exc

        outcomes = await asyncio.gather(*(call(item) for item in items))
        assert await p.inference(np.ones(3)) is not None  # serves on
        await p.aclose()
        assert_settled(p.stats)
        assert len(p.seen) == 2  # the fuzzed batch (forward runs: a majority), the last call
        return outcomes

    outcomes = run_virtual(scenario)
    for (kind, _), item, outcome in zip(members, items, outcomes, strict=True):
        if isinstance(outcome, Exception):  # about the caller's item, not its batch slot
            assert not re.search(r"\bitem \d", str(outcome)), outcome
        if kind in UNMEASURABLE:
            assert type(outcome) is TypeError
            assert_names(outcome, UNMEASURABLE[kind][1])
        elif kind in UNBATCHABLE:
            _, kinds, fragment = UNBATCHABLE[kind]
            assert type(outcome) is kinds
            assert_names(outcome, fragment)
        elif ARRAY_KINDS[kind][0] == want:
            echo, nans = outcome
            same(echo, to_numpy(item))
            assert int(nans) == 0
        else:
            kinds, fragments = mismatch(ARRAY_KINDS[kind][0], want)
            assert type(outcome) is kinds
            assert_names(outcome, *fragments)


def test_empty_and_zero_dim_items_collate_and_split_back():
    empty = tensors.collate([np.zeros(0), np.zeros(0)])
    assert empty.data.shape == (2, 0)
    assert [part.shape for part in tensors.split(empty.data, empty)] == [(0,), (0,)]
    ragged = tensors.collate([np.zeros(0), np.arange(3.0)])
    assert ragged.lengths == [0, 3]
    assert [p.tolist() for p in tensors.split(ragged.data, ragged)] == [[], [0.0, 1.0, 2.0]]
    scalars = tensors.collate([torch.tensor(1.5), torch.tensor(NAN)])
    assert scalars.data.shape == (2,)
    parts = tensors.split(scalars.data, scalars)
    assert parts[0].item() == 1.5
    assert math.isnan(parts[1].item())


ITEMS_ARGUMENTS: list[tuple[object, str]] = [
    (None, "NoneType"),
    ("abc", "str"),
    (b"ab", "bytes"),
    (5, "int"),
    (np.zeros((3, 2)), "numpy.ndarray"),
    ({"ids": np.zeros(2)}, "dict"),
    ({1, 2}, "set"),
    (iter([np.zeros(2)]), "list_iterator"),
]


@pytest.mark.parametrize(("items", "type_name"), ITEMS_ARGUMENTS, ids=lambda v: type(v).__name__)
def test_collate_and_validate_refuse_what_is_not_a_list_of_items(items: object, type_name: str):
    for function in (tensors.collate, tensors.validate):
        with pytest.raises(TypeError) as raised:
            function(items)  # type: ignore[arg-type]
        assert_names(raised.value, f"{function.__name__} takes a list of items, got {type_name}")
    with pytest.raises(ValueError, match="at least one item"):
        tensors.collate(())


@pytest.mark.parametrize("collated", [None, "collated", {"lengths": [1]}, np.zeros(2)], ids=repr)
def test_split_refuses_what_is_not_a_collated_batch(collated: object):
    with pytest.raises(TypeError) as raised:
        tensors.split(np.zeros(2), collated)  # type: ignore[arg-type]
    assert_names(raised.value, "split needs the Collated that collate returned")


SPLIT_OUTPUTS: list[tuple[Any, type[Exception], str]] = [
    ("text", TypeError, "outputs is a str"),
    (3, TypeError, "outputs is a int"),
    (np.float64(1.0), ValueError, "got a 0-d value"),
    (torch.tensor(1.0), ValueError, "got a 0-d value"),
    (np.zeros(5), ValueError, "expected 2 rows (one per item), got shape (5,)"),
    ([1.0, 2.0], TypeError, "outputs[0] is a float"),
    ({"logits": (x for x in range(2))}, TypeError, "outputs['logits'] is a generator"),
]


@pytest.mark.parametrize(("outputs", "kind", "fragment"), SPLIT_OUTPUTS, ids=repr)
def test_split_names_what_is_wrong_with_the_outputs(outputs: Any, kind: type, fragment: str):
    collated = tensors.collate([np.zeros(2), np.zeros(3)])
    with pytest.raises(kind) as raised:
        tensors.split(outputs, collated)
    assert_names(raised.value, fragment)


INT_LIMITS = {"int8": (-128, 127), "uint8": (0, 255), "int64": (-(2**63), 2**63 - 1)}


def pad_rule(value: object, dtype: str) -> tuple[type[Exception], str] | None:
    """Whether `value` pads an array of `dtype`: None, or (error type, fragment)."""
    if isinstance(value, dict):
        return TypeError, "a pad_value mapping needs dict items"
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number, np.bool_)):
        return TypeError, "pad_value must be a number"
    if dtype in FLOAT_DTYPES:  # any value in range; NaN and infinities too
        try:
            number = float(value)
        except OverflowError:
            return ValueError, f"does not fit dtype {dtype}"
        largest = float(np.finfo(dtype).max)
        fits = not math.isfinite(number) or abs(number) <= largest
        return None if fits else (ValueError, f"does not fit dtype {dtype}")
    low, high = INT_LIMITS[dtype]
    number = value.item() if isinstance(value, (np.number, np.bool_)) else value
    if isinstance(number, float) and not (math.isfinite(number) and number.is_integer()):
        return ValueError, f"does not fit dtype {dtype} exactly"
    if not low <= number <= high:
        return ValueError, f"does not fit dtype {dtype} exactly"
    return None


@fuzz
@given(
    value=(odd_values | st.integers(-300, 300) | st.floats(-1e6, 1e6)).filter(
        lambda v: not isinstance(v, np.bool_)  # a bool, to torch: another story
    ),
    dtype=st.sampled_from([*FLOAT_DTYPES, *INT_LIMITS]),
    library=st.sampled_from(["numpy", "torch"]),
)
def test_a_bad_pad_value_is_refused_by_name_and_a_good_one_pads(
    value: object, dtype: str, library: str
):
    arrays = [np.zeros(2, dtype=dtype), np.zeros(3, dtype=dtype)]
    items = [torch.from_numpy(a) for a in arrays] if library == "torch" else arrays
    expected = pad_rule(value, dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # NaN or inf for an int dtype: no cast warning
        if expected is None:
            collated = tensors.collate(items, pad_value=value)  # type: ignore[arg-type]
            padded = to_numpy(collated.data)[0, 2]
            assert np.array_equal(padded, np.asarray(value, dtype=dtype), equal_nan=True)
        else:
            kind, fragment = expected
            with pytest.raises(kind) as raised:
                tensors.collate(items, pad_value=value)  # type: ignore[arg-type]
            assert_names(raised.value, fragment)


# -- tensors: huge dimensions, without allocating them --------------------------------------


def huge(library: str) -> Any:
    """2**62 bytes as a zero-stride view: costs no memory."""
    if library == "torch":
        return torch.zeros((), dtype=torch.uint8).expand(2**62)
    return np.broadcast_to(np.zeros((), dtype=np.uint8), (2**62,))


@pytest.mark.parametrize("library", ["numpy", "torch"])
def test_a_batch_too_big_to_address_is_refused_before_allocating(library: str):
    big = huge(library)
    assert tensors.length(big) == 2**62
    small = big[:3].clone() if library == "torch" else big[:3].copy()
    for items in ([big, big], [big, small], [small, big]):
        with pytest.raises(ValueError) as raised:
            tensors.collate(items)
        assert_names(
            raised.value, "a batch of 2 items", f"({2**62},)", "more than can be addressed"
        )


class Counting(TensorProxy[Any, Any]):
    @override
    def _forward(self, batch: Collated, /) -> Any:
        return to_numpy(batch.data).reshape(len(batch.lengths), -1).sum(axis=1)


@pytest.mark.parametrize("library", ["numpy", "torch"])
async def test_a_huge_item_fails_its_batch_or_alone_under_a_token_budget(library, no_leftovers):
    big = huge(library)
    small = np.ones(3, dtype=np.uint8)
    small_item = torch.from_numpy(small) if library == "torch" else small
    # no budget: one batch holds both, and it cannot be formed: both callers fail
    async with Counting(batch_size=4) as p:
        outcomes = await asyncio.wait_for(
            asyncio.gather(p.inference(big), p.inference(small_item), return_exceptions=True), 30
        )
        for outcome in outcomes:
            assert isinstance(outcome, ValueError)
            assert_names(outcome, "more than can be addressed")
        assert int(await p.inference(small_item)) == 3  # serves on
    # with a token budget the huge item runs alone: only its caller fails
    async with Counting(batch_size=4, max_batch_tokens=64) as p:
        alone, fine = await asyncio.wait_for(
            asyncio.gather(p.inference(big), p.inference(small_item), return_exceptions=True), 30
        )
        assert isinstance(alone, (MemoryError, RuntimeError)), alone  # allocation refused
        assert int(fine) == 3


# -- TensorProxy's own options --------------------------------------------------------------


def pad_type_rule(value: object) -> Expected:
    """TensorProxy checks that pad values are numbers (a dict: of numbers); whether one
    fits the items' dtype it can only tell once it pads a batch."""
    values = value.values() if isinstance(value, dict) else [value]
    kinds = {rule[0] for rule in (pad_rule(v, "float64") for v in values) if rule}
    return (TypeError,) if TypeError in kinds else ()


def tensor_option_rule(option: str, value: object) -> Expected:
    if option == "pad_value":
        return pad_type_rule(value)
    if option == "padding_side":
        return () if isinstance(value, str) and value in ("right", "left") else (ValueError,)
    if option == "pad_to_multiple_of":
        return count_rule(value, optional=True)
    if option == "length_aware":
        return strict_bool_rule(value)
    raise AssertionError(option)


@fuzz
@given(
    option=st.sampled_from(["pad_value", "padding_side", "pad_to_multiple_of", "length_aware"]),
    value=odd_values | st.sampled_from([{"ids": 0}, {"ids": "0"}, {"ids": None}, "left"]),
)
def test_a_bad_tensor_proxy_option_is_refused_by_name(option: str, value: object):
    expected = tensor_option_rule(option, value)
    if expected:
        with pytest.raises(expected) as raised:
            Identity(**{option: value})
        assert_names(raised.value, option)
    elif option == "pad_to_multiple_of" and value is not None and value > 64:  # type: ignore[operator]
        proxy = Identity(**{option: value})
        if value * 2 * 8 > sys.maxsize:  # type: ignore[operator]
            with pytest.raises(ValueError, match="more than can be addressed"):  # refused, and
                run_real(lambda: serves_tensors(proxy, dicts=False))  # nothing allocated
        # else: padding two items to a multiple of it would allocate that much: not here
    elif option == "pad_value" and not isinstance(value, dict) and pad_rule(value, "float64"):
        proxy = Identity(**{option: value})  # a number, too big for the items' float64
        with pytest.raises(ValueError, match=r"pad_value .* does not fit dtype float64"):
            run_real(lambda: serves_tensors(proxy, dicts=False))
    else:
        run_real(lambda: serves_tensors(Identity(**{option: value}), dicts=isinstance(value, dict)))


async def serves_tensors(proxy: TensorProxy[Any, Any], *, dicts: bool) -> None:
    """Two ragged items (so padding happens) go through and come back."""
    items: list[Any] = [np.arange(3.0), np.arange(5.0)]
    if dicts:  # a pad_value per key needs dict items
        items = [{"ids": item} for item in items]
    async with proxy:
        results = await asyncio.wait_for(asyncio.gather(*map(proxy.inference, items)), 10)
    for item, (echo, _) in zip(items, results, strict=True):
        if dicts:
            same(echo["ids"], item["ids"])
        else:
            same(echo, item)
