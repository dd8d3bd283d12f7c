"""`caller_contexts()`: the model reads each item's caller's context, in item order,
while the batch keeps a context of its own."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Sequence
from typing import Any

import pytest
from typing_extensions import override

import batchproxy
from batchproxy import Proxy, caller_contexts

REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="none")


class Tagged(Proxy[int, Any]):
    """Answers each item with its caller's request id, read from `caller_contexts()`."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.batches: list[list[int]] = []
        self.own: list[str] = []

    @override
    async def _inference(self, items: list[int]) -> Sequence[Any]:
        self.batches.append(list(items))
        self.own.append(REQUEST_ID.get())  # the batch's own context: nobody's
        contexts = caller_contexts()
        assert len(contexts) == len(items)
        return [
            (item, context.get(REQUEST_ID)) for item, context in zip(items, contexts, strict=True)
        ]


async def call_as(proxy: Proxy[int, Any], request_id: str, item: int) -> Any:
    REQUEST_ID.set(request_id)
    return await proxy.inference(item)


@pytest.mark.parametrize("offload", [False, True])
async def test_each_item_sees_its_own_callers_context_in_item_order(offload: bool) -> None:
    async with Tagged(caller_context=True, offload=offload) as proxy:
        got = await asyncio.gather(*(call_as(proxy, f"req-{i}", i) for i in range(20)))
    assert got == [(i, f"req-{i}") for i in range(20)]
    assert max(len(b) for b in proxy.batches) > 1  # they were batched together
    assert set(proxy.own) == {"none"}  # the batch's own context stays its own


async def test_a_model_that_sets_a_variable_changes_no_callers_context() -> None:
    class Setter(Proxy[int, str]):
        @override
        async def _inference(self, items: list[int]) -> list[str]:
            REQUEST_ID.set("set by the model")
            return [context.get(REQUEST_ID, "?") for context in caller_contexts()]

    async with Setter(caller_context=True) as proxy:
        assert await call_as(proxy, "mine", 1) == "mine"
        assert await proxy.inference(2) == "mine"  # this task's context: unchanged
        assert REQUEST_ID.get() == "mine"


async def test_isolated_pieces_see_the_contexts_of_their_own_items() -> None:
    class Picky(Tagged):
        @override
        async def _inference(self, items: list[int]) -> Sequence[Any]:
            if 3 in items and len(items) > 1:
                raise ValueError("3 spoils any batch it is in")
            return await super()._inference(items)

    async with Picky(caller_context=True, isolate_errors=True) as proxy:
        got = await asyncio.gather(*(call_as(proxy, f"req-{i}", i) for i in range(8)))
    assert got == [(i, f"req-{i}") for i in range(8)]
    assert [3] in proxy.batches  # it split down to the item that fails


async def test_batch_functions_read_them_too() -> None:
    @batchproxy.batch(caller_context=True)
    async def who(items: list[int]) -> list[str | None]:
        return [context.get(REQUEST_ID) for context in caller_contexts()]

    async def call(request_id: str) -> str | None:
        REQUEST_ID.set(request_id)
        return await who(0)

    try:
        assert list(await asyncio.gather(call("a"), call("b"))) == ["a", "b"]
    finally:
        await who.aclose()


async def test_without_the_option_the_model_is_told_how_to_turn_it_on() -> None:
    async with Tagged() as proxy:
        with pytest.raises(RuntimeError, match="caller_context=True"):
            await proxy.inference(1)


def test_outside_a_model_call_it_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match="caller_context=True"):
        caller_contexts()


async def test_configure_turns_it_on_for_the_calls_made_after() -> None:
    async with Tagged() as proxy:
        proxy.configure(caller_context=True)
        assert proxy.options.caller_context
        assert await call_as(proxy, "later", 5) == (5, "later")


async def test_a_call_admitted_before_it_was_turned_on_has_an_empty_context() -> None:
    release = asyncio.Event()

    class Held(Tagged):
        @override
        async def _inference(self, items: list[int]) -> Sequence[Any]:
            await release.wait()
            return await super()._inference(items)

    async with Held(max_concurrent_batches=1) as proxy:
        first = asyncio.create_task(call_as(proxy, "first", 1))
        await asyncio.sleep(0)  # its batch runs (and waits)
        early = asyncio.create_task(call_as(proxy, "early", 2))
        await asyncio.sleep(0)  # queued without a context
        proxy.configure(caller_context=True)
        late = asyncio.create_task(call_as(proxy, "late", 3))
        await asyncio.sleep(0)
        release.set()
        with pytest.raises(RuntimeError):  # its batch started before the option
            await first
        assert await early == (2, None)  # an empty context: the variable is not in it
        assert await late == (3, "late")


def test_the_option_is_checked() -> None:
    with pytest.raises(TypeError, match="caller_context"):
        Tagged(caller_context="yes")


# -- with batch_sizes: one context per item the model is called on -------------------


class SizedTagged(Proxy[int, Any]):
    """A static-shape model that records, per call, its items and its callers' request
    ids; a filler row (`pad_item=-1`) has no caller, so its context is empty."""

    def __init__(self, **options: Any) -> None:
        super().__init__(caller_context=True, **options)
        self.seen: list[tuple[list[int], list[str | None]]] = []

    @override
    async def _inference(self, items: list[int]) -> Sequence[Any]:
        ids = [context.get(REQUEST_ID) for context in caller_contexts()]
        self.seen.append((list(items), ids))
        return [(item, ids[i] if i < len(ids) else "missing") for i, item in enumerate(items)]


def each_call_saw_its_own_items_contexts(proxy: SizedTagged) -> None:
    for items, ids in proxy.seen:
        assert ids == [None if item == -1 else f"req-{item}" for item in items]


@pytest.mark.parametrize("offload", [False, True])
async def test_a_batch_cut_into_allowed_sizes_gives_each_call_its_own_items_contexts(
    offload: bool,
) -> None:
    async with SizedTagged(batch_size=4, batch_sizes=(1, 2, 4), offload=offload) as proxy:
        calls = [asyncio.create_task(call_as(proxy, f"req-{i}", i)) for i in range(4)]
        await asyncio.sleep(0)  # all queued; the batch task has not taken them yet
        calls[1].cancel()  # dropped at the pop: a batch of 3, run as calls of 2 and 1
        got = await asyncio.gather(*calls[:1], *calls[2:])
    assert got == [(0, "req-0"), (2, "req-2"), (3, "req-3")]
    assert [items for items, _ in proxy.seen] == [[0, 2], [3]]
    each_call_saw_its_own_items_contexts(proxy)


@pytest.mark.parametrize("offload", [False, True])
async def test_a_padded_batch_gives_its_filler_rows_empty_contexts(offload: bool) -> None:
    async with SizedTagged(
        batch_size=8, batch_sizes=batchproxy.BatchSizes((2, 4, 8), pad_item=-1), offload=offload
    ) as proxy:
        got = await asyncio.gather(*(call_as(proxy, f"req-{i}", i) for i in range(7)))
    assert got == [(i, f"req-{i}") for i in range(7)]
    assert [items for items, _ in proxy.seen] == [[0, 1, 2, 3, 4, 5, 6, -1]]
    each_call_saw_its_own_items_contexts(proxy)


@pytest.mark.parametrize("pad_item", [-1, None])
async def test_isolated_pieces_of_a_sized_batch_see_their_own_items_contexts(
    pad_item: int | None,
) -> None:
    class Picky(SizedTagged):
        @override
        async def _inference(self, items: list[int]) -> Sequence[Any]:
            result = await super()._inference(items)
            if 1 in items and len([item for item in items if item != -1]) > 1:
                raise ValueError("1 spoils any batch it is in (alone, with fillers, it runs)")
            return result

    sizes = (
        batchproxy.BatchSizes((1, 2, 4))
        if pad_item is None
        else batchproxy.BatchSizes((2, 4), pad_item=pad_item)
    )
    async with Picky(batch_size=4, batch_sizes=sizes, isolate_errors=True) as proxy:
        calls = [asyncio.create_task(call_as(proxy, f"req-{i}", i)) for i in range(4)]
        await asyncio.sleep(0)
        calls[3].cancel()  # a batch of 3: padded to 4, or cut into 2 and 1
        got = await asyncio.gather(*calls[:3])
    assert got == [(0, "req-0"), (1, "req-1"), (2, "req-2")]
    alone = [1] if pad_item is None else [1, -1]
    assert alone in [items for items, _ in proxy.seen]  # it was re-run down to the item
    each_call_saw_its_own_items_contexts(proxy)


async def test_a_filler_rows_context_is_a_fresh_empty_one() -> None:
    var: contextvars.ContextVar[str] = contextvars.ContextVar("var")

    class Marks(Proxy[int, int]):
        @override
        async def _inference(self, items: list[int]) -> list[int]:
            contexts = caller_contexts()
            assert len(contexts) == len(items) == 2
            assert len(contexts[1]) == 0  # no variable in it
            contexts[1].run(var.set, "set by the model")  # changes nothing elsewhere
            return items

    async with Marks(
        batch_sizes=batchproxy.BatchSizes((2,), pad_item=0), caller_context=True
    ) as proxy:
        assert await proxy.inference(1) == 1
        assert await proxy.inference(2) == 2
