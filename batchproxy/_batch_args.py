"""`@batch_args`: a batched function with more arguments than its items.

`f(items: list[T], /, *, normalize: bool = False) -> list[U]` is called
`await f(item, normalize=True)`. Its arguments after the items are per call and
not batchable: calls are batched only with calls of the same values (the values
are the batch key), and `f` gets them once per batch, as given. They are checked
against `f`'s signature when the call is made, before it is queued. The per-call
options (`timeout`, `priority`, `tenant`) go through `f.with_call_options(...)`,
so they never clash with `f`'s own parameter names.
"""

from __future__ import annotations

import concurrent.futures
import copy
import inspect
from collections.abc import (
    AsyncGenerator,
    Awaitable,
    Callable,
    Coroutine,
    Generator,
    Iterable,
    Sequence,
)
from typing import Any, Concatenate, Generic, ParamSpec, Protocol, TypeVar, overload

from typing_extensions import Unpack

from ._arguments import Arguments, call_with_arguments
from ._decorator import Batched
from ._deprecated import warn_renamed
from ._executors.base import Executor
from ._option_values import UnkeyedCallOptions, check_call
from ._options import ProxyOptions, check_keywords

__all__ = ["BatchedArgs", "batch_args"]

P = ParamSpec("P")
T = TypeVar("T")
U = TypeVar("U")


class BatchedArgs(Batched[T, U], Generic[P, T, U]):
    """What `@batch_args` returns: `await f(item, *args, **kwargs)`, where `args` and
    `kwargs` are `f`'s own arguments after its items; the per-call keywords through
    `f.with_call_options(timeout=...)`."""

    def __init__(
        self, fn: Callable[..., Any], options: dict[str, Any], instance: object = None
    ) -> None:
        if options.get("key") is not None:
            raise TypeError("@batch_args takes no key= option: the arguments are the batch key")
        if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
            raise TypeError(
                f"@batch_args: {getattr(fn, '__qualname__', fn)!r} is a generator, and a "
                f"stream's steps take its items only: use @batch"
            )
        self._arguments = arguments = Arguments.of(fn, skip=instance is not None)
        self._per_call: UnkeyedCallOptions = {}

        super().__init__(call_with_arguments(fn, arguments.count), options, instance)
        self._fn = fn  # bound per instance by `__get__`, as for `@batch`

    def __call__(  # type: ignore[override]  # f's own arguments, not the options
        self, item: T, /, *args: P.args, **kwargs: P.kwargs
    ) -> Coroutine[Any, Any, U]:
        item, key = self._item_and_key(item, args, kwargs)
        return self.proxy.inference(item, key=key, **self._per_call)

    def inference(  # type: ignore[override]
        self, item: T, /, *args: P.args, **kwargs: P.kwargs
    ) -> Coroutine[Any, Any, U]:
        """`Proxy.inference`: `await f.inference(item, *args, **kwargs)` is `await
        f(item, *args, **kwargs)`."""
        return self(item, *args, **kwargs)

    def submit(  # type: ignore[override]
        self, item: T, /, *args: P.args, **kwargs: P.kwargs
    ) -> concurrent.futures.Future[U]:
        """`Proxy.submit`: from any thread, a `concurrent.futures.Future` of `f(item,
        *args, **kwargs)`'s result."""
        item, key = self._item_and_key(item, args, kwargs)
        return self.proxy.submit(item, key=key, **self._per_call)

    def stream(  # type: ignore[override]
        self, item: T, /, *args: P.args, **kwargs: P.kwargs
    ) -> AsyncGenerator[U, None]:
        """`Proxy.stream`, for a generator `f`: `f.stream(item, *args, **kwargs)`."""
        item, key = self._item_and_key(item, args, kwargs)
        return self.proxy.stream(item, key=key, **self._per_call)

    def stream_sync(  # type: ignore[override]
        self, item: T, /, *args: P.args, **kwargs: P.kwargs
    ) -> Generator[U, None, None]:
        """`Proxy.stream_sync`, for a generator `f`: `f.stream_sync(item, *args,
        **kwargs)` in a plain thread."""
        item, key = self._item_and_key(item, args, kwargs)
        return self.proxy.stream_sync(item, key=key, **self._per_call)

    def inference_sync(  # type: ignore[override]
        self, item: T, /, *args: P.args, **kwargs: P.kwargs
    ) -> U:
        """`Proxy.inference_sync`: `f.inference_sync(item, *args, **kwargs)` blocks a
        plain thread for the result."""
        item, key = self._item_and_key(item, args, kwargs)
        result: U = self.proxy.inference_sync(item, key=key, **self._per_call)
        return result

    def sync(  # type: ignore[override]
        self, item: T, /, *args: P.args, **kwargs: P.kwargs
    ) -> U:
        """Deprecated: `f.inference_sync(item, ...)`."""
        warn_renamed("f.sync()", "f.inference_sync()")
        return self.inference_sync(item, *args, **kwargs)

    def _item_and_key(
        self, item: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Any, Any]:
        """The call's item (one value per item parameter) and its batch key (`f`'s
        other arguments), checked against `f`'s signature."""
        item, rest = self._arguments.item(item, args)
        return item, self._arguments.key(rest, kwargs)

    async def inference_many(  # type: ignore[override]
        self, items: Iterable[T], /, *args: P.args, **kwargs: P.kwargs
    ) -> list[U]:
        """`Proxy.inference_many`: every item with the same arguments."""
        key = self._arguments.key(args, kwargs)
        results: list[U] = await self.proxy.inference_many(items, key=key, **self._per_call)
        return results

    def inference_many_sync(  # type: ignore[override]
        self, items: Iterable[T], /, *args: P.args, **kwargs: P.kwargs
    ) -> list[U]:
        """`Proxy.inference_many_sync`: every item with the same arguments, from a plain
        thread."""
        key = self._arguments.key(args, kwargs)
        results: list[U] = self.proxy.inference_many_sync(items, key=key, **self._per_call)
        return results

    async def many(  # type: ignore[override]
        self, items: Iterable[T], /, *args: P.args, **kwargs: P.kwargs
    ) -> list[U]:
        """Deprecated: `f.inference_many(items, ...)`."""
        warn_renamed("f.many()", "f.inference_many()")
        key = self._arguments.key(args, kwargs)
        results: list[U] = await self.proxy.inference_many(items, key=key, **self._per_call)
        return results

    def with_call_options(self, **call: Unpack[UnkeyedCallOptions]) -> BatchedArgs[P, T, U]:
        """The same function, whose calls have these per-call keywords (`timeout`,
        `priority`, `tenant`; its arguments are its batch key)."""
        check_call("with_call_options()", call, keyed=False)
        configured = copy.copy(self)
        configured._per_call = call
        return configured

    def options(self, **call: Unpack[UnkeyedCallOptions]) -> BatchedArgs[P, T, U]:
        """Deprecated: `f.with_call_options(...)` ("options" are the constructor's)."""
        warn_renamed("f.options()", "f.with_call_options()")
        return self.with_call_options(**call)


A = TypeVar("A")
B = TypeVar("B")


class _Decorator(Protocol):
    @overload
    def __call__(
        self, fn: Callable[Concatenate[list[A], list[B], P], Awaitable[Sequence[U]]], /
    ) -> BatchedArgs[..., Any, U]: ...

    @overload
    def __call__(
        self, fn: Callable[Concatenate[list[A], list[B], P], Sequence[U]], /
    ) -> BatchedArgs[..., Any, U]: ...

    @overload
    def __call__(
        self, fn: Callable[Concatenate[list[T], P], Awaitable[Sequence[U]]], /
    ) -> BatchedArgs[P, T, U]: ...

    @overload
    def __call__(
        self, fn: Callable[Concatenate[list[T], P], Sequence[U]], /
    ) -> BatchedArgs[P, T, U]: ...


def batch_args(
    batch_size: int = 64,
    *,
    offload: bool | Executor = False,
    name: str | None = None,
    **options: Unpack[ProxyOptions],
) -> _Decorator:
    """Decorate `f(items: list[T], /, *args, **kwargs) -> list[U]` (function or method)
    to be awaited per item with its other arguments: `await f(item, *args, **kwargs)`.

    The item parameters are `f`'s positional-only ones (at least the first): each
    call gives one value for each, `f` gets a list per parameter. The others are
    per batch: calls are batched only with calls of equal values, which `f` gets
    once per batch. Takes `Proxy`'s options but `key`.
    """
    if callable(batch_size):
        raise TypeError("use @batch_args() or @batch_args(batch_size=...), with parentheses")
    check_keywords("@batch_args()", options)
    settings: dict[str, Any] = {"batch_size": batch_size, "offload": offload, **options}
    if name is not None:
        settings["name"] = name

    def decorate(fn: Callable[..., Any]) -> Any:  # (typed by `_Decorator`)
        if not callable(fn):
            raise TypeError(f"@batch_args decorates a function, got {fn!r}")
        return BatchedArgs(fn, settings)

    return decorate
