"""`WorkerThread(overlap=True)`: a `StagedModel`'s next batch is prepared while the
current one computes; every caller still gets its own result, whatever else is on.

The CUDA side (a device thread's stream, events between the stages' streams) is in
test_cuda.py; here the stages run on the CPU.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import torch
from typing_extensions import override

import batchproxy
from batchproxy import StagedModel, TensorProxy, WorkerThread, batch
from batchproxy.tensors import Collated

WAIT = 10.0  # seconds: a stage that waits longer for the other thread fails the test


class Staged(StagedModel):
    """Records which thread ran each stage; `compute` of the first batch holds until
    the second batch's `prepare` has started (only an overlapping executor gets there)."""

    def __init__(self, hold_first: bool = False) -> None:
        self.log: list[tuple[str, str, int]] = []
        self.second_prepared = threading.Event()
        self.hold_first = hold_first
        self.computes = 0

    def _note(self, stage: str, items: list[Any]) -> None:
        self.log.append((stage, threading.current_thread().name, items[0]))

    @override
    def prepare(self, items: list[Any], /) -> list[Any]:
        self._note("prepare", items)
        if items[0] >= 100:
            self.second_prepared.set()
        return [item * 10 for item in items]

    @override
    def compute(self, prepared: list[Any], /) -> list[Any]:
        self._note("compute", prepared)
        self.computes += 1
        if self.hold_first and self.computes == 1:
            assert self.second_prepared.wait(WAIT), "the next batch was not prepared meanwhile"
        return [item + 1 for item in prepared]

    @override
    def finish(self, computed: list[Any], /) -> list[Any]:
        self._note("finish", computed)
        return [("done", item) for item in computed]


async def test_next_batch_is_prepared_while_the_current_one_computes(
    no_leftovers: None,
) -> None:
    model = Staged(hold_first=True)
    worker = WorkerThread("model", overlap=True)
    assert worker.capacity == 2
    try:
        first = asyncio.ensure_future(worker.run(model, [1, 2]))
        await asyncio.sleep(0.05)  # the first batch is computing (held)
        second = await worker.run(model, [100, 101])
        assert await first == [("done", 11), ("done", 21)]
        assert second == [("done", 1001), ("done", 1011)]
    finally:
        await worker.aclose()
    threads = {(stage, item): thread for stage, thread, item in model.log}
    # the lone first batch ran its stages in a row on the model thread
    assert threads["prepare", 1] == threads["compute", 10] == threads["finish", 11] == "model"
    # the second, sent while the first computed: prepare and finish on the stage thread
    assert threads["prepare", 100] == threads["finish", 1001] == "model-stages"
    assert threads["compute", 1000] == "model"


async def test_without_overlap_stages_run_in_a_row_on_one_thread(no_leftovers: None) -> None:
    model = Staged()
    async with WorkerThread("plain") as worker:
        assert worker.capacity == 1
        assert worker.overlap is False
        results = await asyncio.gather(worker.run(model, [1]), worker.run(model, [100]))
    assert results == [[("done", 11)], [("done", 1001)]]
    assert {thread for _, thread, _ in model.log} == {"plain"}


async def test_a_plain_model_on_an_overlapping_thread_runs_as_before(no_leftovers: None) -> None:
    async with WorkerThread("mixed", overlap=True) as worker:
        names = await asyncio.gather(
            *(worker.run(lambda items: [threading.current_thread().name] * len(items), [i])
              for i in range(4))
        )  # fmt: skip
    assert names == [["mixed"]] * 4


async def test_a_stage_that_raises_fails_its_batch_only(no_leftovers: None) -> None:
    class Breaks(Staged):
        @override
        def prepare(self, items: list[Any], /) -> list[Any]:
            if items[0] == 666:
                raise ValueError("bad batch")
            return super().prepare(items)

    model = Breaks(hold_first=False)
    async with WorkerThread("breaks", overlap=True) as worker:
        results = await asyncio.gather(
            worker.run(model, [1]), worker.run(model, [666]), worker.run(model, [100]),
            return_exceptions=True,
        )  # fmt: skip
    assert results[0] == [("done", 11)]
    assert isinstance(results[1], ValueError)
    assert results[2] == [("done", 1001)]


async def test_a_batch_sent_to_a_closed_overlapping_thread_fails(no_leftovers: None) -> None:
    worker = WorkerThread("closing", overlap=True)
    await worker.run(Staged(), [1])
    await worker.aclose()
    with pytest.raises(RuntimeError, match="closed"):
        await worker.run(Staged(), [1])


def test_bad_arguments() -> None:
    with pytest.raises(TypeError, match="overlap must be a bool"):
        WorkerThread(overlap="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="device must be a CUDA device"):
        WorkerThread(device="cpu")
    with pytest.raises(ValueError, match="device must be a torch device"):
        WorkerThread(device="cuda:zz")
    with pytest.raises(TypeError, match=r"device must be a str, a torch\.device or None"):
        WorkerThread(device=0)  # type: ignore[arg-type]
    assert WorkerThread().overlap is False


# -- a TensorProxy on an overlapping thread, with the features it meets ---------------------


class Doubler(TensorProxy[torch.Tensor, torch.Tensor]):
    """Each row doubled, plus the item's length, so each result says whose it is."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.batches: list[int] = []

    @override
    def _forward(self, batch: Collated, /) -> torch.Tensor:
        self.batches.append(len(batch.data))
        if bool((batch.data == -7).any()):
            raise MemoryError("out of memory (this batch holds the poison row)")
        lengths = torch.tensor(batch.lengths or [batch.padded_length] * len(batch.data))
        return batch.data * 2 + lengths[:, None]


def item(i: int) -> torch.Tensor:
    return torch.arange(1 + i % 5, dtype=torch.float32) + 100 * i


def expected(i: int) -> torch.Tensor:
    row = item(i)
    return row * 2 + len(row)


OPTIONS: dict[str, dict[str, Any]] = {
    "plain": {},
    "batch_sizes": {"batch_sizes": (1, 2, 4, 8)},
    "oom_backoff": {"oom_backoff": True},
    "isolate_errors": {"isolate_errors": True},
    "length_budget": {"max_batch_tokens": 12},
    "output_device": {"output_device": "cpu"},
    "dedup": {"dedup": True},
}


@pytest.mark.parametrize("name", list(OPTIONS))
async def test_every_caller_gets_its_own_result(no_leftovers: None, name: str) -> None:
    worker = WorkerThread("overlap", overlap=True)
    proxy = Doubler(batch_size=8, max_delay_ms=1, offload=worker, **OPTIONS[name])
    try:
        async with proxy:
            for _ in range(3):  # bursts: batches overlap within each
                results = await asyncio.gather(*(proxy.inference(item(i)) for i in range(40)))
                for i, result in enumerate(results):
                    assert torch.equal(result, expected(i)), (name, i)
    finally:
        await worker.aclose()
    assert sum(proxy.batches) >= 40
    assert worker._stages is not None
    assert worker._stages.started


async def test_cancelled_and_timed_out_callers_leave_the_rest_intact(no_leftovers: None) -> None:
    worker = WorkerThread("overlap", overlap=True)
    proxy = Doubler(batch_size=4, max_delay_ms=1, offload=worker)
    try:
        async with proxy:
            calls = [asyncio.ensure_future(proxy.inference(item(i))) for i in range(32)]
            calls[5].cancel()
            calls[17].cancel()
            results = await asyncio.gather(*calls, return_exceptions=True)
    finally:
        await worker.aclose()
    for i, result in enumerate(results):
        if i in (5, 17):
            assert isinstance(result, asyncio.CancelledError)
        else:
            assert torch.equal(result, expected(i)), i


async def test_oom_backoff_splits_an_overlapped_batch(no_leftovers: None) -> None:
    worker = WorkerThread("overlap", overlap=True)
    proxy = Doubler(batch_size=8, max_delay_ms=1, offload=worker, oom_backoff=True)
    try:
        async with proxy:
            items = [item(i) for i in range(16)]
            items[3] = torch.full((2,), -7.0)  # fails alone too: its caller alone gets the error
            results = await asyncio.gather(
                *(proxy.inference(x) for x in items), return_exceptions=True
            )
            assert proxy.stats.oom_splits >= 1
    finally:
        await worker.aclose()
    assert isinstance(results[3], MemoryError)
    for i, result in enumerate(results):
        if i != 3:
            assert torch.equal(result, expected(i)), i


async def test_aclose_drains_an_overlapping_proxy(no_leftovers: None) -> None:
    worker = WorkerThread("overlap", overlap=True)
    proxy = Doubler(batch_size=4, max_delay_ms=1, offload=worker)
    calls = [asyncio.ensure_future(proxy.inference(item(i))) for i in range(20)]
    await asyncio.sleep(0)
    await proxy.aclose()
    await worker.aclose()
    for i, call in enumerate(calls):
        assert torch.equal(call.result(), expected(i))
    with pytest.raises(batchproxy.ProxyClosed):
        await proxy.inference(item(0))


async def test_output_device_cpu_keeps_numpy_outputs() -> None:
    class Numpy(TensorProxy[Any, Any]):
        @override
        def _forward(self, batch: Collated, /) -> Any:
            return batch.data.numpy() * 3

    async with Numpy(batch_size=4, output_device="cpu") as proxy:
        result = await proxy.inference(torch.ones(2))
    assert result.tolist() == [3.0, 3.0]


def test_output_device_is_checked() -> None:
    with pytest.raises(ValueError, match="output_device must be a torch device"):
        Doubler(output_device="gpu:x")
    with pytest.raises(TypeError, match="output_device must be a str"):
        Doubler(output_device=1.5)


async def test_batch_of_a_staged_model_object_overlaps_its_stages(no_leftovers: None) -> None:
    """The public way to pipeline a model of one's own: `batch(...)` of a `StagedModel`
    instance on an overlapping `WorkerThread` runs `prepare` and `finish` on the stage
    thread while the model thread computes another batch; every caller gets its own."""
    model = Staged(hold_first=True)
    worker = WorkerThread("model", overlap=True)
    embed = batch(batch_size=2, max_delay_ms=0, offload=worker)(model)
    try:
        first = asyncio.gather(embed(1), embed(2))
        await asyncio.sleep(0.05)  # the first batch is computing (held)
        second = await asyncio.gather(embed(100), embed(101))
        assert await first == [("done", 11), ("done", 21)]
        assert second == [("done", 1001), ("done", 1011)]
        assert embed.stats.batches == 2
    finally:
        await embed.aclose()
        await worker.aclose()
    threads = {(stage, item): thread for stage, thread, item in model.log}
    assert threads["prepare", 100] == threads["finish", 1001] == "model-stages"
    assert threads["compute", 1000] == "model"
