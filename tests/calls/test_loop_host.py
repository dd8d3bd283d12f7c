"""What a proxy's binding uses of a `BackgroundLoop` is a small internal object,
`LoopHost` (adopt, release, on_loop_thread, route), handed over by `host_of` and
`default_host`: the binding calls no private method of the public class."""

from __future__ import annotations

import ast
import asyncio
import concurrent.futures
from pathlib import Path
from typing import Any

from _support import Recorder

import batchproxy
from batchproxy import BackgroundLoop
from batchproxy._loops import binding as binding_module
from batchproxy._loops.background_loop import LoopHost, default_host, host_of


def test_loop_host_offers_what_the_binding_needs_and_nothing_of_it_is_public() -> None:
    offered = {name for name in vars(LoopHost) if not name.startswith("_")}
    assert offered == {"adopt", "release", "on_loop_thread", "route"}
    assert not offered & set(dir(BackgroundLoop))
    assert "LoopHost" not in batchproxy.__all__


def test_the_binding_calls_no_private_method_of_another_object() -> None:
    tree = ast.parse(Path(binding_module.__file__).read_text())
    private = sorted(
        ast.unparse(node.func)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr.startswith("_")
        and not node.func.attr.startswith("__")
        and not (isinstance(node.func.value, ast.Name) and node.func.value.id == "self")
    )
    assert private == []


def test_host_of_a_plain_loop_is_none() -> None:
    loop = asyncio.new_event_loop()
    try:
        assert host_of(loop) is None
    finally:
        loop.close()


def test_a_proxy_bound_on_a_background_loop_is_adopted_and_closed_with_it() -> None:
    with BackgroundLoop("host-test") as background:
        proxy = Recorder()
        assert background.run(proxy.inference(1)) == ("out", 1)
        loop = background._loop
        assert loop is not None
        host = host_of(loop)
        assert isinstance(host, LoopHost)
        assert not host.on_loop_thread()
        assert list(background._proxies) == [proxy]  # adopted when it bound there
    assert proxy.closed  # close() closed it


def test_route_runs_a_call_on_the_loop_and_release_lets_the_proxy_go() -> None:
    with BackgroundLoop("host-route") as background:
        loop = background._loop
        assert loop is not None
        host = host_of(loop)
        assert host is not None

        async def where() -> Any:
            return asyncio.get_running_loop()

        routed = host.route(where, lambda: RuntimeError("ended"))
        assert routed is not None
        future, _ = routed
        assert isinstance(future, concurrent.futures.Future)
        assert future.result(5) is loop
        proxy = Recorder()
        host.adopt(proxy)
        host.release(proxy)
        assert not list(background._proxies)


def test_default_host_is_the_default_loops() -> None:
    host = default_host()
    assert host._background is BackgroundLoop.default()
    assert not host.on_loop_thread()
