"""`@batch`: turn `f(items) -> results` into something awaited per item, on `Proxy`.

On a plain function the decorated object owns one proxy. On a method it is a
descriptor: each instance gets its own proxy on first access (cached in the
instance's `__dict__`), so two model instances never share a queue.
"""

from __future__ import annotations

import concurrent.futures
import functools
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Generator,
    Iterable,
    Sequence,
)
from typing import Any, Generic, Literal, Protocol, TypeVar, overload

from typing_extensions import Self, Unpack

from ._deprecated import warn_renamed
from ._executors.base import Executor
from ._loops.sync_scope import SyncScope
from ._option_values import CALL_KEYWORDS, CallOptions, unexpected_keyword
from ._options import ConfigurableOptions, ProxyOptions, check_keywords
from ._proxy import Proxy
from ._stats import Health, ProxyStats

__all__ = ["Batched", "batch"]

T = TypeVar("T")
U = TypeVar("U")


class _FunctionProxy(Proxy[T, U]):
    """A proxy whose model is a given callable rather than an overridden method."""

    def __init__(self, fn: Callable[[list[T]], Any], **options: Any) -> None:
        self._fn = fn
        super().__init__(**options)

    def _model_function(self) -> Callable[[list[T]], Any]:
        return self._fn

    def _inference(self, items: list[T], /) -> Any:
        return self._fn(items)


class Batched(SyncScope, Generic[T, U]):
    """What `@batch` returns: `await f(x)` (or `f.inference(x)`), `await
    f.inference_many(xs)`, `f.submit(x)`, `f.inference_sync(x)` and
    `f.inference_many_sync(xs)` from threads, `f.stats`, `async with f:` (and `with
    f:` from plain code): `Proxy`'s call methods and lifecycle, by the same names (so
    a `ModelHost` serves it as it serves a proxy)."""

    def __init__(
        self, fn: Callable[..., Any], options: dict[str, Any], instance: object = None
    ) -> None:
        if hasattr(fn, "__name__"):  # a function; else a model object (a StagedModel)
            functools.update_wrapper(self, fn)
        self._fn = fn
        self._options = options
        self._attribute = getattr(fn, "__name__", type(fn).__name__)
        model = fn if instance is None else functools.partial(fn, instance)
        options = {"name": getattr(fn, "__qualname__", type(fn).__qualname__), **options}
        self._proxy: Proxy[T, U] | None = _FunctionProxy(model, **options)  # checks options

    def __set_name__(self, owner: type, name: str) -> None:
        """A method: each instance gets its own proxy in `__get__`; the class has none."""
        self._attribute = name
        self._proxy = None

    @property
    def proxy(self) -> Proxy[T, U]:
        """The `Proxy` doing the batching."""
        if self._proxy is None:
            raise TypeError(f"{self._fn.__qualname__} is a batched method: use it on an instance")
        return self._proxy

    @overload
    def __get__(self, instance: None, owner: type | None = None) -> Self: ...

    @overload
    def __get__(self, instance: object, owner: type | None = None) -> Batched[T, U]: ...

    def __get__(self, instance: object, owner: type | None = None) -> Batched[T, U]:
        if instance is None:
            return self
        bound: Batched[T, U] = type(self)(self._fn, self._options, instance)
        try:
            vars(instance)[self._attribute] = bound  # later lookups skip this descriptor
        except TypeError:
            raise TypeError(
                f"@batch on {self._fn.__qualname__} needs instances with a __dict__ "
                f"to keep one proxy per instance"
            ) from None
        return bound

    def __call__(self, item: T, **call: Unpack[CallOptions]) -> Coroutine[Any, Any, U]:
        """`await f(item)`: the proxy's own coroutine, no extra layer per call. The
        keywords are `Proxy.inference`'s (`CallOptions`)."""
        try:
            return self.proxy.inference(item, **call)
        except TypeError:  # (only a keyword it does not take: the coroutine is not started)
            for name in call:
                if name not in CALL_KEYWORDS:
                    where = f"{self._fn.__qualname__}()"
                    raise unexpected_keyword(where, name, CALL_KEYWORDS) from None
            raise

    def inference(self, item: T, **call: Unpack[CallOptions]) -> Coroutine[Any, Any, U]:
        """`Proxy.inference`: `await f.inference(item)` is `await f(item)`."""
        return self(item, **call)

    @overload
    async def inference_many(
        self,
        items: Iterable[T],
        *,
        return_exceptions: Literal[False] = ...,
        **call: Unpack[CallOptions],
    ) -> list[U]: ...

    @overload
    async def inference_many(
        self, items: Iterable[T], *, return_exceptions: bool, **call: Unpack[CallOptions]
    ) -> list[U | Exception]: ...

    async def inference_many(
        self,
        items: Iterable[T],
        *,
        return_exceptions: bool = False,
        **call: Unpack[CallOptions],
    ) -> list[U] | list[U | Exception]:
        """`Proxy.inference_many`: each item batched like a call of its own."""
        return await self.proxy.inference_many(items, return_exceptions=return_exceptions, **call)

    async def many(
        self,
        items: Iterable[T],
        *,
        return_exceptions: bool = False,
        **call: Unpack[CallOptions],
    ) -> list[Any]:
        """Deprecated: `f.inference_many(items)`."""
        warn_renamed("f.many()", "f.inference_many()")
        return await self.proxy.inference_many(items, return_exceptions=return_exceptions, **call)

    def stream(self, item: T, **call: Unpack[CallOptions]) -> AsyncGenerator[U, None]:
        """`Proxy.stream`: `async for chunk in f.stream(item)`, for a generator `f`."""
        return self.proxy.stream(item, **call)

    def stream_sync(self, item: T, **call: Unpack[CallOptions]) -> Generator[U, None, None]:
        """`Proxy.stream_sync`: `for chunk in f.stream_sync(item)` in a plain thread."""
        return self.proxy.stream_sync(item, **call)

    def submit(self, item: T, **call: Unpack[CallOptions]) -> concurrent.futures.Future[U]:
        """`Proxy.submit`: from any thread, a `concurrent.futures.Future` of `f(item)`'s
        result (the call runs on the function's loop, or the default `BackgroundLoop`)."""
        return self.proxy.submit(item, **call)

    def inference_sync(self, item: T, **call: Unpack[CallOptions]) -> U:
        """`Proxy.inference_sync`: `f.inference_sync(item)` blocks a plain thread for
        the result."""
        return self.proxy.inference_sync(item, **call)

    @overload
    def inference_many_sync(
        self,
        items: Iterable[T],
        *,
        return_exceptions: Literal[False] = ...,
        **call: Unpack[CallOptions],
    ) -> list[U]: ...

    @overload
    def inference_many_sync(
        self, items: Iterable[T], *, return_exceptions: bool, **call: Unpack[CallOptions]
    ) -> list[U | Exception]: ...

    def inference_many_sync(
        self,
        items: Iterable[T],
        *,
        return_exceptions: bool = False,
        **call: Unpack[CallOptions],
    ) -> list[U] | list[U | Exception]:
        """`Proxy.inference_many_sync`: blocks a plain thread for `f.inference_many`."""
        return self.proxy.inference_many_sync(items, return_exceptions=return_exceptions, **call)

    def sync(self, item: T, **call: Unpack[CallOptions]) -> U:
        """Deprecated: `f.inference_sync(item)`."""
        warn_renamed("f.sync()", "f.inference_sync()")
        return self.proxy.inference_sync(item, **call)

    @property
    def name(self) -> str:
        """The proxy's name (the function's `__qualname__` unless `name=` was given)."""
        return self.proxy.name

    @property
    def stats(self) -> ProxyStats:
        return self.proxy.stats

    @property
    def health(self) -> Health:
        """`Proxy.health`: whether the function answers within `batch_timeout`."""
        return self.proxy.health

    @property
    def healthy(self) -> bool:
        """`Proxy.healthy`: `f.health.healthy`."""
        return self.proxy.healthy

    @property
    def closed(self) -> bool:
        """`Proxy.closed`: whether `aclose()` was called."""
        return self.proxy.closed

    def configure(self, **changes: Unpack[ConfigurableOptions]) -> None:
        """`Proxy.configure`: change limits while it runs."""
        self.proxy.configure(**changes)

    async def start(self) -> None:
        await self.proxy.start()

    async def aclose(self, *, timeout: float | None = None) -> None:
        """Close the function's proxy (`Proxy.aclose`): `timeout` is the drain's deadline
        (None: drain without one)."""
        await self.proxy.aclose(timeout=timeout)

    async def __aenter__(self) -> Self:
        """`async with f:` starts the function's proxy and closes it after (as `async
        with proxy:` does)."""
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


class _Decorator(Protocol):
    @overload
    def __call__(self, fn: Callable[[list[T]], Awaitable[Sequence[U]]], /) -> Batched[T, U]: ...

    @overload
    def __call__(
        self, fn: Callable[[Any, list[T]], Awaitable[Sequence[U]]], /
    ) -> Batched[T, U]: ...

    @overload
    def __call__(self, fn: Callable[[list[T]], Sequence[U]], /) -> Batched[T, U]: ...

    @overload
    def __call__(
        self, fn: Callable[[list[T]], AsyncIterator[Sequence[Any]]], /
    ) -> Batched[T, Any]: ...

    @overload
    def __call__(self, fn: Callable[[Any, list[T]], Sequence[U]], /) -> Batched[T, U]: ...


def batch(
    batch_size: int = 64,
    *,
    offload: bool | Executor = False,
    name: str | None = None,
    **options: Unpack[ProxyOptions],
) -> _Decorator:
    """Decorate `f(items: list[T]) -> list[U]` (function or method) to be awaited per item.

    Takes the same options as `Proxy`; they are checked here, at decoration time.
    A model object works too: `batch(offload=gpu)(MyStagedModel())` runs a
    `StagedModel`'s stages apart on an overlapping `WorkerThread`.
    """
    if callable(batch_size):
        raise TypeError("use @batch() or @batch(batch_size=...), with parentheses")
    check_keywords("@batch()", options)
    settings: dict[str, Any] = {"batch_size": batch_size, "offload": offload, **options}
    if name is not None:
        settings["name"] = name

    def decorate(fn: Callable[..., Any]) -> Batched[Any, Any]:
        if not callable(fn):
            raise TypeError(f"@batch decorates a function or method, got {fn!r}")
        return Batched(fn, settings)

    return decorate
