"""`@batch_args`: a batched function with per-call arguments after its items; calls
batched per distinct value of those arguments, which the function gets once per batch;
bad calls refused before queueing; the per-item signature checked by mypy."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

import batchproxy
from batchproxy import batch_args

looptime = pytest.mark.looptime


def make_embed(calls: list[tuple[list[str], bool, str]]) -> Any:
    @batch_args(batch_size=8)
    async def embed(texts: list[str], /, normalize: bool = False, *, unit: str = "x") -> list[str]:
        calls.append((list(texts), normalize, unit))
        await asyncio.sleep(1.0)
        return [f"{t}:{normalize}:{unit}" for t in texts]

    return embed


@looptime
async def test_calls_are_batched_per_distinct_value_of_the_other_arguments() -> None:
    calls: list[tuple[list[str], bool, str]] = []
    embed = make_embed(calls)
    first = asyncio.create_task(embed("busy"))
    await asyncio.sleep(0.1)
    results = await asyncio.gather(
        first,
        embed("a", normalize=True),
        embed("b"),
        embed("c", True),  # positionally: the same value as a's
        embed("d", unit="y"),
    )
    assert results == ["busy:False:x", "a:True:x", "b:False:x", "c:True:x", "d:False:y"]
    assert calls == [
        (["busy"], False, "x"),
        (["a", "c"], True, "x"),
        (["b"], False, "x"),
        (["d"], False, "y"),
    ]
    await embed.aclose()


@looptime
async def test_many_and_per_call_options() -> None:
    calls: list[tuple[list[str], bool, str]] = []
    embed = make_embed(calls)
    assert await embed.inference_many(["a", "b"], normalize=True) == ["a:True:x", "b:True:x"]
    with pytest.raises(TimeoutError):
        await embed.with_call_options(timeout=0.5)("slow")
    assert await embed.with_call_options(priority=3, tenant="t")("p") == "p:False:x"
    assert embed.stats.timed_out == 1
    await embed.aclose()


async def test_a_thread_calls_with_its_arguments_and_per_call_options() -> None:
    """`inference_sync` takes `f`'s own arguments as `f(...)` does, and keeps the
    `with_call_options` ones (issue 27: it took neither, and dropped the timeout)."""
    calls: list[tuple[list[str], bool, str]] = []
    embed = make_embed(calls)
    answer = await asyncio.to_thread(embed.inference_sync, "a", True, unit="y")
    assert answer == "a:True:y"
    with pytest.raises(TimeoutError):
        await asyncio.to_thread(embed.with_call_options(timeout=0.05).inference_sync, "slow")
    assert embed.stats.timed_out == 1
    with pytest.raises(TypeError, match="nope"):
        await asyncio.to_thread(embed.inference_sync, "a", nope=1)
    await embed.aclose()


@looptime
async def test_a_stream_takes_its_arguments_and_per_call_options() -> None:
    """`f.stream(item, ...)` (its one result, `f` not being a generator) takes `f`'s
    arguments and keeps the `with_call_options` ones, as `f(...)` does."""
    calls: list[tuple[list[str], bool, str]] = []
    embed = make_embed(calls)
    assert [chunk async for chunk in embed.stream("a", True, unit="y")] == ["a:True:y"]
    with pytest.raises(TimeoutError):
        async for _ in embed.with_call_options(timeout=0.5).stream("slow"):
            pass
    assert calls[0] == (["a"], True, "y")
    await embed.aclose()


def test_a_generator_is_refused_at_decoration() -> None:
    """A stream's steps take no arguments (as for a `Proxy`'s `_inference`): refused
    when decorated, not with a puzzling error at the first call."""
    with pytest.raises(TypeError, match="items only"):

        @batch_args(batch_size=8)
        async def count(texts: list[str], /, *, upto: int = 2) -> Any:
            yield [f"{t}{upto}" for t in texts]


async def test_bad_calls_are_refused_before_queueing() -> None:
    calls: list[tuple[list[str], bool, str]] = []
    embed = make_embed(calls)
    with pytest.raises(TypeError, match="unexpected keyword argument 'colour'"):
        embed("x", colour=1)
    with pytest.raises(TypeError, match="too many positional arguments"):
        embed("x", True, "y")
    with pytest.raises(
        TypeError, match=r"per-call keywords go through \.with_call_options\(timeout"
    ):
        embed("x", timeout=1)
    with pytest.raises(TypeError, match="argument 'unit' must be hashable"):
        embed("x", unit=[])  # type: ignore[arg-type]
    assert embed.stats.requests == 0
    assert calls == []
    await embed.aclose()


async def test_a_missing_argument_is_named() -> None:
    @batch_args()
    def scale(xs: list[float], factor: float) -> list[float]:  # a plain def: a worker thread
        return [x * factor for x in xs]

    with pytest.raises(TypeError, match="missing a required argument: 'factor'"):
        scale(1.0)  # type: ignore[call-arg]
    assert await scale(2.0, 3.0) == 6.0
    assert await scale(2.0, factor=0.5) == 1.0
    await scale.aclose()


@looptime
async def test_a_caller_cancelled_while_queued_never_reaches_the_function() -> None:
    calls: list[tuple[list[str], bool, str]] = []
    embed = make_embed(calls)
    first = asyncio.create_task(embed("busy"))
    await asyncio.sleep(0.1)
    gone = asyncio.create_task(embed("gone", normalize=True))
    kept = asyncio.create_task(embed("kept"))
    await asyncio.sleep(0.1)
    gone.cancel()
    assert await asyncio.gather(first, kept) == ["busy:False:x", "kept:False:x"]
    assert [texts for texts, _, _ in calls] == [["busy"], ["kept"]]
    assert embed.stats.cancelled == 1
    await embed.aclose()


def test_declarations_refused_at_decoration() -> None:
    with pytest.raises(TypeError, match="no key= option"):

        @batch_args(key=len)
        async def keyed(items: list[str], flag: bool) -> list[str]:
            return items

    with pytest.raises(TypeError, match="with parentheses"):
        batch_args(lambda items: items)  # type: ignore[arg-type]


@looptime
async def test_several_item_parameters_get_a_list_each() -> None:
    calls: list[tuple[list[str], list[float], str]] = []

    @batch_args(batch_size=8)
    async def weigh(texts: list[str], weights: list[float], /, unit: str = "kg") -> list[str]:
        calls.append((texts, weights, unit))
        await asyncio.sleep(1.0)
        return [f"{t}={w}{unit}" for t, w in zip(texts, weights, strict=True)]

    first = asyncio.create_task(weigh("busy", 0.0))
    await asyncio.sleep(0.1)
    results = await asyncio.gather(
        first, weigh("a", 1.0), weigh("b", 2.0, "g"), weigh("c", 3.0), weigh("d", 4.0, unit="g")
    )
    assert results == ["busy=0.0kg", "a=1.0kg", "b=2.0g", "c=3.0kg", "d=4.0g"]
    assert calls[1:] == [(["a", "c"], [1.0, 3.0], "kg"), (["b", "d"], [2.0, 4.0], "g")]
    assert await weigh.inference_many([("e", 5.0), ("f", 6.0)]) == ["e=5.0kg", "f=6.0kg"]
    with pytest.raises(TypeError, match="takes 2 item arguments, got 1"):
        weigh("x")  # type: ignore[call-arg]
    await weigh.aclose()


async def test_a_method_gets_its_instance() -> None:
    class Model:
        def __init__(self, bias: int) -> None:
            self.bias = bias

        @batch_args(batch_size=4)
        async def add(self, xs: list[int], *, times: int = 1) -> list[int]:
            return [x * times + self.bias for x in xs]

    model = Model(100)
    assert await asyncio.gather(model.add(1), model.add(2, times=10)) == [101, 120]
    await model.add.aclose()


def test_mypy_checks_calls_against_the_per_item_signature(tmp_path: Path) -> None:
    pytest.importorskip("mypy")
    source = tmp_path / "calls.py"
    source.write_text(
        textwrap.dedent(
            """
            import batchproxy

            @batchproxy.batch_args(batch_size=8)
            async def embed(texts: list[str], /, *, normalize: bool = False) -> list[float]:
                return [0.0 for _ in texts]

            async def main() -> None:
                ok: float = await embed("x", normalize=True)
                await embed.with_call_options(timeout=1.0)("x")
                await embed(1)                       # line 11: the item's type
                await embed("x", normalize="yes")    # line 12: the argument's type
                await embed("x", colour=1)           # line 13: no such argument
                bad: str = await embed("x")          # line 14: the result's type

            @batchproxy.batch_args()
            def weigh(texts: list[str], weights: list[float], /) -> list[int]:
                return [0 for _ in texts]

            async def two() -> None:
                ok: int = await weigh("x", 1.0)
                bad: str = await weigh("x", 1.0)     # line 22: the result's type
            """
        )
    )
    # in a process of its own: mypy in this one would leave objects behind for the
    # object-counting tests that follow
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--no-incremental",
            "--cache-dir",
            str(tmp_path / "cache"),
            str(source),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "MYPYPATH": str(Path(__file__).resolve().parents[2])},
        check=False,
    )
    out, status = run.stdout, run.returncode
    errors = sorted(int(line.split(":")[1]) for line in out.splitlines() if ": error:" in line)
    assert errors == [11, 12, 13, 14, 22], out
    assert status == 1


def test_the_names_are_public() -> None:
    assert batchproxy.batch_args is batch_args


async def test_inference_and_submit_take_its_arguments_as_a_call_does() -> None:
    calls: list[tuple[list[str], bool, str]] = []

    @batch_args(batch_size=8, max_delay_ms=1.0)
    async def embed(texts: list[str], /, normalize: bool = False, *, unit: str = "x") -> list[str]:
        calls.append((list(texts), normalize, unit))
        return [f"{t}:{normalize}:{unit}" for t in texts]

    async with embed:
        assert await asyncio.wait_for(embed.inference("a", True, unit="y"), 10) == "a:True:y"
        assert await asyncio.wait_for(embed.inference("b"), 10) == "b:False:x"
        future = await asyncio.to_thread(embed.with_call_options(timeout=10).submit, "c", True)
        assert await asyncio.wait_for(asyncio.wrap_future(future), 10) == "c:True:x"
        with pytest.raises(TypeError, match="nope"):
            embed.submit("a", nope=1)
    assert sorted(calls) == [(["a"], True, "y"), (["b"], False, "x"), (["c"], True, "x")]
