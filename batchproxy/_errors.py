"""Every exception batchproxy raises to a caller; all share `BatchProxyError`."""

from __future__ import annotations

from collections.abc import Hashable

__all__ = [
    "BatchProxyError",
    "BatchSizeMismatch",
    "BatchSizeUnreachable",
    "BatchTimeout",
    "DeadlineExceeded",
    "DrainDeadline",
    "HostUnavailable",
    "InferenceError",
    "InvalidItem",
    "PoolUnavailable",
    "ProxyClosed",
    "QueueFull",
    "StreamBufferFull",
    "WorkerDied",
]


class BatchProxyError(Exception):
    """Base class of the errors batchproxy itself raises."""


class QueueFull(BatchProxyError):
    """The proxy's queue is at `max_queue_size`, or the calling tenant's share of it
    at `max_queue_size_per_tenant` (then `per_tenant` is True and `tenant` names the
    tenant; the message does not, as a tenant may be a user's id): the call was
    refused at once.

    Overload, not failure: map it to HTTP 503 (or 429) and let the client retry.
    """

    def __init__(
        self, proxy: str, max_queue_size: int, *, tenant: Hashable = None, per_tenant: bool = False
    ) -> None:
        whose = (
            "this tenant's share of the queue is full (max_queue_size_per_tenant: "
            if per_tenant
            else "queue is full ("
        )
        super().__init__(f"{proxy}: {whose}{max_queue_size} requests waiting); retry later")
        self.proxy = proxy
        self.max_queue_size = max_queue_size
        self.tenant = tenant
        self.per_tenant = per_tenant


class ProxyClosed(BatchProxyError):
    """The proxy is closing or closed and takes no new calls.

    `reason` says why when the proxy closed itself (`on_batch_timeout="stop"`);
    `detail`, what became of a call the close cut short (a stream nobody read).
    """

    def __init__(self, proxy: str, reason: str | None = None, *, detail: str | None = None) -> None:
        stopped = "" if reason is None else f" (stopped: {reason})"
        message = f"{proxy} is closed and accepts no new calls{stopped}"
        super().__init__(message if detail is None else f"{proxy} closed: {detail}")
        self.proxy = proxy
        self.reason = reason


class DrainDeadline(ProxyClosed):
    """The proxy's drain deadline (`aclose(timeout=...)`) passed before this call was
    answered: nobody cancelled the call, the proxy gave up on it to close in time.

    `running` is False for a call still queued (it never reached the model) and True
    for one whose batch was running: that batch was abandoned (cancelled where it runs
    on the event loop; a model call on a thread or in a process may run on, its result
    discarded). A `ProxyClosed`, so the HTTP helpers answer it 503 with `Retry-After`
    (another replica may serve the retry). `timeout` is the drain's, in seconds.
    """

    def __init__(self, proxy: str, timeout: float, *, running: bool) -> None:
        what = (
            "while this call's batch was running; the batch was abandoned"
            if running
            else "before this queued call reached the model"
        )
        deadline = f"its drain deadline (timeout={timeout:.3g} s)"
        super().__init__(proxy, detail=f"{deadline} passed {what}")
        self.timeout = timeout
        self.running = running


class StreamBufferFull(BatchProxyError):
    """A stream's consumer left `stream_buffer` chunks unread: it was dropped from its
    batch (the model stops computing it) rather than let chunks pile up without limit.

    The consumer gets the chunks it left unread, then this error. A consumer that
    stops early should close its stream (`contextlib.aclosing`); one that reads
    slowly on purpose needs a larger `stream_buffer`.
    """

    def __init__(self, proxy: str, stream_buffer: int) -> None:
        super().__init__(
            f"{proxy}: this stream's consumer left {stream_buffer} chunks unread "
            f"(stream_buffer={stream_buffer}), so it was dropped from its batch; read a "
            f"stream to its end or close it (async with contextlib.aclosing(proxy.stream(x)) "
            f"as chunks: ...), or raise stream_buffer"
        )
        self.proxy = proxy
        self.stream_buffer = stream_buffer


class InvalidItem(BatchProxyError, ValueError):
    """An item the model cannot serve: the caller's mistake, not the model's.

    Put one in an item's slot of `_inference`'s results (or raise it from `length`)
    to fail that caller alone; the HTTP helpers of `batchproxy.integrations` answer
    it with 422. A `ValueError`, so code that catches those still does.
    """


class BatchSizeMismatch(BatchProxyError):
    """`_inference` returned a different number of results than it was given items.

    Every caller of that batch gets this error: with a wrong count there is no
    telling which result belongs to whom.
    """

    def __init__(self, proxy: str, expected: int, got: int) -> None:
        super().__init__(
            f"{proxy}._inference returned {got} results for a batch of {expected} items; "
            f"it must return exactly one result per item, in order"
        )
        self.proxy = proxy
        self.expected = expected
        self.got = got


class DeadlineExceeded(BatchProxyError, TimeoutError):
    """The call's `timeout` ran out before its result arrived.

    A request still queued at its deadline is removed and never reaches the model.
    With `shed_late=True` a call the proxy predicts cannot finish in time fails at
    once, before it is queued; `predicted` is then the expected seconds to an
    answer (None otherwise). A `TimeoutError`, so `except TimeoutError` catches it.
    """

    def __init__(self, proxy: str, timeout: float, predicted: float | None = None) -> None:
        if predicted is None:
            message = f"{proxy}: no result within the call's timeout of {timeout:g} s"
        else:
            message = (
                f"{proxy}: refused at once: the answer is expected in {predicted:.3g} s, "
                f"after the call's timeout of {timeout:g} s (shed_late=True)"
            )
        super().__init__(message)
        self.proxy = proxy
        self.timeout = timeout
        self.predicted = predicted


class BatchTimeout(BatchProxyError, TimeoutError):
    """The caller's batch ran longer than the proxy's `batch_timeout` (the watchdog).

    Every caller still waiting on that batch gets it, and the proxy stops waiting
    for the model call (`proxy.health` says why it is unhealthy). A `TimeoutError`.
    """

    def __init__(self, proxy: str, timeout: float, items: int) -> None:
        super().__init__(
            f"{proxy}: a batch of {items} items ran longer than batch_timeout={timeout:g} s; "
            f"the model call was abandoned"
        )
        self.proxy = proxy
        self.timeout = timeout
        self.items = items


class InferenceError(BatchProxyError):
    """The call could not be answered, for a reason that is not an `Exception`.

    `_inference` raised or returned a `BaseException` that is not an `Exception`:
    a stray `CancelledError`, `KeyboardInterrupt` or `SystemExit` from the model is
    not re-raised in the callers as-is (a caller would mistake it for its own
    cancellation, or stop its event loop); it arrives wrapped in this error, the
    original as `__cause__`. Or the call's batch was cancelled from outside, or
    the event loop serving the proxy ended, before it was answered (`detail` says
    which). The proxy keeps serving.
    """

    def __init__(self, proxy: str, cause: BaseException, detail: str | None = None) -> None:
        message = detail or f"{proxy}._inference raised {type(cause).__name__}: {cause!r}"
        super().__init__(message if detail is None else f"{proxy}: {detail}")
        self.proxy = proxy
        self.__cause__ = cause


class WorkerDied(BatchProxyError, RuntimeError):
    """A worker process or actor died while it held a batch.

    The callers of exactly that batch get this error (unless the executor was told
    to retry such a batch once on another worker); the executor replaces the worker
    and later batches are served.
    """

    def __init__(self, executor: str, worker: str, items: int, detail: str) -> None:
        super().__init__(
            f"{executor}: worker {worker} died while running a batch of {items} items "
            f"({detail}); it is being replaced"
        )
        self.executor = executor
        self.worker = worker
        self.items = items
        self.detail = detail


class PoolUnavailable(BatchProxyError, RuntimeError):
    """No worker of a pool could take a batch: none was ready within the pool's
    `start_timeout` (still being placed, loading its model, or unreachable).

    The callers of that batch get this error; the pool keeps trying to bring its
    workers up, and later batches are served once one is ready.
    """

    def __init__(self, executor: str, waited: float, detail: str) -> None:
        super().__init__(
            f"{executor}: no replica ready to run a batch after {waited:g} s ({detail})"
        )
        self.executor = executor
        self.waited = waited
        self.detail = detail


class HostUnavailable(BatchProxyError, ConnectionError):
    """A `RemoteProxy` could not reach its `ModelHost`, or lost it with the call in
    flight: the host process is not running, or stopped or died before it answered.

    Nothing that may have reached the host is retried: the call may or may not have
    reached the model (a call that finds its connection lost while idle, before any
    of it was written, is sent on a new one). The next call connects again, so calls
    succeed once the host is back.
    """

    def __init__(self, path: str, detail: str) -> None:
        super().__init__(f"model host at {path}: {detail}")
        self.path = path
        self.detail = detail


class BatchSizeUnreachable(UserWarning):
    """A bound in front of the batcher keeps batches below `batch_size`: fewer calls
    than that can ever wait (`max_queue_size`), or reach the service at once (the
    server's caller limit given to `Serving(max_callers=...)`). A warning, not an
    error: the proxy works, with smaller batches than configured."""
