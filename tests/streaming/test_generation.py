"""Continuous batching (`GenerationProxy`): sequences join and leave between steps, the
`batch_size` and token budget hold, consumers that leave free their slot, and step
errors fail only the streams they touch. Scheduling runs on looptime."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
from _support import assert_settled, batch_tasks, cancel_batches_before_they_run
from typing_extensions import override

import batchproxy
from batchproxy import END, GenerationProxy, Last, Step

Job = tuple[str, int]  # (name, how many chunks)


class Counting(GenerationProxy[Job, str]):
    """Job (name, n) streams "name0" .. "name{n-1}"; each step takes one second of
    virtual time. Records what every step saw: (active, joined, kept, left) names."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.steps: list[tuple[list[str], list[str], list[int], list[str]]] = []
        self.fail_step: int | None = None

    @override
    async def _step(self, step: Step[Job]) -> Sequence[Any]:
        def names(slots: Sequence[batchproxy.Slot[Job]]) -> list[str]:
            return [slot.item[0] for slot in slots]

        self.steps.append((names(step.active), names(step.joined), step.kept, names(step.left)))
        assert step.active[len(step.active) - len(step.joined) :] == step.joined
        await asyncio.sleep(1)
        if self.fail_step == len(self.steps):
            raise RuntimeError("the step broke")
        out: list[Any] = []
        for slot in step.active:
            name, n = slot.item
            index = slot.state = 0 if slot.state is None else slot.state + 1
            assert slot.chunks == index  # one chunk went at each of its earlier steps
            chunk = f"{name}{index}"
            if name.startswith("bad") and index == 1:
                out.append(ValueError(f"{name} broke"))
            elif n == 0:
                out.append(END)
            else:
                out.append(Last(chunk) if index == n - 1 else chunk)
        return out


def raise_(error: BaseException) -> Any:
    raise error


async def collect(stream: AsyncIterator[Any]) -> list[Any]:
    return [chunk async for chunk in stream]


def later(delay: float, stream: AsyncIterator[Any]) -> asyncio.Task[list[Any]]:
    async def run() -> list[Any]:
        await asyncio.sleep(delay)
        return await collect(stream)

    return asyncio.create_task(run())


@pytest.mark.looptime
async def test_a_newcomer_joins_at_the_next_step_not_after_the_batch() -> None:
    proxy = Counting()
    loop = asyncio.get_running_loop()
    long = asyncio.create_task(collect(proxy.stream(("a", 10))))
    await asyncio.sleep(3.5)
    joined_at = loop.time()
    first = await anext(proxy.stream(("b", 2)))
    assert first == "b0"
    assert loop.time() - joined_at == pytest.approx(1.5)  # the rest of step 4, then step 5
    assert await long == [f"a{i}" for i in range(10)]
    assert proxy.steps[4] == (["a", "b"], ["b"], [0], [])
    await proxy.aclose()


@pytest.mark.looptime
async def test_finished_sequences_leave_and_kept_lines_up_the_survivors() -> None:
    proxy = Counting()
    calls = [
        asyncio.create_task(collect(proxy.stream((k, n))))
        for k, n in (("a", 3), ("b", 1), ("c", 2))
    ]
    results = [await c for c in calls]
    assert results == [["a0", "a1", "a2"], ["b0"], ["c0", "c1"]]
    assert proxy.steps == [
        (["a", "b", "c"], ["a", "b", "c"], [], []),
        (["a", "c"], [], [0, 2], ["b"]),
        (["a"], [], [0], ["c"]),
    ]
    stats = proxy.stats
    assert (stats.batches, stats.items, stats.succeeded) == (3, 6, 3)
    assert dict(stats.batch_sizes) == {3: 1, 2: 1, 1: 1}
    assert_settled(stats)
    await proxy.aclose()


@pytest.mark.looptime
async def test_batch_size_caps_the_active_sequences_and_the_queue_joins_as_they_leave() -> None:
    proxy = Counting(batch_size=2)
    calls = [
        asyncio.create_task(collect(proxy.stream((k, n))))
        for k, n in zip("abcd", (1, 3, 2, 1), strict=True)
    ]
    await asyncio.wait(calls)
    assert [s[0] for s in proxy.steps] == [["a", "b"], ["b", "c"], ["b", "c"], ["d"]]
    assert max(len(active) for active, *_ in proxy.steps) == 2
    assert_settled(proxy.stats)
    await proxy.aclose()


@pytest.mark.looptime
async def test_the_token_budget_holds_and_a_request_waits_its_turn_for_room() -> None:
    proxy = Counting(max_batch_tokens=10, length=lambda job: job[1] * 2)  # n chunks: 2n tokens
    calls = [
        asyncio.create_task(collect(proxy.stream(job)))
        for job in (("a", 3), ("b", 2), ("c", 4), ("d", 1))  # 6 + 4 | 8 | 2
    ]
    await asyncio.wait(calls)
    actives = [s[0] for s in proxy.steps]
    # c (8) waits for room; d (2) would fit beside a and b but does not overtake c
    assert actives == [["a", "b"], ["a", "b"], ["a"], ["c", "d"], ["c"], ["c"], ["c"]]
    with pytest.raises(ValueError, match="needs 22 tokens, more than max_batch_tokens=10"):
        await collect(proxy.stream(("huge", 11)))
    assert_settled(proxy.stats)
    await proxy.aclose()


@pytest.mark.looptime
async def test_a_consumer_that_leaves_frees_its_slot_for_the_queue() -> None:
    proxy = Counting(batch_size=1)
    waiting = asyncio.create_task(collect(proxy.stream(("b", 2))))
    long = proxy.stream(("a", 100))
    assert await anext(long) == "a0"
    await asyncio.sleep(0)  # b queued behind a: only one slot
    assert proxy.stats.queue_depth == 1
    await long.aclose()
    assert await waiting == ["b0", "b1"]
    assert proxy.steps[:3] == [
        (["a"], ["a"], [], []),
        (["a"], [], [0], []),  # a's consumer left during step 2
        (["b"], ["b"], [], ["a"]),
    ]
    stats = proxy.stats
    assert (stats.succeeded, stats.cancelled) == (1, 1)
    assert_settled(stats)
    await proxy.aclose()


@pytest.mark.looptime
async def test_a_cancelled_consumer_and_a_deadline_drop_the_sequence() -> None:
    proxy = Counting()
    cancelled = asyncio.create_task(collect(proxy.stream(("a", 100))))
    timed = asyncio.create_task(collect(proxy.stream(("t", 100), timeout=2.5)))
    keeper = asyncio.create_task(collect(proxy.stream(("k", 5))))
    await asyncio.sleep(1.5)
    cancelled.cancel()
    assert await keeper == [f"k{i}" for i in range(5)]
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    with pytest.raises(batchproxy.DeadlineExceeded):
        await timed
    # earliest deadline first: t queued ahead of a; a left after step 2, t after step 3
    assert [s[0] for s in proxy.steps] == [["t", "a", "k"]] * 2 + [["t", "k"]] + [["k"]] * 2
    stats = proxy.stats
    assert (stats.succeeded, stats.cancelled, stats.timed_out) == (1, 1, 1)
    assert_settled(stats)
    await proxy.aclose()


@pytest.mark.looptime
async def test_an_error_in_a_slot_fails_that_stream_only() -> None:
    proxy = Counting()
    bad = asyncio.create_task(collect(proxy.stream(("bad", 5))))
    good = asyncio.create_task(collect(proxy.stream(("good", 3))))
    with pytest.raises(ValueError, match="bad broke"):
        await bad
    assert await good == ["good0", "good1", "good2"]
    stats = proxy.stats
    assert (stats.succeeded, stats.errors) == (1, 1)
    assert_settled(stats)
    await proxy.aclose()


@pytest.mark.looptime
async def test_a_raising_step_fails_its_streams_and_the_engine_serves_the_queue() -> None:
    failures: list[tuple[str, int]] = []

    class Errors(batchproxy.Listener):
        def error(self, proxy: str, error: BaseException, size: int) -> None:
            failures.append((str(error), size))

    proxy = Counting(batch_size=2)
    proxy.add_listener(Errors())
    proxy.fail_step = 2
    calls = [asyncio.create_task(collect(proxy.stream((k, 3)))) for k in "abc"]
    await asyncio.wait(calls)
    for call in calls[:2]:
        with pytest.raises(RuntimeError, match="the step broke"):
            call.result()
    assert calls[2].result() == ["c0", "c1", "c2"]
    assert proxy.steps[2] == (["c"], ["c"], [], ["a", "b"])  # a fresh start
    stats = proxy.stats
    assert (stats.errors, stats.failed_batches, stats.succeeded) == (2, 1, 1)
    assert failures == [("the step broke", 2)]  # a failed step, heard like a failed batch
    assert_settled(stats)
    await proxy.aclose()


@pytest.mark.parametrize(
    ("answer", "error", "match"),
    [
        (lambda step: ["x"] * (len(step.active) + 1), batchproxy.BatchSizeMismatch, "2 results"),
        (lambda step: None, TypeError, "must return a sequence"),
        (lambda step: [StopIteration()], RuntimeError, "StopIteration"),
        (lambda step: raise_(GeneratorExit()), batchproxy.InferenceError, "GeneratorExit"),
    ],
)
@pytest.mark.looptime
async def test_steps_that_cannot_answer_fail_their_streams_clearly(
    answer: Any, error: type[Exception], match: str
) -> None:
    class Wrong(GenerationProxy[str, str]):
        @override
        async def _step(self, step: Step[str]) -> Any:
            return answer(step)

    proxy = Wrong()
    with pytest.raises(error, match=match):
        await collect(proxy.stream("x"))
    assert_settled(proxy.stats)
    await proxy.aclose()


@pytest.mark.looptime
async def test_higher_priority_joins_first() -> None:
    proxy = Counting(batch_size=1)
    first = asyncio.create_task(collect(proxy.stream(("a", 2))))
    await asyncio.sleep(0.5)
    low = asyncio.create_task(collect(proxy.stream(("low", 1))))
    high = asyncio.create_task(collect(proxy.stream(("high", 1), priority=5)))
    await asyncio.wait([first, low, high])
    assert [s[0] for s in proxy.steps] == [["a"], ["a"], ["high"], ["low"]]
    await proxy.aclose()


async def test_the_engine_stops_when_idle_and_a_plain_step_runs_on_the_worker_thread(
    no_leftovers: None,
) -> None:
    class Threaded(GenerationProxy[int, str]):
        @override
        def _step(self, step: Step[int]) -> list[Any]:
            return [Last(threading.current_thread().name) for _ in step.active]

    proxy = Threaded(name="gen")
    assert await collect(proxy.stream(1)) == ["batchproxy-gen"]
    await asyncio.sleep(0.05)
    assert not batch_tasks(proxy)  # no engine while idle
    assert proxy.stats.in_flight == 0
    assert await collect(proxy.stream(2)) == ["batchproxy-gen"]  # a new one starts
    await proxy.aclose()


@pytest.mark.looptime
async def test_aclose_finishes_the_active_and_the_queued_then_refuses() -> None:
    proxy = Counting(batch_size=1)
    calls = [asyncio.create_task(collect(proxy.stream((k, 2)))) for k in "ab"]
    await asyncio.sleep(0.5)
    await proxy.aclose()
    assert [c.result() for c in calls] == [["a0", "a1"], ["b0", "b1"]]
    with pytest.raises(batchproxy.ProxyClosed):
        await collect(proxy.stream(("c", 1)))


@pytest.mark.looptime
async def test_the_engine_cancelled_from_outside_fails_its_streams() -> None:
    """Its active streams fail with InferenceError; the queued one, which it had not
    taken, is served by a new engine."""
    proxy = Counting(batch_size=1)
    active = asyncio.create_task(collect(proxy.stream(("a", 50))))
    queued = asyncio.create_task(collect(proxy.stream(("b", 2))))
    await asyncio.sleep(1.5)
    (engine,) = batch_tasks(proxy)
    engine.cancel()
    with pytest.raises(batchproxy.InferenceError):
        await active
    assert await queued == ["b0", "b1"]
    assert_settled(proxy.stats)
    await proxy.aclose()


@pytest.mark.looptime
async def test_an_engine_cancelled_before_its_first_step_fails_its_streams_and_frees_the_slot() -> (
    None
):
    """Issue 16.5: cancelled before it ran, the engine's coroutine never started, so
    its streams hung and the one batch slot stayed taken for ever."""
    proxy = Counting(batch_size=2)
    cancel_batches_before_they_run(proxy, lambda n: n == 0)  # the first engine
    first, queued = (asyncio.create_task(collect(proxy.stream((name, 2)))) for name in "ab")
    with pytest.raises(batchproxy.InferenceError, match="cancelled"):
        await asyncio.wait_for(first, 5)  # the engine's own (the scheduler hands it one)
    assert await asyncio.wait_for(queued, 5) == ["b0", "b1"]  # the next engine's
    assert await asyncio.wait_for(collect(proxy.stream(("c", 2))), 5) == ["c0", "c1"]
    assert_settled(proxy.stats)
    await proxy.aclose()


def test_misuse_is_refused_clearly() -> None:
    class NoStep(GenerationProxy[int, int]):
        pass

    with pytest.raises(TypeError, match="must implement _step"):
        NoStep()
    with pytest.raises(ValueError, match="max_batch_tokens"):
        Counting(max_batch_tokens=0, length=len)
    proxy = Counting()
    only = "takes only batch_size, max_queue_size, timeout and stream_buffer"
    with pytest.raises(TypeError, match=only):
        proxy.configure(max_delay_ms=1)
    with pytest.raises(TypeError, match="not batch_timeout, window"):
        proxy.configure(window="fixed", batch_timeout=1.0)
    proxy.configure(batch_size=4, max_queue_size=10, timeout=30.0)
    assert proxy.options.timeout == 30.0

    async def call() -> None:
        await proxy.inference(("a", 1))

    with pytest.raises(TypeError, match=r"proxy\.stream"):
        asyncio.run(call())


@pytest.mark.looptime
async def test_configure_batch_size_applies_from_the_next_step() -> None:
    proxy = Counting(batch_size=1)
    calls = [asyncio.create_task(collect(proxy.stream((k, 3)))) for k in "abc"]
    await asyncio.sleep(0.5)
    proxy.configure(batch_size=3)
    await asyncio.wait(calls)
    assert [s[0] for s in proxy.steps][:2] == [["a"], ["a", "b", "c"]]
    await proxy.aclose()


@pytest.mark.looptime
async def test_listeners_hear_each_step_as_a_batch_with_the_newcomers_queue_waits() -> None:
    heard: list[tuple[Any, ...]] = []

    class Log(batchproxy.Listener):
        def batch_started(self, proxy: str, size: int, queue_waits: Sequence[float]) -> None:
            heard.append(("started", size, [round(w, 3) for w in queue_waits]))

        def batch_finished(
            self, proxy: str, size: int, seconds: float, error: BaseException | None
        ) -> None:
            heard.append(("finished", size, round(seconds, 3)))

        def request_finished(self, proxy: str, outcome: str, seconds: float) -> None:
            heard.append((outcome, round(seconds, 3)))

    proxy = Counting(batch_size=1)
    proxy.add_listener(Log())
    calls = [asyncio.create_task(collect(proxy.stream((k, 2)))) for k in "ab"]
    await asyncio.wait(calls)
    assert heard == [
        ("started", 1, [0.0]),
        ("finished", 1, 1.0),
        ("started", 1, []),
        ("finished", 1, 1.0),
        ("succeeded", 2.0),
        ("started", 1, [2.0]),  # b waited for a's two steps
        ("finished", 1, 1.0),
        ("started", 1, []),
        ("finished", 1, 1.0),
        ("succeeded", 4.0),
    ]
    stats = proxy.stats
    assert (stats.batches, stats.queue_wait.count, stats.model_time.count) == (4, 2, 4)
    await proxy.aclose()


def test_the_options_are_the_proxys_own_and_either_of_the_pair_is_taken() -> None:
    """Issue 38: `max_batch_tokens` (enforced) was missing from `options`, and each of
    `length` and `max_batch_tokens` was refused alone, where `Proxy` takes either."""
    both = Counting(max_batch_tokens=100, length=len)
    assert (both.options.max_batch_tokens, both.options.length) == (100, len)
    alone = Counting(max_batch_tokens=100)  # costs by batchproxy.tensors.length, as Proxy's
    assert (alone.options.max_batch_tokens, alone.options.length) == (100, None)
    measured = Counting(length=len)  # costs measured, no budget
    assert (measured.options.max_batch_tokens, measured.options.length) == (None, len)


@pytest.mark.looptime
async def test_max_batch_tokens_alone_measures_items_with_tensors_length() -> None:
    np = pytest.importorskip("numpy")

    class Lengths(GenerationProxy[Any, int]):
        async def _step(self, step: Step[Any]) -> list[Any]:
            await asyncio.sleep(1)
            return [batchproxy.Last(len(slot.item)) for slot in step.active]

    proxy = Lengths(max_batch_tokens=10)
    calls = [asyncio.create_task(collect(proxy.stream(np.zeros(n)))) for n in (6, 4, 5)]
    assert await asyncio.gather(*calls) == [[6], [4], [5]]
    with pytest.raises(ValueError, match="needs 11 tokens, more than max_batch_tokens=10"):
        await collect(proxy.stream(np.zeros(11)))
    assert_settled(proxy.stats)
    await proxy.aclose()


@pytest.mark.looptime
async def test_length_alone_runs_without_a_budget() -> None:
    proxy = Counting(batch_size=8, length=lambda job: 1000 * job[1])
    calls = [asyncio.create_task(collect(proxy.stream(job))) for job in (("a", 2), ("b", 1))]
    assert await asyncio.gather(*calls) == [["a0", "a1"], ["b0"]]
    assert proxy.steps[0][0] == ["a", "b"]  # no budget: both at once
    await proxy.aclose()


def test_an_unknown_keyword_names_the_nearest_one() -> None:
    with pytest.raises(
        TypeError,
        match=r"got an unexpected keyword argument 'batch_sise'; did you mean `batch_size`\?",
    ):
        Counting(batch_sise=4)
    with pytest.raises(TypeError, match=r"'max_batch_token'; did you mean `max_batch_tokens`\?"):
        Counting(max_batch_token=4, length=len)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'max_delay_ms'; it takes"):
        Counting(max_delay_ms=1)  # a Proxy option a generation proxy has no use for
