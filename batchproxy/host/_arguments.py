"""Per-batch arguments through a model host: `remote.with_args(*args, **kwargs)`.

The arguments travel as the call's `key` (`RemoteArguments`), as a proxy's
`with_args` makes them its calls' batch key; the host hands them to its proxy's
`with_args(*args, **kwargs)`, which checks them against its `_inference` and batches
the call only with calls of equal arguments.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Coroutine, Iterable
from typing import Any

from typing_extensions import Unpack

from .._option_values import UnkeyedCallOptions, check_call

__all__ = ["RemoteArguments", "RemoteWithArguments"]


class RemoteArguments(tuple[tuple[Any, ...], tuple[tuple[str, Any], ...]]):
    """A call's per-batch arguments, `(args, ((name, value), ...))`, as its `key` on
    the way to the host (a tuple: hashable, and pickled as one)."""

    __slots__ = ()

    @classmethod
    def of(cls, args: tuple[Any, ...], kwargs: dict[str, Any]) -> RemoteArguments:
        """The arguments, each checked hashable here (they are the batch key)."""
        for name, value in [*enumerate(args), *kwargs.items()]:
            try:
                hash(value)
            except TypeError:
                raise TypeError(
                    f"with_args(): argument {name!r} must be hashable (it is the batch key), "
                    f"got {type(value).__name__}"
                ) from None
        return cls((tuple(args), tuple(kwargs.items())))

    def call(self, proxy: Any) -> Any:
        """`proxy.with_args(*args, **kwargs)`: what the host calls (a `TypeError` if its
        `_inference` takes no such arguments)."""
        with_args = getattr(proxy, "with_args", None)
        if with_args is None:
            raise TypeError(f"the model host's {proxy!r} takes no per-batch arguments")
        args, kwargs = self
        return with_args(*args, **dict(kwargs))


class RemoteWithArguments:
    """`remote.with_args(...)`: the `RemoteProxy`'s call methods, each call with these
    per-batch arguments for the host proxy's `_inference` (as a proxy's `with_args`;
    the keywords are `inference`'s but `key`, which the arguments are)."""

    __slots__ = ("_arguments", "_remote")

    def __init__(self, remote: Any, arguments: RemoteArguments) -> None:  # (a RemoteProxy)
        self._remote = remote
        self._arguments = arguments

    def inference(self, item: Any, **call: Unpack[UnkeyedCallOptions]) -> Coroutine[Any, Any, Any]:
        check_call("with_args(...).inference()", call, keyed=False)
        called: Coroutine[Any, Any, Any] = self._remote.inference(item, key=self._arguments, **call)
        return called

    async def inference_many(
        self,
        items: Iterable[Any],
        *,
        return_exceptions: bool = False,
        **call: Unpack[UnkeyedCallOptions],
    ) -> list[Any]:
        check_call("with_args(...).inference_many()", call, keyed=False)
        results: list[Any] = await self._remote.inference_many(
            items, key=self._arguments, return_exceptions=return_exceptions, **call
        )
        return results

    def submit(
        self, item: Any, **call: Unpack[UnkeyedCallOptions]
    ) -> concurrent.futures.Future[Any]:
        check_call("with_args(...).submit()", call, keyed=False)
        future: concurrent.futures.Future[Any] = self._remote.submit(
            item, key=self._arguments, **call
        )
        return future

    def inference_sync(self, item: Any, **call: Unpack[UnkeyedCallOptions]) -> Any:
        check_call("with_args(...).inference_sync()", call, keyed=False)
        return self._remote.inference_sync(item, key=self._arguments, **call)

    def inference_many_sync(
        self,
        items: Iterable[Any],
        *,
        return_exceptions: bool = False,
        **call: Unpack[UnkeyedCallOptions],
    ) -> list[Any]:
        check_call("with_args(...).inference_many_sync()", call, keyed=False)
        results: list[Any] = self._remote.inference_many_sync(
            items, key=self._arguments, return_exceptions=return_exceptions, **call
        )
        return results

    def __repr__(self) -> str:
        args, kwargs = self._arguments
        shown = [repr(value) for value in args] + [f"{name}={value!r}" for name, value in kwargs]
        return f"<{self._remote!r} with_args({', '.join(shown)})>"
