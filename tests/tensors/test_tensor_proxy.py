"""TensorProxy: per-caller results from one collated batch; validation fails one caller only."""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from _support import batchproxy_cycles, fails_with, in_a_task_of_its_own
from typing_extensions import override

from batchproxy import TensorProxy
from batchproxy.tensors import Collated

torch = pytest.importorskip("torch")

Forward = Callable[[Collated], Any]


def _double(batch: Collated) -> Any:
    return batch.data * 2


class SyncModel(TensorProxy[Any, Any]):
    """A plain-`def` `_forward`: records each collated batch and the thread it ran on."""

    def __init__(self, forward: Forward = _double, **options: Any) -> None:
        self.forward = forward
        self.batches: list[Collated] = []
        self.threads: list[int] = []
        super().__init__(**options)

    @override
    def _forward(self, batch: Collated, /) -> Any:
        self.batches.append(batch)
        self.threads.append(threading.get_ident())
        return self.forward(batch)


class AsyncModel(TensorProxy[Any, Any]):
    """An `async def` `_forward`, recording like `SyncModel`."""

    def __init__(self, forward: Forward = _double, **options: Any) -> None:
        self.forward = forward
        self.batches: list[Collated] = []
        self.threads: list[int] = []
        super().__init__(**options)

    @override
    async def _forward(self, batch: Collated, /) -> Any:
        await asyncio.sleep(0)
        self.batches.append(batch)
        self.threads.append(threading.get_ident())
        return self.forward(batch)


def _sequences(lengths: list[int], hidden: int = 3, *, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((n, hidden)).astype(np.float32) for n in lengths]


LENGTHS = [5, 1, 9, 3, 7, 2, 8, 4, 6, 5]


async def _gather(proxy: TensorProxy[Any, Any], items: list[Any]) -> list[Any]:
    return await asyncio.wait_for(asyncio.gather(*(proxy.inference(x) for x in items)), 30)


# -- each caller gets its own, un-padded output ----------------------------------------


@pytest.mark.parametrize("padding_side", ["right", "left"])
async def test_numpy_token_level_outputs_are_unpadded_per_caller(padding_side: str) -> None:
    items = _sequences(LENGTHS)
    async with SyncModel(batch_size=4, padding_side=padding_side) as proxy:
        results = await _gather(proxy, items)
    for item, result in zip(items, results, strict=True):
        assert isinstance(result, np.ndarray)
        assert result.dtype == np.float32
        np.testing.assert_array_equal(result, item * 2)
    assert any(batch.mask is not None for batch in proxy.batches)  # something was padded
    assert sum(len(batch.lengths) for batch in proxy.batches) == len(items)


async def test_numpy_token_ids_left_padded_reach_forward_padded() -> None:
    items = [np.arange(1, n + 1, dtype=np.int64) for n in (3, 1, 4)]
    async with SyncModel(lambda b: b.data + 100, batch_size=8, padding_side="left") as proxy:
        results = await asyncio.wait_for(proxy.inference_many(items), 30)
    for item, result in zip(items, results, strict=True):
        np.testing.assert_array_equal(result, item + 100)
        assert result.dtype == np.int64
    for batch in proxy.batches:
        assert batch.padding_side == "left"
        for row, n in zip(batch.data, batch.lengths, strict=True):
            assert (row[: batch.padded_length - n] == 0).all()  # pads on the left


def _tokens_and_pooled(batch: Collated) -> dict[str, Any]:
    data, mask = batch.data, batch.mask
    if mask is None:
        pooled = data.mean(dim=1)
    else:
        weights = mask.unsqueeze(-1).to(data.dtype)
        pooled = (data * weights).sum(dim=1) / weights.sum(dim=1)
    return {"tokens": data * 2, "pooled": pooled}


@pytest.mark.parametrize("padding_side", ["right", "left"])
async def test_torch_token_level_and_pooled_outputs(padding_side: str) -> None:
    items = [torch.from_numpy(x) for x in _sequences(LENGTHS, hidden=4)]
    async with SyncModel(_tokens_and_pooled, batch_size=4, padding_side=padding_side) as proxy:
        results = await _gather(proxy, items)
    for item, result in zip(items, results, strict=True):
        assert set(result) == {"tokens", "pooled"}
        assert result["tokens"].shape == item.shape
        torch.testing.assert_close(result["tokens"], item * 2, rtol=0, atol=0)
        assert result["pooled"].shape == (4,)
        torch.testing.assert_close(result["pooled"], item.mean(dim=0), rtol=1e-6, atol=1e-6)


async def test_same_shape_items_are_stacked_without_a_mask() -> None:
    images = [torch.full((3, 2, 2), float(i)) for i in range(6)]

    def pool(batch: Collated) -> Any:
        return batch.data.mean(dim=(2, 3))  # (n, channels)

    async with SyncModel(pool, batch_size=8) as proxy:
        results = await asyncio.wait_for(proxy.inference_many(images), 30)
    for i, result in enumerate(results):
        torch.testing.assert_close(result, torch.full((3,), float(i)))
    assert all(batch.mask is None for batch in proxy.batches)


async def test_pad_to_multiple_of_still_unpads_each_output() -> None:
    items = _sequences([3, 5, 2])
    async with SyncModel(batch_size=8, pad_to_multiple_of=8) as proxy:
        results = await asyncio.wait_for(proxy.inference_many(items), 30)
    for item, result in zip(items, results, strict=True):
        np.testing.assert_array_equal(result, item * 2)
    assert all(batch.padded_length % 8 == 0 for batch in proxy.batches)


async def test_feature_dicts_are_padded_per_key() -> None:
    items = [
        {
            "input_ids": torch.arange(1, n + 1),
            "labels": torch.arange(10, 10 + n),
            "scale": torch.full((n,), 0.5, dtype=torch.float32),
        }
        for n in (2, 5, 3)
    ]
    pad_value = {"input_ids": 0, "labels": -100, "scale": 1.0}
    async with SyncModel(lambda b: b.data, batch_size=8, pad_value=pad_value) as proxy:
        results = await asyncio.wait_for(proxy.inference_many(items), 30)
    for item, result in zip(items, results, strict=True):
        assert set(result) == set(item)
        for key in item:
            assert result[key].dtype == item[key].dtype
            torch.testing.assert_close(result[key], item[key], rtol=0, atol=0)
    for batch in proxy.batches:
        assert batch.mask is not None
        padding = ~batch.mask
        assert (batch.data["input_ids"][padding] == 0).all()
        assert (batch.data["labels"][padding] == -100).all()
        assert (batch.data["scale"][padding] == 1.0).all()
        assert batch.data["scale"].dtype == torch.float32  # float stays float
        assert batch.mask.dtype == torch.bool
        assert batch.mask.shape == (len(batch.lengths), batch.padded_length)
    assert any(not batch.mask.all() for batch in proxy.batches if batch.mask is not None)


# -- validation: a mismatched item fails its caller only -------------------------------


def _float_rows(n: int) -> Any:
    return torch.ones(n, 2)


MISMATCHES: dict[str, tuple[Callable[[int], Any], Any]] = {
    "dtype": (_float_rows, torch.ones(3, 2, dtype=torch.int64)),
    "numpy among torch": (_float_rows, np.ones((3, 2), dtype=np.float32)),
    "rank": (_float_rows, torch.ones(3, 2, 1)),
    "keys": (
        lambda n: {"input_ids": torch.ones(n, dtype=torch.int64)},
        {"input_ids": torch.ones(3, dtype=torch.int64), "extra": torch.ones(3)},
    ),
}


@pytest.mark.parametrize("case", list(MISMATCHES))
async def test_a_mismatched_item_fails_only_its_caller(case: str) -> None:
    make_good, bad = MISMATCHES[case]
    items = [make_good(2), make_good(4), bad, make_good(1), make_good(3)]
    async with SyncModel(lambda b: b.data, batch_size=8) as proxy:
        results = await asyncio.wait_for(proxy.inference_many(items, return_exceptions=True), 30)
    error = results[2]
    assert isinstance(error, (TypeError, ValueError)), error
    assert str(error)
    for index in (0, 1, 3, 4):
        assert not isinstance(results[index], Exception), results[index]
    assert [len(batch.lengths) for batch in proxy.batches] == [4]  # the others ran together
    if case != "keys":
        torch.testing.assert_close(results[1], make_good(4))


@pytest.mark.parametrize("path", ["inference", "inference_many"])
async def test_a_mismatched_item_error_describes_the_item_not_its_place_in_the_batch(
    path: str,
) -> None:
    """A caller sent one item: its error says what that item is and what was expected,
    the same wherever the item landed in the internal batch."""
    messages = set()
    for position in (0, 3, 6):
        items: list[Any] = [np.zeros(384) for _ in range(6)]
        items.insert(position, np.zeros(()))  # rank 0 among rank-1 arrays
        async with SyncModel(lambda b: b.data, batch_size=8) as proxy:
            if path == "inference":
                calls = (proxy.inference(item) for item in items)
                results = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 30)
            else:
                results = await asyncio.wait_for(
                    proxy.inference_many(items, return_exceptions=True), 30
                )
        error = results[position]
        assert isinstance(error, ValueError), error
        assert [len(batch.lengths) for batch in proxy.batches] == [6]
        messages.add(str(error))
    assert len(messages) == 1, messages  # independent of the position
    (message,) = messages
    assert not re.search(r"\bitem \d", message), message
    for fragment in ("expected rank 1", "shape (384,)", "got rank 0", "float64", "shape ()"):
        assert fragment in message, (fragment, message)


async def test_validation_messages_name_the_problem() -> None:
    good = {"input_ids": torch.ones(4, dtype=torch.int64)}
    missing = {"token_ids": torch.ones(4, dtype=torch.int64)}
    async with SyncModel(lambda b: b.data, batch_size=8) as proxy:
        results = await asyncio.wait_for(
            proxy.inference_many([good, good, missing], return_exceptions=True), 30
        )
    assert isinstance(results[2], Exception)
    assert "input_ids" in str(results[2]) or "token_ids" in str(results[2])
    assert results[0]["input_ids"].tolist() == [1, 1, 1, 1]


async def test_forward_is_not_called_when_every_item_is_invalid() -> None:
    unbatchable = [{}, {1: np.ones(2)}]  # an empty dict; a key that is not a str
    async with SyncModel(batch_size=8) as proxy:
        results = await asyncio.wait_for(
            proxy.inference_many(unbatchable, return_exceptions=True), 30
        )
    assert all(isinstance(result, Exception) for result in results)
    assert proxy.batches == []


async def test_a_forward_returning_the_wrong_count_fails_the_batch() -> None:
    async with SyncModel(lambda b: b.data[:1], batch_size=8) as proxy:
        results = await asyncio.wait_for(
            proxy.inference_many(_sequences([2, 3]), return_exceptions=True), 30
        )
    assert all(isinstance(result, Exception) for result in results)


# -- where _forward runs ---------------------------------------------------------------


@pytest.mark.parametrize("offload", [False, True])
async def test_sync_forward_runs_off_the_event_loop(offload: bool) -> None:
    async with SyncModel(batch_size=2, offload=offload, name="sync-fwd") as proxy:
        results = await _gather(proxy, _sequences([1, 2, 3, 4, 5]))
    assert [r.shape[0] for r in results] == [1, 2, 3, 4, 5]
    assert threading.get_ident() not in proxy.threads
    assert len(set(proxy.threads)) == 1


@pytest.mark.parametrize("offload", [False, True])
async def test_async_forward(offload: bool) -> None:
    items = _sequences([4, 2, 6])
    async with AsyncModel(batch_size=2, offload=offload) as proxy:
        results = await _gather(proxy, items)
    for item, result in zip(items, results, strict=True):
        np.testing.assert_array_equal(result, item * 2)
    on_loop = threading.get_ident() in proxy.threads
    assert on_loop is not offload


# -- device ----------------------------------------------------------------------------


async def test_device_cpu_moves_torch_batches_and_skips_cuda(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_cuda() -> bool:
        raise AssertionError("a CPU target must not touch torch.cuda")

    monkeypatch.setattr(torch.cuda, "is_available", no_cuda)
    items = [torch.from_numpy(x) for x in _sequences([3, 1, 2])]
    async with SyncModel(batch_size=8, device="cpu") as proxy:
        results = await asyncio.wait_for(proxy.inference_many(items), 30)
    for item, result in zip(items, results, strict=True):
        torch.testing.assert_close(result, item * 2)
    for batch in proxy.batches:
        assert batch.data.device.type == "cpu"
        assert batch.mask is None or batch.mask.device.type == "cpu"


async def test_device_moves_batch_and_mask_and_outputs_stay_there() -> None:
    """The meta device stands in for an accelerator on a CPU-only machine."""
    items = [torch.from_numpy(x) for x in _sequences([3, 1, 2])]
    async with SyncModel(batch_size=8, device="meta") as proxy:
        results = await asyncio.wait_for(proxy.inference_many(items), 30)
    for item, result in zip(items, results, strict=True):
        assert result.device.type == "meta"  # where _forward put it
        assert result.shape == item.shape
    for batch in proxy.batches:
        assert batch.data.device.type == "meta"
        assert batch.mask is None or batch.mask.device.type == "meta"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_device_cuda_through_pinned_memory() -> None:
    items = [torch.from_numpy(x) for x in _sequences([3, 1, 2])]
    async with SyncModel(batch_size=8, device="cuda:0") as proxy:
        results = await asyncio.wait_for(proxy.inference_many(items), 30)
    for item, result in zip(items, results, strict=True):
        assert result.device.type == "cuda"
        torch.testing.assert_close(result.cpu(), item * 2)


async def test_numpy_items_with_a_device_fail_with_a_clear_type_error() -> None:
    async with SyncModel(batch_size=8, device="cpu") as proxy:
        with pytest.raises(TypeError, match="NumPy"):
            await asyncio.wait_for(proxy.inference(np.ones((2, 2), dtype=np.float32)), 30)
    assert proxy.batches == []


def test_constructor_checks_its_options() -> None:
    with pytest.raises(ValueError, match="padding_side"):
        SyncModel(padding_side="middle")
    with pytest.raises(ValueError, match="pad_to_multiple_of"):
        SyncModel(pad_to_multiple_of=0)
    with pytest.raises(TypeError, match="device"):
        SyncModel(device=0)


@pytest.mark.parametrize("device", ["cuda:zz", "no-such-device", "", "cpu:x", "cuda:-1", "CPU"])
def test_a_malformed_device_is_a_value_error_naming_it(device: str) -> None:
    with pytest.raises(ValueError, match=f"device must be .*, got {re.escape(repr(device))}"):
        SyncModel(device=device)


def test_device_accepts_device_objects_and_refuses_other_types() -> None:
    assert SyncModel(device=torch.device("cpu"))._device == torch.device("cpu")
    assert SyncModel(device="cuda:1")._device == torch.device("cuda:1")  # checked per batch
    with pytest.raises(TypeError, match=r"device must be .*, got float 3\.5"):
        SyncModel(device=3.5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
async def test_a_valid_device_this_machine_lacks_fails_each_batch_not_construction() -> None:
    async with SyncModel(batch_size=8, device="cuda:0") as proxy:
        with pytest.raises(Exception, match="CUDA"):  # torch's own error, at the move
            await asyncio.wait_for(proxy.inference(torch.zeros(3)), 30)
    assert proxy.batches == []


def test_tensor_proxy_is_abstract() -> None:
    with pytest.raises(TypeError):
        TensorProxy()  # type: ignore[abstract]


# -- length-aware batches (scheduling itself is tested elsewhere) ----------------------


@pytest.mark.parametrize(
    "options", [{}, {"length_aware": False}, {"max_batch_tokens": 16}], ids=str
)
async def test_every_caller_gets_its_own_result_with_length_aware_batching(
    options: dict[str, Any],
) -> None:
    lengths = [1 + (i * 7) % 13 for i in range(40)]
    items = _sequences(lengths, hidden=2, seed=1)
    async with SyncModel(batch_size=8, **options) as proxy:
        results = await _gather(proxy, items)
    for item, result in zip(items, results, strict=True):
        np.testing.assert_array_equal(result, item * 2)
    assert sum(len(batch.lengths) for batch in proxy.batches) == len(items)


class Refuses999(TensorProxy[Any, Any]):
    """Doubles its batch; raises for a batch holding a 999."""

    @override
    def _forward(self, batch: Collated, /) -> Any:
        if bool((batch.data == 999).any()):
            raise RuntimeError("boom")
        return batch.data * 2


@pytest.mark.parametrize("offload", [False, True], ids=["on-the-loop", "offload"])
async def test_a_batch_leaves_no_reference_cycle_whatever_its_outcome(offload: bool) -> None:
    """A tensor batch's collated data, staged jobs and error are freed by reference
    counting as it ends: a model error's traceback kept the worker thread's frame that
    took the job from its inbox, and so the job, whose future kept the error."""
    async with Refuses999(batch_size=8, offload=offload, length_aware=True) as proxy:
        await proxy.inference(torch.ones(2))  # (what stays: the worker thread)

        async def calls() -> None:
            results = await asyncio.gather(*(proxy.inference(torch.ones(i + 1)) for i in range(20)))
            assert [r.tolist() for r in results] == [[2.0] * (i + 1) for i in range(20)]
            await fails_with(proxy.inference(torch.full((3,), 999.0)), RuntimeError)

        with batchproxy_cycles() as cycles:
            await in_a_task_of_its_own(calls())
            for _ in range(3):
                await asyncio.sleep(0)
        assert cycles == []
