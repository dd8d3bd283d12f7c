"""`TensorProxy(batch_sizes=...)`: the batch axis padded with `pad_value` rows up to an
allowed size; their outputs dropped before the split."""

from __future__ import annotations

import asyncio
import contextvars
from typing import Any

import numpy as np
import pytest
from _sized_models import check

from batchproxy import BatchSizes, TensorProxy, caller_contexts
from batchproxy.tensors import Collated


class StaticNumpy(TensorProxy[Any, Any]):
    """Sums each row; refuses a batch axis of a size not allowed."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.seen: list[Collated] = []

    def _forward(self, batch: Collated) -> Any:
        self.seen.append(batch)
        check(batch.data.shape[0], (2, 4, 8))
        return batch.data.sum(axis=tuple(range(1, batch.data.ndim)))


async def test_the_batch_axis_is_padded_with_pad_value_rows() -> None:
    async with StaticNumpy(batch_size=8, batch_sizes=(2, 4, 8), pad_value=-1) as proxy:
        items = [np.full((2, 3), i, dtype=np.int32) for i in range(1, 6)]
        results = await asyncio.gather(*map(proxy.inference, items))
        assert [int(r) for r in results] == [6 * i for i in range(1, 6)]
        (batch,) = proxy.seen
        assert batch.data.shape == (8, 2, 3)
        assert (batch.data[5:] == -1).all()
        assert batch.data.dtype == np.int32
        assert batch.lengths == [2] * 5  # the real items only
        assert proxy.stats.padded_rows == 3
        assert proxy.stats.items == 5


async def test_ragged_items_get_a_mask_false_on_the_filler_rows() -> None:
    async with StaticNumpy(batch_size=8, batch_sizes=(2, 4, 8)) as proxy:
        items = [np.ones(n, dtype=np.float32) for n in (1, 2, 3)]
        results = await asyncio.gather(*map(proxy.inference, items))
        assert [float(r) for r in results] == [1.0, 2.0, 3.0]
        (batch,) = proxy.seen
        assert batch.mask.shape == (4, 3)
        assert not batch.mask[3].any()


async def test_an_invalid_item_fails_alone_and_the_rest_still_run_at_an_allowed_size() -> None:
    async with StaticNumpy(batch_size=8, batch_sizes=(2, 4, 8)) as proxy:
        items: list[Any] = [np.ones(2), np.ones(2), np.ones((2, 2))]  # another rank
        results = await asyncio.gather(*map(proxy.inference, items), return_exceptions=True)
        assert isinstance(results[2], Exception)
        assert [float(r) for r in results[:2]] == [2.0, 2.0]
        assert proxy.seen[0].data.shape[0] == 2


async def test_dict_items_pad_each_key_with_its_own_value() -> None:
    class Keys(TensorProxy[Any, Any]):
        def _forward(self, batch: Collated) -> Any:
            check(batch.data["ids"].shape[0], (4,))
            self.batch = batch
            return {"ids": batch.data["ids"]}

    async with Keys(batch_size=4, batch_sizes=(4,), pad_value={"ids": 7, "labels": -100}) as p:
        item = {"ids": np.array([1, 2]), "labels": np.array([0, 1])}
        result = await p.inference(item)
        assert result["ids"].tolist() == [1, 2]
        assert p.batch.data["ids"][1:].tolist() == [[7, 7]] * 3
        assert p.batch.data["labels"][1:].tolist() == [[-100, -100]] * 3


REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("request_id")


class Traced(StaticNumpy):
    """Also records its callers' request ids, one per row of the batch axis."""

    def __init__(self, **options: Any) -> None:
        super().__init__(caller_context=True, **options)
        self.ids: list[list[str | None]] = []

    def _forward(self, batch: Collated) -> Any:
        self.ids.append([context.get(REQUEST_ID) for context in caller_contexts()])
        return super()._forward(batch)


class TracedAsync(Traced):
    async def _forward(self, batch: Collated) -> Any:  # type: ignore[override]
        return Traced._forward(self, batch)


async def call_as(proxy: Traced, request_id: str, item: Any) -> Any:
    REQUEST_ID.set(request_id)
    return await proxy.inference(item)


@pytest.mark.parametrize("proxy_type", [Traced, TracedAsync])
async def test_caller_contexts_are_one_per_row_the_filler_rows_empty(
    proxy_type: type[Traced],
) -> None:
    async with proxy_type(batch_size=8, batch_sizes=(2, 4, 8)) as proxy:
        items: list[Any] = [np.ones(2), np.ones((2, 2)), np.ones(2), np.ones(2), np.ones(2)]
        calls = (call_as(proxy, f"req-{i}", item) for i, item in enumerate(items))
        results = await asyncio.gather(*calls, return_exceptions=True)
        assert isinstance(results[1], Exception)  # another rank: not in the batch
        assert proxy.seen[0].data.shape[0] == 4
        assert proxy.ids == [["req-0", "req-2", "req-3", "req-4"]]
        await asyncio.gather(*(call_as(proxy, f"req-{i}", np.ones(2)) for i in range(3)))
        assert proxy.ids[1] == ["req-0", "req-1", "req-2", None]  # a filler: no caller


def test_tensor_proxy_takes_no_pad_item() -> None:
    with pytest.raises(TypeError, match="takes no pad_item"):
        StaticNumpy(batch_size=8, batch_sizes=BatchSizes((2, 4, 8), pad_item=np.zeros(2)))
    with pytest.raises(TypeError, match="takes no pad_item"):  # (the deprecated spelling)
        StaticNumpy(batch_size=8, batch_sizes=(2, 4, 8), pad_item=np.zeros(2))


async def test_a_fixed_shape_torch_model() -> None:
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 2)

    class Compiled(TensorProxy[Any, Any]):
        """Stands for an engine built for batches of 4 or 8 exactly."""

        @torch.no_grad()
        def _forward(self, batch: Collated) -> Any:
            check(batch.data.shape[0], (4, 8))
            return layer(batch.data)

    async with Compiled(batch_size=8, batch_sizes=(4, 8)) as proxy:
        items = [torch.randn(4) for _ in range(6)]
        results = await asyncio.gather(*map(proxy.inference, items))
        with torch.no_grad():
            for item, result in zip(items, results, strict=True):
                assert torch.allclose(result, layer(item))
        assert proxy.stats.padded_rows == 2


@pytest.mark.parametrize(
    ("valid", "model_sees", "fillers"),
    [
        (2, 2, 0),  # 2 collated: of an allowed size, no filler row
        (3, 4, 1),  # 3 collated: padded to 4 (one filler row)
        (0, None, 0),  # none collated: no model call, no filler row
    ],
)
async def test_padded_rows_counts_the_rows_the_model_ran_with_an_invalid_item(
    valid: int, model_sees: int | None, fillers: int
) -> None:
    """An invalid item is not collated: the filler rows are those that pad the valid ones
    (the call's length, invalid item included, says nothing of them)."""
    async with StaticNumpy(batch_size=8, batch_sizes=(2, 4, 8)) as proxy:
        invalid = {1: np.ones(2)}  # measured (a length), but a dict key must be a str
        items: list[Any] = [np.ones(2) for _ in range(valid)] + [invalid]
        results = await asyncio.gather(*map(proxy.inference, items), return_exceptions=True)
        assert isinstance(results[-1], TypeError)
        assert all(not isinstance(result, Exception) for result in results[:-1])
        assert [batch.data.shape[0] for batch in proxy.seen] == ([model_sees] if model_sees else [])
        assert proxy.stats.padded_rows == fillers


async def test_padded_rows_with_keys_counts_each_key_batch_from_its_collated_items() -> None:
    """Each key's batch is padded on its own: key 2 collates 3 items (one filler row), key 3
    collates 2 (none: its invalid item is in its batch, but not collated)."""
    async with StaticNumpy(batch_size=8, batch_sizes=(2, 4, 8), key=len) as p:
        items: list[Any] = [np.ones(2)] * 3 + [np.ones(3)] * 2 + [{1: np.ones(3)}]
        results = await asyncio.gather(*map(p.inference, items), return_exceptions=True)
        assert [isinstance(result, TypeError) for result in results] == [False] * 5 + [True]
        assert sorted(batch.data.shape for batch in p.seen) == [(2, 3), (4, 2)]
        assert p.stats.padded_rows == 1
