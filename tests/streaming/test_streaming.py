"""Streaming results: a generator `_inference`, `proxy.stream(item)`, end markers,
dropped consumers, errors, deadlines and the watchdog, per step."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from _support import assert_settled
from typing_extensions import override

import batchproxy
from batchproxy import END, Last

Element = Any


class Counter(batchproxy.Proxy[int, Any]):
    """Item n streams n chunks (n, 0), (n, 1), ... and ends with Last; every step
    waits `delay` seconds. Records each batch, each step's `keep`, and whether the
    generator was closed."""

    def __init__(self, delay: float = 1.0, **options: Any) -> None:
        options.setdefault("max_delay_ms", 0)
        super().__init__(**options)
        self.delay = delay
        self.batches: list[list[int]] = []
        self.keeps: list[list[int] | None] = []
        self.closed_early = 0

    @override
    async def _inference(self, items: list[int]) -> AsyncIterator[list[Element]]:
        self.batches.append(list(items))
        active = list(items)
        step = 0
        try:
            while active:
                await asyncio.sleep(self.delay)
                out = [(n, step) if step < n - 1 else Last((n, step)) for n in active]
                keep = yield out
                self.keeps.append(keep)
                assert keep is not None
                active = [active[i] for i in keep]
                step += 1
        except GeneratorExit:
            self.closed_early += 1
            raise


async def collect(stream: AsyncIterator[Any], into: list[Any] | None = None) -> list[Any]:
    """Every chunk of `stream`, also appended to `into` as they come (kept on a failure)."""
    chunks = [] if into is None else into
    async for chunk in stream:
        chunks.append(chunk)
    return chunks


@pytest.mark.looptime
async def test_each_caller_gets_its_own_chunks_from_one_shared_batch() -> None:
    proxy = Counter()
    streams = await asyncio.gather(*(collect(proxy.stream(n)) for n in (1, 3, 2)))
    assert streams == [[(n, i) for i in range(n)] for n in (1, 3, 2)]
    assert proxy.batches == [[1, 3, 2]]
    assert proxy.keeps == [[1, 2], [0]]  # ended slots leave; positions in the last yield
    assert proxy.closed_early == 1  # nobody left after the third step: closed at its yield
    assert asyncio.get_running_loop().time() == pytest.approx(3.0)
    stats = proxy.stats
    assert (stats.batches, stats.succeeded) == (1, 3)
    assert_settled(stats)
    await proxy.aclose()


@pytest.mark.looptime
async def test_end_last_and_an_exception_end_only_their_own_streams() -> None:
    class Mixed(batchproxy.Proxy[str, Any]):
        @override
        async def _inference(self, items: list[str]) -> AsyncIterator[list[Element]]:
            keep = yield ["a1", "b1", "c1", "d1"]
            assert keep == [0, 1, 2, 3]
            keep = yield [END, Last("b2"), ValueError("c broke"), "d2"]
            assert keep == [3]  # only d goes on: its position in the list just yielded
            yield ["d3"]

    proxy = Mixed(max_delay_ms=0)
    calls = [asyncio.create_task(collect(proxy.stream(k))) for k in "abcd"]
    await asyncio.wait(calls)
    assert calls[0].result() == ["a1"]
    assert calls[1].result() == ["b1", "b2"]
    with pytest.raises(ValueError, match="c broke"):
        calls[2].result()
    assert calls[3].result() == ["d1", "d2", "d3"]  # the generator returned: it ends
    stats = proxy.stats
    assert (stats.succeeded, stats.errors) == (3, 1)
    assert_settled(stats)
    await proxy.aclose()


@pytest.mark.parametrize("form", ["full length", "not ended"])
@pytest.mark.looptime
async def test_a_generator_that_ignores_keep_may_yield_the_lenient_forms(form: str) -> None:
    """One element per original item every step, or one per slot it has not ended
    itself (not knowing of dropped consumers): both line up, extra elements ignored."""

    class Lenient(batchproxy.Proxy[int, Any]):
        @override
        async def _inference(self, items: list[int]) -> AsyncIterator[list[Element]]:
            open_ = list(items)
            for step in range(3):
                await asyncio.sleep(1)
                if form == "full length":
                    yield [Last(n) if step == n else (n, step) for n in items]
                else:
                    yield [Last(n) if step == n else (n, step) for n in open_]
                    open_ = [n for n in open_ if n != step]

    proxy = Lenient(max_delay_ms=0)
    quitter = proxy.stream(2)
    assert await anext(quitter) == (2, 0)
    calls = [asyncio.create_task(collect(proxy.stream(n))) for n in (0, 1)]
    await asyncio.sleep(0.5)  # the first batch is [2]: wait for the second, [0, 1]
    more = asyncio.create_task(collect(proxy.stream(9)))
    await quitter.aclose()
    assert [await c for c in calls] == [[0], [(1, 0), 1]]
    assert await more == [(9, 0), (9, 1), (9, 2)]
    assert_settled(proxy.stats)
    await proxy.aclose()


@pytest.mark.looptime
async def test_a_consumer_that_breaks_out_is_dropped_at_the_next_step() -> None:
    proxy = Counter()
    keeper = asyncio.create_task(collect(proxy.stream(4)))
    seen = []
    async for chunk in proxy.stream(10):
        seen.append(chunk)
        if len(seen) == 2:
            break
    assert await keeper == [(4, i) for i in range(4)]
    assert seen == [(10, 0), (10, 1)]
    assert proxy.batches == [[10, 4]]  # the task's call queues after this one
    # it left after reading step 1's chunk, which was sent on together with the keep
    # of step 1: it is left out from step 2 on
    assert proxy.keeps[:3] == [[0, 1], [0, 1], [1]]
    stats = proxy.stats
    assert (stats.succeeded, stats.cancelled) == (1, 1)
    assert_settled(stats)
    await proxy.aclose()


@pytest.mark.looptime
async def test_when_every_consumer_leaves_the_generator_is_closed_and_the_slot_freed() -> None:
    proxy = Counter()
    first = proxy.stream(100)
    assert await anext(first) == (100, 0)
    waiting = asyncio.create_task(collect(proxy.stream(2)))  # static: waits for the slot
    await first.aclose()
    assert await waiting == [(2, 0), (2, 1)]
    assert proxy.closed_early == 2  # each batch's generator, once nobody was left
    assert proxy.batches == [[100], [2]]
    assert_settled(proxy.stats)
    await proxy.aclose()


@pytest.mark.looptime
async def test_a_consumer_cancelled_while_queued_never_reaches_the_model() -> None:
    proxy = Counter()
    running = asyncio.create_task(collect(proxy.stream(2)))
    await asyncio.sleep(0.1)
    queued = asyncio.create_task(collect(proxy.stream(7)))
    await asyncio.sleep(0.1)
    queued.cancel()
    assert await running == [(2, 0), (2, 1)]
    with pytest.raises(asyncio.CancelledError):
        await queued
    assert proxy.batches == [[2]]
    stats = proxy.stats
    assert (stats.succeeded, stats.cancelled) == (1, 1)
    assert_settled(stats)
    await proxy.aclose()


@pytest.mark.looptime
async def test_a_consumer_that_leaves_after_its_stream_ended_unread_counts_cancelled() -> None:
    proxy = Counter(delay=0)
    stream = proxy.stream(3)
    assert await anext(stream) == (3, 0)
    await asyncio.sleep(1)  # the model has streamed the rest and ended the stream
    await stream.aclose()
    stats = proxy.stats
    assert (stats.succeeded, stats.cancelled) == (0, 1)
    assert_settled(stats)
    await proxy.aclose()


@pytest.mark.looptime
async def test_a_raising_generator_fails_the_open_streams_only() -> None:
    class Breaks(batchproxy.Proxy[str, Any]):
        @override
        async def _inference(self, items: list[str]) -> AsyncIterator[list[Element]]:
            yield [Last("done early"), "x"]
            raise RuntimeError("step 2 broke")

    class Errors(batchproxy.Listener):
        def __init__(self) -> None:
            self.seen: list[tuple[str, int]] = []

        @override
        def error(self, proxy: str, error: BaseException, size: int) -> None:
            self.seen.append((str(error), size))

    proxy = Breaks(max_delay_ms=0)
    listener = Errors()
    proxy.add_listener(listener)
    early, late = (asyncio.create_task(collect(proxy.stream(k))) for k in "ab")
    assert await early == ["done early"]
    with pytest.raises(RuntimeError, match="step 2 broke"):
        await late
    stats = proxy.stats
    assert (stats.succeeded, stats.errors, stats.failed_batches) == (1, 1, 1)
    assert listener.seen == [("step 2 broke", 2)]  # a failed batch, as for inference()
    assert_settled(stats)
    await proxy.aclose()


@pytest.mark.parametrize(
    ("step", "error", "match"),
    [
        ([1, 2, 3], batchproxy.BatchSizeMismatch, "3 results for a batch of 2"),
        (42, TypeError, "must return a sequence"),
    ],
)
@pytest.mark.looptime
async def test_a_step_that_cannot_be_matched_to_its_callers_fails_them(
    step: object, error: type[Exception], match: str
) -> None:
    class Wrong(batchproxy.Proxy[str, Any]):
        closed = False

        @override
        async def _inference(self, items: list[str]) -> AsyncIterator[Any]:
            try:
                yield step
            finally:
                Wrong.closed = True

    proxy = Wrong(max_delay_ms=0)
    calls = [asyncio.create_task(collect(proxy.stream(k))) for k in "ab"]
    for call in calls:
        with pytest.raises(error, match=match):
            await call
    assert Wrong.closed  # the generator was closed, its finally ran
    assert_settled(proxy.stats)
    await proxy.aclose()


async def test_a_plain_generator_runs_each_step_on_the_worker_thread(no_leftovers: None) -> None:
    class Threaded(batchproxy.Proxy[int, Any]):
        @override
        def _inference(self, items: list[int]) -> Iterator[list[Element]]:
            keep = yield [(threading.current_thread().name, n) for n in items]
            assert keep == [0, 1]
            yield [Last(n) for n in items]

    proxy = Threaded(max_delay_ms=0, name="streams")
    streams = await asyncio.gather(*(collect(proxy.stream(n)) for n in (1, 2)))
    assert streams == [[("batchproxy-streams", n), n] for n in (1, 2)]
    await proxy.aclose()  # the generator is closed on the thread after the last step
    assert_settled(proxy.stats)


@pytest.mark.looptime
async def test_the_timeout_bounds_the_whole_stream() -> None:
    proxy = Counter()
    chunks: list[Any] = []
    with pytest.raises(batchproxy.DeadlineExceeded):
        await collect(proxy.stream(10, timeout=3.5), into=chunks)
    assert chunks == [(10, i) for i in range(3)]
    other = await collect(proxy.stream(2))  # the slot freed once the batch saw it gone
    assert other == [(2, 0), (2, 1)]
    stats = proxy.stats
    assert (stats.timed_out, stats.succeeded) == (1, 1)
    assert_settled(stats)
    await proxy.aclose()


@pytest.mark.looptime
async def test_batch_timeout_bounds_each_step() -> None:
    class Stalls(batchproxy.Proxy[int, Any]):
        @override
        async def _inference(self, items: list[int]) -> AsyncIterator[list[Element]]:
            for step in range(3):
                await asyncio.sleep(1.5)  # each step is within the 2 s limit
                yield [(n, step) for n in items]
            await asyncio.sleep(60)  # this one is not
            yield [END for _ in items]

    proxy = Stalls(max_delay_ms=0, batch_timeout=2.0)
    chunks: list[Any] = []
    with pytest.raises(batchproxy.BatchTimeout):
        await collect(proxy.stream(1), into=chunks)
    assert chunks == [(1, 0), (1, 1), (1, 2)]
    assert asyncio.get_running_loop().time() == pytest.approx(6.5)
    assert not proxy.healthy
    assert proxy.stats.timed_out_batches == 1
    await proxy.aclose()


@pytest.mark.looptime
async def test_a_newcomer_waits_for_the_whole_static_batch() -> None:
    """Static batching: the batch keeps its slot until its generator is done."""
    proxy = Counter()
    long = asyncio.create_task(collect(proxy.stream(5)))
    await asyncio.sleep(0.5)
    started = asyncio.get_running_loop().time()
    first = await anext(proxy.stream(1))
    assert first == Last((1, 0)).chunk
    assert asyncio.get_running_loop().time() - started == pytest.approx(5.5)
    await long
    await proxy.aclose()


@pytest.mark.looptime
async def test_aclose_lets_accepted_streams_finish() -> None:
    proxy = Counter()
    calls = [asyncio.create_task(collect(proxy.stream(n))) for n in (2, 3)]
    await asyncio.sleep(0.5)
    await proxy.aclose()
    assert [c.result() for c in calls] == [[(2, 0), (2, 1)], [(3, 0), (3, 1), (3, 2)]]
    with pytest.raises(batchproxy.ProxyClosed):
        await collect(proxy.stream(1))


async def test_a_streaming_proxy_refuses_inference_and_a_plain_one_streams_its_result() -> None:
    proxy = Counter(delay=0)
    with pytest.raises(TypeError, match=r"use `async for chunk in proxy\.stream"):
        await proxy.inference(1)
    with pytest.raises(TypeError, match=r"proxy\.stream"):
        await proxy.inference_many([1, 2])
    await proxy.aclose()

    class Plain(batchproxy.Proxy[int, int]):
        @override
        async def _inference(self, items: list[int]) -> list[int]:
            return [n * 10 for n in items]

    plain = Plain()
    assert await collect(plain.stream(4)) == [40]
    await plain.aclose()


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"isolate_errors": True}, "isolate_errors reruns parts of a batch"),
        ({"oom_backoff": True}, "oom_backoff reruns parts of a batch"),
        ({"offload": True}, "async generator _inference runs on the event loop"),
    ],
)
def test_options_a_streaming_model_cannot_honour_are_refused(
    options: dict[str, Any], match: str
) -> None:
    with pytest.raises(TypeError, match=match):
        Counter(**options)


def test_markers_are_public_and_readable() -> None:
    assert batchproxy.END is batchproxy.StreamEnd.END
    assert repr(batchproxy.END) == "batchproxy.END"
    assert Last(3) == Last(3)
    assert Last(3).chunk == 3


@pytest.mark.looptime
async def test_a_step_that_swallows_the_watchdogs_cancel_is_stopped_after_it() -> None:
    """The overrun step's callers already have BatchTimeout and its slot went to the
    next batch; when the step returns anyway, the generator is closed there."""

    class Stubborn(batchproxy.Proxy[int, Any]):
        closed = False

        @override
        async def _inference(self, items: list[int]) -> AsyncIterator[list[Element]]:
            try:
                while True:
                    try:
                        await asyncio.sleep(5)
                    except asyncio.CancelledError:
                        await asyncio.sleep(5)  # ignores the cancel and steps on
                    yield list(items)
            finally:
                Stubborn.closed = True

    proxy = Stubborn(max_delay_ms=0, batch_timeout=2.0)
    with pytest.raises(batchproxy.BatchTimeout):
        await collect(proxy.stream(1))
    await asyncio.sleep(10)
    assert Stubborn.closed
    assert proxy.stats.in_flight == 0
    await proxy.aclose()


@pytest.mark.looptime
async def test_the_decorator_streams_a_generator_function() -> None:
    @batchproxy.batch(batch_size=8, max_delay_ms=0)
    async def spell(items: list[str]) -> AsyncIterator[list[Element]]:
        for i in range(max(map(len, items))):
            yield [Last(w[i]) if i == len(w) - 1 else w[i] if i < len(w) else END for w in items]

    words = await asyncio.gather(*(collect(spell.stream(w)) for w in ("to", "batch", "a")))
    assert ["".join(w) for w in words] == ["to", "batch", "a"]
    assert spell.stats.batches == 1
    await spell.aclose()


@pytest.mark.parametrize("error", [GeneratorExit, KeyboardInterrupt])
@pytest.mark.looptime
async def test_a_generator_raising_a_base_exception_fails_its_streams(
    error: type[BaseException],
) -> None:
    """Not an Exception (GeneratorExit included: the loop is alive, so it is the
    model's): the open streams fail with InferenceError, and the proxy serves on."""

    class Raises(batchproxy.Proxy[int, Any]):
        @override
        async def _inference(self, items: list[int]) -> AsyncIterator[list[Element]]:
            yield list(items)
            if items != [99]:
                raise error()
            yield [Last("fine")]

    proxy = Raises(max_delay_ms=0)
    chunks: list[Any] = []
    with pytest.raises(batchproxy.InferenceError):
        await collect(proxy.stream(1), into=chunks)
    assert chunks == [1]
    assert await collect(proxy.stream(99)) == [99, "fine"]
    assert_settled(proxy.stats)
    await proxy.aclose()


# -- consumers that stop reading (issue 16.9) -------------------------------------------------


class Endless(batchproxy.Proxy[int, Any]):
    """Each caller's stream never ends by itself; a step takes `delay` seconds (0: a
    generator that never awaits). Counts the steps."""

    def __init__(self, delay: float = 1.0, **options: Any) -> None:
        options.setdefault("max_delay_ms", 0)
        super().__init__(**options)
        self.delay = delay
        self.steps = 0

    @override
    async def _inference(self, items: list[int]) -> AsyncIterator[list[Element]]:
        active = list(items)
        while active:
            if self.delay:
                await asyncio.sleep(self.delay)
            self.steps += 1
            keep = yield [(n, self.steps) for n in active]
            assert keep is not None
            active = [active[i] for i in keep]


@pytest.mark.looptime
async def test_a_stream_held_but_not_read_is_dropped_once_its_buffer_is_full() -> None:
    """A consumer that `break`s while it still holds the iterator (or just stops
    reading) used to keep its batch running with its chunks piling up without limit."""
    proxy = Endless()  # the default bound: 1,024 unread chunks
    held = proxy.stream(1)
    async for _ in held:
        break  # `held` is still referenced: Python does not close it
    await asyncio.sleep(5000)
    assert proxy.steps == 1026  # 1 read, 1,024 filled the buffer, the next found it full
    assert proxy.stats.in_flight == 0  # it left the batch, which then ended
    chunks: list[Any] = []
    with pytest.raises(batchproxy.StreamBufferFull, match="stream_buffer=1024"):
        await collect(held, into=chunks)
    assert chunks == [(1, step) for step in range(2, 1026)]  # what it held, then the error
    stats = proxy.stats
    assert stats.errors == 1
    assert_settled(stats)
    await proxy.aclose()


async def test_a_reading_consumer_keeps_up_with_a_generator_that_never_awaits() -> None:
    """The bound counts unread chunks, not steps: a consumer that reads is never cut off,
    even when the model never yields to the event loop between steps."""

    class Burst(batchproxy.Proxy[int, int]):
        async def _inference(self, items: list[int]) -> AsyncIterator[list[Any]]:
            for step in range(items[0] - 1):
                yield [step]
            yield [Last(items[0] - 1)]

    proxy = Burst(stream_buffer=4)
    assert await asyncio.wait_for(collect(proxy.stream(1000)), 10) == list(range(1000))
    await proxy.aclose()


@pytest.mark.looptime
async def test_aclose_ends_a_stream_its_consumer_stopped_reading() -> None:
    """aclose() waits for the streams being read; one whose consumer holds it without
    reading is ended at once (ProxyClosed after what it holds), so aclose() returns."""
    proxy = Endless()
    held = proxy.stream(1)
    assert await anext(held) == (1, 1)
    reader = asyncio.create_task(collect(proxy.stream(2)))
    await asyncio.sleep(3.5)
    assert proxy.steps == 4
    closing = asyncio.create_task(proxy.aclose())
    await asyncio.sleep(10)
    # the held stream is cut within two steps; the read one runs on: Endless never ends
    chunks: list[Any] = []
    with pytest.raises(batchproxy.ProxyClosed, match="not reading"):
        await collect(held, into=chunks)
    # steps 2 to 4 came before aclose(); step 5 found them unread, and ended the stream
    assert chunks == [(1, 2), (1, 3), (1, 4)]
    assert not closing.done()
    assert not reader.done()  # the reading consumer is served on
    reader.cancel()  # it leaves: the batch is over
    await asyncio.wait_for(closing, 5)
    assert_settled(proxy.stats)


@pytest.mark.looptime
async def test_a_smaller_stream_buffer_drops_a_stream_sooner() -> None:
    proxy = Endless(stream_buffer=8)
    held = proxy.stream(1)
    assert await anext(held) == (1, 1)
    await asyncio.sleep(100)
    assert proxy.steps == 10  # 1 read, 8 filled the buffer, the 10th found it full
    with pytest.raises(batchproxy.StreamBufferFull, match="stream_buffer=8"):
        await collect(held)
    assert_settled(proxy.stats)
    await proxy.aclose()


@pytest.mark.looptime
async def test_a_generation_stream_held_but_not_read_is_dropped_once_its_buffer_is_full() -> None:
    class Forever(batchproxy.GenerationProxy[int, int]):
        async def _step(self, step: batchproxy.Step[int]) -> list[int]:
            await asyncio.sleep(1)
            return [slot.item for slot in step.active]

    proxy = Forever(stream_buffer=4)
    held = proxy.stream(7)
    assert await anext(held) == 7
    reader = asyncio.create_task(collect(proxy.stream(8)))
    await asyncio.sleep(50)
    assert proxy.stats.errors == 1  # the held one left; the read one runs on
    with pytest.raises(batchproxy.StreamBufferFull):
        await collect(held)
    reader.cancel()
    await proxy.aclose()
    assert_settled(proxy.stats)


def test_stream_buffer_is_checked() -> None:
    for bad, error in ((0, ValueError), (-1, ValueError), (1.5, TypeError), ("8", TypeError)):
        with pytest.raises(error, match="stream_buffer"):
            Endless(stream_buffer=bad)
        with pytest.raises(error, match="stream_buffer"):
            Endless().configure(stream_buffer=bad)
    Endless(stream_buffer=None)  # unbounded, by choice
