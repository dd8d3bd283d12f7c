"""`RemoteProxy.inference_many` is the host proxy's `inference_many`: one message, the
list admitted whole or refused whole (`QueueFull`: the model sees none of it), the
same refusal of a string, bytes or a mapping, each failure in its item's place with
`return_exceptions` (the host's deadline, no host, an item that cannot travel)."""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
from typing import Any

import pytest
from _host_models import Tagged
from _support import wait_until

import batchproxy
from batchproxy.host import ModelHost, RemoteProxy

pytestmark = [
    pytest.mark.skipif(sys.platform == "win32", reason="Unix domain sockets"),
    pytest.mark.usefixtures("no_leftovers"),
]

NOT_LISTS: list[Any] = ["abc", b"ab", bytearray(b"ab"), {"a": 1, "b": 2}]


async def test_a_string_bytes_or_a_mapping_is_refused_as_by_the_proxy(
    served: tuple[Tagged, ModelHost, RemoteProxy],
) -> None:
    proxy, _, remote = served
    for items in NOT_LISTS:
        with pytest.raises(TypeError, match="iterable of items") as here:
            await proxy.inference_many(items)
        with pytest.raises(TypeError, match="iterable of items") as there:
            await remote.inference_many(items)
        assert str(there.value) == str(here.value)
    assert proxy.stats.requests == 0  # nothing was sent
    assert await remote.inference_many([]) == []
    assert [answer[0] for answer in await remote.inference_many(iter("ab"))] == ["a", "b"]


@pytest.mark.parametrize("return_exceptions", [False, True])
async def test_a_list_that_does_not_fit_the_hosts_queue_is_refused_whole(
    socket_path: str, return_exceptions: bool
) -> None:
    proxy = Tagged(max_queue_size=3)
    proxy.gate.clear()
    async with ModelHost(proxy, socket_path), RemoteProxy(socket_path) as remote:
        running = asyncio.ensure_future(remote.inference("running"))
        await wait_until(lambda: proxy.seen == [["running"]])
        with pytest.raises(batchproxy.QueueFull):
            await remote.inference_many(range(5), return_exceptions=return_exceptions)
        assert proxy.stats.queue_depth == 0  # none of it was queued
        fits = asyncio.ensure_future(
            remote.inference_many(["a", "b", "c"], return_exceptions=return_exceptions)
        )
        await wait_until(lambda: proxy.stats.queue_depth == 3)
        proxy.gate.set()
        assert (await running)[0] == "running"
        assert [answer[0] for answer in await fits] == ["a", "b", "c"]
    stats = proxy.stats
    assert (stats.rejected, stats.cancelled, stats.requests) == (5, 0, 4)
    assert [item for batch in proxy.seen for item in batch] == ["running", "a", "b", "c"]


async def test_each_failure_takes_its_items_place_with_return_exceptions(
    served: tuple[Tagged, ModelHost, RemoteProxy],
) -> None:
    proxy, _, remote = served
    answers = await remote.inference_many(
        ["ok", "bad", lambda: None, "boom", "unsendable"], return_exceptions=True
    )
    assert answers[0][0] == "ok"
    assert isinstance(answers[1], batchproxy.InvalidItem)
    assert isinstance(answers[2], TypeError)
    assert "cannot be sent to the model host" in str(answers[2])
    assert isinstance(answers[3], ValueError)
    assert isinstance(answers[4], TypeError)
    assert "could not send the call's result" in str(answers[4])
    assert proxy.stats.requests == 4  # the item that could not travel never left
    with pytest.raises(TypeError, match="cannot be sent to the model host"):
        await remote.inference_many(["a", lambda: None])
    assert proxy.stats.requests == 4  # refused before anything was sent
    with pytest.raises(TypeError, match="could not send the call's result"):
        await remote.inference_many(["a", "unsendable"])


async def test_the_hosts_deadline_fails_each_item_in_its_place(socket_path: str) -> None:
    proxy = Tagged()
    proxy.gate.clear()
    async with ModelHost(proxy, socket_path), RemoteProxy(socket_path) as remote:
        running = asyncio.ensure_future(remote.inference("running"))
        await wait_until(lambda: proxy.seen == [["running"]])
        answers = await remote.inference_many(["a", "b"], timeout=0.1, return_exceptions=True)
        assert [type(answer) for answer in answers] == [batchproxy.DeadlineExceeded] * 2
        with pytest.raises(batchproxy.DeadlineExceeded):
            await remote.inference_many(["c", "d"], timeout=0.1)
        # (the first to time out withdraws the other, which may not have timed out yet)
        assert proxy.stats.timed_out >= 3
        assert proxy.stats.timed_out + proxy.stats.cancelled == 4
        proxy.gate.set()
        await running
    assert proxy.seen == [["running"]]


async def test_no_host_is_host_unavailable_in_each_items_place() -> None:
    folder = tempfile.mkdtemp(prefix="bp-host-", dir="/tmp")
    try:
        remote = RemoteProxy(os.path.join(folder, "none.sock"))  # (not started: no host)
        try:
            answers = await remote.inference_many([1, 2], return_exceptions=True)
            assert [type(answer) for answer in answers] == [batchproxy.HostUnavailable] * 2
            assert answers[0] is not answers[1]
            with pytest.raises(batchproxy.HostUnavailable):
                await remote.inference_many([1, 2])
        finally:
            await remote.aclose()
    finally:
        os.rmdir(folder)


class OnlyInference:
    """A host's proxy with `inference` alone (no `inference_many`)."""

    async def inference(self, item: Any, **call: Any) -> Any:
        if item == "boom":
            raise ValueError("boom")
        return ("only", item)


async def test_a_host_proxy_without_inference_many_answers_a_list_call_by_call(
    socket_path: str,
) -> None:
    async with ModelHost(OnlyInference(), socket_path), RemoteProxy(socket_path) as remote:
        assert await remote.inference_many([1, 2]) == [("only", 1), ("only", 2)]
        answers = await remote.inference_many([1, "boom"], return_exceptions=True)
        assert answers[0] == ("only", 1)
        assert isinstance(answers[1], ValueError)
        with pytest.raises(ValueError, match="boom"):
            await remote.inference_many([1, "boom"])
