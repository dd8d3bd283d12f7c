"""Dropped without `aclose()`: the object owning a `@batch` method, or a proxy, is
collected (`gc.collect()`: a proxy is in reference cycles) and its private worker
thread stops; a worker thread the user passed in is theirs and keeps running."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import pytest

from batchproxy import Proxy, WorkerThread, batch

Refs = tuple["weakref.ref[Any]", "weakref.ref[Any]", threading.Thread]


@pytest.fixture(autouse=True)
def slow_to_return(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker threads here return from handing a batch's outcome to its caller's
    loop 50 ms late: the caller gets its result, drops the model and collects while
    the thread is still in the act, as it may on a busy machine."""
    hand_over = asyncio.BaseEventLoop.call_soon_threadsafe

    def slowly(
        loop: asyncio.BaseEventLoop, callback: Callable[..., object], *args: Any, **kw: Any
    ) -> asyncio.Handle:
        handle = hand_over(loop, callback, *args, **kw)
        if threading.current_thread().name.startswith("batchproxy-gc-"):
            time.sleep(0.05)
        return handle

    monkeypatch.setattr(asyncio.BaseEventLoop, "call_soon_threadsafe", slowly)


def _model(name: str, *, offload: bool = False) -> Any:
    """An instance of a class whose `@batch` method `double` runs on a private worker
    thread (a plain `def`, or an `async def` with `offload=True`)."""
    if offload:

        class Offloaded:
            @batch(batch_size=4, max_delay_ms=1.0, offload=True, name=name)
            async def double(self, items: list[int]) -> list[int]:
                return [2 * i for i in items]

        return Offloaded()

    class Model:
        @batch(batch_size=4, max_delay_ms=1.0, name=name)
        def double(self, items: list[int]) -> list[int]:
            return [2 * i for i in items]

    return Model()


class Doubler(Proxy[int, int]):
    def _inference(self, items: list[int]) -> list[int]:
        return [2 * i for i in items]


def _refs(owner: object, proxy: Proxy[Any, Any]) -> Refs:
    (thread,) = [t for t in threading.enumerate() if t.name == f"batchproxy-{proxy.name}"]
    return weakref.ref(owner), weakref.ref(proxy), thread


def _assert_collected(refs: Refs) -> None:
    owner, proxy, thread = refs
    gc.collect()
    assert owner() is None, "the owner was not collected"
    assert proxy() is None, "the proxy was not collected"
    thread.join(10)
    assert not thread.is_alive(), "its private worker thread still runs"


@pytest.mark.parametrize("offload", [False, True], ids=["def", "offloaded-async"])
async def test_dropped_owner_of_a_batched_method_is_collected(offload: bool) -> None:
    model = _model(f"gc-loop-{offload}", offload=offload)
    assert await asyncio.wait_for(model.double(3), 10) == 6
    refs = _refs(model, model.double.proxy)
    del model
    _assert_collected(refs)


def test_owner_dropped_after_asyncio_run_is_collected() -> None:
    async def use() -> Refs:
        model = _model("gc-run")
        assert await asyncio.wait_for(model.double(3), 10) == 6
        return _refs(model, model.double.proxy)

    _assert_collected(asyncio.run(use()))


def test_owner_used_from_a_plain_thread_is_collected() -> None:
    """`.inference_sync()` binds the proxy to the default `BackgroundLoop`, which lives on."""

    def use() -> Refs:
        model = _model("gc-sync")
        assert model.double.inference_sync(3, timeout=10) == 6
        return _refs(model, model.double.proxy)

    _assert_collected(use())


async def test_dropped_unclosed_proxy_is_collected() -> None:
    proxy = Doubler(batch_size=4, name="gc-proxy")
    assert await asyncio.wait_for(proxy.inference(3), 10) == 6
    refs = _refs(proxy, proxy)
    del proxy
    _assert_collected(refs)


async def test_dropped_proxy_leaves_a_shared_worker_thread_running() -> None:
    with WorkerThread(name="batchproxy-gc-shared") as worker:
        proxy = Doubler(batch_size=4, offload=worker)
        assert await asyncio.wait_for(proxy.inference(3), 10) == 6
        dropped = weakref.ref(proxy)
        del proxy
        gc.collect()
        assert dropped() is None
        assert not worker.closed
        assert await asyncio.wait_for(Doubler(offload=worker).inference(4), 10) == 8


@pytest.mark.parametrize("closed", [False, True], ids=["unclosed", "closed"])
async def test_a_proxy_collected_while_its_loop_runs_leaves_no_task_on_it(closed: bool) -> None:
    """Its loop-end hook (an async generator its loop knows of) is closed with it, not
    left to the loop's collector of unfinished generators, which would start a task on
    the loop to close it: a stray task, wherever a collection happened to run (seen as
    a flaky leftover in the test suite on Python 3.13)."""
    proxy = Doubler(batch_size=4, name="gc-hook")
    assert await asyncio.wait_for(proxy.inference(3), 10) == 6
    if closed:
        await proxy.aclose()
    before = asyncio.all_tasks()
    dropped = weakref.ref(proxy)
    del proxy
    gc.collect()
    assert dropped() is None
    await asyncio.sleep(0)  # a task to close the hook would have started by now
    assert asyncio.all_tasks() == before
