"""`Serving`, the web helpers' shared core, without a web framework: its states, the
executors it owns, and its refusals."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from _support import Recorder

from batchproxy import WorkerThread
from batchproxy.integrations._serving import NotReady, Serving, State


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
