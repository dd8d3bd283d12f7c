"""`Serving`, the web helpers' shared core, without a web framework: its states, the
executors it owns, and its refusals."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import pytest
from _support import Recorder

from batchproxy import Health, HostUnavailable, PoolUnavailable, Proxy, WorkerThread
from batchproxy._executors.base import LoopExecutor
from batchproxy.integrations._serving import NotReady, Serving, State, answer_for


async def test_it_starts_shared_executors_before_the_proxies_and_closes_them_after() -> None:
    thread = WorkerThread(name="shared-gpu")
    proxy = Recorder(offload=thread)
    serving = Serving(proxy, executors=[thread])
    async with serving.running():
        await serving.wait_ready()
        assert thread.started
        assert serving.state is State.READY
        assert await proxy.inference(1) == ("out", 1)
    assert serving.state is State.CLOSED
    assert proxy.closed
    assert thread.closed


async def test_closing_while_it_loads_stops_the_load_and_closes_the_proxies() -> None:
    loading = asyncio.Event()

    async def load() -> None:
        loading.set()
        await asyncio.Event().wait()  # never ends by itself

    proxy = Recorder()
    serving = Serving(proxy, load=load)
    await serving.start()
    await loading.wait()
    assert serving.readiness().status == 503
    with pytest.raises(NotReady, match="loading"):
        serving.check_ready()
    await serving.aclose()
    assert serving.state is State.CLOSED
    assert proxy.closed


async def test_a_failed_load_is_reported_not_raised() -> None:
    async def load() -> None:
        raise OSError("weights not found")

    serving = Serving(Recorder(), load=load)
    async with serving.running():
        with pytest.raises(NotReady, match="weights not found"):
            await serving.wait_ready()
        assert serving.state is State.FAILED
        live = serving.liveness()
        assert live.status == 503
        assert live.body["error"] == "OSError: weights not found"


async def test_wait_ready_before_start_says_nothing_loads() -> None:
    with pytest.raises(NotReady, match="new"):
        await Serving(Recorder()).wait_ready()


def test_proxies_are_found_by_name_or_class() -> None:
    class Other(Recorder):
        pass

    first, other = Recorder(name="first"), Other(name="other")
    serving = Serving(first, other)
    assert serving.proxy("other") is other
    assert serving.proxy(Other) is other
    with pytest.raises(LookupError, match=r"first \(Recorder\), other \(Other\)"):
        serving.proxy("missing")
    with pytest.raises(LookupError):
        serving.provider("missing")  # at once, not at the first request


@pytest.mark.parametrize(
    ("proxies", "options", "error"),
    [
        ((object(),), {}, TypeError),
        (("same", "same"), {}, ValueError),
        ((), {"retry_after": 0}, ValueError),
        ((), {"retry_after": float("nan")}, ValueError),
    ],
)
def test_bad_arguments_are_refused(proxies: tuple[Any, ...], options: Any, error: type) -> None:
    made = tuple(Recorder(name=p) if isinstance(p, str) else p for p in proxies)
    with pytest.raises(error):
        Serving(*made, **options)


class Pool(LoopExecutor):
    """An executor whose health a test sets (as a pool with no replica ready reports)."""

    def __init__(self) -> None:
        self.state: Health | None = None

    @property
    def health(self) -> Health | None:
        return self.state


async def test_a_pool_with_no_worker_ready_makes_its_proxy_and_readiness_unhealthy() -> None:
    pool = Pool()
    proxy = Recorder(offload=pool)
    serving = Serving(proxy, executors=[pool])
    async with serving.running():
        await serving.wait_ready()
        assert serving.readiness().status == 200
        pool.state = Health(False, "pool: no replica ready (2 pending)", 1.0)
        assert proxy.health == pool.state
        assert not proxy.healthy
        answer = serving.readiness()
        assert answer.status == 503
        assert answer.body["proxies"][proxy.name]["reason"] == "pool: no replica ready (2 pending)"
        pool.state = Health(True, None, None)
        assert serving.readiness().status == 200
        assert await proxy.inference(1) == ("out", 1)


def test_pool_unavailable_is_answered_503_with_retry_after() -> None:
    answer = answer_for(PoolUnavailable("pool", 60.0, "2 pending"), retry_after=2.0)
    assert (answer.status, answer.headers) == (503, {"Retry-After": "2"})
    assert answer.body == {
        "detail": "pool: no replica ready to run a batch after 60 s (2 pending)",
        "error": "PoolUnavailable",
    }


def test_host_unavailable_is_answered_503_with_retry_after() -> None:
    answer = answer_for(HostUnavailable("/run/m.sock", "cannot connect"), retry_after=1.0)
    assert (answer.status, answer.headers) == (503, {"Retry-After": "1"})
    assert answer.body == {
        "detail": "model host at /run/m.sock: cannot connect",
        "error": "HostUnavailable",
    }


async def test_an_executor_sees_the_items_its_proxies_queue_in_batches() -> None:
    release = asyncio.Event()

    class Held(Proxy[int, int]):
        async def _inference(self, items: list[int]) -> list[int]:
            await release.wait()
            return items

    executor = LoopExecutor()
    assert executor.queued_items() == (0, 0)  # no proxy
    first = Held(4, offload=executor, name="first", max_concurrent_batches=1)
    second = Held(2, offload=executor, name="second", max_concurrent_batches=1)
    assert executor.queued_items() == (0, 4)  # the largest batch_size
    calls = [asyncio.ensure_future(first.inference(i)) for i in range(9)]
    calls += [asyncio.ensure_future(second.inference(i)) for i in range(3)]
    await asyncio.sleep(0.01)  # one batch of each runs; the rest waits
    assert executor.queued_items() == (5 + 1, 4)
    release.set()
    await asyncio.gather(*calls)
    assert executor.queued_items() == (0, 4)
    await first.aclose()
    assert executor.queued_items() == (0, 2)  # a closed proxy stops counting
    del second
    gc.collect()
    assert executor.queued_items() == (0, 0)  # and so does a collected one
