"""`Events`: each event of a proxy is counted in its stats and told to its listeners
once, in one step; and no other module writes a counter or calls a listener hook."""

from __future__ import annotations

import ast
import asyncio
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

import batchproxy
from batchproxy._events import Events
from batchproxy._listeners import Listeners
from batchproxy._stats import StatsRecorder

PACKAGE = Path(batchproxy.__file__).resolve().parent


class Heard(batchproxy.Listener):
    """Every hook call, as (hook, arguments after the proxy's name)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def request_queued(self, proxy: str, queue_depth: int) -> None:
        self.calls.append(("request_queued", (queue_depth,)))

    def request_rejected(self, proxy: str, count: int) -> None:
        self.calls.append(("request_rejected", (count,)))

    def request_shed(self, proxy: str) -> None:
        self.calls.append(("request_shed", ()))

    def request_deduplicated(self, proxy: str, cached: bool) -> None:
        self.calls.append(("request_deduplicated", (cached,)))

    def batch_started(self, proxy: str, size: int, queue_waits: Sequence[float]) -> None:
        self.calls.append(("batch_started", (size, list(queue_waits))))

    def batch_finished(
        self, proxy: str, size: int, model_seconds: float, error: BaseException | None
    ) -> None:
        self.calls.append(("batch_finished", (size, model_seconds, error)))

    def request_finished(self, proxy: str, outcome: str, seconds: float) -> None:
        self.calls.append(("request_finished", (outcome,)))

    def error(self, proxy: str, error: BaseException, size: int) -> None:
        self.calls.append(("error", (error, size)))

    def batch_timed_out(self, proxy: str, size: int, timeout: float) -> None:
        self.calls.append(("batch_timed_out", (size, timeout)))

    def batch_split(self, proxy: str, size: int, reason: str) -> None:
        self.calls.append(("batch_split", (size, reason)))


class Call:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.future: asyncio.Future[Any] = loop.create_future()
        self.enqueued_at = loop.time()


def counters(stats: StatsRecorder) -> dict[str, Any]:
    return {
        name: value
        for name, value in vars(stats).items()
        if isinstance(value, int) and not isinstance(value, bool) and value
    }


BOOM = RuntimeError("boom")

# (what happens, the counters it leaves, what the listeners hear)
CASES: list[tuple[str, Callable[[Events, Call], None], dict[str, int], list[tuple[str, Any]]]] = [
    ("queued", lambda e, c: e.request_queued(3), {"requests": 1}, [("request_queued", (3,))]),
    (
        "joined",
        lambda e, c: e.request_joined(),
        {"deduplicated": 1},
        [("request_deduplicated", (False,))],
    ),
    (
        "rejected",
        lambda e, c: e.requests_rejected(4),
        {"rejected": 4},
        [("request_rejected", (4,))],
    ),
    (
        "rejected for the tenant",
        lambda e, c: e.requests_rejected(2, per_tenant=True),
        {"rejected": 2, "tenant_rejected": 2},
        [("request_rejected", (2,))],
    ),
    ("shed", lambda e, c: e.request_shed(), {"shed": 1}, [("request_shed", ())]),
    (
        "batch started",
        lambda e, c: e.batch_started(2, [0.5, 0.25]),
        {"batches": 1, "items": 2},
        [("batch_started", (2, [0.5, 0.25]))],
    ),
    (
        "batch finished",
        lambda e, c: e.batch_finished(2, 0.125, None),
        {},
        [("batch_finished", (2, 0.125, None))],
    ),
    (
        "batch failed",
        lambda e, c: e.batch_failed(BOOM, 3),
        {"failed_batches": 1},
        [("error", (BOOM, 3))],
    ),
    (
        "batch timed out",
        lambda e, c: e.batch_timed_out(3, 1.5),
        {"timed_out_batches": 1},
        [("batch_timed_out", (3, 1.5))],
    ),
    (
        "split for memory",
        lambda e, c: e.batch_split(8, "oom"),
        {"oom_splits": 1},
        [("batch_split", (8, "oom"))],
    ),
    (
        "split to isolate",
        lambda e, c: e.batch_split(8, "isolation"),
        {"isolation_splits": 1},
        [("batch_split", (8, "isolation"))],
    ),
    ("failed", lambda e, c: e.failed(c), {"errors": 1}, [("request_finished", ("error",))]),
    (
        "timed out",
        lambda e, c: e.timed_out(c),
        {"timed_out": 1},
        [("request_finished", ("timed_out",))],
    ),
    (
        "stream ended",
        lambda e, c: e.stream_ended(c, c.enqueued_at),
        {"succeeded": 1},
        [("request_finished", ("succeeded",))],
    ),
    (
        "from the cache",
        lambda e, c: e.answered_from_cache(c),
        {"cache_hits": 1, "succeeded": 1},
        [("request_deduplicated", (True,)), ("request_finished", ("succeeded",))],
    ),
    (
        "cancelled",
        lambda e, c: e.cancelled(c),
        {"cancelled": 1},
        [("request_finished", ("cancelled",))],
    ),
    ("delivered", lambda e, c: e.delivered(3, 1, [0.1] * 4), {"succeeded": 3, "errors": 1}, []),
]


@pytest.mark.parametrize(
    ("event", "counted", "told"), [case[1:] for case in CASES], ids=[case[0] for case in CASES]
)
@pytest.mark.parametrize("listening", [True, False], ids=["listening", "no listener"])
async def test_each_event_is_counted_and_told_once(
    event: Callable[[Events, Call], None],
    counted: dict[str, int],
    told: list[tuple[str, Any]],
    listening: bool,
) -> None:
    events = Events(StatsRecorder("p"), Listeners("p"))
    heard = Heard()
    if listening:
        events.listeners.add(heard)
    event(events, Call(asyncio.get_running_loop()))
    assert counters(events.stats) == counted
    assert heard.calls == (told if listening else [])


def test_a_call_recounted_as_cancelled_moves_from_its_outcome_and_is_not_told_again() -> None:
    events = Events(StatsRecorder("p"), Listeners("p"))
    heard = Heard()
    events.listeners.add(heard)
    events.delivered(2, 1, [0.1] * 3)
    events.stats.timed_out += 1  # (as `timed_out` counts it)
    for outcome in ("succeeded", "error", "timed_out"):
        events.recounted_as_cancelled(outcome)
    assert counters(events.stats) == {"succeeded": 1, "cancelled": 3}
    assert heard.calls == []


def _writes_a_counter(node: ast.AST) -> bool:
    """`<...>.stats.<counter> += n` (or `-=`), or a `stats` local's."""
    if not isinstance(node, ast.AugAssign) or not isinstance(node.target, ast.Attribute):
        return False
    owner = node.target.value
    return (isinstance(owner, ast.Attribute) and owner.attr in ("stats", "_stats")) or (
        isinstance(owner, ast.Name) and owner.id == "stats"
    )


def _calls_a_hook(node: ast.AST) -> bool:
    """`<...>.listeners.<hook>(...)`, but adding and removing listeners."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
        return False
    owner = node.func.value
    return (
        isinstance(owner, ast.Attribute)
        and owner.attr in ("listeners", "_listeners")
        and node.func.attr not in ("add", "remove")
    )


def test_only_the_events_write_counters_and_call_listener_hooks() -> None:
    allowed = {"_events.py", "_stats.py", "_listeners.py"}
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if _writes_a_counter(node) or _calls_a_hook(node):
                found.append(f"{path.relative_to(PACKAGE)}: {ast.unparse(node)}")
    assert found == []
