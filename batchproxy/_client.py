"""Whether the client behind a call is gone: told by the web-framework helpers, read
when a call is cancelled.

An HTTP helper (`integrations._disconnect`) makes one `Client` per request and sets
it in `current_client` while the request is handled; when it sees the connection
lost it sets `gone` and cancels the request's handler. Every call the handler made
is then cancelled like any other (a queued one leaves the queue, a running one has
its result dropped), and `Events` counts it as `disconnected` too: it reads
`client_gone()` only when a call is cancelled, never on the way of a call that is
answered.
"""

from __future__ import annotations

from contextvars import ContextVar

__all__ = ["Client", "client_gone", "current_client"]


class Client:
    """One HTTP request's client, as the server sees it."""

    __slots__ = ("gone",)

    def __init__(self) -> None:
        self.gone = False  # set once, by the helper that saw the connection lost


current_client: ContextVar[Client | None] = ContextVar("batchproxy_client", default=None)


def client_gone() -> bool:
    """Whether the code running now serves an HTTP client that disconnected."""
    client = current_client.get()
    return client is not None and client.gone
