"""The machinery of tests/failures/test_combinations.py: a drawn configuration, a drawn
program of calls, the models that answer with what they were given, one runner and one
oracle.

Every model result carries what it was computed from: `("out", item, key, tag)`, the
item, the batch key the model saw (`batch_key()`) and the per-batch argument `tag`
(`with_args(tag=...)`). A caller's identity is the same triple from its own side (its
item, the key its call had, the tag it asked for), so "caller i got result i" is an
equality. Every model call is recorded (its items, key, tag, the caller ids of the
contexts it saw, and how it ended), and the oracle checks the callers' outcomes, the
model calls and the stats against each other once the proxy is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import math
import os
import shutil
import tempfile
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st
from typing_extensions import override

import batchproxy
from batchproxy import Last
from batchproxy._tasks import current_batch
from batchproxy.host import ModelHost, RemoteProxy

EXAMPLES = int(os.environ.get("BATCHPROXY_COMBINATIONS", "0"))
"""How many examples each combination test runs (0: its CI default)."""

CALLER: contextvars.ContextVar[int | None] = contextvars.ContextVar("caller", default=None)
"""Set by each caller to its call id: what the model reads from `caller_contexts()`."""

PAD = "PAD"
"""The filler item (`pad_item`): never an item of a call."""

ITEMS: list[Hashable] = ["x", "x", "y", "bad", "boom", "oom", ("k", "x"), ("k", "y")]
"""Few, so dedup and the cache meet often; tuples that look like (key, item) pairs."""
KEYS: list[Hashable] = [None, "k", "j"]
TAGS = ["", "t"]
TENANTS: list[Hashable] = [None, "a", "b"]


HANG = "hang"
"""An item whose model call never returns (drawn only with a watchdog: `batch_timeout`)."""

LENGTHS: dict[Hashable, int] = {"x": 1, "y": 2, "bad": 1, "boom": 3, "oom": 2, HANG: 1}
"""Each item's cost for `length=` (a tuple: 4)."""


def item_length(item: Hashable) -> int:
    """The `length=` option: an item's cost, by `LENGTHS`."""
    return LENGTHS.get(item, 4)


def kinds() -> Any:
    """tests/_combination_kinds.py (which imports this module)."""
    import _combination_kinds

    return _combination_kinds


def key_option(item: Hashable) -> Hashable:
    """The `key=` option: a tuple item's first element, else None."""
    return item[0] if isinstance(item, tuple) else None


Identity = tuple[Hashable, Hashable, str]
"""(item, batch key, tag): what a result must have been computed from."""


def answer(items: Sequence[Hashable], key: Hashable, tag: str) -> list[Any]:
    """What every model here answers: one result per item that carries its inputs;
    "bad" gets a `ValueError` in its slot, "boom" makes the call raise, and "oom"
    makes a call of more than one item (filler aside) run out of memory."""
    if "boom" in items:
        raise RuntimeError("boom")
    if "oom" in items and len([item for item in items if item != PAD]) > 1:
        raise MemoryError("oom")
    return [
        ValueError("bad", item, key, tag) if item == "bad" else ("out", item, key, tag)
        for item in items
    ]


@dataclass
class ModelCall:
    """One call of the model, as the model saw it."""

    items: list[Hashable]
    key: Hashable
    tag: str
    contexts: list[int | None] | None  # the caller ids of `caller_contexts()`, if on
    raised: str | None = None  # "boom" or "oom"
    done: bool = False  # the model returned or raised
    batch: object = None  # the batch task it ran in (`current_batch`)
    started: float = 0.0  # the loop's time when it began (the caller's loop)
    hung: bool = False  # it held a "hang" item: it never returns
    abandoned: bool = False  # ... and was cancelled (by the watchdog or a shutdown)


class Log:
    """What the models saw: every call, and anything that broke inside a model."""

    def __init__(self) -> None:
        self.calls: list[ModelCall] = []
        self.loop: asyncio.AbstractEventLoop | None = None

    def record(
        self, items: list[Hashable], tag: str, contexts: bool, *, arguments: bool = False
    ) -> ModelCall:
        """A model call on `items`: its batch key is `batch_key()`, but for a model with
        arguments (whose batch key is its arguments: the tag, recorded on its own)."""
        seen = None
        if contexts:
            seen = [context.get(CALLER) for context in batchproxy.caller_contexts()]
        key = None if arguments else batchproxy.batch_key()
        call = ModelCall(list(items), key, tag, seen, batch=current_batch.get())
        call.started = self.clock()
        self.calls.append(call)
        return call

    def clock(self) -> float:
        """The time on the loop the calls are made on (set by the run)."""
        return self.loop.time() if self.loop is not None else 0.0

    async def model(self, call: ModelCall, delay: float) -> list[Any]:
        """What every async model here does with a call: hang on a "hang" item (until
        cancelled), else take `delay`, then answer."""
        if HANG in call.items:
            await self.hang(call)
        if delay:
            await asyncio.sleep(delay)
        return self.answer(call)

    async def hang(self, call: ModelCall) -> None:
        call.hung = True
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            call.abandoned = True
            raise
        finally:
            call.done = True
        raise AssertionError("a hung model call ran for an hour")

    def running(self, identity: Identity) -> bool:
        """Whether a model call on `identity` is under way."""
        return any(
            not c.done and (item, c.key, c.tag) == identity for c in self.calls for item in c.items
        )

    def answer(self, call: ModelCall) -> list[Any]:
        try:
            return answer(call.items, call.key, call.tag)
        except MemoryError:
            call.raised = "oom"
            raise
        except RuntimeError:
            call.raised = "boom"
            raise
        finally:
            call.done = True


class Plain(batchproxy.Proxy[Hashable, Any]):
    """An async model on the loop (or a `WorkerThread` with `offload=`)."""

    def __init__(self, log: Log, delay: float, **options: Any) -> None:
        super().__init__(**options)
        self.log, self.delay = log, delay

    @override
    async def _inference(self, items: list[Hashable]) -> Sequence[Any]:
        call = self.log.record(items, "", self.options.caller_context)
        return await self.log.model(call, self.delay)


class Tagged(batchproxy.Proxy[Hashable, Any]):
    """An async model with a per-batch argument: `with_args(tag=...)`."""

    def __init__(self, log: Log, delay: float, **options: Any) -> None:
        super().__init__(**options)
        self.log, self.delay = log, delay

    @override
    async def _inference(  # a per-batch argument
        self, items: list[Hashable], /, *, tag: str = ""
    ) -> Sequence[Any]:
        call = self.log.record(items, tag, self.options.caller_context, arguments=True)
        return await self.log.model(call, self.delay)


class Streaming(batchproxy.Proxy[Hashable, Any]):
    """A streaming model: two chunks per item, `("c0", ...)` then `Last(("out", ...))`."""

    def __init__(self, log: Log, delay: float, **options: Any) -> None:
        super().__init__(**options)
        self.log, self.delay = log, delay

    @override
    async def _inference(  # a generator: one list per step; sent: the positions kept
        self, items: list[Hashable]
    ) -> AsyncGenerator[list[Any], list[int]]:
        call = self.log.record(items, "", self.options.caller_context)
        left = list(items)
        keep = yield [("c0", item, call.key, "") for item in left]
        left = [left[i] for i in keep]
        if HANG in left:  # (its second step: the watchdog bounds each step)
            await self.log.hang(call)
        if self.delay:
            await asyncio.sleep(self.delay)
        step = ModelCall(left, call.key, "", None)
        try:
            results = self.log.answer(step)
        finally:
            call.raised = step.raised
        yield [r if isinstance(r, Exception) else Last(r) for r in results]


def decorated(model: str, log: Log, delay: float, **options: Any) -> Any:
    """The same models as decorated functions: `@batch` ("batch", like `Plain`) and
    `@batch_args` ("args", like `Tagged`: the per-batch argument `tag`)."""
    contexts = bool(options.get("caller_context"))
    if model == "batch":

        @batchproxy.batch(**options)
        async def plain(items: list[Hashable]) -> Sequence[Any]:
            call = log.record(items, "", contexts)
            return await log.model(call, delay)

        return plain

    @batchproxy.batch_args(**options)
    async def tagged(items: list[Hashable], /, *, tag: str = "") -> Sequence[Any]:
        call = log.record(items, tag, contexts, arguments=True)
        return await log.model(call, delay)

    return tagged


def process_model() -> Callable[[list[Hashable]], list[Any]]:
    """A `ProcessWorkers` factory: `answer` in a worker process (which sees no batch
    key, so such runs use none)."""
    return lambda items: answer(items, None, "")


@dataclass(frozen=True)
class Config:
    """The proxy's options and how it is made."""

    model: str  # "plain", "tagged" (with_args), "streaming", "process" (ProcessWorkers),
    # "batch" (@batch) or "args" (@batch_args); "generation", "tensor" or "ray"
    # (tests/_combination_kinds.py)
    options: dict[str, Any]
    keys: bool  # calls may pass key=
    offload: bool  # a WorkerThread runs the model
    delay: float  # the model's own time per call
    remote: bool = False  # served by a ModelHost, called through a RemoteProxy
    # -- the options of issue 38 item 3 (`option_extras`) --
    real_time: bool = False  # run in real time: a batch may overrun its watchdog by load
    # -- the run kinds of tests/_combination_kinds.py ("generation", "tensor", "ray")
    kind_options: dict[str, Any] = field(default_factory=dict)  # a kind's own options
    # -- issue 40 item 1: "with": entered by `with front:` from a plain thread, so it
    # runs on the process's `with` loop and only threads call it; "async": `start()`
    entry: str = "async"

    @property
    def hangs(self) -> bool:
        """Whether calls may hold a "hang" item: with a watchdog, on a model that can be
        abandoned (not one in a worker process, whose model is not async)."""
        return self.options.get("batch_timeout") is not None and self.model != "process"

    @property
    def elsewhere(self) -> bool:
        """Whether the model runs in another process (its calls are not in the log)."""
        return self.model in ("process", "ray")

    @property
    def arguments(self) -> bool:
        """Whether the model takes the per-batch argument `tag` (its batch key)."""
        return self.model in ("tagged", "args")

    def make(self, log: Log) -> tuple[batchproxy.Proxy[Hashable, Any], Any]:
        """The proxy, and what the calls go through: the proxy, or the decorated
        function."""
        if self.model in kinds().MODELS:
            return kinds().make(self, log)  # type: ignore[no-any-return]
        if self.model == "process":
            workers = batchproxy.ProcessWorkers(process_model, 1, name="combinations")
            proxy = batchproxy.Proxy(offload=workers, name="combo", **self.options)
            return proxy, proxy
        offload = batchproxy.WorkerThread(name="combinations") if self.offload else False
        if self.model in ("batch", "args"):
            front = decorated(
                self.model, log, self.delay, offload=offload, name="combo", **self.options
            )
            return front.proxy, front
        cls = {"plain": Plain, "tagged": Tagged, "streaming": Streaming}[self.model]
        proxy = cls(log, self.delay, offload=offload, name="combo", **self.options)
        return proxy, proxy

    @property
    def limited(self) -> bool:
        o = self.options
        return o.get("max_queue_size") is not None or o.get("max_queue_size_per_tenant") is not None


@dataclass(frozen=True)
class Call:
    """One call of the program."""

    id: int
    at: float
    form: str  # "inference", "many", "stream", "submit", "sync", "many_sync"
    items: tuple[Hashable, ...]  # one, but for "many"
    key: Hashable
    tag: str
    tenant: Hashable
    priority: int
    timeout: float | None
    cancel_after: float | None

    def identity(self, config: Config, item: Hashable) -> Identity:
        key = self.key
        if key is None and config.options.get("key") is not None:
            key = key_option(item)
        if config.arguments:  # the batch key is the arguments: the tag
            return item, None, self.tag
        return item, key, self.tag


@dataclass(frozen=True)
class Program:
    calls: list[Call]
    configure_at: float | None = None
    changes: dict[str, Any] = field(default_factory=dict)
    close_at: float | None = None


# -- strategies ---------------------------------------------------------------------------


@st.composite
def configs(
    draw: st.DrawFn,
    *,
    threads: bool = False,
    processes: bool = False,
    remote: bool = False,
    entry: str = "async",
) -> Config:
    models = ["plain", "plain", "tagged", "streaming", "batch", "args"]
    if entry == "with":  # (a stream is read on the proxy's loop: not from a thread)
        models = ["plain", "plain", "tagged", "batch", "args"]
    if remote:  # (a host serves a proxy's calls: no per-batch arguments, no decorator)
        models = ["plain", "plain", "streaming"]
    model = "process" if processes else draw(st.sampled_from(models))
    batch_size = draw(st.integers(1, 8))
    options: dict[str, Any] = {
        "batch_size": batch_size,
        "max_delay_ms": draw(st.sampled_from([0.0, 1.0, 5.0])),
        "max_concurrent_batches": draw(st.sampled_from([None, 1, 2])),
        "max_queue_size": draw(st.sampled_from([None, 1, 2, 3, 10])),
        "max_queue_size_per_tenant": draw(st.none() | st.integers(1, 4)),
        "tenant_weights": draw(st.none() | st.just({"a": 3.0, "b": 0.5})),
        "aging_ms": draw(st.none() | st.sampled_from([1.0, 10.0])),
        # small calls ahead of bulk ones: an inference_many of 2 or 3 items is bulk at 1
        "bulk_threshold": draw(st.sampled_from([None, 1, 2, 64])),
        # (a model in another process, or behind a host, runs in no caller's context)
        "caller_context": model != "process" and not remote and draw(st.booleans()),
    }
    if model != "streaming":
        options["isolate_errors"] = draw(st.booleans())
        options["oom_backoff"] = draw(st.booleans())
        dedup = draw(st.booleans())
        if dedup:
            cache_size = draw(st.none() | st.integers(1, 4))
            cache_ttl = None
            if cache_size is not None:
                cache_ttl = draw(st.none() | st.sampled_from([0.005, 1.0]))
            options["dedup"] = batchproxy.Dedup(cache_size=cache_size, cache_ttl=cache_ttl)
        sizes = draw(st.sampled_from(["any", "cut", "pad"]))
        if sizes == "cut":
            options["batch_sizes"] = draw(st.sampled_from([(1, 2, 4, 8), (1, 3)]))
        elif sizes == "pad":
            padded = (2, 4, 8) if batch_size >= 2 else (1, 4, 8)
            options["batch_sizes"] = batchproxy.BatchSizes(padded, pad_item=PAD)
    keyable = model not in ("tagged", "args", "process")  # (the arguments are the key)
    keys = keyable and draw(st.booleans())
    if keyable and draw(st.booleans()):
        options["key"] = key_option
    offload = threads and model not in ("streaming", "process") and draw(st.booleans())
    delay = draw(st.sampled_from([0.0, 0.001, 0.01]))
    real_time = threads or processes or remote
    options.update(draw(option_extras(real_time)))
    return Config(model, options, keys, offload, delay, remote, real_time, entry=entry)


WATCHDOG_SECONDS = (0.5, 1.0)
"""A watchdog's seconds on the virtual clock: more than any batch but a hung one takes
(a batch of 8 re-run down to single items takes 15 model calls of 10 ms at most)."""

WATCHDOG_SECONDS_REAL = (0.2,)
"""... and in real time (where a batch may overrun them on a loaded machine: the oracle
then allows a `BatchTimeout` to any call)."""


@st.composite
def option_extras(draw: st.DrawFn, real_time: bool) -> dict[str, Any]:
    """The options of issue 38 item 3, drawn apart from the rest: `length` with
    `max_batch_tokens`, `window`, `shed_late`, and a `batch_timeout` (a `Watchdog`
    serving on or stopping), which puts "hang" items in the calls."""
    options: dict[str, Any] = {}
    if draw(st.booleans()):
        options["length"] = item_length
        options["max_batch_tokens"] = draw(st.none() | st.sampled_from([2, 4, 6]))
    options["window"] = draw(st.sampled_from(["adaptive", "fixed"]))
    options["shed_late"] = draw(st.booleans())
    if draw(st.integers(0, 2)) == 0:  # one in three
        seconds = draw(st.sampled_from(WATCHDOG_SECONDS_REAL if real_time else WATCHDOG_SECONDS))
        on_timeout = draw(st.sampled_from(["serve", "serve", "stop"]))
        options["batch_timeout"] = batchproxy.Watchdog(seconds, on_timeout=on_timeout)
    return options


def option_changes(config: Config) -> dict[str, Any]:
    """What `configure()` may change of `option_extras`' options (a watchdog's seconds
    alone, keeping what it does; never one removed while calls may hang)."""
    seconds = WATCHDOG_SECONDS_REAL if config.real_time else WATCHDOG_SECONDS
    changes: dict[str, Any] = {
        "window": st.sampled_from(["adaptive", "fixed"]),
        "shed_late": st.booleans(),
    }
    if config.options.get("batch_timeout") is not None:
        changes["batch_timeout"] = st.sampled_from(seconds)
    return changes


@st.composite
def programs(draw: st.DrawFn, config: Config, horizon: float, *, threads: bool = False) -> Program:
    forms = ["inference", "inference", "many"]
    if config.model in ("streaming", "generation"):
        forms = ["stream"]
    elif config.model == "args":  # (its inference_many has no return_exceptions)
        forms = ["inference"] + ["sync"] * threads
    elif config.model == "batch":  # (a decorated function has no submit)
        forms += ["sync"] * threads
    elif threads:  # (a stream is read on the loop)
        forms += ["submit", "sync"]
    if config.entry == "with":  # on the `with` loop: called from plain threads only
        # (`@batch_args`' forms take its arguments in `sync` alone; neither its
        # `inference_many` nor `inference_many_sync` has `return_exceptions`)
        forms = ["sync"] if config.model == "args" else ["submit", "sync", "many_sync"]
    n = draw(st.integers(1, 24))
    items = [*ITEMS, HANG] if config.hangs else ITEMS
    arrivals = [0.0, 0.0, horizon / 20, horizon / 4, horizon / 2]
    if config.options.get("shed_late"):  # late ones too: once the cost model has a line
        arrivals += [k * horizon for k in (1, 2, 3, 4, 5, 6)]
    calls = []
    for i in range(n):
        form = draw(st.sampled_from(forms))
        count = draw(st.integers(1, 3)) if form in ("many", "many_sync") else 1
        calls.append(
            Call(
                id=i,
                at=draw(st.sampled_from(arrivals)),
                form=form,
                items=tuple(draw(st.lists(st.sampled_from(items), min_size=count, max_size=count))),
                key=draw(st.sampled_from(KEYS)) if config.keys else None,
                tag=draw(st.sampled_from(TAGS)) if config.arguments else "",
                tenant=draw(st.sampled_from(TENANTS)),
                priority=draw(st.sampled_from([0, 0, 1])),
                timeout=draw(st.none() | st.sampled_from([0.002, horizon])),
                # a thread's call is not cancelled from the loop
                cancel_after=None
                if form in ("submit", "sync", "many_sync")
                else draw(st.none() | st.sampled_from([0.0, 0.003])),
            )
        )
    configure_at = draw(st.none() | st.sampled_from([0.0, horizon / 4]))
    changes: dict[str, Any] = {}
    if configure_at is not None and config.model == "generation":
        changes = draw(kinds().GENERATION_CHANGES)
    elif configure_at is not None:
        changes = draw(
            st.fixed_dictionaries(
                {},
                optional={
                    "max_delay_ms": st.sampled_from([0.0, 2.0]),
                    "max_queue_size": st.none() | st.integers(1, 6),
                    "batch_size": st.integers(1, 8),
                    "aging_ms": st.none() | st.just(5.0),
                    "bulk_threshold": st.none() | st.just(1),
                    "tenant_weights": st.none() | st.just({"b": 2.0}),
                    "max_queue_size_per_tenant": st.none() | st.integers(1, 3),
                    **option_changes(config),
                },
            )
        )
    close_at = draw(st.none() | st.sampled_from([0.0, horizon / 4, horizon]))
    return Program(calls, configure_at, changes, close_at)


# -- the run ------------------------------------------------------------------------------

NEVER_CALLED = "cancelled before calling"


@dataclass
class Run:
    """What happened: per call, its outcomes (one per item; a list, to see doubles)."""

    config: Config
    program: Program
    proxy: batchproxy.Proxy[Hashable, Any]
    log: Log
    outcomes: dict[tuple[int, int], list[Any]]
    closed_at: float | None = None
    configured: bool = False
    joinable_refused: list[str] = field(default_factory=list)
    max_batch_size: int = 0
    ended_at: dict[tuple[int, int], float] = field(default_factory=dict)  # per item, on the loop
    drain_timeout: float | None = None  # the drain's deadline (the Serving walk's)
    serving_closed: bool = False  # the Serving walk's service ended CLOSED


class Queued:
    """Which identities surely wait in the queue (for "a call that only joins a queued
    identical call is never refused"): a caller with no deadline nor cancel, admitted
    while no model call on its identity was under way, until the model is called on
    its identity or the caller ends."""

    def __init__(self, log: Log, result: Run) -> None:
        self.log = log
        self.result = result
        self.since: dict[Identity, int] = {}  # identity -> model calls made before it

    def joinable(self, identities: list[Identity]) -> bool:
        """Whether a call on `identities`, now, only joins queued identical calls."""
        calls = self.log.calls
        for identity, mark in list(self.since.items()):
            if any((item, c.key, c.tag) == identity for c in calls[mark:] for item in c.items):
                del self.since[identity]  # sent to the model since
        return all(i in self.since and i[0] != PAD for i in identities)

    def calling(self, call: Call, identities: list[Identity]) -> None:
        """`call` is about to be made: once admitted (a step later), its identities
        wait in the queue, if they surely do."""
        plain = call.timeout is None and call.cancel_after is None and call.form == "inference"
        if plain and not any(map(self.log.running, identities)):  # not joining a run
            asyncio.get_running_loop().call_soon(
                self._admitted, call, identities, len(self.log.calls)
            )

    def _admitted(self, call: Call, identities: list[Identity], mark: int) -> None:
        if not self.result.outcomes[call.id, 0]:  # not refused
            for identity in identities:
                self.since.setdefault(identity, mark)

    def ended(self, call: Call, identities: list[Identity]) -> None:
        if call.timeout is None and call.cancel_after is None:
            for identity in identities:
                self.since.pop(identity, None)


async def run(config: Config, program: Program) -> Run:
    """Run `program` against a proxy made from `config`, in the running loop; close it."""
    log = Log()
    proxy, front = config.make(log)
    if config.entry == "with":  # `with front:` in a plain thread: on the `with` loop
        await asyncio.to_thread(front.__enter__)
        bound = proxy._binder.current
        assert bound is not None
        assert bound.loop is not asyncio.get_running_loop()
        try:  # (`run_on` closes it from this loop; the exit drains again and ends it)
            return await run_on(config, program, proxy, front, log)
        finally:
            await asyncio.to_thread(front.__exit__, None, None, None)
    await proxy.start()  # here: a thread's first call would start it on a loop of its own
    async with contextlib.AsyncExitStack() as stack:
        if config.remote:
            front = await stack.enter_async_context(served_by_a_host(proxy))
        return await run_on(config, program, proxy, front, log)
    raise AssertionError("unreachable")  # (mypy: the stack may swallow an exception)


@contextlib.asynccontextmanager
async def served_by_a_host(proxy: batchproxy.Proxy[Hashable, Any]) -> AsyncIterator[RemoteProxy]:
    """`proxy` served by a `ModelHost` in this process; the `RemoteProxy` to call it by.
    Closed after: the client, the host, and the `BackgroundLoop` threads called by."""
    folder = tempfile.mkdtemp(prefix="bp-combo-", dir="/tmp")
    path = os.path.join(folder, "m.sock")
    try:
        async with ModelHost(proxy, path, drain_timeout=None), RemoteProxy(path) as remote:
            yield remote
    finally:
        await asyncio.to_thread(batchproxy.BackgroundLoop.default().close)
        shutil.rmtree(folder, ignore_errors=True)


async def run_on(
    config: Config, program: Program, proxy: batchproxy.Proxy[Hashable, Any], front: Any, log: Log
) -> Run:
    result = Run(config, program, proxy, log, {})
    result.max_batch_size = config.options["batch_size"]
    loop = log.loop = asyncio.get_running_loop()
    queued = Queued(log, result)
    # (through a host, a call is admitted some steps after it is made: the tracker of
    # which calls surely wait in the queue cannot follow it there)
    dedup = bool(config.options.get("dedup")) and not config.remote
    for call in program.calls:
        for index in range(len(call.items)):
            result.outcomes[call.id, index] = []

    def settle(call: Call, outcome: Any, index: int | None = None) -> None:
        for i in range(len(call.items)) if index is None else [index]:
            result.outcomes[call.id, i].append(outcome)
            result.ended_at.setdefault((call.id, i), loop.time())

    async def caller(call: Call) -> None:
        CALLER.set(call.id)
        try:
            await asyncio.sleep(call.at)
        except asyncio.CancelledError:
            settle(call, NEVER_CALLED)
            raise
        identities = [call.identity(config, item) for item in call.items]
        joinable = dedup and queued.joinable(identities)
        if dedup:
            queued.calling(call, identities)
        try:
            await one_call(front, call, settle)
        except batchproxy.QueueFull as exc:
            if joinable:
                result.joinable_refused.append(f"call {call.id} ({call.form}): {exc}")
            raise
        except batchproxy.DeadlineExceeded as exc:
            if joinable and exc.predicted is not None:  # shed, though it adds no work
                result.joinable_refused.append(f"call {call.id} ({call.form}) shed: {exc}")
            raise
        finally:
            queued.ended(call, identities)

    tasks = []
    helpers = []
    for call in program.calls:
        task = asyncio.create_task(caller(call))
        tasks.append(task)
        if call.cancel_after is not None:
            helpers.append(asyncio.create_task(cancel(task, call.at + call.cancel_after)))
    if program.configure_at is not None:
        helpers.append(asyncio.create_task(configure(result, program.configure_at)))
    if program.close_at is not None:
        helpers.append(asyncio.create_task(close(result, program.close_at)))
    done = await asyncio.gather(*tasks, *helpers, return_exceptions=True)
    for call, outcome in zip(program.calls, done, strict=False):  # (then the helpers)
        for index in range(len(call.items)):
            if not result.outcomes[call.id, index]:
                settle(call, outcome, index)  # ended outside `one_call`
    await proxy.aclose()
    if config.offload or config.elsewhere:  # not the proxy's to close
        await proxy._executor.aclose()
    return result


async def cancel(task: asyncio.Task[None], after: float) -> None:
    await asyncio.sleep(after)
    task.cancel()


async def configure(result: Run, at: float) -> None:
    """`configure()` under load (a change it refuses changes nothing)."""
    await asyncio.sleep(at)
    try:
        result.proxy.configure(**result.program.changes)
    except (ValueError, TypeError):
        return
    result.configured = True
    result.max_batch_size = max(result.max_batch_size, result.proxy.options.batch_size)


async def close(result: Run, at: float) -> None:
    """`aclose()` mid-flight."""
    await asyncio.sleep(at)
    result.closed_at = at
    await result.proxy.aclose()


async def one_call(
    front: Any,
    call: Call,
    settle: Callable[[Call, Any, int | None], None],
) -> None:
    """Make `call` in its form through `front` (a proxy, or a decorated function);
    record each item's outcome (an exception, or a result)."""
    target: Any = front
    keywords: dict[str, Any] = {
        "timeout": call.timeout,
        "priority": call.priority,
        "tenant": call.tenant,
    }
    arguments: dict[str, Any] = {}
    if isinstance(front, batchproxy.BatchedArgs):  # f(item, tag=...), options apart
        target = front.with_call_options(**keywords)
        keywords, arguments = {}, {"tag": call.tag}
    elif call.tag:
        target = front.with_args(tag=call.tag)
    elif call.key is not None:
        keywords["key"] = call.key
    item = call.items[0]
    try:
        if call.form == "inference" and isinstance(front, batchproxy.Batched):
            settle(call, await target(item, **keywords, **arguments), None)
        elif call.form == "inference":
            settle(call, await target.inference(item, **keywords), None)
        elif call.form == "many":
            results = await target.inference_many(call.items, return_exceptions=True, **keywords)
            for index, outcome in enumerate(results):
                settle(call, outcome, index)
        elif call.form == "stream":
            chunks = []
            async with contextlib.aclosing(front.stream(item, **keywords)) as stream:
                async for chunk in stream:
                    chunks.append(chunk)
            settle(call, tuple(chunks), None)
        elif call.form == "submit":
            future = await asyncio.to_thread(target.submit, item, **keywords)  # from a thread
            settle(call, await asyncio.wrap_future(future), None)
        elif call.form == "sync":
            answer = await asyncio.to_thread(target.inference_sync, item, **keywords, **arguments)
            settle(call, answer, None)
        elif call.form == "many_sync":
            results = await asyncio.to_thread(
                target.inference_many_sync, call.items, return_exceptions=True, **keywords
            )
            for index, outcome in enumerate(results):
                settle(call, outcome, index)
        else:
            raise AssertionError(call.form)
    except Exception as exc:
        settle(call, exc, None)
        raise
    except asyncio.CancelledError as exc:
        settle(call, exc, None)
        raise


# -- the oracle ---------------------------------------------------------------------------


def check(result: Run) -> None:
    """Every promise, for one run (see the test module's docstring)."""
    # unsure: maybe never accepted; cancelled: callers who saw CancelledError
    # guarded: a thread's call that its own wait ended (DeadlineExceeded), maybe refused
    counts = {
        "rejected": 0,
        "refused": 0,
        "unsure": 0,
        "cancelled": 0,
        "timed_out": 0,
        "guarded": 0,
    }
    problems = [
        *model_calls_problems(result),
        *callers_problems(result, counts),
        *stats_problems(result, counts),
        *option_problems(result, counts),
        *kinds().problems(result),
    ]
    if problems:
        problems.append("model calls (items, key, tag, contexts, raised, started, hung):")
        problems += [
            f"  {c.items} {c.key!r} {c.tag!r} {c.contexts} {c.raised} {c.started:.4f}"
            f"{' hung' if c.hung else ''}"
            for c in result.log.calls
        ]
    assert not problems, "\n".join(problems)


def model_calls_problems(result: Run) -> Iterator[str]:
    """Every model call has an allowed size, and sees its own items' contexts, in order."""
    config = result.config
    sizes = config.options.get("batch_sizes")
    sizes = getattr(sizes, "sizes", sizes)  # a BatchSizes, or the sizes alone
    calls_by_id = {call.id: call for call in result.program.calls}
    for number, model_call in enumerate(result.log.calls):
        size = len(model_call.items)
        if not 1 <= size <= result.max_batch_size:
            yield f"model call {number} has {size} items: {model_call.items}"
        if sizes is not None and config.model != "streaming" and size not in sizes:
            yield f"model call {number} of {size} items: not in {sizes}"
        # (each run kind measures its items its own way: _combination_kinds.cost)
        budget = config.options.get("max_batch_tokens")
        real = [item for item in model_call.items if item != PAD]
        cost = kinds().cost(config)
        if budget is not None and cost is not None and len(real) > 1:  # (one over it: alone)
            tokens = len(real) * max(map(cost, real))
            if tokens > budget:
                yield f"model call {number} on {real}: {tokens} tokens, over {budget}"
        if model_call.contexts is None:
            continue
        if len(model_call.contexts) != size:
            yield (
                f"model call {number} on {size} items saw {len(model_call.contexts)} "
                f"contexts: {model_call.items} / {model_call.contexts}"
            )
        for item, caller in zip(model_call.items, model_call.contexts, strict=False):
            owner = calls_by_id.get(caller) if caller is not None else None
            seen = (item, model_call.key, model_call.tag)
            if item != PAD and (
                owner is None or seen not in {owner.identity(config, i) for i in owner.items}
            ):
                yield (
                    f"model call {number} on {model_call.items} (key {model_call.key!r}) "
                    f"saw call {caller}'s context "
                    f"({owner.items if owner else None}, key {owner.key if owner else None!r})"
                    f" for item {item!r}"
                )


def callers_problems(result: Run, counts: dict[str, int]) -> Iterator[str]:
    """Every call ended once, with its own result or an error its story explains."""
    ran: dict[Identity, list[ModelCall]] = {}
    for model_call in result.log.calls:
        for item in model_call.items:
            ran.setdefault((item, model_call.key, model_call.tag), []).append(model_call)
    for call in result.program.calls:
        for index, item in enumerate(call.items):
            outcomes = result.outcomes[call.id, index]
            where = f"call {call.id} ({call.form} of {item!r}, key {call.key!r}, tag {call.tag!r})"
            if len(outcomes) != 1:
                yield f"{where} ended {len(outcomes)} times: {outcomes}"
                continue
            problem = explain(result, call, item, outcomes[0], ran, counts)
            if problem:
                yield f"{where}: {problem}"
    yield from result.joinable_refused


def stats_problems(result: Run, counts: dict[str, int]) -> Iterator[str]:
    """The stats add up, to each other and to what the callers and the model saw."""
    log = result.log
    stats = result.proxy.stats
    ended = stats.succeeded + stats.errors + stats.timed_out + stats.cancelled
    if stats.requests != ended:
        yield f"stats: requests {stats.requests} != ended {ended}: {stats}"
    if stats.queue_depth or stats.in_flight:
        yield f"stats: still queued or running: {stats}"
    # (through a host, a caller cancelled on its way may miss the refusal it caused; a
    # thread's guard may end its wait inside the very step that refuses its call)
    slack = counts["guarded"] + (counts["cancelled"] if result.config.remote else 0)
    if not counts["rejected"] <= stats.rejected <= counts["rejected"] + slack:
        yield f"stats: rejected {stats.rejected}, callers saw {counts['rejected']}"
    items = sum(1 for c in log.calls for i in c.items if i != PAD)
    # (a batch counts its items as it starts; one the watchdog abandoned in its first
    # cut never ran the others; a step of a generation counts its active sequences; a
    # tensor model never sees the items its validation fails)
    abandoned = stats.timed_out_batches and result.config.options.get("batch_sizes")
    unseen = ("streaming", "process", "ray", "generation", "tensor")
    if result.config.model not in unseen and stats.items > items and not abandoned:
        yield f"stats: {stats.items} items, the model saw {items}"
    total = sum(len(call.items) for call in result.program.calls)
    accepted = total - counts["refused"] - counts["rejected"]
    if not accepted - counts["unsure"] <= stats.requests <= accepted:
        yield (
            f"stats: {stats.requests} accepted, callers saw {accepted} "
            f"({counts['unsure']} of them maybe never accepted): {result.outcomes}"
        )


def explain(
    result: Run,
    call: Call,
    item: Hashable,
    outcome: Any,
    ran: dict[Identity, list[ModelCall]],
    counts: dict[str, int],
) -> str | None:
    """Why `outcome` is wrong for this item of `call`, or None when it is right."""
    config = result.config
    options = config.options
    identity = call.identity(config, item)
    key, tag = identity[1], identity[2]
    expected = ("out", item, key, tag)
    if outcome is NEVER_CALLED:
        counts["refused"] += 1
        return None
    if isinstance(outcome, tuple):
        if call.form == "stream" and config.model in ("streaming", "generation"):
            want = (("c0", item, key, tag), expected)
            return None if outcome == want else f"got chunks {outcome}, want {want}"
        if outcome != expected:
            return f"cross-talk: got {outcome}, want {expected}"
        if item in ("bad", "boom"):
            return f"{item!r} succeeded: {outcome}"
        return None
    if isinstance(outcome, batchproxy.QueueFull):
        counts["rejected"] += 1
        return None if config.limited or result.configured else f"refused: {outcome!r}"
    if isinstance(outcome, batchproxy.DrainDeadline):
        return drain_cut(result, call, item, outcome)
    if isinstance(outcome, batchproxy.ProxyClosed) and stopped(result, call, item):
        counts["unsure"] += 1  # queued when the watchdog stopped the proxy, or refused
        return None
    if isinstance(outcome, batchproxy.ProxyClosed):
        counts["refused"] += 1
        return None if result.closed_at is not None else f"closed: {outcome!r}"
    if isinstance(outcome, batchproxy.DeadlineExceeded) and outcome.predicted is not None:
        counts["unsure"] += 1  # shed (an inference_many's items before it were accepted)
        if not sheds(result):
            return f"shed without shed_late: {outcome!r}"
        if call.timeout is None:
            return f"shed without a timeout: {outcome!r}"
        # (through a host, the proxy's timeout is the time left when the call arrived)
        left = outcome.timeout
        given = left <= call.timeout if config.remote else left == call.timeout
        if not (outcome.predicted > left and given):
            return f"shed, but expected within its timeout {call.timeout}: {outcome!r}"
        return None
    if isinstance(outcome, batchproxy.BatchTimeout):
        counts["timed_out"] += 1
        return overran(result, call, item, identity, ran)
    if isinstance(outcome, batchproxy.DeadlineExceeded):
        # its deadline may pass on the way to a host; a thread's own wait (its timeout
        # + 0.5 s, `inference_sync`'s guard against a loop too busy to answer) may end
        # before that busy loop admitted the call
        counts["guarded"] += (guarded := call.form in ("sync", "many_sync"))
        counts["unsure"] += config.remote or guarded
        return None if call.timeout is not None else f"timed out: {outcome!r}"
    if isinstance(outcome, asyncio.CancelledError):
        # a caller cancelled as it called, on a closed proxy, may not have been accepted;
        # through a host, one cancelled on its way may never have arrived
        counts["unsure"] += result.closed_at is not None or config.remote
        counts["cancelled"] += 1
        return None if call.cancel_after is not None else f"cancelled: {outcome!r}"
    if isinstance(outcome, ValueError) and outcome.args[:1] == ("bad",):
        if outcome.args != ("bad", item, key, tag):
            return f"cross-talk: got {outcome!r} for {identity}"
        return None
    decided, problem = kinds().explain(config, call, item, outcome, counts)
    if decided:
        return problem
    if config.elsewhere:  # a worker process's model calls are not seen from here
        reruns = options.get("isolate_errors") or options.get("oom_backoff")
        if isinstance(outcome, RuntimeError) and str(outcome) == "boom":
            return None if item == "boom" or not options.get("isolate_errors") else "boom"
        if isinstance(outcome, MemoryError):
            return None if not reruns else f"{outcome!r} with isolate_errors or oom_backoff"
    runs = ran.get(identity, [])
    if isinstance(outcome, RuntimeError) and str(outcome) == "boom":
        if not any(c.raised == "boom" for c in runs):
            return f"{outcome!r}, but no model call with it raised"
        if options.get("isolate_errors") and item != "boom":
            return f"{outcome!r} with isolate_errors"
        return None
    if isinstance(outcome, MemoryError):
        if not any(c.raised == "oom" for c in runs):
            return f"{outcome!r}, but no model call with it ran out of memory"
        if any(len(c.items) > 1 for c in runs if c.raised == "oom") and (
            options.get("isolate_errors") or options.get("oom_backoff")
        ):
            return f"{outcome!r} with isolate_errors or oom_backoff"
        return None
    return f"unexpected outcome {outcome!r}"


# -- the oracle of issue 38 item 3's options ----------------------------------------------


def sheds(result: Run) -> bool:
    """Whether `shed_late` was on at some point of the run."""
    changes = result.program.changes
    return bool(result.config.options.get("shed_late")) or (
        result.configured and bool(changes.get("shed_late"))
    )


def stopped(result: Run, call: Call, item: Hashable) -> bool:
    """Whether a watchdog that stops the proxy (`on_timeout="stop"`) may have stopped it
    before this item of `call` ended: on the virtual clock, once a hung model call
    began; in real time, a batch may have overrun by load at any time."""
    watchdog = result.config.options.get("batch_timeout")
    if watchdog is None or watchdog.on_timeout != "stop":
        return False
    if result.config.real_time:
        return True
    end = result.ended_at.get((call.id, call.items.index(item)), math.inf)
    return any(c.hung and c.started <= end for c in result.log.calls)


def overran(
    result: Run,
    call: Call,
    item: Hashable,
    identity: Identity,
    ran: dict[Identity, list[ModelCall]],
) -> str | None:
    """Why a `BatchTimeout` is wrong for this item of `call`, or None: it needs a
    watchdog, and on the virtual clock (where only a hung batch overruns) a batch
    that hung with its item in it, or, where a batch runs in several model calls (cut
    to allowed sizes), a hung one running when the call ended."""
    if result.config.options.get("batch_timeout") is None:
        return "BatchTimeout without a watchdog"
    if result.config.real_time:
        return None
    log = result.log
    hung = {id(c.batch) for c in log.calls if c.hung}
    if any(id(c.batch) in hung for c in ran.get(identity, [])):
        return None
    sizes = result.config.options.get("batch_sizes")
    if sizes is not None and not isinstance(sizes, batchproxy.BatchSizes):
        end = result.ended_at.get((call.id, call.items.index(item)), math.inf)
        if any(c.hung and c.started <= end for c in log.calls):
            return None
    return "BatchTimeout, but no batch it was in hung"


def option_problems(result: Run, counts: dict[str, int]) -> Iterator[str]:
    """What the stats say of the options of issue 38 item 3, against what the callers
    saw; and every hung model call was abandoned (nothing left running)."""
    stats = result.proxy.stats
    shed = sum(
        1
        for call in result.program.calls
        if any(
            isinstance(o, batchproxy.DeadlineExceeded) and o.predicted is not None
            for index in range(len(call.items))
            for o in result.outcomes[call.id, index]
        )
    )
    if not result.config.remote and stats.shed != shed:
        yield f"stats: shed {stats.shed}, callers saw {shed} calls shed"
    if counts["timed_out"] and not stats.timed_out_batches:
        yield f"{counts['timed_out']} callers got BatchTimeout, but stats.timed_out_batches is 0"
    if not result.config.real_time:
        hung = {id(c.batch) for c in result.log.calls if c.hung}
        if stats.timed_out_batches > len(hung):
            yield f"stats: {stats.timed_out_batches} batches timed out, {len(hung)} hung"
    for c in result.log.calls:
        if c.hung and not c.abandoned:
            yield f"the hung model call on {c.items} was never abandoned"


def drain_cut(result: Run, call: Call, item: Hashable, outcome: Any) -> str | None:
    """Why a `DrainDeadline` is wrong for this item of `call`, or None: only with a drain
    deadline, once it passed (an accepted call: it counts as accepted)."""
    if result.drain_timeout is None or result.closed_at is None:
        return f"DrainDeadline without a drain deadline: {outcome!r}"
    end = result.ended_at.get((call.id, call.items.index(item)), math.inf)
    deadline = result.closed_at + result.drain_timeout
    if end < deadline - 1e-9:
        return f"DrainDeadline at {end}, before the drain's deadline {deadline}"
    return None
