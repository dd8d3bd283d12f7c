"""On a real GPU: the device thread, CUDA round trips, overlap, out of memory, graphs.

Marked `cuda` and skipped with the reason "needs CUDA" on a machine without one
(CI's); `benchmarks/gpu/gpu.py` runs them on the GPU machine and records the result.
The last test runs where there is no CUDA instead: a device thread there fails
each batch with the reason.
"""

from __future__ import annotations

import asyncio
import copy
import gc
import threading
from typing import Any

import pytest
import torch
from typing_extensions import override

from batchproxy import TensorProxy, WorkerThread
from batchproxy.tensors import Collated

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")
pytestmark = pytest.mark.cuda

WIDTH = 32


def linear(seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(WIDTH, WIDTH)


def rows(i: int) -> torch.Tensor:
    """Item i: 1 to 12 rows of WIDTH values (deterministic, distinct per item)."""
    generator = torch.Generator().manual_seed(i)
    return torch.randn(1 + i % 12, WIDTH, generator=generator)


class Encoder(TensorProxy[torch.Tensor, torch.Tensor]):
    """A linear layer, then a running sum along each item's rows: the result depends
    on every row of the item and on nothing of the others (the mask zeroes padding)."""

    def __init__(self, model: torch.nn.Module, **options: Any) -> None:
        super().__init__(**options)
        self.model = model
        self.seen: list[tuple[str, int, str]] = []

    @override
    def _forward(self, batch: Collated, /) -> torch.Tensor:
        data = batch.data
        self.seen.append((data.device.type, len(data), threading.current_thread().name))
        with torch.inference_mode():
            out = self.model(data)
            if batch.mask is not None:
                out = out * batch.mask[..., None]
            return out.cumsum(dim=1)


def reference(model: torch.nn.Module, item: torch.Tensor) -> torch.Tensor:
    """The item alone through a CPU copy of the model."""
    with torch.inference_mode():
        return copy.deepcopy(model).cpu()(item).cumsum(dim=0)


def close(result: torch.Tensor, want: torch.Tensor) -> bool:
    return torch.allclose(result.cpu().float(), want, rtol=1e-4, atol=1e-4)


@needs_cuda
async def test_the_device_thread_binds_its_device_and_a_stream_of_its_own() -> None:
    async with WorkerThread("gpu", device="cuda") as worker:

        def where(items: list[Any]) -> list[Any]:
            stream = torch.cuda.current_stream()
            return [(torch.cuda.current_device(), stream == worker.stream, stream)] * len(items)

        device, on_its_stream, stream = (await worker.run(where, [0]))[0]
    assert device == 0
    assert on_its_stream
    assert stream != torch.cuda.default_stream(0)


@needs_cuda
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("output_device", ["cpu", None])
async def test_round_trip_results_on_the_cpu_or_kept_on_the_device(
    overlap: bool, output_device: str | None
) -> None:
    model = linear()
    worker = WorkerThread("gpu", device="cuda", overlap=overlap)
    proxy = Encoder(
        copy.deepcopy(model).cuda(), batch_size=16, max_delay_ms=1, device="cuda",
        output_device=output_device, offload=worker,
    )  # fmt: skip
    try:
        async with proxy:
            results = await asyncio.gather(*(proxy.inference(rows(i)) for i in range(100)))
    finally:
        await worker.aclose()
    want_type = "cpu" if output_device == "cpu" else "cuda"
    for i, result in enumerate(results):
        assert result.device.type == want_type
        assert close(result, reference(model, rows(i))), i
    assert {device for device, _, _ in proxy.seen} == {"cuda"}  # the model saw CUDA tensors
    if output_device == "cpu":
        assert all(result.is_pinned() for result in results)  # one pinned copy back
    if overlap:  # bursts of 100 on capacity 2: some batches prepared while another computed
        assert worker._stages is not None
        assert worker._stages.started


@needs_cuda
@pytest.mark.parametrize("pin_inputs", [False, True])
async def test_inputs_are_pinned_on_the_fly_only_when_asked(
    monkeypatch: pytest.MonkeyPatch, pin_inputs: bool
) -> None:
    from batchproxy import _tensor_proxy

    monkeypatch.setattr(_tensor_proxy, "PIN_INPUTS", pin_inputs)
    pinned = []
    pin_memory = torch.Tensor.pin_memory

    def counted(tensor: torch.Tensor, *args: Any) -> torch.Tensor:
        pinned.append(tensor.shape)
        return pin_memory(tensor, *args)

    monkeypatch.setattr(torch.Tensor, "pin_memory", counted)
    model = linear()
    async with Encoder(copy.deepcopy(model).cuda(), batch_size=8, device="cuda") as proxy:
        results = await asyncio.gather(*(proxy.inference(rows(i)) for i in range(8)))
    for i, result in enumerate(results):
        assert close(result, reference(model, rows(i))), i
    assert bool(pinned) == pin_inputs  # each batch's data and mask, or nothing


@needs_cuda
async def test_overlapped_bursts_give_every_caller_its_own_result() -> None:
    model = linear(1)
    worker = WorkerThread("gpu", device="cuda", overlap=True)
    proxy = Encoder(
        copy.deepcopy(model).cuda(), batch_size=32, max_delay_ms=0.5, device="cuda",
        output_device="cpu", offload=worker, batch_sizes=(8, 16, 32),
    )  # fmt: skip
    try:
        async with proxy:
            for burst in range(5):
                ids = range(burst * 200, burst * 200 + 200)
                results = await asyncio.gather(*(proxy.inference(rows(i)) for i in ids))
                for i, result in zip(ids, results, strict=True):
                    assert close(result, reference(model, rows(i))), i
    finally:
        await worker.aclose()
    assert {size for _, size, _ in proxy.seen} <= {8, 16, 32}


@needs_cuda
async def test_a_batch_out_of_memory_is_split_and_its_memory_given_back() -> None:
    """A real `torch.cuda.OutOfMemoryError`: attention scores of a long sequence, times
    the batch. The batch is split, every caller answered, the cap lowered, and the
    memory allocated is back to where it was before the batch."""
    free, _ = torch.cuda.mem_get_info()
    heads = 8
    # one item's scores take about a third of the free memory: 8 items cannot fit, 2 can
    length = int((free / 3 / 4 / heads) ** 0.5)

    class Attention(TensorProxy[torch.Tensor, torch.Tensor]):
        @override
        def _forward(self, batch: Collated, /) -> torch.Tensor:
            n = len(batch.data)
            query = batch.data.reshape(n, 1, 1, 1).expand(n, heads, length, 1)
            scores = query @ query.transpose(-1, -2)  # (n, heads, length, length) float32
            return scores.mean(dim=(1, 2, 3))

    worker = WorkerThread("gpu", device="cuda", overlap=True)
    proxy = Attention(batch_size=8, max_delay_ms=50, device="cuda", output_device="cpu",
                      offload=worker, oom_backoff=True)  # fmt: skip
    try:
        async with proxy:
            # a first product on the thread's stream gets cuBLAS its workspace there (32 MiB
            # on a Hopper card, kept for the stream's life): allocated before the baseline
            assert torch.allclose(await proxy.inference(torch.tensor(3.0)), torch.tensor(9.0))
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            values = [float(i + 1) for i in range(8)]
            results = await asyncio.gather(*(proxy.inference(torch.tensor(v)) for v in values))
            stats = proxy.stats
    finally:
        await worker.aclose()
    for value, result in zip(values, results, strict=True):
        assert torch.allclose(result, torch.tensor(value * value)), (value, result)
    assert stats.oom_splits >= 1
    assert stats.batch_cap < 8
    assert stats.errors == 0
    del results
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= before  # (the warm-up call's blocks went too)


@needs_cuda
async def test_captured_cuda_graphs_per_batch_size_give_the_eager_results() -> None:
    """`batch_sizes` and a fixed padded length: one captured graph per size, replayed
    on the device thread; every caller gets what the eager model gives."""
    model = linear(2).cuda()
    sizes = (1, 2, 4, 8)

    class Graphed(TensorProxy[torch.Tensor, torch.Tensor]):
        def __init__(self) -> None:
            super().__init__(batch_size=8, max_delay_ms=1, device="cuda", output_device="cpu",
                             offload=worker, batch_sizes=sizes, pad_to_multiple_of=12)  # fmt: skip
            self.graphs: dict[tuple[int, ...], tuple[Any, torch.Tensor, torch.Tensor]] = {}

        @override
        def _forward(self, batch: Collated, /) -> torch.Tensor:
            # pad_to_multiple_of rounds ragged batches only: a batch whose items are all
            # as long (a lone one) comes shorter, and is padded to the graph's length here
            length = batch.data.shape[1]
            data = torch.nn.functional.pad(batch.data, (0, 0, 0, 12 - length))
            shape = tuple(data.shape)
            if shape not in self.graphs:
                static_in = data.clone()
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side), torch.inference_mode():
                    for _ in range(3):
                        model(static_in)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                capture = torch.cuda.graph(graph, stream=torch.cuda.current_stream())
                with capture, torch.inference_mode():
                    static_out = model(static_in).cumsum(dim=1)
                self.graphs[shape] = (graph, static_in, static_out)
            graph, static_in, static_out = self.graphs[shape]
            static_in.copy_(data)
            graph.replay()
            return static_out[:, :length].clone()

    worker = WorkerThread("gpu", device="cuda", overlap=True)
    proxy = Graphed()
    try:
        async with proxy:
            for burst in (1, 3, 8, 20, 50):
                ids = range(burst)
                results = await asyncio.gather(*(proxy.inference(rows(i)) for i in ids))
                for i, result in zip(ids, results, strict=True):
                    # padding rows sit after the item's rows: its running sum is unchanged
                    assert close(result, reference(model, rows(i))), i
    finally:
        await worker.aclose()
    assert {shape[0] for shape in proxy.graphs} <= set(sizes)
    assert {shape[1] for shape in proxy.graphs} == {12}


@pytest.mark.skipif(CUDA, reason="needs a machine without CUDA")
async def test_a_device_this_machine_lacks_fails_each_batch_with_the_reason(
    no_leftovers: None,
) -> None:
    async with WorkerThread("gpu", device="cuda:0", overlap=True) as worker:
        for _ in range(2):
            with pytest.raises(RuntimeError, match=r"WorkerThread 'gpu' could not bind cuda:0"):
                await worker.run(lambda items: items, [1])
