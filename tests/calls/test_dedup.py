"""`dedup`: identical calls in flight computed once; `cache_size`/`cache_ttl` on top.

On looptime's virtual clock: a `Recorder` model takes `delay` virtual seconds.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from typing import Any

import pytest
from _support import RaisingListener, Recorder, assert_settled, wait_for

import batchproxy
from batchproxy import Dedup

pytestmark = pytest.mark.looptime


async def settle(rounds: int = 5) -> None:
    for _ in range(rounds):
        await asyncio.sleep(0)


async def test_identical_calls_share_one_slot_and_each_gets_the_result() -> None:
    p = Recorder(delay=1.0, batch_size=8, dedup=True)
    results = await asyncio.gather(*(p.inference(x) for x in ["a", "b", "a", "a", "c", "b"]))
    assert results == [("out", x) for x in ["a", "b", "a", "a", "c", "b"]]
    assert [sorted(batch) for batch in p.batches] == [["a", "b", "c"]]
    stats = p.stats
    assert (stats.requests, stats.succeeded, stats.deduplicated, stats.items) == (6, 6, 3, 3)
    assert stats.total_latency.count == 6  # each caller's latency, not the slot's
    assert_settled(stats)
    await p.aclose()


async def test_a_call_joins_a_slot_whose_batch_is_running() -> None:
    p = Recorder(delay=10.0, batch_size=4, dedup=True)
    first = asyncio.create_task(p.inference("x"))
    await asyncio.sleep(5.0)  # its batch runs
    assert p.batches == [["x"]]
    second = asyncio.create_task(p.inference("x"))
    assert await asyncio.gather(first, second) == [("out", "x")] * 2
    assert p.batches == [["x"]]
    assert p.stats.deduplicated == 1
    # settled: the next call with that key makes a new slot
    assert await p.inference("x") == ("out", "x")
    assert p.batches == [["x"], ["x"]]
    await p.aclose()


async def test_a_key_function_decides_what_is_identical() -> None:
    p = Recorder(delay=1.0, batch_size=8, dedup=lambda item: item["id"])
    a, b, c = {"id": 1, "v": "first"}, {"id": 1, "v": "second"}, {"id": 2, "v": "third"}
    results = await asyncio.gather(p.inference(a), p.inference(b), p.inference(c))
    assert results == [("out", a), ("out", a), ("out", c)]  # b gets the slot's result
    assert p.batches == [[a, c]]
    await p.aclose()


async def test_an_unhashable_item_is_refused_with_the_fix() -> None:
    p = Recorder(batch_size=8, dedup=True)
    with pytest.raises(TypeError, match=r"hashable key, got list; pass dedup=<a function"):
        await p.inference([1, 2])
    bad = Recorder(batch_size=8, dedup=lambda item: [item])
    with pytest.raises(TypeError, match="the dedup function must return a hashable value"):
        await bad.inference(1)
    assert p.stats.requests == bad.stats.requests == 0
    await p.aclose()
    await bad.aclose()


async def test_an_exception_in_the_slot_fails_each_of_its_callers() -> None:
    def respond(items: list[Any]) -> list[Any]:
        return [ValueError(f"bad {x}") if x == "bad" else ("out", x) for x in items]

    p = Recorder(respond, delay=1.0, batch_size=8, dedup=True)
    outcomes = await asyncio.gather(
        p.inference("bad"), p.inference("ok"), p.inference("bad"), return_exceptions=True
    )
    assert isinstance(outcomes[0], ValueError)
    assert isinstance(outcomes[2], ValueError)
    assert outcomes[1] == ("out", "ok")
    stats = p.stats
    assert (stats.errors, stats.succeeded, stats.items) == (2, 1, 2)
    assert_settled(stats)
    await p.aclose()


async def test_a_failed_batch_fails_every_caller_of_its_slots() -> None:
    def respond(items: list[Any]) -> list[Any]:
        raise RuntimeError("model down")

    p = Recorder(respond, batch_size=8, dedup=True)
    outcomes = await asyncio.gather(*(p.inference(x) for x in "aab"), return_exceptions=True)
    assert all(isinstance(o, RuntimeError) for o in outcomes)
    assert p.stats.errors == 3
    assert_settled(p.stats)
    await p.aclose()


async def busy(p: Recorder) -> asyncio.Task[Any]:
    """Hold the proxy's one slot until t0 + 10 with a first call."""
    first = asyncio.create_task(p.inference("first"))
    await settle()
    assert p.batches == [["first"]]
    return first


async def test_one_caller_cancelled_while_queued_leaves_the_others_their_result() -> None:
    p = Recorder(delay=10.0, batch_size=4, max_concurrent_batches=1, dedup=True)
    first = await busy(p)
    a, b = (asyncio.create_task(p.inference("x")) for _ in range(2))
    await settle()
    a.cancel()
    await settle()
    assert p.stats.queue_depth == 1  # the slot stays: b still waits
    assert await b == ("out", "x")
    await first
    assert p.batches == [["first"], ["x"]]
    stats = p.stats
    assert (stats.cancelled, stats.succeeded) == (1, 2)
    assert_settled(stats)
    await p.aclose()


async def test_every_caller_gone_the_slot_never_reaches_the_model() -> None:
    p = Recorder(delay=10.0, batch_size=4, max_concurrent_batches=1, dedup=True)
    first = await busy(p)
    calls = [asyncio.create_task(p.inference("x")) for _ in range(3)]
    await settle()
    for call in calls:
        call.cancel()
    await settle()
    assert p.stats.queue_depth == 0
    await first
    await asyncio.sleep(20.0)
    assert p.batches == [["first"]]
    # and the key is free again: a new call makes a new slot
    assert await p.inference("x") == ("out", "x")
    assert p.batches == [["first"], ["x"]]
    assert p.stats.cancelled == 3
    assert_settled(p.stats)
    await p.aclose()


async def test_a_caller_cancelled_while_its_slot_runs_does_not_disturb_the_others() -> None:
    p = Recorder(delay=10.0, batch_size=4, dedup=True)
    a, b = (asyncio.create_task(p.inference("x")) for _ in range(2))
    await asyncio.sleep(5.0)
    a.cancel()
    assert await b == ("out", "x")
    with pytest.raises(asyncio.CancelledError):
        await a
    assert p.stats.cancelled == 1
    assert_settled(p.stats)
    await p.aclose()


async def test_each_caller_keeps_its_own_deadline() -> None:
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    p = Recorder(delay=10.0, batch_size=4, max_concurrent_batches=1, dedup=True)
    first = await busy(p)
    short = asyncio.create_task(p.inference("x", timeout=3.0))
    patient = asyncio.create_task(p.inference("x"))
    with pytest.raises(batchproxy.DeadlineExceeded):
        await short
    assert loop.time() - t0 == pytest.approx(3.0)
    assert await patient == ("out", "x")
    assert loop.time() - t0 == pytest.approx(20.0)
    await first
    assert p.batches == [["first"], ["x"]]
    assert (p.stats.timed_out, p.stats.succeeded) == (1, 2)
    assert_settled(p.stats)
    await p.aclose()


async def test_every_caller_expired_the_slot_leaves_the_queue() -> None:
    p = Recorder(delay=10.0, batch_size=4, max_concurrent_batches=1, dedup=True)
    first = await busy(p)
    calls = [asyncio.create_task(p.inference("x", timeout=2.0 + i)) for i in range(2)]
    outcomes = await asyncio.gather(*calls, return_exceptions=True)
    assert all(isinstance(o, batchproxy.DeadlineExceeded) for o in outcomes)
    assert p.stats.queue_depth == 0
    await first
    await asyncio.sleep(20.0)
    assert p.batches == [["first"]]
    assert_settled(p.stats)
    await p.aclose()


async def test_a_caller_of_higher_priority_moves_the_slot_up() -> None:
    p = Recorder(delay=10.0, batch_size=1, max_concurrent_batches=1, dedup=True)
    first = await busy(p)
    low = [asyncio.create_task(p.inference(x)) for x in ["other", "shared"]]
    await settle()
    urgent = asyncio.create_task(p.inference("shared", priority=5))
    await settle()
    assert p.stats.queue_depth == 2  # still one slot for "shared"
    await asyncio.gather(first, *low, urgent)
    assert p.batches == [["first"], ["shared"], ["other"]]  # ahead of "other" now
    await p.aclose()


async def test_a_caller_with_an_earlier_deadline_moves_the_slot_up() -> None:
    p = Recorder(delay=10.0, batch_size=1, max_concurrent_batches=1, dedup=True)
    first = await busy(p)
    queued = [asyncio.create_task(p.inference(x, timeout=100.0)) for x in ["other", "shared"]]
    await settle()
    sooner = asyncio.create_task(p.inference("shared", timeout=50.0))
    await asyncio.gather(first, *queued, sooner)
    assert p.batches == [["first"], ["shared"], ["other"]]
    await p.aclose()


async def test_joining_a_slot_is_never_refused_for_room() -> None:
    p = Recorder(delay=10.0, batch_size=1, max_concurrent_batches=1, max_queue_size=1, dedup=True)
    first = await busy(p)
    queued = asyncio.create_task(p.inference("x"))
    await settle()
    with pytest.raises(batchproxy.QueueFull):
        await p.inference("y")
    joined = asyncio.create_task(p.inference("x"))  # the queue is full, but x adds no work
    assert await asyncio.gather(first, queued, joined) == [("out", v) for v in ["first", "x", "x"]]
    await p.aclose()


async def test_inference_many_with_repeats() -> None:
    p = Recorder(delay=1.0, batch_size=8, dedup=True)
    assert await p.inference_many(["a", "b", "a"]) == [("out", "a"), ("out", "b"), ("out", "a")]
    assert [sorted(b) for b in p.batches] == [["a", "b"]]
    await p.aclose()


async def test_calls_with_different_batch_keys_never_share() -> None:
    p = Recorder(delay=1.0, batch_size=8, dedup=True)
    await asyncio.gather(p.inference("x", key="en"), p.inference("x", key="de"))
    assert sum(len(batch) for batch in p.batches) == 2
    assert p.stats.deduplicated == 0
    await p.aclose()


def typed_answers(items: list[Any]) -> list[Any]:
    """A model that tells `1`, `1.0` and `True` apart (as `repr`, a type check or a
    tokenizer does)."""
    return [("out", repr(item)) for item in items]


EQUAL_ACROSS_TYPES = [1, 1.0, True, 1 + 0j]


@pytest.mark.parametrize("many", [False, True])
async def test_equal_items_of_different_types_are_different_calls(many: bool) -> None:
    """Issue 38: the identity is typed by default (`functools.lru_cache(typed=True)`):
    `1`, `1.0` and `True` are equal, and one model answers them differently."""
    p = Recorder(typed_answers, delay=1.0, batch_size=8, dedup=True)
    items = [*EQUAL_ACROSS_TYPES, 1, True]
    if many:
        results = await p.inference_many(items)
    else:
        results = await asyncio.gather(*map(p.inference, items))
    assert results == [("out", repr(item)) for item in items]
    assert sorted(map(repr, p.batches[0])) == sorted(map(repr, EQUAL_ACROSS_TYPES))
    assert p.stats.deduplicated == 2  # the second 1 and the second True only
    await p.aclose()


async def test_the_cache_is_typed_too() -> None:
    p = Recorder(typed_answers, batch_size=8, dedup=Dedup(cache_size=8))
    for item in EQUAL_ACROSS_TYPES:
        assert await p.inference(item) == ("out", repr(item))
    for item in EQUAL_ACROSS_TYPES:  # each from its own entry
        assert await p.inference(item) == ("out", repr(item))
    assert p.stats.cache_hits == len(EQUAL_ACROSS_TYPES)
    await p.aclose()


async def test_typed_identity_with_batch_keys_and_tenants() -> None:
    p = Recorder(keyed_answers, delay=1.0, batch_size=8, dedup=Dedup(cache_size=8))
    calls = [(1, "k", "a"), (True, "k", "b"), (1, "k", "b"), (1.0, "j", "a"), (1.0, "j", "b")]
    results = await asyncio.gather(
        *(p.inference(item, key=key, tenant=tenant) for item, key, tenant in calls)
    )
    assert [(key, repr(item)) for _, key, item in results] == [
        ("k", "1"),
        ("k", "True"),
        ("k", "1"),
        ("j", "1.0"),
        ("j", "1.0"),
    ]
    assert p.stats.deduplicated == 2  # 1 under "k" twice; 1.0 under "j" twice
    await p.aclose()


async def test_a_dedup_function_defines_identity_untyped() -> None:
    """The identity a dedup function returns is the user's own: its value, compared with
    `==` (a function that wants types returns them)."""
    p = Recorder(typed_answers, delay=1.0, batch_size=8, dedup=lambda item: item)
    results = await asyncio.gather(*(p.inference(item) for item in EQUAL_ACROSS_TYPES))
    assert results == [("out", "1")] * len(EQUAL_ACROSS_TYPES)
    assert p.stats.deduplicated == len(EQUAL_ACROSS_TYPES) - 1
    await p.aclose()


async def test_unhashable_items_with_equal_keys_still_share() -> None:
    p = Recorder(delay=1.0, batch_size=8, dedup=tuple)
    results = await asyncio.gather(p.inference([1, 2]), p.inference([1, 2]), p.inference([2]))
    assert results == [("out", [1, 2]), ("out", [1, 2]), ("out", [2])]
    assert p.stats.deduplicated == 1
    await p.aclose()


def keyed_answers(items: list[Any]) -> list[Any]:
    """Each result carries what it was computed from: the batch's key and the item."""
    key = batchproxy.batch_key()
    return [("out", key, item) for item in items]


async def test_a_keyed_call_never_shares_with_an_unkeyed_call_of_the_pair() -> None:
    """Issue 27, item 1: `("k", "x")` unkeyed and `"x"` under key `"k"` are different
    calls (different items for different batches), whatever the identity is made of."""
    p = Recorder(keyed_answers, delay=1.0, batch_size=8, dedup=True)
    keyed, unkeyed = await asyncio.gather(p.inference("x", key="k"), p.inference(("k", "x")))
    assert keyed == ("out", "k", "x")
    assert unkeyed == ("out", None, ("k", "x"))
    assert p.stats.deduplicated == 0
    await p.aclose()


@pytest.mark.parametrize("keyed_first", [True, False])
async def test_the_cache_never_answers_a_keyed_call_with_an_unkeyed_result(
    keyed_first: bool,
) -> None:
    p = Recorder(keyed_answers, batch_size=8, dedup=Dedup(cache_size=8))
    calls = [lambda: p.inference("x", key="k"), lambda: p.inference(("k", "x"))]
    if not keyed_first:
        calls.reverse()
    results = [await call() for call in calls]
    if not keyed_first:
        results.reverse()
    assert results == [("out", "k", "x"), ("out", None, ("k", "x"))]
    assert p.stats.cache_hits == 0
    assert await p.inference("x", key="k") == ("out", "k", "x")  # each from its own entry
    assert await p.inference(("k", "x")) == ("out", None, ("k", "x"))
    assert p.stats.cache_hits == 2
    await p.aclose()


async def test_a_dedup_function_and_a_key_function_never_mix_keyed_and_unkeyed() -> None:
    """The same with `dedup=<function>` and the `key=` option, under tenants: the
    dedup key of a keyed call is its own, never an unkeyed call's."""

    def batch_of(item: dict[str, Any]) -> Any:
        return item.get("lang")

    p = Recorder(
        keyed_answers,
        delay=1.0,
        batch_size=8,
        dedup=Dedup(key=lambda item: item["text"], cache_size=8),
        key=batch_of,
    )
    keyed = {"lang": "en", "text": "x"}
    unkeyed = {"text": ("en", "x")}
    results = await asyncio.gather(p.inference(keyed, tenant="a"), p.inference(unkeyed, tenant="b"))
    assert results == [("out", "en", keyed), ("out", None, unkeyed)]
    assert await p.inference(unkeyed, tenant="a") == ("out", None, unkeyed)  # cached
    assert p.stats.cache_hits == 1
    await p.aclose()


async def test_calls_with_different_arguments_never_share() -> None:
    class Scaled(batchproxy.Proxy[Any, Any]):
        async def _inference(self, items: list[Any], /, *, scale: int = 1) -> list[Any]:
            await asyncio.sleep(1.0)
            return [(item, scale) for item in items]

    p = Scaled(batch_size=8, dedup=Dedup(cache_size=8))
    results = await asyncio.gather(
        p.with_args(scale=2).inference("x"),
        p.inference("x"),
        p.with_args(scale=2).inference("x", tenant="t"),
    )
    assert results == [("x", 2), ("x", 1), ("x", 2)]
    assert p.stats.deduplicated == 1
    assert await p.with_args(scale=3).inference("x") == ("x", 3)  # not the cached scale 2
    await p.aclose()


async def test_the_cache_answers_a_repeated_call_without_the_model() -> None:
    p = Recorder(delay=1.0, batch_size=8, dedup=Dedup(cache_size=2))
    assert await p.inference("a") == ("out", "a")
    loop = asyncio.get_running_loop()
    t = loop.time()
    assert await p.inference("a") == ("out", "a")
    assert loop.time() == t  # at once
    assert p.batches == [["a"]]
    stats = p.stats
    assert (stats.requests, stats.succeeded, stats.cache_hits) == (2, 2, 1)
    assert_settled(stats)
    await p.aclose()


async def test_the_cache_keeps_the_most_recently_used_keys() -> None:
    p = Recorder(batch_size=8, dedup=Dedup(cache_size=2))
    for x in ["a", "b", "a", "c"]:  # "a" used again, so "b" is the one evicted by "c"
        await p.inference(x)
    assert p.batches == [["a"], ["b"], ["c"]]
    await p.inference("a")
    await p.inference("b")
    assert p.batches == [["a"], ["b"], ["c"], ["b"]]
    await p.aclose()


async def test_a_cached_result_expires_after_the_ttl() -> None:
    p = Recorder(batch_size=8, dedup=Dedup(cache_size=8, cache_ttl=60.0))
    await p.inference("a")
    await asyncio.sleep(59.0)
    await p.inference("a")
    assert len(p.batches) == 1
    await asyncio.sleep(1.0)
    await p.inference("a")
    assert len(p.batches) == 2
    await p.aclose()


async def test_errors_are_never_cached() -> None:
    p = Recorder(
        lambda items: [ValueError("no")] * len(items), batch_size=8, dedup=Dedup(cache_size=8)
    )
    for _ in range(2):
        with pytest.raises(ValueError):
            await p.inference("a")
    assert len(p.batches) == 2
    assert p.stats.cache_hits == 0
    await p.aclose()


async def test_a_closed_proxy_refuses_even_a_cached_key() -> None:
    p = Recorder(batch_size=8, dedup=Dedup(cache_size=8))
    await p.inference("a")
    await p.aclose()
    with pytest.raises(batchproxy.ProxyClosed):
        await p.inference("a")


async def test_aclose_answers_every_caller_of_a_queued_slot() -> None:
    p = Recorder(delay=10.0, batch_size=1, max_concurrent_batches=1, dedup=True)
    first = await busy(p)
    calls = [asyncio.create_task(p.inference("x")) for _ in range(3)]
    await settle()
    await p.aclose()
    assert await asyncio.gather(first, *calls) == [("out", "first")] + [("out", "x")] * 3
    assert_settled(p.stats)


async def test_the_batch_watchdog_fails_every_caller_of_a_slot() -> None:
    p = Recorder(delay=100.0, batch_size=4, dedup=True, batch_timeout=5.0)
    outcomes = await asyncio.gather(*(p.inference("x") for _ in range(3)), return_exceptions=True)
    assert all(isinstance(o, batchproxy.BatchTimeout) for o in outcomes)
    assert p.stats.errors == 3
    await p.aclose()


def test_calls_from_threads_join_a_running_slot() -> None:
    started, release = threading.Event(), threading.Event()
    batches: list[list[str]] = []

    class Held(batchproxy.Proxy[str, str]):
        def _inference(self, items: list[str]) -> list[str]:  # on a worker thread
            batches.append(list(items))
            started.set()
            assert release.wait(10)
            return [item.upper() for item in items]

    background = batchproxy.BackgroundLoop.default()
    try:
        p = Held(batch_size=8, dedup=True)
        futures = [p.submit("x")]
        assert started.wait(10)
        futures += [p.submit("x") for _ in range(2)]
        # a thread's call reaches the proxy on its loop, later than submit() returns: the
        # model answers only once both have joined (had its answer come first, they
        # would rightly make a new slot: "joins while in flight")
        wait_for(lambda: p.stats.deduplicated == 2)
        release.set()
        assert [f.result(timeout=10) for f in futures] == ["X"] * 3
        assert batches == [["x"]]
        assert p.stats.deduplicated == 2
        background.run(p.aclose())
    finally:
        release.set()
        background.close()


def test_options_are_checked() -> None:
    with pytest.raises(TypeError, match="dedup must be a Dedup, a bool or a function"):
        Recorder(dedup="yes")
    with (
        pytest.warns(DeprecationWarning, match="cache_size"),
        pytest.raises(ValueError, match="need dedup="),
    ):
        Recorder(cache_size=10)  # (the deprecated flat spelling)
    with pytest.raises(ValueError, match=r"cache_ttl=...\) needs cache_size"):
        Recorder(dedup=Dedup(cache_ttl=5.0))
    with pytest.raises(ValueError, match="cache_size"):
        Recorder(dedup=Dedup(cache_size=0))
    with pytest.raises(ValueError, match="cache_ttl"):
        Recorder(dedup=Dedup(cache_size=4, cache_ttl=0))
    with pytest.raises(TypeError, match="configure"):
        Recorder(dedup=True).configure(dedup=False)  # type: ignore[call-arg]


def test_a_streaming_proxy_refuses_dedup() -> None:
    class Streamer(batchproxy.Proxy[str, str]):
        async def _inference(self, items: list[str]) -> Any:  # type: ignore[override]
            yield items

    with pytest.raises(TypeError, match="dedup does not apply to a proxy that streams"):
        Streamer(dedup=True)


def test_a_proxy_serves_a_second_loop_after_the_first_ended() -> None:
    p = Recorder(batch_size=8, dedup=True)
    for _ in range(2):  # each asyncio.run is a new loop: the slots of the old one are gone
        assert asyncio.run(p.inference("x")) == ("out", "x")
    assert p.batches == [["x"], ["x"]]


class Outcomes(batchproxy.Listener):
    def __init__(self) -> None:
        self.events: list[tuple[str, object]] = []

    def request_finished(self, proxy: str, outcome: str, seconds: float) -> None:
        self.events.append(("finished", outcome))

    def request_deduplicated(self, proxy: str, cached: bool) -> None:
        self.events.append(("deduplicated", cached))


async def test_listeners_hear_of_each_caller() -> None:
    p = Recorder(delay=1.0, batch_size=8, dedup=Dedup(cache_size=4))
    log = Outcomes()
    p.add_listener(log)
    await asyncio.gather(p.inference("a"), p.inference("a"))
    await p.inference("a")
    assert log.events == [
        ("deduplicated", False),
        ("finished", "succeeded"),
        ("finished", "succeeded"),
        ("deduplicated", True),
        ("finished", "succeeded"),
    ]
    await p.aclose()


async def test_a_raising_listener_changes_no_outcome() -> None:
    p = Recorder(delay=1.0, batch_size=8, dedup=Dedup(cache_size=4))
    p.add_listener(RaisingListener())
    assert await asyncio.gather(p.inference("a"), p.inference("a")) == [("out", "a")] * 2
    assert await p.inference("a") == ("out", "a")
    assert_settled(p.stats)
    await p.aclose()


async def test_a_tensor_proxy_shares_rows_between_identical_calls() -> None:
    np = pytest.importorskip("numpy")

    class Doubler(batchproxy.TensorProxy[Any, Any]):
        def _forward(self, batch: Any, /) -> Any:
            self.sizes.append(len(batch.data))
            return batch.data * 2

    p = Doubler(batch_size=8, dedup=lambda row: tuple(row.tolist()))
    p.sizes = []
    rows = [np.array([1.0, 2.0]), np.array([1.0, 2.0]), np.array([3.0, 4.0])]
    results = await asyncio.gather(*(p.inference(row) for row in rows))
    assert [r.tolist() for r in results] == [[2.0, 4.0], [2.0, 4.0], [6.0, 8.0]]
    assert p.sizes == [2]
    await p.aclose()


async def test_callers_that_leave_a_long_queued_slot_are_not_kept() -> None:
    """A popular slot stuck behind a long batch, its callers timing out one by one: the
    slot keeps no record of them (memory stays bounded by the callers still waiting)."""
    p = Recorder(delay=10_000.0, batch_size=1, max_concurrent_batches=1, dedup=True)
    first = await busy(p)
    patient = asyncio.create_task(p.inference("x"))
    leaving = [asyncio.create_task(p.inference("x", timeout=1.0 + i)) for i in range(1000)]
    await asyncio.gather(*leaving, return_exceptions=True)
    slot = p._intake._dedup.inflight[None, (str, "x")]  # type: ignore[union-attr]
    assert slot.waiting == 1
    assert len(slot.callers) <= 2 + 16
    assert p.stats.timed_out == 1000
    patient.cancel()
    first.cancel()
    await asyncio.gather(patient, first, return_exceptions=True)
    assert not p._intake._dedup.inflight  # type: ignore[union-attr]
    await p.aclose()


USER: contextvars.ContextVar[str] = contextvars.ContextVar("user", default="-")


async def test_a_dedup_function_reads_the_callers_context() -> None:
    """A result that depends on the caller (read from its context by the model) is kept
    apart by a dedup function that reads the same context: it runs in the caller's."""

    def per_user(items: list[Any]) -> list[Any]:
        users = [context.get(USER) for context in batchproxy.caller_contexts()]
        return [(user, item) for user, item in zip(users, items, strict=True)]

    p = Recorder(
        per_user,
        delay=1.0,
        batch_size=8,
        caller_context=True,
        dedup=Dedup(key=lambda text: (USER.get(), text), cache_size=8),
    )

    async def as_user(user: str, text: str) -> Any:
        USER.set(user)  # (each task has its own copy of the context)
        return await p.inference(text)

    results = await asyncio.gather(as_user("ann", "x"), as_user("bob", "x"), as_user("ann", "x"))
    assert results == [("ann", "x"), ("bob", "x"), ("ann", "x")]
    assert p.stats.deduplicated == 1
    assert await as_user("bob", "x") == ("bob", "x")  # from bob's cache entry
    assert p.stats.cache_hits == 1
    await p.aclose()
