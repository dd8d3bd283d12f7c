"""Out-of-memory back-off: batches retried in halves, the batch cap lowered and
raised again, only an item that cannot fit alone fails."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
from typing import Any

import pytest
from _support import Recorder
from typing_extensions import override

import batchproxy
from batchproxy._oom import RECOVER_AFTER, BatchCap, is_out_of_memory


class OutOfMemoryError(RuntimeError):
    """Named like torch.cuda.OutOfMemoryError, without torch."""


def fits(
    limit: int, error: Callable[[], BaseException] = MemoryError
) -> Callable[[list[Any]], Any]:
    """A model whose memory holds `limit` items: more raises `error()`."""

    def respond(items: list[Any]) -> list[Any]:
        if len(items) > limit:
            raise error()
        return [("out", item) for item in items]

    return respond


async def burst(proxy: Recorder, items: range) -> list[Any]:
    return list(await asyncio.gather(*(proxy.inference(i) for i in items)))


@pytest.mark.looptime
async def test_a_batch_out_of_memory_is_retried_in_halves() -> None:
    async with Recorder(fits(4), oom_backoff=True, batch_size=16, max_delay_ms=1) as proxy:
        assert await burst(proxy, range(16)) == [("out", i) for i in range(16)]
        # 16 and 8 ran out of memory; then chunks of the learned cap, 4
        assert [len(b) for b in proxy.batches] == [16, 8, 4, 4, 4, 4]
        stats = proxy.stats
        assert stats.succeeded == 16
        assert stats.errors == 0
        assert stats.oom_splits == 2
        assert stats.batch_cap == 4


@pytest.mark.looptime
async def test_the_lowered_cap_shapes_the_next_batches() -> None:
    async with Recorder(fits(4), oom_backoff=True, batch_size=16, max_delay_ms=1) as proxy:
        await burst(proxy, range(16))
        proxy.batches.clear()
        await burst(proxy, range(100, 112))
        assert [len(b) for b in proxy.batches] == [4, 4, 4]  # no more failed attempts


@pytest.mark.looptime
async def test_the_cap_creeps_back_after_sustained_success() -> None:
    limit = [4]

    def respond(items: list[Any]) -> Any:
        return fits(limit[0])(items)

    model = Recorder(respond, oom_backoff=True, batch_size=16, max_delay_ms=1)
    async with model as proxy:
        await burst(proxy, range(16))
        assert proxy.stats.batch_cap == 4
        limit[0] = 1000  # memory freed
        for _ in range(RECOVER_AFTER):
            await burst(proxy, range(4))
        assert proxy.stats.batch_cap == 5
        for _ in range(30 * RECOVER_AFTER):
            await burst(proxy, range(16))
        assert proxy.stats.batch_cap == 16  # back to batch_size, never past it


@pytest.mark.looptime
async def test_an_item_that_does_not_fit_alone_fails_only_its_caller() -> None:
    def respond(items: list[Any]) -> list[Any]:
        if "huge" in items:
            raise MemoryError("huge")
        return [("out", item) for item in items]

    async with Recorder(respond, oom_backoff=True, batch_size=4, max_delay_ms=1) as proxy:
        results = await asyncio.gather(
            *(proxy.inference(i) for i in ["a", "huge", "b", "c"]), return_exceptions=True
        )
        assert results[0] == ("out", "a")
        assert isinstance(results[1], MemoryError)
        assert results[2:] == [("out", "b"), ("out", "c")]


@pytest.mark.looptime
async def test_torch_style_errors_are_recognised_by_name_and_message() -> None:
    for error in (OutOfMemoryError, lambda: RuntimeError("CUDA out of memory. Tried...")):
        async with Recorder(
            fits(2, error), oom_backoff=True, batch_size=8, max_delay_ms=1
        ) as proxy:
            assert await burst(proxy, range(8)) == [("out", i) for i in range(8)]
            assert proxy.stats.oom_splits == 2


@pytest.mark.looptime
async def test_other_errors_are_not_retried() -> None:
    async with Recorder(
        fits(2, lambda: ValueError("bad")), oom_backoff=True, batch_size=8
    ) as proxy:
        results = await asyncio.gather(
            *(proxy.inference(i) for i in range(8)), return_exceptions=True
        )
        assert all(isinstance(r, ValueError) for r in results)
        assert proxy.stats.oom_splits == 0
        assert len(proxy.batches) == 1


class Exhausted(Exception):
    """A user's own out-of-resources error."""


@pytest.mark.looptime
async def test_a_user_predicate_decides_what_is_out_of_memory() -> None:
    options = {"batch_size": 8, "max_delay_ms": 1}
    predicate = lambda error: isinstance(error, Exhausted)  # noqa: E731
    async with Recorder(fits(2, Exhausted), oom_backoff=predicate, **options) as proxy:
        assert await burst(proxy, range(8)) == [("out", i) for i in range(8)]
        assert proxy.stats.oom_splits == 2


@pytest.mark.looptime
async def test_back_off_is_off_by_default() -> None:
    """Without the opt-in, an exception fails every caller of the batch (guarantee 4 of
    docs/failures.md)."""
    async with Recorder(fits(2), batch_size=8, max_delay_ms=1) as proxy:
        results = await asyncio.gather(
            *(proxy.inference(i) for i in range(8)), return_exceptions=True
        )
        assert all(isinstance(r, MemoryError) for r in results)
        assert proxy.stats.oom_splits == 0
        assert len(proxy.batches) == 1


def test_oom_backoff_must_be_a_bool_or_a_predicate() -> None:
    with pytest.raises(TypeError, match="oom_backoff"):
        Recorder(oom_backoff="yes")


async def test_back_off_works_through_the_worker_thread() -> None:
    class Sync(batchproxy.Proxy[int, int]):
        def _inference(self, items: list[int]) -> list[int]:
            if len(items) > 3:
                raise MemoryError
            return [2 * i for i in items]

    async with Sync(batch_size=12, max_delay_ms=1, oom_backoff=True) as proxy:
        results = await asyncio.wait_for(
            asyncio.gather(*(proxy.inference(i) for i in range(12))), 10
        )
        assert results == [2 * i for i in range(12)]
        assert proxy.stats.batch_cap == 3


def test_the_cap_follows_a_lower_configured_batch_size() -> None:
    cap = BatchCap(16)
    cap.out_of_memory(16)
    assert cap.cap == 8
    cap.set_limit(4)
    assert (cap.limit, cap.cap) == (4, 4)
    cap.set_limit(32)
    assert (cap.limit, cap.cap) == (32, 4)  # a raise waits for proven success


def test_is_out_of_memory() -> None:
    assert is_out_of_memory(MemoryError())
    assert is_out_of_memory(OutOfMemoryError())
    assert is_out_of_memory(RuntimeError("CUDA out of memory"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    assert not is_out_of_memory(ValueError("out of memory"))


@pytest.mark.looptime
async def test_a_chunk_answered_with_a_wrong_count_fails_the_batch_not_loops() -> None:
    def respond(items: list[Any]) -> list[Any]:
        if len(items) > 2:
            raise MemoryError
        return []  # a buggy model: no results at all

    async with Recorder(respond, oom_backoff=True, batch_size=4, max_delay_ms=1) as proxy:
        results = await asyncio.gather(
            *(proxy.inference(i) for i in range(4)), return_exceptions=True
        )
        assert all(isinstance(r, batchproxy.BatchSizeMismatch) for r in results)
        assert len(proxy.batches) == 3  # 4 (out of memory), then two chunks of 2


class _Activations:
    """Stands for what a forward pass had allocated when it ran out of memory."""


@pytest.mark.parametrize("offload", [False, True])
async def test_the_failed_call_lets_go_of_its_memory_before_the_reruns(offload: bool) -> None:
    """The error's traceback holds the failed call's frames, and with them its tensors:
    kept through the re-runs, they would make the halves run out of memory too (a GPU's
    `memory_allocated()` would not fall back until the last piece ran)."""
    allocated: list[weakref.ref[_Activations]] = []
    alive_at_each_call: list[int] = []

    def respond(items: list[Any]) -> list[Any]:
        alive_at_each_call.append(sum(ref() is not None for ref in allocated))
        if len(items) > 2:
            activations = _Activations()
            allocated.append(weakref.ref(activations))
            raise MemoryError(f"out of memory on {len(items)} items")
        return [("out", item) for item in items]

    class Model(batchproxy.Proxy[Any, Any]):
        @override
        def _inference(self, items: list[Any]) -> list[Any]:
            return respond(items)

    async with Model(batch_size=8, max_delay_ms=1, oom_backoff=True, offload=offload) as proxy:
        results = await asyncio.gather(*(proxy.inference(i) for i in range(8)))
    assert results == [("out", i) for i in range(8)]
    assert alive_at_each_call[0] == 0
    assert alive_at_each_call[1:] == [0] * (len(alive_at_each_call) - 1)  # none kept alive
