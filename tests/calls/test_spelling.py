"""One spelling for each concept (issue 28, item 3): the option values (`Dedup`,
`BatchSizes`, `Watchdog`), the per-call keywords (`CallOptions`), one set of verbs
for `Proxy` and `@batch`, `GenerationProxy`'s `length`/`max_batch_tokens`, the
did-you-mean errors, and each old spelling: it warns naming the new one and
still works the same."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import re
from collections.abc import AsyncIterator
from typing import Any

import pytest
from typing_extensions import override

import batchproxy
from batchproxy import (
    BatchSizes,
    Dedup,
    GenerationProxy,
    Last,
    Options,
    Proxy,
    Step,
    Watchdog,
)
from batchproxy._scheduling.sizes import NO_ITEM


class Echo(Proxy[Any, Any]):
    """Each item's result is the item; records each batch."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.batches: list[list[Any]] = []

    @override
    async def _inference(self, items: list[Any]) -> list[Any]:
        self.batches.append(list(items))
        await asyncio.sleep(0.01)
        return [("out", item) for item in items]


# -- the values ----------------------------------------------------------------------


def test_dedup_holds_its_parts_checked_and_frozen() -> None:
    dedup = Dedup(key=str.lower, cache_size=8, cache_ttl=2)
    assert (dedup.key, dedup.cache_size, dedup.cache_ttl) == (str.lower, 8, 2.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        dedup.cache_size = 3  # type: ignore[misc]
    assert Dedup() == Dedup(key=None, cache_size=None, cache_ttl=None)
    with pytest.raises(ValueError, match=r"cache_ttl=...\) needs cache_size"):
        Dedup(cache_ttl=5.0)
    with pytest.raises(ValueError, match="cache_size"):
        Dedup(cache_size=0)
    with pytest.raises(ValueError, match="cache_ttl"):
        Dedup(cache_size=1, cache_ttl=-1)
    with pytest.raises(TypeError, match="function of the item"):
        Dedup(key="text")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        Dedup(str.lower)  # type: ignore[misc]  # keywords only


def test_the_dedup_shorthands_mean_a_dedup() -> None:
    assert Options(dedup=True).dedup == Dedup()  # type: ignore[arg-type]
    assert Options(dedup=str.lower).dedup == Dedup(key=str.lower)  # type: ignore[arg-type]
    assert Options(dedup=False).dedup is None  # type: ignore[arg-type]
    assert Options().dedup is None


def test_batch_sizes_holds_sorted_sizes_and_its_filler() -> None:
    sizes = BatchSizes([8, 2, 4], pad_item=0)  # type: ignore[arg-type]
    assert sizes.sizes == (2, 4, 8)
    assert sizes.pad_item == 0
    assert sizes.pads
    assert not BatchSizes((1, 2)).pads
    assert BatchSizes((1, 2)).pad_item is NO_ITEM
    assert BatchSizes((2, 4), pad_item=None).pads  # None is a filler like any other
    assert repr(BatchSizes((2, 4), pad_item=0)) == "BatchSizes((2, 4), pad_item=0)"
    assert repr(BatchSizes((1, 2))) == "BatchSizes((1, 2))"
    with pytest.raises(ValueError, match="repeat"):
        BatchSizes((2, 2))
    with pytest.raises(ValueError, match="positive"):
        BatchSizes((0, 2))
    with pytest.raises(TypeError, match="needs its sizes"):
        BatchSizes(None)  # type: ignore[arg-type]
    assert Options(batch_size=8, batch_sizes=(4, 1)).batch_sizes == BatchSizes((1, 4))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="below the smallest"):
        Options(batch_size=2, batch_sizes=BatchSizes((4, 8)))


def test_watchdog_holds_its_seconds_and_what_it_does() -> None:
    assert Watchdog(2) == Watchdog(2.0, on_timeout="serve")
    assert Watchdog(2, on_timeout="stop").on_timeout == "stop"
    with pytest.raises(ValueError, match=r'on_timeout=...\) must be "serve" or "stop"'):
        Watchdog(1.0, on_timeout="close")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="> 0"):
        Watchdog(0)
    with pytest.raises(ValueError, match="finite"):
        Watchdog(math.inf)
    assert Options(batch_timeout=2.0).batch_timeout == Watchdog(2.0)  # type: ignore[arg-type]
    assert Options(batch_timeout=math.inf).batch_timeout is None  # type: ignore[arg-type]
    options = Options(batch_timeout=Watchdog(2.0, on_timeout="stop"))
    assert options.stops_on_overrun
    assert options.batch_timeout_seconds == 2.0


def test_proxy_options_show_the_new_shape() -> None:
    proxy = Echo(
        dedup=Dedup(cache_size=4),
        batch_sizes=(1, 2, 4),
        batch_timeout=Watchdog(3.0, on_timeout="stop"),
    )
    options = proxy.options
    assert options.dedup == Dedup(cache_size=4)
    assert options.batch_sizes == BatchSizes((1, 2, 4))
    assert options.batch_timeout == Watchdog(3.0, on_timeout="stop")
    shown = repr(options)
    for old in ("cache_size=None,", "pad_item", "on_batch_timeout"):
        assert f" {old}" not in shown.replace("Dedup(", "").replace("BatchSizes(", "")
    for name in ("cache_size", "cache_ttl", "pad_item", "on_batch_timeout"):
        assert name not in {f.name for f in dataclasses.fields(Options)}


# -- together, through the public API ------------------------------------------------


async def test_dedup_with_a_cache_batch_keys_and_padded_sizes_together() -> None:
    """`Dedup(cache_size=...)`, a `key=` option and `BatchSizes(..., pad_item=...)` on one
    proxy: equal items share a slot, the cache answers a repeat, batches are by key
    and padded to an allowed size with the filler, whose results are dropped."""
    proxy = Echo(
        batch_size=4,
        max_delay_ms=50,
        dedup=Dedup(key=lambda item: item[1], cache_size=8),
        key=lambda item: item[0],
        batch_sizes=BatchSizes((2, 4), pad_item=("pad", "pad")),
    )
    async with proxy:
        first = await asyncio.gather(
            proxy.inference(("en", "a")),
            proxy.inference(("en", "a")),  # joins the first one's slot
            proxy.inference(("fr", "b")),
        )
        assert first == [("out", ("en", "a")), ("out", ("en", "a")), ("out", ("fr", "b"))]
        again = await proxy.inference(("en", "a"))  # from the cache: no model call
        assert again == ("out", ("en", "a"))
        stats = proxy.stats
    assert stats.deduplicated == 1
    assert stats.cache_hits == 1
    assert sorted(len(batch) for batch in proxy.batches) == [2, 2]  # padded to size 2
    for batch in proxy.batches:
        assert len({item[0] for item in batch if item != ("pad", "pad")}) == 1  # one key
        assert ("pad", "pad") in batch


# -- configure() ---------------------------------------------------------------------


def test_configure_takes_a_watchdog_and_seconds_keep_what_it_does() -> None:
    proxy = Echo()
    proxy.configure(batch_timeout=Watchdog(1.0, on_timeout="stop"))
    assert proxy.options.batch_timeout == Watchdog(1.0, on_timeout="stop")
    proxy.configure(batch_timeout=2.0)
    assert proxy.options.batch_timeout == Watchdog(2.0, on_timeout="stop")
    proxy.configure(batch_timeout=None)
    assert proxy.options.batch_timeout is None
    proxy.configure(batch_timeout=3.0)
    assert proxy.options.batch_timeout == Watchdog(3.0)
    with pytest.raises(TypeError, match="fixed at construction"):
        proxy.configure(dedup=Dedup())  # type: ignore[call-arg]


@pytest.mark.looptime
async def test_a_watchdog_set_by_configure_stops_intake() -> None:
    class Slow(Echo):
        @override
        async def _inference(self, items: list[Any]) -> list[Any]:
            await asyncio.sleep(1.0)
            return items

    async with Slow(batch_size=1) as proxy:
        proxy.configure(batch_timeout=Watchdog(0.5, on_timeout="stop"))
        with pytest.raises(batchproxy.BatchTimeout):
            await proxy.inference("overruns")
        assert proxy.closed


# -- did you mean --------------------------------------------------------------------


def test_a_misspelt_option_names_the_nearest() -> None:
    with pytest.raises(TypeError, match="did you mean `max_delay_ms`"):
        Echo(max_dealy_ms=3)
    with pytest.raises(
        TypeError, match=r"@batch\(\) .*'max_queue_sise'.*did you mean `max_queue_size`"
    ):
        batchproxy.batch(max_queue_sise=3)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"@batch_args\(\).*did you mean `timeout`"):
        batchproxy.batch_args(timout=1)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"configure\(\).*did you mean `max_queue_size`"):
        Echo().configure(max_qeue_size=3)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="it takes"):  # nothing near: the list
        Echo(zzz=1)


async def test_a_misspelt_call_keyword_names_the_nearest() -> None:
    @batchproxy.batch(max_delay_ms=0)
    async def f(items: list[int]) -> list[int]:
        return items

    proxy = Echo()
    with pytest.raises(TypeError, match=r"f\(\).*'timout'.*did you mean `timeout`"):
        await f(1, timout=2)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="did you mean `priority`"):
        await f.inference_many([1], prioriti=2)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"inference_many\(\).*did you mean `tenant`"):
        await proxy.inference_many([1], tenat="a")  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"submit\(\).*did you mean `key`"):
        proxy.submit(1, kee="k")  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"inference_sync\(\).*did you mean `timeout`"):
        proxy.inference_sync(1, timeot=1)  # type: ignore[call-arg]
    assert await f(1, timeout=1, priority=1, tenant="t", key="k") == 1
    await f.aclose()
    await proxy.aclose()


# -- the verbs -----------------------------------------------------------------------


async def test_batched_has_proxys_verbs_and_the_old_ones_warn() -> None:
    @batchproxy.batch(max_delay_ms=0)
    async def double(items: list[int]) -> list[int]:
        return [2 * i for i in items]

    assert await double.inference_many([1, 2], priority=1) == [2, 4]
    with pytest.warns(DeprecationWarning, match=r"f\.many\(\).*use f\.inference_many\(\)"):
        assert await double.many([1, 2], priority=1) == [2, 4]
    results = await double.inference_many([1], return_exceptions=True)
    assert results == [2]
    await double.aclose()

    @batchproxy.batch(max_delay_ms=0)
    def triple(items: list[int]) -> list[int]:
        return [3 * i for i in items]

    def from_a_thread() -> tuple[int, int]:
        new = triple.inference_sync(2, timeout=5)
        with pytest.warns(DeprecationWarning, match=r"use f\.inference_sync\(\)"):
            old = triple.sync(2, timeout=5)
        return new, old

    assert await asyncio.to_thread(from_a_thread) == (6, 6)
    await triple.aclose()


async def test_batch_args_with_call_options_and_the_old_names_warn() -> None:
    @batchproxy.batch_args(max_delay_ms=0)
    async def scale(items: list[int], /, *, factor: int = 1) -> list[int]:
        return [factor * i for i in items]

    urgent = scale.with_call_options(timeout=2.0, priority=1)
    assert await urgent(2, factor=3) == 6
    assert await scale.inference_many([1, 2], factor=2) == [2, 4]
    with pytest.warns(DeprecationWarning, match=r"f\.options\(\).*with_call_options"):
        old = scale.options(timeout=2.0, priority=1)
    assert await old(2, factor=3) == 6
    with pytest.warns(DeprecationWarning, match=r"use f\.inference_many\(\)"):
        assert await scale.many([1, 2], factor=2) == [2, 4]
    with pytest.raises(TypeError, match="takes no key="):
        scale.with_call_options(key="k")  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="did you mean `tenant`"):
        scale.with_call_options(tenat="a")  # type: ignore[call-arg]
    await scale.aclose()


# -- GenerationProxy: length and max_batch_tokens ------------------------------------


class Countdown(GenerationProxy[int, int]):
    """Each sequence yields its item's chunks, then ends."""

    @override
    async def _step(self, step: Step[int]) -> list[Any]:
        out: list[Any] = []
        for slot in step.active:
            slot.state = slot.item if slot.state is None else slot.state - 1
            out.append(Last(slot.state) if slot.state <= 1 else slot.state)
        return out


async def _collect(stream: AsyncIterator[int]) -> list[int]:
    return [chunk async for chunk in stream]


async def test_generation_takes_length_and_max_batch_tokens() -> None:
    proxy = Countdown(max_batch_tokens=10, length=lambda n: n)
    assert await _collect(proxy.stream(3)) == [3, 2, 1]
    with pytest.raises(ValueError, match="more than max_batch_tokens=10"):
        await _collect(proxy.stream(11))
    await proxy.aclose()
    alone = Countdown(max_batch_tokens=10)  # as Proxy: measured by tensors.length
    assert alone.options.max_batch_tokens == 10


async def test_generation_old_names_warn_and_work_the_same() -> None:
    with (
        pytest.warns(DeprecationWarning, match=r"max_tokens=.*use max_batch_tokens="),
        pytest.warns(DeprecationWarning, match=r"\(tokens=.*use length="),
    ):
        proxy = Countdown(max_tokens=10, tokens=lambda n: n)
    assert await _collect(proxy.stream(3)) == [3, 2, 1]
    with pytest.raises(ValueError, match="more than max_batch_tokens=10"):
        await _collect(proxy.stream(11))
    await proxy.aclose()
    with (
        pytest.warns(DeprecationWarning, match="max_tokens"),
        pytest.raises(TypeError, match="give only max_batch_tokens"),
    ):
        Countdown(max_tokens=10, max_batch_tokens=10, length=len)


# -- the old flat options ------------------------------------------------------------


@pytest.mark.parametrize(
    ("old", "new", "named"),
    [
        (
            {"dedup": True, "cache_size": 4, "cache_ttl": 5.0},
            {"dedup": Dedup(cache_size=4, cache_ttl=5.0)},
            r"dedup=Dedup\(cache_",
        ),
        (
            {"dedup": str.lower, "cache_size": 4},
            {"dedup": Dedup(key=str.lower, cache_size=4)},
            r"dedup=Dedup\(cache_size=",
        ),
        (
            {"batch_sizes": (2, 4), "pad_item": 0},
            {"batch_sizes": BatchSizes((2, 4), pad_item=0)},
            r"BatchSizes\(sizes, pad_item=",
        ),
        (
            {"batch_timeout": 2.0, "on_batch_timeout": "stop"},
            {"batch_timeout": Watchdog(2.0, on_timeout="stop")},
            r"batch_timeout=Watchdog\(seconds, on_timeout=",
        ),
    ],
)
def test_an_old_flat_option_warns_naming_the_new_spelling_and_means_the_same(
    old: dict[str, Any], new: dict[str, Any], named: str
) -> None:
    with pytest.warns(DeprecationWarning, match=named) as warned:
        old_proxy = Echo(**old)
    assert all(w.filename == __file__ for w in warned)  # it points at the caller's line
    new_proxy = Echo(**new)
    assert old_proxy.options == new_proxy.options
    assert old_proxy.options.filler == new_proxy.options.filler


async def test_old_flat_options_work_the_same() -> None:
    with pytest.warns(DeprecationWarning, match="deprecated"):
        old = Echo(batch_size=4, dedup=True, cache_size=4, batch_sizes=(2, 4), pad_item=-1)
    new = Echo(batch_size=4, dedup=Dedup(cache_size=4), batch_sizes=BatchSizes((2, 4), pad_item=-1))
    for proxy in (old, new):
        async with proxy:
            assert await proxy.inference(1) == ("out", 1)
            assert await proxy.inference(1) == ("out", 1)  # cached
            assert proxy.stats.cache_hits == 1
    assert old.batches == new.batches == [[1, -1]]


def test_configure_with_the_old_on_batch_timeout_warns_and_works() -> None:
    proxy = Echo(batch_timeout=2.0)
    with pytest.warns(DeprecationWarning, match=r"Watchdog\(seconds, on_timeout="):
        proxy.configure(on_batch_timeout="stop")
    assert proxy.options.batch_timeout == Watchdog(2.0, on_timeout="stop")
    with pytest.warns(DeprecationWarning, match="on_batch_timeout"):
        proxy.configure(batch_timeout=3.0, on_batch_timeout="serve")
    assert proxy.options.batch_timeout == Watchdog(3.0)


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"cache_size": 4}, ValueError, "need dedup="),
        ({"dedup": Dedup(), "cache_size": 4}, TypeError, r"go inside Dedup\(...\)"),
        ({"pad_item": 0}, ValueError, "needs batch_sizes"),
        ({"batch_sizes": BatchSizes((1, 2)), "pad_item": 0}, TypeError, "inside BatchSizes"),
        ({"on_batch_timeout": "stop"}, ValueError, "needs batch_timeout"),
        (
            {"batch_timeout": Watchdog(1.0), "on_batch_timeout": "stop"},
            TypeError,
            "inside Watchdog",
        ),
    ],
)
def test_a_meaningless_old_combination_is_refused_clearly(
    options: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.warns(DeprecationWarning, match="deprecated"), pytest.raises(error, match=message):
        Echo(**options)


@pytest.mark.parametrize(
    ("options", "missing"),
    [
        ({"cache_size": 4}, "dedup"),
        ({"cache_ttl": 4.0}, "dedup"),
        ({"pad_item": 0}, "batch_sizes"),
        ({"on_batch_timeout": "stop"}, "batch_timeout"),
    ],
)
def test_a_part_without_its_option_is_one_error_class(
    options: dict[str, Any], missing: str
) -> None:
    """Issue 38: one misuse, one class: a part given without the option it modifies is a
    `ValueError` (it was a `TypeError` for pad_item=), naming the missing option."""
    with pytest.warns(DeprecationWarning, match="deprecated"), pytest.raises(ValueError) as raised:
        Echo(**options)
    assert type(raised.value) is ValueError
    assert f"{missing}=" in str(raised.value)
    with pytest.raises(ValueError, match=r"Dedup\(cache_ttl=...\) needs cache_size="):
        Dedup(cache_ttl=4.0)  # (the new spelling's part without its part)


def test_configure_on_batch_timeout_without_a_watchdog_is_refused() -> None:
    with (
        pytest.warns(DeprecationWarning, match="on_batch_timeout"),
        pytest.raises(ValueError, match="needs batch_timeout"),
    ):
        Echo().configure(on_batch_timeout="stop")


def test_the_tensor_proxy_is_typed_like_proxy_and_refuses_a_filler() -> None:
    import numpy as np

    class Static(batchproxy.TensorProxy[Any, Any]):
        @override
        def _forward(self, batch: Any) -> Any:
            return batch.data

    assert Static(batch_sizes=(2, 4)).options.batch_sizes == BatchSizes((2, 4))
    with pytest.raises(TypeError, match="takes no pad_item"):
        Static(batch_sizes=BatchSizes((2, 4), pad_item=np.zeros(2)))
    with pytest.raises(TypeError, match="did you mean `max_delay_ms`"):
        Static(max_delay=3)


# -- the hooks -----------------------------------------------------------------------


def test_proxy_offers_inference_and_cost_as_hooks_and_fences_off_the_rest() -> None:
    doc = Proxy.__doc__ or ""
    assert "`_inference`" in doc
    assert "`_cost`" in doc
    assert "_run_kind" not in doc
    assert "_model_function" not in doc
    for name in ("_model_function", "_run_kind"):
        assert "library's own" in (getattr(Proxy, name).__doc__ or "")


@pytest.mark.parametrize(
    ("field", "new", "expected"),
    [
        ("cache_size", "options.dedup.cache_size", 8),
        ("cache_ttl", "options.dedup.cache_ttl", 2.0),
        ("pad_item", "options.batch_sizes.pad_item", "filler"),
        ("on_batch_timeout", "options.batch_timeout.on_timeout", "stop"),
    ],
)
def test_the_old_flat_fields_of_options_still_read_for_one_release(
    field: str, new: str, expected: object
) -> None:
    options = Options(
        dedup=Dedup(cache_size=8, cache_ttl=2.0),
        batch_sizes=BatchSizes((1, 2, 4), pad_item="filler"),
        batch_timeout=Watchdog(1.0, on_timeout="stop"),
    )
    with pytest.warns(DeprecationWarning, match=re.escape(new)):
        assert getattr(options, field) == expected
