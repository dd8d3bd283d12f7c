"""What the web-framework helpers share: a service's proxies, their start and drain, what
its health routes say, and which HTTP answer each batchproxy error gets.

A `Serving` goes through these states, in this order (each moves only forward):

    NEW ──start()──> LOADING ──loaded──> READY ──aclose()──> DRAINING ──> CLOSED
                        └──raised──> FAILED ──aclose()──> DRAINING ──> CLOSED

- LOADING: `start()` returned at once; a background task runs `load` (if any),
  then starts every executor given and every proxy. Liveness: 200; readiness:
  503 ("loading"); calls through `check_ready` (the frameworks' dependency) get
  `NotReady` (503 with `Retry-After`).
- READY: readiness is 200 while every proxy is open and healthy; a proxy that
  overran its `batch_timeout` makes it 503 ("unhealthy") until a later batch
  answers in time. A proxy that closed while the service is READY (it stopped
  itself, `on_batch_timeout="stop"`, or someone closed it) fails readiness and
  liveness: it will not come back, so the process should be restarted.
- FAILED: `load` or a start raised (logged at ERROR, with its traceback);
  readiness and liveness are 503 with the error, without `Retry-After` (a retry
  cannot help), so an orchestrator restarts the process.
- DRAINING: `aclose()` began (the app is shutting down), or, with a
  `drain_timeout`, the process got SIGTERM: readiness 503 ("draining"); each
  proxy is closed in turn, which answers every call it accepted (by the drain's
  deadline, with `drain_timeout`); then the executors given are closed.

Only the owner of the `Serving` (the framework's startup and shutdown) calls
`start` and `aclose`; the routes only read.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import inspect
import logging
import math
import signal
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar, overload

from .. import (
    BatchProxyError,
    BatchTimeout,
    DeadlineExceeded,
    Executor,
    HostUnavailable,
    InvalidItem,
    PoolUnavailable,
    Proxy,
    ProxyClosed,
    QueueFull,
    WorkerDied,
)
from .._collector import freezes
from .._reachable import check_callers
from .._validate import flag
from ..host import RemoteProxy
from ._nodelay import nodelay_listeners

__all__ = ["Answer", "NotReady", "Serving", "State", "answer_for"]

logger = logging.getLogger("batchproxy")

P = TypeVar("P", bound=Proxy[Any, Any])

Served = Proxy[Any, Any] | RemoteProxy
"""What a `Serving` starts, drains and reports: a proxy in this process, or one that a
model host serves to several web workers (`batchproxy.host.RemoteProxy`)."""


class State(enum.Enum):
    NEW = "new"
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"
    DRAINING = "draining"
    CLOSED = "closed"


class NotReady(BatchProxyError):
    """The service is still loading its models (or failed to): retry later (503)."""

    def __init__(self, state: State, error: BaseException | None = None) -> None:
        why = "" if error is None else f": {type(error).__name__}: {error}"
        super().__init__(f"the service is {state.value}, not ready{why}")
        self.state = state


@dataclass(frozen=True)
class Answer:
    """An HTTP answer, framework-free: status, JSON body, extra headers."""

    status: int
    body: dict[str, Any]
    headers: Mapping[str, str] = field(default_factory=dict)


def answer_for(error: BatchProxyError, *, retry_after: float = 1.0) -> Answer:
    """The answer a batchproxy error gets (other exceptions are the framework's):
    overload and closing 503 with `Retry-After`, deadlines 504, an item the model
    cannot serve 422, any other 500. The body is `{"detail": message, "error": class
    name}`."""
    body = {"detail": str(error), "error": type(error).__name__}
    if isinstance(error, NotReady) and error.state is State.FAILED:
        return Answer(503, body)  # loading failed: a retry cannot help
    unavailable = (QueueFull, ProxyClosed, NotReady, WorkerDied, PoolUnavailable, HostUnavailable)
    if isinstance(error, unavailable):
        return Answer(503, body, _retry(retry_after))
    if isinstance(error, (DeadlineExceeded, BatchTimeout)):
        return Answer(504, body)
    if isinstance(error, InvalidItem):
        return Answer(422, body)
    return Answer(500, body)


class Serving:
    """The proxies of one web service (and the executors they share): started in the
    background at startup, drained at shutdown, reported by the health routes.

    `load`: a coroutine function run first (load weights, build the proxies' model);
    `executors`: shared `WorkerThread`s and pools to start before the proxies and
    close after them (a proxy's own worker thread is the proxy's to start and close).
    `max_callers`: how many requests the server lets in at once (uvicorn's
    `--limit-concurrency`, say), if it bounds them: a proxy whose batch slots need
    more callers than that to fill gets a `BatchSizeUnreachable` warning.
    `drain_timeout`: seconds (>= 0) the drain at shutdown may take, from its start:
    at that deadline each proxy's calls still queued or running get `DrainDeadline`
    (503) and the drain returns (see `Proxy.aclose(timeout=...)`). None (the
    default): drain without a bound. With it, the drain starts as soon as the process
    gets SIGTERM, if a server handles that signal (uvicorn, aiohttp's `run_app`) and
    `start()` ran in the main thread: `Serving` chains its own handler in front of
    the server's until `aclose()`. So the deadline holds for the requests the server
    waits for before it runs the shutdown (see docs/serving.md for the settings).
    `freeze_gc` (default True): once loading succeeded, before the service reports
    ready, collect once and `gc.freeze()` what is alive (the model, the framework), so
    the garbage collector's full passes, which hold the GIL and so stall the model's
    thread and the event loop, no longer walk it: with a model loaded such a pass took
    200-250 ms, every 10-15 s under load; frozen, 2-13 ms. On by default because it is
    safe for a service: the collection first frees what loading left as garbage (so
    none of it is kept); what is frozen is what was alive, which a serving process
    keeps anyway, and only what of it later becomes garbage in a reference cycle waits
    for the freeze's end; and `aclose()` gives the frozen objects back to the
    collector (`gc.unfreeze()`) once no service that froze is still running, so a
    process that outlives its service (tests, notebooks) keeps nothing for good. It
    costs one full collection before the service is ready. False leaves the collector
    alone (see docs/serving.md, "Garbage-collection pauses").
    `tcp_nodelay` (default True): at `start()`, set TCP_NODELAY on this process's TCP
    listeners that lack it, so that the connections they accept have it, as asyncio
    gives its own: `uvicorn --workers N` binds its shared listener so that asyncio's
    loop leaves it off (and `--fd N` so that uvloop does too), and each keep-alive
    response then waits about 40 ms for the client's delayed ACK (uvicorn issue
    #3149). Connections are left as they are.
    False leaves every socket alone (docs/serving.md).
    """

    def __init__(
        self,
        *proxies: Served,
        executors: Iterable[Executor] = (),
        load: Callable[[], Awaitable[None]] | None = None,
        retry_after: float = 1.0,
        max_callers: int | None = None,
        drain_timeout: float | None = None,
        freeze_gc: bool = True,
        tcp_nodelay: bool = True,
    ) -> None:
        for proxy in proxies:
            if not isinstance(proxy, (Proxy, RemoteProxy)):
                raise TypeError(f"Serving takes batchproxy proxies, got {proxy!r}")
        if max_callers is not None:
            if isinstance(max_callers, bool) or not isinstance(max_callers, int):
                raise TypeError(f"max_callers must be an int or None, got {max_callers!r}")
            if max_callers < 1:
                raise ValueError(f"max_callers must be at least 1, got {max_callers}")
            for proxy in proxies:
                if isinstance(proxy, RemoteProxy):
                    continue  # its batches fill with every worker's callers
                stats = proxy.stats
                check_callers(
                    proxy.name,
                    max_callers,
                    proxy.options.batch_size,
                    stats.max_in_flight,
                    stacklevel=2,
                )
        names = [proxy.name for proxy in proxies]
        if len(set(names)) != len(names):
            raise ValueError(f"two proxies share a name: {names}; give each a name=")
        if not math.isfinite(retry_after) or retry_after <= 0:
            raise ValueError(f"retry_after must be a positive number of seconds: {retry_after}")
        if drain_timeout is not None:
            if isinstance(drain_timeout, bool) or not isinstance(drain_timeout, (int, float)):
                raise TypeError(f"drain_timeout must be a number or None, got {drain_timeout!r}")
            if math.isnan(drain_timeout) or drain_timeout < 0:
                raise ValueError(f"drain_timeout must be >= 0 seconds or None: {drain_timeout}")
            if drain_timeout == math.inf:
                drain_timeout = None
        self.drain_timeout: float | None = drain_timeout
        self.freeze_gc = flag("freeze_gc", freeze_gc)
        self.tcp_nodelay = flag("tcp_nodelay", tcp_nodelay)
        self.proxies: tuple[Served, ...] = proxies
        self.executors: tuple[Executor, ...] = tuple(executors)
        self.retry_after = retry_after
        self._load = load
        # changed by: start() (LOADING), the loading task (READY or FAILED), aclose()
        self.state = State.NEW
        self.error: BaseException | None = None  # why FAILED
        self._loading: asyncio.Task[None] | None = None
        self._draining: asyncio.Task[None] | None = None  # the drain, once begun
        self._signal_handler: Any = None  # ours, while installed, and the one it chains to
        self._chained: Any = None
        self._frozen = False  # this service holds a freeze (`freezes`) until its drain ends

    # -- the owner's side: startup and shutdown ---------------------------------------------

    async def start(self) -> None:
        """Begin loading in the background and return at once (the server can answer its
        health routes meanwhile). Idempotent."""
        if self.state is not State.NEW:
            return
        self.state = State.LOADING
        if self.tcp_nodelay:  # before the server listens (uvicorn's workers: after this)
            nodelay_listeners()
        loop = asyncio.get_running_loop()
        self._loading = loop.create_task(self._load_all(), name="batchproxy-serving-load")
        if self.drain_timeout is not None:
            self._drain_on_sigterm(loop)

    async def _load_all(self) -> None:
        try:
            if self._load is not None:
                await self._load()
            for executor in self.executors:
                start = getattr(executor, "start", None)  # a pool's is async, a thread's not
                started = None if start is None else start()
                if inspect.isawaitable(started):
                    await started
            for proxy in self.proxies:
                await proxy.start()
        except asyncio.CancelledError:
            raise  # aclose() during loading
        except BaseException as exc:  # reported by the health routes, not raised
            self.error = exc
            logger.error(
                "the service failed to load: %s: %s", type(exc).__name__, exc, exc_info=exc
            )
            if self.state is State.LOADING:
                self.state = State.FAILED
            if not isinstance(exc, Exception):
                raise
        else:
            if self.state is State.LOADING:
                if self.freeze_gc:
                    freezes.hold()
                    self._frozen = True
                self.state = State.READY

    async def wait_ready(self) -> None:
        """Wait for loading to end: return once READY, raise `NotReady` if it failed (or
        if `start()` has not been called: then nothing is loading)."""
        if self._loading is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(self._loading)
        self.check_ready()

    async def aclose(self) -> None:
        """Stop loading if it still runs, close every proxy (each answers every call it
        accepted; by the drain's deadline, with `drain_timeout`), then the executors
        given. Idempotent: a second call waits for the first's drain (begun at SIGTERM,
        maybe) to end."""
        self._restore_sigterm()
        if self.state is State.CLOSED:
            return
        self._begin_drain()
        assert self._draining is not None
        await asyncio.shield(self._draining)

    def _begin_drain(self) -> None:
        """Start the drain in the background (once), on the running loop."""
        if self._draining is not None or self.state is State.CLOSED:
            return
        self.state = State.DRAINING
        loop = asyncio.get_running_loop()
        deadline = None if self.drain_timeout is None else loop.time() + self.drain_timeout
        self._draining = loop.create_task(self._drain(deadline), name="batchproxy-serving-drain")

    async def _drain(self, deadline: float | None) -> None:
        loop = asyncio.get_running_loop()

        def left() -> float | None:
            """What is left of the drain's deadline: never more than `drain_timeout` (the
            float sum and difference on the loop's clock may come out a hair above it)."""
            if deadline is None or self.drain_timeout is None:
                return None
            return min(self.drain_timeout, max(0.0, deadline - loop.time()))

        loading, self._loading = self._loading, None
        if loading is not None and not loading.done():
            loading.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await loading
        try:
            for proxy in self.proxies:  # in turn: a proxy may call the ones after it
                remaining = left()  # (none: a subclass's aclose() may take no timeout)
                await (proxy.aclose() if remaining is None else proxy.aclose(timeout=remaining))
        finally:
            for executor in self.executors:
                closing = loop.create_task(executor.aclose())
                done, _ = await asyncio.wait([closing], timeout=left())
                if not done:
                    logger.warning(
                        "%r did not close by the drain's deadline; left closing", executor
                    )
            if self._frozen:
                self._frozen = False
                freezes.release()
            self.state = State.CLOSED

    def _drain_on_sigterm(self, loop: asyncio.AbstractEventLoop) -> None:
        """Chain a SIGTERM handler in front of the server's: it begins the drain (and its
        deadline) at once, then calls the server's. Only in the main thread, and only
        over a handler of the server's (a default handler would have ended the process:
        there is no graceful shutdown to start the drain in)."""
        if threading.current_thread() is not threading.main_thread():
            return
        previous = signal.getsignal(signal.SIGTERM)
        if not callable(previous):
            return

        def on_sigterm(signum: int, frame: Any) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(self._begin_drain)
            previous(signum, frame)

        signal.signal(signal.SIGTERM, on_sigterm)
        self._signal_handler, self._chained = on_sigterm, previous

    def _restore_sigterm(self) -> None:
        """Put the server's SIGTERM handler back, if ours is still the one installed."""
        ours, self._signal_handler = self._signal_handler, None
        if ours is None or threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is ours:
            signal.signal(signal.SIGTERM, self._chained)
        self._chained = None

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Serving]:
        """`start()` on entry, `aclose()` on exit: the body of a framework's lifespan."""
        await self.start()
        try:
            yield self
        finally:
            await self.aclose()

    @contextlib.asynccontextmanager
    async def lifespan(self, app: object) -> AsyncIterator[None]:
        """`FastAPI(lifespan=serving.lifespan)` (Starlette's signature): `running()`,
        yielding nothing (Starlette would take a value yielded for the app's state)."""
        async with self.running():
            yield

    # -- the routes' side ---------------------------------------------------------------

    @overload
    def proxy(self, key: type[P]) -> P: ...
    @overload
    def proxy(self, key: type[RemoteProxy]) -> RemoteProxy: ...
    @overload
    def proxy(self, key: str) -> Proxy[Any, Any]: ...
    def proxy(self, key: type[Served] | str) -> Served:
        """The proxy named `key`, or the one of class `key` (`RemoteProxy` for a
        model host's; by name, typed as a `Proxy`)."""
        for proxy in self.proxies:
            if proxy.name == key if isinstance(key, str) else isinstance(proxy, key):
                return proxy
        have = ", ".join(f"{p.name} ({type(p).__name__})" for p in self.proxies) or "none"
        raise LookupError(f"no proxy {key!r} in this service (it has: {have})")

    @overload
    def provider(self, key: type[P]) -> Callable[[], Awaitable[P]]: ...
    @overload
    def provider(self, key: type[RemoteProxy]) -> Callable[[], Awaitable[RemoteProxy]]: ...
    @overload
    def provider(self, key: str) -> Callable[[], Awaitable[Proxy[Any, Any]]]: ...
    def provider(self, key: type[Served] | str) -> Callable[[], Awaitable[Served]]:
        """A function that returns the proxy `key` (see `proxy`), or raises `NotReady`
        while the service loads: FastAPI's `Depends(serving.provider(Embedder))`.

        It is a coroutine function, so FastAPI runs it on the event loop: a plain `def`
        dependency would cost every request a hop to its thread pool and back."""
        proxy = self.proxy(key)  # an unknown key fails here, at import, not per request

        async def ready_proxy() -> Served:
            self.check_ready()
            return proxy

        return ready_proxy

    def check_ready(self) -> None:
        """Raise `NotReady` while loading or after loading failed (calls then get 503)."""
        if self.state in (State.NEW, State.LOADING, State.FAILED):
            raise NotReady(self.state, self.error)

    def liveness(self) -> Answer:
        """200 unless the process should be restarted: loading failed, or a proxy closed
        while the service was serving (it will not come back)."""
        broken = self.state is State.FAILED or (
            self.state is State.READY and any(proxy.closed for proxy in self.proxies)
        )
        return Answer(503 if broken else 200, self._report(live=not broken))

    def readiness(self) -> Answer:
        """200 only when loaded, not draining, and every proxy open and healthy."""
        ready = self.state is State.READY and all(
            not proxy.closed and proxy.health.healthy for proxy in self.proxies
        )
        # a failed load does not come back: no Retry-After
        headers = {} if ready or self.state is State.FAILED else _retry(self.retry_after)
        return Answer(200 if ready else 503, self._report(ready=ready), headers)

    def _report(self, **verdict: bool) -> dict[str, Any]:
        body: dict[str, Any] = {"status": self.state.value, **verdict}
        if self.error is not None:
            body["error"] = f"{type(self.error).__name__}: {self.error}"
        body["proxies"] = {proxy.name: _proxy_report(proxy) for proxy in self.proxies}
        return body


def _proxy_report(proxy: Served) -> dict[str, Any]:
    health = proxy.health
    state = "closed" if proxy.closed else "healthy" if health.healthy else "unhealthy"
    report: dict[str, Any] = {"state": state}
    if health.reason is not None:
        report["reason"] = health.reason
    return report


def _retry(seconds: float) -> dict[str, str]:
    return {"Retry-After": str(max(1, math.ceil(seconds)))}  # HTTP wants whole seconds
