"""`Proxy` subclasses whose `_inference` takes more than its items: keyword-only
parameters are per batch (`proxy.with_args(...)`), several positional-only ones
each get a list. On looptime's virtual clock."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import Any

import pytest

import batchproxy
from batchproxy import BackgroundLoop, Proxy

pytestmark = pytest.mark.looptime


class Embedder(Proxy[str, str]):
    """Records each batch with its arguments."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.calls: list[tuple[list[str], bool, str]] = []

    async def _inference(  # type: ignore[override]
        self, texts: list[str], /, *, normalize: bool = False, unit: str = "x"
    ) -> list[str]:
        self.calls.append((list(texts), normalize, unit))
        await asyncio.sleep(1.0)
        return [f"{t}:{normalize}:{unit}" for t in texts]


async def test_calls_are_batched_per_distinct_arguments_which_the_model_gets_once() -> None:
    p = Embedder(batch_size=8)
    loud = p.with_args(normalize=True)
    results = await asyncio.gather(
        p.inference("a"),
        loud.inference("b"),
        p.inference("c"),
        loud.inference("d"),
        p.with_args(unit="y").inference("e"),
    )
    assert results == ["a:False:x", "b:True:x", "c:False:x", "d:True:x", "e:False:y"]
    assert sorted(p.calls) == [
        (["a", "c"], False, "x"),
        (["b", "d"], True, "x"),
        (["e"], False, "y"),
    ]
    # the defaults spelt out are the same batch as none given
    await asyncio.gather(p.inference("f"), p.with_args(normalize=False, unit="x").inference("g"))
    assert p.calls[-1] == (["f", "g"], False, "x")
    await p.aclose()


async def test_with_args_has_every_call_form() -> None:
    p = Embedder(batch_size=8)
    loud = p.with_args(normalize=True)
    assert await loud.inference_many(["a", "b"]) == ["a:True:x", "b:True:x"]
    assert await loud.inference("c", timeout=5.0, priority=1, tenant="t") == "c:True:x"
    with pytest.raises(batchproxy.DeadlineExceeded):
        await loud.inference("late", timeout=0.5)
    assert "normalize=True" in repr(loud)
    await p.aclose()


def test_with_args_from_a_plain_thread() -> None:
    p = Embedder(batch_size=8)
    background = BackgroundLoop.default()
    try:
        loud = p.with_args(normalize=True)
        assert loud.inference_sync("a", timeout=30) == "a:True:x"
        assert loud.submit("b").result(30) == "b:True:x"
        background.run(p.aclose())
    finally:
        background.close()


async def test_bad_arguments_are_refused_before_any_call() -> None:
    p = Embedder(batch_size=8)
    with pytest.raises(TypeError, match="unexpected keyword argument 'colour'"):
        p.with_args(colour="red")
    with pytest.raises(TypeError, match="argument 'unit' must be hashable"):
        p.with_args(unit=["y"])
    with pytest.raises(TypeError, match="per-batch arguments, which are its batch key"):
        await p.inference("a", key="k")
    assert p.stats.requests == 0
    await p.aclose()


async def test_required_arguments_must_be_given() -> None:
    class Scaled(Proxy[float, float]):
        async def _inference(self, xs: list[float], /, *, factor: float) -> list[float]:  # type: ignore[override]
            return [x * factor for x in xs]

    p = Scaled(batch_size=4)
    with pytest.raises(
        TypeError, match=r"missing a required (keyword-only )?argument: 'factor'.*with_args"
    ):
        await p.inference(1.0)
    assert await p.with_args(factor=3.0).inference(2.0) == 6.0
    await p.aclose()


async def test_several_item_parameters_each_get_a_list() -> None:
    seen: list[tuple[list[str], list[float]]] = []

    class Weigh(Proxy[tuple[str, float], str]):
        async def _inference(self, texts: list[str], weights: list[float], /) -> list[str]:  # type: ignore[override]
            seen.append((texts, weights))
            return [f"{t}*{w}" for t, w in zip(texts, weights, strict=True)]

    p = Weigh(batch_size=4)
    assert await asyncio.gather(p.inference(("a", 0.5)), p.inference(("b", 2.0))) == [
        "a*0.5",
        "b*2.0",
    ]
    assert seen == [(["a", "b"], [0.5, 2.0])]
    with pytest.raises(TypeError, match="takes 2 item arguments: an item must be a tuple"):
        await p.inference("ab")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="unexpected keyword argument 'x'"):
        p.with_args(x=1)  # positional-only parameters only: nothing per batch
    await p.aclose()


async def test_a_caller_cancelled_while_queued_never_reaches_the_model() -> None:
    p = Embedder(batch_size=1, max_concurrent_batches=1)
    first = asyncio.create_task(p.inference("first"))
    await asyncio.sleep(0)
    queued = asyncio.create_task(p.with_args(normalize=True).inference("gone"))
    await asyncio.sleep(0)
    queued.cancel()
    assert await first == "first:False:x"
    await asyncio.sleep(5.0)
    assert [texts for texts, _, _ in p.calls] == [["first"]]
    await p.aclose()


async def test_a_plain_def_model_gets_its_arguments_on_the_worker_thread() -> None:
    class OnThread(Proxy[str, str]):
        def _inference(self, texts: list[str], /, *, suffix: str = "") -> list[str]:  # type: ignore[override]
            assert threading.current_thread() is not threading.main_thread()
            return [t + suffix for t in texts]

    p = OnThread(batch_size=4)
    assert await asyncio.gather(p.inference("a"), p.with_args(suffix="!").inference("b")) == [
        "a",
        "b!",
    ]
    await p.aclose()


def test_declarations_refused_at_construction() -> None:
    class Keyed(Embedder):
        pass

    with pytest.raises(TypeError, match="takes no key= option"):
        Keyed(key=len)

    class Streams(Proxy[str, str]):
        async def _inference(self, texts: list[str], /, *, n: int = 1) -> AsyncIterator[list[str]]:  # type: ignore[override]
            yield texts

    with pytest.raises(TypeError, match="a streaming _inference takes its items only"):
        Streams()


async def test_a_proxy_whose_inference_takes_items_only_is_unchanged() -> None:
    """Extra parameters that are not keyword-only (older code) do not opt in."""

    class Old(Proxy[str, str]):
        async def _inference(self, items: list[str], extra: str = "") -> list[str]:  # type: ignore[override]
            return [i + extra for i in items]

    p = Old(batch_size=4)
    assert await p.inference("a", key="k") == "a"  # a batch key as for any proxy
    with pytest.raises(TypeError, match="takes no per-batch arguments"):
        p.with_args(extra="!")
    await p.aclose()
