"""OpenTelemetry traces for batchproxy proxies (the ``otel`` extra).

```python
from batchproxy.integrations.otel import instrument

instrument(embedder)   # after the tracer provider is set up; any number of proxies
```

Each batch gets a span of its own, `batchproxy.batch <proxy>`, linked to the span
of every caller in it (a batch serves many traces, so it is the child of none of
them), current while the model runs (spans the model starts are its children),
with these attributes: `batchproxy.proxy`, `batchproxy.batch.size`,
`batchproxy.queue_wait.max_ms` and `.mean_ms` (how long its requests waited),
`batchproxy.model.duration_ms`, and `batchproxy.outcome` (`ok` or `error`, with
the error recorded and the span's status set; `abandoned` for a batch the
watchdog or a drain's deadline gave up on, ended with its task). Each caller's span gets an event,
`batchproxy.batch_started`, when its batch starts. A streaming proxy gets a span
per step.

The callers' spans reach the batch through `caller_contexts()`: `instrument`
turns on `caller_context` for the proxy. A proxy that is not instrumented pays
nothing, and `import batchproxy` never imports OpenTelemetry.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import statistics
from collections.abc import Callable, Sequence
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace

from .. import Listener, Proxy, caller_contexts

__all__ = ["instrument"]

_TRACER_NAME = "batchproxy"
# the span, its context token, and the callback that ends it if its task ends first
_Started = tuple[
    trace.Span, contextvars.Token[otel_context.Context], Callable[[asyncio.Task[Any]], None]
]
_batch_span: contextvars.ContextVar[_Started | None] = contextvars.ContextVar(
    "batchproxy_otel_batch_span", default=None
)


def instrument(
    proxy: Proxy[Any, Any], *, tracer_provider: trace.TracerProvider | None = None
) -> None:
    """Trace `proxy`'s batches (see the module docstring); `tracer_provider`: the global
    one by default."""
    proxy.configure(caller_context=True)
    proxy.add_listener(_BatchSpans(trace.get_tracer(_TRACER_NAME, tracer_provider=tracer_provider)))


class _BatchSpans(Listener):
    """Starts a batch's span when it starts and ends it when its model call ends: both
    hooks run in the batch's own task, so the span is kept in its context. A batch
    abandoned by the watchdog or a drain's deadline is not finished (no
    `batch_finished`): its span ends, `abandoned`, when its task does."""

    def __init__(self, tracer: trace.Tracer) -> None:
        self._tracer = tracer

    def batch_started(self, proxy: str, size: int, queue_waits: Sequence[float]) -> None:
        links: list[trace.Link] = []
        for caller in _callers():
            span = caller.run(trace.get_current_span)
            if span.get_span_context().is_valid:
                links.append(trace.Link(span.get_span_context()))
            if span.is_recording():
                span.add_event(
                    "batchproxy.batch_started",
                    {"batchproxy.proxy": proxy, "batchproxy.batch.size": size},
                )
        attributes: dict[str, Any] = {"batchproxy.proxy": proxy, "batchproxy.batch.size": size}
        if queue_waits:
            attributes["batchproxy.queue_wait.max_ms"] = max(queue_waits) * 1e3
            attributes["batchproxy.queue_wait.mean_ms"] = statistics.fmean(queue_waits) * 1e3
        span = self._tracer.start_span(
            f"batchproxy.batch {proxy}",
            context=otel_context.Context(),  # a root: the batch is no one caller's child
            links=links,
            attributes=attributes,
        )
        token = otel_context.attach(trace.set_span_in_context(span))
        ended = functools.partial(_abandoned, span)
        task = asyncio.current_task()
        if task is not None:
            task.add_done_callback(ended)
        _batch_span.set((span, token, ended))

    def batch_finished(
        self, proxy: str, size: int, seconds: float, error: BaseException | None
    ) -> None:
        started = _batch_span.get()
        if started is None:
            return
        span, token, ended = started
        _batch_span.set(None)
        task = asyncio.current_task()
        if task is not None:
            task.remove_done_callback(ended)
        span.set_attribute("batchproxy.model.duration_ms", seconds * 1e3)
        span.set_attribute("batchproxy.outcome", "ok" if error is None else "error")
        if error is not None:
            span.record_exception(error)
            span.set_status(trace.Status(trace.StatusCode.ERROR, str(error)))
        otel_context.detach(token)
        span.end()


def _abandoned(span: trace.Span, task: asyncio.Task[Any]) -> None:
    """The batch's task ended without `batch_finished`: the batch was abandoned."""
    span.set_attribute("batchproxy.outcome", "abandoned")
    span.set_status(trace.Status(trace.StatusCode.ERROR, "the batch was abandoned"))
    span.end()


def _callers() -> list[contextvars.Context]:
    """The callers' contexts of this batch (none for a kind of proxy that has none)."""
    try:
        return caller_contexts()
    except RuntimeError:  # a GenerationProxy: its batch changes at every step
        return []
