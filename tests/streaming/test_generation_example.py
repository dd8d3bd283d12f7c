"""examples/generate.py: a GPT-2 behind continuous and static batching, and its SSE service.

Every stream must equal `greedy_decode` of its prompt alone (a batch of one, no
padding), whatever ran beside it: prompts of very different lengths at once, joins
and leaves mid-run, consumers that go away. The model is small, random and float64,
so no near-tie between two logits can flip an argmax between the batched and the
unbatched computation.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import json
import re
import sys
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from _support import assert_settled, on_uvicorn, run_script, wait_until
from typing_extensions import override

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
generate = importlib.import_module("generate")
Prompt = generate.Prompt

MODEL = generate.build_model(dtype=torch.float64)


@functools.cache
def reference(prompt: Any, eos: int = generate.EOS) -> list[int]:
    """What `prompt` generates alone: the ground truth (cached per prompt)."""
    return generate.greedy_decode(MODEL, prompt.ids, prompt.max_new_tokens, eos=eos)  # type: ignore[no-any-return]


def prompt(length: int, new: int, seed: int = 0) -> Any:
    """A prompt of `length` byte tokens (varied, from `seed`) asking for `new` tokens."""
    ids = tuple((seed * 31 + i * 7 + i * i) % 256 for i in range(length))
    return Prompt(ids, new)


# very different lengths, so that left padding, position ids and masks all matter
MIXED = [
    prompt(n, new, seed)
    for seed, (n, new) in enumerate(
        [(1, 30), (3, 9), (17, 25), (60, 14), (150, 30), (2, 1), (90, 22), (8, 40)]
    )
]


class Recording(generate.Gpt2Generator):  # type: ignore[misc]
    """A `Gpt2Generator` that records each step: (kept, joined count, left count)."""

    def __init__(self, **options: Any) -> None:
        super().__init__(MODEL, **options)
        self.log: list[tuple[list[int], int, int]] = []

    @override
    def _step(self, step: Any) -> list[Any]:
        self.log.append((list(step.kept), len(step.joined), len(step.left)))
        return super()._step(step)  # type: ignore[no-any-return]


async def collect(stream: AsyncIterator[int]) -> list[int]:
    return [token async for token in stream]


def test_the_reference_itself_depends_on_context_and_position() -> None:
    """A sanity check of the ground truth: the random model is not trivial (with tied
    weights it would just repeat the last byte), so a padding bug shows."""
    outs = [reference(p) for p in MIXED]
    assert all(
        len(out) == p.max_new_tokens or out[-1] == generate.EOS
        for p, out in zip(MIXED, outs, strict=True)
    )
    assert len({tuple(out) for out in outs}) == len(MIXED)
    assert all(len(set(out)) > 1 for out in outs if len(out) > 5)


async def test_concurrent_prompts_of_very_different_lengths_equal_the_reference() -> None:
    async with Recording(batch_size=8) as proxy:
        streams = await asyncio.gather(*(collect(proxy.stream(p)) for p in MIXED))
    assert_settled(proxy.stats)
    for p, got in zip(MIXED, streams, strict=True):
        assert got == reference(p), p
    assert max(proxy.stats.batch_sizes) == len(MIXED)  # they really ran together
    assert proxy.log[0] == ([], len(MIXED), 0)


async def test_sequences_join_and_leave_mid_run_and_every_stream_still_equals_the_reference() -> (
    None
):
    long = [prompt(5, 60, seed=10), prompt(120, 50, seed=11)]
    late = [prompt(40, 3, seed=12), prompt(2, 8, seed=13), prompt(77, 20, seed=14)]
    later = [prompt(1, 5, seed=15), prompt(200, 4, seed=16)]
    async with Recording(batch_size=8) as proxy:
        first = [asyncio.ensure_future(collect(proxy.stream(p))) for p in long]
        await wait_until(lambda: proxy.steps >= 5)
        second = [asyncio.ensure_future(collect(proxy.stream(p))) for p in late]
        await wait_until(lambda: proxy.steps >= 15)
        third = [asyncio.ensure_future(collect(proxy.stream(p))) for p in later]
        streams = await asyncio.gather(*first, *second, *third)
    assert_settled(proxy.stats)
    for p, got in zip(long + late + later, streams, strict=True):
        assert got == reference(p), p
    # newcomers joined a running batch (survivors kept, newcomers prefilled at once) ...
    assert any(kept and joined for kept, joined, _ in proxy.log)
    # ... and short ones left while others went on
    assert any(kept and left for kept, _, left in proxy.log)
    assert proxy.steps < sum(p.max_new_tokens for p in long + late + later)


def step_all(batch: Any, kept: Sequence[int], joined: Sequence[Any]) -> list[Any]:
    """One engine step; check the cache: a row per sequence (and maybe free ones), as
    wide as the longest sequence needs at least, spare room after that."""
    chunks = batch.step(kept, joined)
    kv = batch.kv
    assert kv is not None
    assert len(batch.rows) == len(set(batch.rows)) == len(chunks) <= kv.rows
    assert kv.columns >= int(kv.lengths[batch.rows].max())
    assert len(kv.buffers) == MODEL.config.n_layer
    for keys, values in kv.buffers:
        assert keys.shape == values.shape
        assert keys.shape[0] == kv.rows
        assert kv.columns <= keys.shape[2] <= kv.columns + generate.SPARE
    return list(chunks)


def test_the_engine_alone_joins_leaves_and_prunes_by_hand() -> None:
    """No proxy: drive `GreedyBatch.step` with a hand-written schedule of joins and
    leaves (including sequences whose consumer went away mid-stream) and compare each
    sequence with the reference."""
    a, b, c, d, e = (
        prompt(n, new, seed)
        for seed, (n, new) in enumerate([(70, 12), (2, 100), (25, 6), (130, 9), (6, 7)], start=20)
    )
    assert all(generate.EOS not in reference(p) for p in (a, b, c, d, e))  # no early ends
    batch = generate.GreedyBatch(generate.Engine(MODEL))
    got: dict[Any, list[int]] = {p: [] for p in (a, b, c, d, e)}
    ended: set[Any] = set()
    rows: list[Any] = []

    def run(kept: Sequence[int], joined: Sequence[Any]) -> None:
        nonlocal rows
        rows = [rows[i] for i in kept] + list(joined)
        for p, chunk in zip(rows, step_all(batch, kept, joined), strict=True):
            if isinstance(chunk, generate.Last):
                ended.add(p)
            got[p].append(chunk.chunk if isinstance(chunk, generate.Last) else chunk)

    run([], [a, b])  # two prefills, left-padded to 70
    run([0, 1], [c])  # a decode step for a and b; c prefilled and appended
    run([0, 1, 2], [])
    run([1, 2], [d])  # a leaves (its consumer went away)
    width = batch.kv.columns
    run([0, 1, 2], [])
    buffer = batch.kv.buffers[0][0]
    run([0, 2], [e])  # c leaves; e takes its row (no copy); d (130 tokens) keeps the cache wide
    assert batch.kv.buffers[0][0] is buffer
    assert batch.kv.rows == 3
    for _ in range(4):
        run([0, 1, 2], [])
    run([0, 2], [])  # d leaves: 120 columns are padding for b and e, so the cache shrinks
    assert batch.kv.columns < width
    assert batch.kv.rows == 2
    assert batch.kv.columns == len(b.ids) + len(got[b]) - 1  # b's newest token is not in yet
    # b and e run to their ends; b's 100 tokens outrun the spare columns, so the cache
    # grows (a copy into bigger buffers) on the way
    while any(p not in ended for p in rows):
        run([i for i, p in enumerate(rows) if p not in ended], [])
    assert ended == {b, e}
    assert len(got[b]) > generate.SPARE + 10
    for p in (b, e):
        assert got[p] == reference(p), p
    for p, count in ((a, 3), (c, 4), (d, 7)):  # those that left: a true prefix
        assert got[p] == reference(p)[:count], p


def test_the_engine_reclaims_rows_nobody_takes_and_static_batches_prune_at_once() -> None:
    prompts = [prompt(n, 40, seed) for seed, n in enumerate([5, 9, 3, 7], start=30)]
    batch = generate.GreedyBatch(generate.Engine(MODEL))
    step_all(batch, [], prompts)
    step_all(batch, [0, 2, 3], [])  # the second leaves: its row stays, free for a newcomer
    assert batch.kv.rows == 4
    for _ in range(generate.GreedyBatch.IDLE_STEPS - 2):  # the step it left counts
        step_all(batch, [0, 1, 2], [])
    assert batch.kv.rows == 4
    step_all(batch, [0, 1, 2], [])  # nobody came: the cache is rebuilt without it
    assert batch.kv.rows == 3
    static = generate.GreedyBatch(generate.Engine(MODEL), reuse_rows=False)
    step_all(static, [], prompts)
    step_all(static, [0, 2, 3], [])
    assert static.kv.rows == 3


def test_the_engine_ends_a_sequence_at_eos_and_refuses_a_prompt_too_long() -> None:
    p = prompt(30, 40, seed=40)
    full = reference(p)
    eos = full[6]  # make the 7th token the end of the sequence
    want = reference(p, eos)
    assert want == full[: full.index(eos) + 1]
    batch = generate.GreedyBatch(generate.Engine(MODEL), eos=eos)
    too_long = Prompt((1,) * 500, 100)  # 600 > n_positions=512
    chunks = batch.step([], [p, too_long])
    assert isinstance(chunks[1], ValueError)
    got = [chunks[0]]
    while not isinstance(got[-1], generate.Last):
        got += batch.step([0], [])
    assert [*got[:-1], got[-1].chunk] == want


async def test_a_prompt_too_long_fails_its_own_stream_only() -> None:
    ok = MIXED[2]
    async with generate.Gpt2Generator(MODEL, batch_size=4) as proxy:
        bad = asyncio.ensure_future(collect(proxy.stream(Prompt((7,) * 600, 5))))
        good = asyncio.ensure_future(collect(proxy.stream(ok)))
        with pytest.raises(ValueError, match="prompt \\+ max_new_tokens"):
            await bad
        assert await good == reference(ok)


async def test_a_consumer_that_breaks_or_is_cancelled_frees_its_slot_for_the_queue() -> None:
    hog, queued = prompt(10, 500, seed=50), prompt(12, 10, seed=51)
    other_hog, queued_again = prompt(11, 500, seed=52), prompt(3, 10, seed=53)
    async with Recording(batch_size=1) as proxy:
        # break: the consumer leaves after 3 tokens; a request queued meanwhile gets the slot
        got: list[int] = []
        async for token in proxy.stream(hog):
            got.append(token)
            if len(got) == 1:
                waiting = asyncio.ensure_future(collect(proxy.stream(queued)))
            if len(got) == 3:
                break
        assert not waiting.done()
        assert await waiting == reference(queued)
        assert got == reference(hog)[:3]

        # cancellation: the consuming task is cancelled mid-stream
        started = asyncio.Event()

        async def consume() -> None:
            async for _ in proxy.stream(other_hog):
                started.set()

        hogging = asyncio.ensure_future(consume())
        await started.wait()
        waiting = asyncio.ensure_future(collect(proxy.stream(queued_again)))
        at = proxy.steps
        await wait_until(lambda: proxy.steps >= at + 3)
        assert not waiting.done()  # it waits for the one slot
        hogging.cancel()
        assert await waiting == reference(queued_again)
        assert proxy.stats.cancelled == 2
    assert_settled(proxy.stats)
    assert proxy.steps < 500  # neither hog ran to its 500 tokens
    assert max(proxy.stats.batch_sizes) == 1


async def test_the_static_generator_matches_the_reference_and_newcomers_wait_for_the_batch() -> (
    None
):
    class Static(generate.StaticGenerator):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__(MODEL, batch_size=8, max_delay_ms=20)
            self.batches: list[int] = []

        @override
        def _inference(self, prompts: list[Any]) -> Any:
            self.batches.append(len(prompts))
            yield from super()._inference(prompts)

    async with Static() as proxy:
        first = [asyncio.ensure_future(collect(proxy.stream(p))) for p in MIXED[:5]]
        await asyncio.sleep(0.1)  # the batch of 5 is running
        late = [asyncio.ensure_future(collect(proxy.stream(p))) for p in MIXED[5:]]
        streams = await asyncio.gather(*first, *late)
    assert_settled(proxy.stats)
    for p, got in zip(MIXED, streams, strict=True):
        assert got == reference(p), p
    assert proxy.batches == [5, 3]  # the late ones waited for the whole first batch


# -- the SSE service over a real uvicorn server ------------------------------------------


@asynccontextmanager
async def serve(proxy: Any) -> AsyncIterator[httpx.AsyncClient]:
    """`create_app(proxy)` on 127.0.0.1 on a free port; yield a client for it."""
    async with serve_on(proxy) as (_, http):
        yield http


@asynccontextmanager
async def serve_on(proxy: Any) -> AsyncIterator[tuple[Any, httpx.AsyncClient]]:
    """`serve`, yielding the uvicorn server too."""
    async with (
        on_uvicorn(generate.create_app(proxy)) as (server, port),
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http,
    ):
        yield server, http


async def events(response: Any) -> AsyncIterator[tuple[str, Any]]:
    """Parse a `text/event-stream` body: (event name, decoded JSON data) per event."""
    name, data = "message", None
    async for line in response.aiter_lines():
        if line.startswith("event: "):
            name = line.removeprefix("event: ")
        elif line.startswith("data: "):
            data = json.loads(line.removeprefix("data: "))
        elif line == "" and data is not None:
            yield name, data
            name, data = "message", None


async def sse_tokens(http: Any, text: str, max_new_tokens: int) -> tuple[list[int], str, Any]:
    """POST /generate; the streamed tokens, their text, and the final event's data."""
    body = {"prompt": text, "max_new_tokens": max_new_tokens}
    tokens: list[int] = []
    pieces: list[str] = []
    async with http.stream("POST", "/generate", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        async for name, data in events(response):
            if name == "end":
                return tokens, "".join(pieces) + data.pop("text"), data
            assert name == "message", (name, data)
            tokens.append(data["token"])
            pieces.append(data["text"])
    raise AssertionError("the stream ended without an end event")


async def test_sse_streams_every_token_then_an_end_event() -> None:
    texts = [("Hello", 12), ("A much longer prompt, éèà, to be padded on the left", 20), ("x", 30)]
    proxy = generate.Gpt2Generator(MODEL, batch_size=4)
    async with serve(proxy) as http:
        results = await asyncio.gather(*(sse_tokens(http, t, n) for t, n in texts))
        assert (await http.get("/livez")).status_code == 200
        assert (await http.get("/readyz")).json()["status"] == "ready"
        assert (await http.post("/generate", json={"prompt": ""})).status_code == 422
        too_long = {"prompt": "y" * 500, "max_new_tokens": 100}
        assert (await http.post("/generate", json=too_long)).status_code == 413
    for (text, n), (tokens, decoded, end) in zip(texts, results, strict=True):
        want = reference(Prompt.of(text, n))
        assert tokens == want
        assert decoded == generate.decode(want)
        assert end == {"tokens": len(want)}
    assert max(proxy.stats.batch_sizes) > 1
    assert_settled(proxy.stats)


async def test_a_client_that_disconnects_mid_stream_frees_its_slot() -> None:
    proxy = Recording(batch_size=1)
    async with serve(proxy) as http:
        body = {"prompt": "a long one", "max_new_tokens": 256}
        async with http.stream("POST", "/generate", json=body) as response:
            received = 0
            async for name, _ in events(response):
                assert name == "message"
                received += 1
                if received == 3:
                    break  # leaving the block closes the connection
        await wait_until(lambda: proxy.stats.cancelled == 1)
        steps = proxy.steps
        assert steps < 200
        # the one slot is free: the next request runs at once, to its end
        tokens, _, end = await sse_tokens(http, "next", 5)
        assert tokens == reference(Prompt.of("next", 5))
        assert end == {"tokens": 5}
        await asyncio.sleep(0.05)
        # the dropped stream ran no further (but for a step in flight when it left)
        assert proxy.steps <= steps + 6
    assert_settled(proxy.stats)


async def test_a_stream_runs_to_its_end_when_the_server_shuts_down() -> None:
    class Slow(Recording):
        @override
        def _step(self, step: Any) -> list[Any]:
            time.sleep(0.01)  # 100 tokens: over a second, past sse-starlette's 0.5 s poll
            return super()._step(step)

    proxy = Slow(batch_size=1)
    async with serve_on(proxy) as (server, http):
        body = {"prompt": "shutdown", "max_new_tokens": 100}
        async with http.stream("POST", "/generate", json=body) as response:
            tokens: list[int] = []
            async for name, data in events(response):
                if name == "end":
                    break
                tokens.append(data["token"])
                if len(tokens) == 3:
                    server.should_exit = True  # what uvicorn's SIGTERM handler does
        assert (name, data) == ("end", {"tokens": 100, "text": ""})
        assert tokens == reference(Prompt.of("shutdown", 100))
    assert_settled(proxy.stats)


def test_the_example_runs_as_a_script_and_every_stream_equals_its_reference() -> None:
    out = run_script("generate", timeout=120)
    verdicts = re.findall(r"\(= unbatched greedy_decode: (\w+)\)", out)
    assert verdicts == ["yes"] * 5, out
    # 5 prompts through 3 slots: the later ones join a running batch, not a new one
    assert re.search(r"#3 first token \(step (\d+)\)", out), out
    assert "122 tokens in 42 steps" in out, out
