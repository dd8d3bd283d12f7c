"""The machinery of the Serving walk (tests/failures/test_combinations.py, issue 38
item 3): a `Serving` holding one proxy drawn with dedup (and the cache), batch keys and
tenants; HTTP requests that reach it through `CancelOnDisconnect` (the ASGI middleware
that FastAPI's `install` adds), driven in-process: each request is an ASGI call whose
client may disconnect mid-call (the server's `receive()` then says ``http.disconnect``);
and the drain at shutdown (`Serving.aclose()`) with a deadline (`drain_timeout`) that
cuts off the calls still queued or running, hung ones among them.

The oracle is the combination walk's (`_combinations.check`), with what a `Serving`
adds: a call ends once, with its own result, `ProxyClosed` (it came after the drain
began), `DrainDeadline` (only at the deadline), `DeadlineExceeded` (its own timeout),
or cancelled by its client's disconnect (then counted in `stats.disconnected`, and
the middleware swallows the cancellation: the server's task ends quietly); the
response is sent whole, the app's own unless the client left (then none, or the
middleware's 499); the service ends CLOSED with nothing left running.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass
from typing import Any

from _combinations import (
    CALLER,
    HANG,
    ITEMS,
    KEYS,
    NEVER_CALLED,
    TENANTS,
    Call,
    Config,
    Log,
    Program,
    Run,
    key_option,
)
from hypothesis import strategies as st

import batchproxy
from batchproxy.integrations._disconnect import WATCH_AFTER, CancelOnDisconnect
from batchproxy.integrations._serving import Serving, State, answer_for

Message = MutableMapping[str, Any]


@dataclass(frozen=True)
class ServingProgram:
    """The requests (`Call`s; `cancel_after`: when after its arrival the client
    disconnects) and the drain: when it begins, and its deadline."""

    calls: list[Call]
    drain_at: float
    drain_timeout: float | None


@st.composite
def serving_configs(draw: st.DrawFn) -> Config:
    """A plain model on the loop with dedup (and the cache), keys and tenants drawn."""
    options: dict[str, Any] = {
        "batch_size": draw(st.integers(1, 6)),
        "max_delay_ms": draw(st.sampled_from([0.0, 1.0, 5.0])),
        "max_concurrent_batches": draw(st.sampled_from([None, 1, 2])),
        "max_queue_size": draw(st.sampled_from([None, 3, 10])),
        "max_queue_size_per_tenant": draw(st.none() | st.integers(1, 4)),
        "tenant_weights": draw(st.none() | st.just({"a": 3.0, "b": 0.5})),
        "aging_ms": draw(st.none() | st.sampled_from([1.0, 10.0])),
        "isolate_errors": draw(st.booleans()),
    }
    if draw(st.booleans()):
        cache_size = draw(st.none() | st.integers(1, 4))
        options["dedup"] = batchproxy.Dedup(cache_size=cache_size)
    if draw(st.booleans()):
        options["key"] = key_option
    # (the middleware watches a request from `WATCH_AFTER` = 50 ms on: calls that last)
    delay = draw(st.sampled_from([0.0, 0.01, 0.05]))
    return Config("plain", options, draw(st.booleans()), False, delay)


@st.composite
def serving_programs(draw: st.DrawFn, config: Config, horizon: float) -> ServingProgram:
    drain_timeout = draw(st.none() | st.sampled_from([0.0, horizon / 4, horizon]))
    items = ITEMS if drain_timeout is None else [*ITEMS, HANG]  # (a deadline cuts a hang)
    calls = []
    for i in range(draw(st.integers(1, 16))):
        calls.append(
            Call(
                id=i,
                at=draw(st.sampled_from([0.0, 0.0, horizon / 20, horizon / 4, horizon / 2])),
                form="inference",
                items=(draw(st.sampled_from(items)),),
                key=draw(st.sampled_from(KEYS)) if config.keys else None,
                tag="",
                tenant=draw(st.sampled_from(TENANTS)),
                priority=draw(st.sampled_from([0, 0, 1])),
                timeout=draw(st.none() | st.sampled_from([0.002, horizon])),
                # the client disconnects: before the watch starts, or after
                cancel_after=draw(
                    st.none() | st.sampled_from([0.0, WATCH_AFTER / 2, 2 * WATCH_AFTER])
                ),
            )
        )
    drain_at = draw(st.sampled_from([0.0, horizon / 20, horizon / 4, horizon, 2 * horizon]))
    return ServingProgram(calls, drain_at, drain_timeout)


@dataclass
class Exchange:
    """One HTTP request as the server saw it: what was sent back, and how it ended."""

    messages: list[Message]
    raised: BaseException | None = None


async def run_serving(config: Config, program: ServingProgram) -> tuple[Run, dict[int, Exchange]]:
    """Serve `program`'s requests through `CancelOnDisconnect` in front of a `Serving`
    of a proxy made from `config`, drain it at `drain_at`; what happened."""
    log = Log()
    proxy, _ = config.make(log)
    # (freeze_gc off: one full collection per example would cost the walk more than it
    # checks; the freeze has tests of its own, tests/integrations/test_collector.py)
    serving = Serving(proxy, drain_timeout=program.drain_timeout, freeze_gc=False)
    await serving.start()
    await serving.wait_ready()
    log.loop = asyncio.get_running_loop()
    result = Run(config, Program(program.calls, close_at=program.drain_at), proxy, log, {})
    result.max_batch_size = config.options["batch_size"]
    result.drain_timeout = program.drain_timeout
    server = Server(result)

    async def drain() -> None:
        await asyncio.sleep(program.drain_at)
        result.closed_at = log.clock()
        await serving.aclose()

    await asyncio.gather(*(server.client(call) for call in program.calls), drain())
    for call in program.calls:
        if call.id not in server.exchanges:
            server.settle(call, NEVER_CALLED)
    result.serving_closed = serving.state is State.CLOSED
    return result, server.exchanges


class Server:
    """The ASGI side: the route, the middleware in front of it, and the clients."""

    def __init__(self, result: Run) -> None:
        self.result = result
        self.calls = {call.id: call for call in result.program.calls}
        for call in result.program.calls:
            result.outcomes[call.id, 0] = []
        self.exchanges: dict[int, Exchange] = {}
        self.middleware = CancelOnDisconnect(self.app)

    def settle(self, call: Call, outcome: Any) -> None:
        self.result.outcomes[call.id, 0].append(outcome)
        self.result.ended_at.setdefault((call.id, 0), self.result.log.clock())

    async def app(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        """The route: one call of the proxy, its answer as JSON (an error's as
        `answer_for` says)."""
        call = self.calls[scope["call"]]
        CALLER.set(call.id)
        keywords: dict[str, Any] = {"timeout": call.timeout, "priority": call.priority}
        keywords["tenant"] = call.tenant
        if call.key is not None:
            keywords["key"] = call.key
        try:
            outcome = await self.result.proxy.inference(call.items[0], **keywords)
        except batchproxy.BatchProxyError as exc:
            self.settle(call, exc)
            answer = answer_for(exc)
            status, body = answer.status, answer.body
        except Exception as exc:  # the model's own error: the framework's 500
            self.settle(call, exc)
            status, body = 500, {"detail": repr(exc)}
        except asyncio.CancelledError as exc:
            self.settle(call, exc)
            raise
        else:
            self.settle(call, outcome)
            status, body = 200, {"result": repr(outcome)}
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": json.dumps(body).encode()})

    async def client(self, call: Call) -> None:
        """A request at `call.at`, its client leaving `cancel_after` later (if ever), as
        the server hands it to the app; the server's task must end quietly."""
        await asyncio.sleep(call.at)
        exchange = self.exchanges[call.id] = Exchange([])
        gone = asyncio.Event()
        if call.cancel_after is not None:
            asyncio.get_running_loop().call_later(call.cancel_after, gone.set)

        async def receive() -> Message:  # (a bodiless request: only the disconnect)
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            exchange.messages.append(message)

        scope = {"type": "http", "headers": [], "call": call.id}
        try:
            await self.middleware(scope, receive, send)
        except BaseException as exc:
            exchange.raised = exc


def serving_problems(result: Run, exchanges: dict[int, Exchange]) -> Iterator[str]:
    """What the server saw: each request's response whole (but a client that left),
    its task ended quietly; every cancelled call counted as disconnected; the service
    closed."""
    cancelled = 0
    for call in result.program.calls:
        exchange = exchanges.get(call.id)
        outcomes = result.outcomes[call.id, 0]
        if exchange is None or not outcomes:
            continue
        if exchange.raised is not None:
            yield f"request {call.id}: the server's task raised {exchange.raised!r}"
        left = isinstance(outcomes[0], asyncio.CancelledError)
        cancelled += left
        types = [m["type"] for m in exchange.messages]
        status = exchange.messages[0].get("status") if exchange.messages else None
        # (the middleware may complete a cancelled request's response: 499, dropped)
        if left and types and status != 499:
            yield f"request {call.id}: its client left, yet it was answered: {status} {types}"
        if not left and types != ["http.response.start", "http.response.body"]:
            yield f"request {call.id} ({outcomes[0]!r}): sent {types}"
        if left and call.cancel_after is None:
            yield f"request {call.id}: cancelled, but its client never left"
    stats = result.proxy.stats
    if stats.disconnected != cancelled:
        yield f"stats: {stats.disconnected} disconnected, {cancelled} clients left"
    if not result.serving_closed:
        yield "the service did not end CLOSED"
