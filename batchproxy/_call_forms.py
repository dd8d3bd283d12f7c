"""The call methods built on `Proxy.inference`: `inference_many` (a list, each item
batched like a call of its own), `submit`, `inference_sync` and `inference_many_sync`
(calls from plain threads, routed to the proxy's loop), and `with_args` (per-batch
arguments for an `_inference` that takes them). Each takes the per-call keywords as `**call`, typed
by `CallOptions` and checked (`check_call`) before it is forwarded."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from collections.abc import (
    AsyncGenerator,
    Callable,
    Coroutine,
    Generator,
    Hashable,
    Iterable,
    Mapping,
)
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar, overload

from typing_extensions import Unpack

from . import _validate
from ._arguments import Arguments, ArgumentsKey
from ._errors import DeadlineExceeded
from ._loops.bridge import LoopBridge
from ._loops.sync_stream import chunks_from_thread
from ._option_values import CallOptions, UnkeyedCallOptions, check_call

if TYPE_CHECKING:
    from ._intake import Intake
    from ._loops.binding import Binder
    from ._options import Options

__all__ = ["CallForms", "WithArguments"]

In = TypeVar("In")
Out = TypeVar("Out")
T = TypeVar("T")


class CallForms(Generic[In, Out]):
    """The call methods of `Proxy` built on `inference` (a base of it, nothing on its
    own)."""

    if TYPE_CHECKING:  # what `Proxy` provides
        name: str
        _intake: Intake[In]
        _binder: Binder[In]
        _arguments: Arguments | None

        @property
        def _options(self) -> Options: ...
        def _require_init(self) -> None: ...
        def _start_worker(self) -> None: ...
        def inference(
            self,
            item: In,
            *,
            timeout: float | None = None,
            priority: int = 0,
            tenant: Hashable | None = None,
            key: Hashable | None = None,
        ) -> Coroutine[Any, Any, Out]: ...
        def stream(
            self,
            item: In,
            *,
            timeout: float | None = None,
            priority: int = 0,
            tenant: Hashable | None = None,
            key: Hashable | None = None,
        ) -> AsyncGenerator[Out, None]: ...

    @overload
    async def inference_many(
        self,
        items: Iterable[In],
        *,
        return_exceptions: Literal[False] = ...,
        **call: Unpack[CallOptions],
    ) -> list[Out]: ...

    @overload
    async def inference_many(
        self, items: Iterable[In], *, return_exceptions: bool, **call: Unpack[CallOptions]
    ) -> list[Out | Exception]: ...

    async def inference_many(
        self,
        items: Iterable[In],
        *,
        return_exceptions: bool = False,
        **call: Unpack[CallOptions],
    ) -> list[Out] | list[Out | Exception]:
        """Queue each item as its own request; return their results in order.

        The items are batched like separate calls (with each other and with
        everyone else's). `timeout` bounds the whole call. By default the first
        failure is raised as soon as it happens and the remaining items are
        withdrawn; with `return_exceptions=True` failures take their item's place
        in the list. An empty input returns `[]` without touching the model.
        `tenant` and `key` apply to every item (see `inference`; the keywords are
        its `CallOptions`). If the items that add work to the queue do not fit
        (`max_queue_size`, the tenant's limit), the whole list is refused with
        `QueueFull`.
        """
        _refuse_single(items)
        check_call("inference_many()", call)
        timeout = call.get("timeout")
        priority = call.get("priority", 0)
        _validate.timeout("timeout", timeout)  # checked even for no items
        _validate.priority(priority)
        batch = list(items)
        if not batch:
            return []
        binding = self._binder.current
        if binding is None or binding.loop is not asyncio.get_running_loop():
            self._require_init()
            return await self._binder.serve_elsewhere(
                lambda: self.inference_many(batch, return_exceptions=return_exceptions, **call)
            )
        return await self._intake.admit_many(
            binding,
            batch,
            timeout,
            priority,
            call.get("tenant"),
            call.get("key"),
            return_exceptions=return_exceptions,
        )

    def with_args(self, *args: Any, **kwargs: Any) -> WithArguments[In, Out]:
        """The proxy's calls with these per-batch arguments for `_inference`.

        For a subclass whose `_inference` takes keyword-only parameters after its
        items (`_inference(self, texts, /, *, normalize=False)`): calls are batched
        only with calls of equal arguments, and `_inference` gets them once per
        batch. `await proxy.with_args(normalize=True).inference(text)`; a plain
        `proxy.inference(text)` has the defaults. Checked here, before any call.
        """
        self._require_init()
        arguments = self._arguments
        if arguments is None:
            raise TypeError(
                f"{self.name}._inference takes no per-batch arguments: declare them as "
                f"keyword-only parameters after its items (def _inference(self, items, /, "
                f"*, name=default))"
            )
        return WithArguments(self, arguments.key(args, kwargs))

    def submit(self, item: In, **call: Unpack[CallOptions]) -> concurrent.futures.Future[Out]:
        """Thread-safe entry: queue `item` from any thread; returns a concurrent future.

        The call goes through the proxy's event loop if that runs in another
        thread (the `with` loop inside `with proxy:`); a proxy running in no event
        loop is started on the default `BackgroundLoop`. Calling this from the
        proxy's own loop thread is refused: blocking on the future would deadlock.
        The keywords are `inference`'s (`CallOptions`).
        """
        self._require_init()
        check_call("submit()", call)
        future, _ = self._from_thread("submit", functools.partial(self.inference, item, **call))
        return future

    def inference_sync(self, item: In, **call: Unpack[CallOptions]) -> Out:
        """Blocking `inference`, for plain threads (Flask, Django sync views, scripts).

        Goes through the proxy's loop like `submit()`. `timeout` bounds the whole
        call (`DeadlineExceeded`); a wait interrupted by `KeyboardInterrupt` or
        the like withdraws the call. If the proxy's loop ends first, the call gets
        `InferenceError` (`ProxyClosed` if the proxy was closed): it never blocks
        for ever. Refused on the proxy's own loop thread. The keywords are
        `inference`'s (`CallOptions`).
        """
        self._require_init()
        check_call("inference_sync()", call)
        seconds = self._sync_seconds(call)
        make = functools.partial(self.inference, item, **call)
        result: Out = self._wait(*self._from_thread("inference_sync", make), seconds)
        return result

    @overload
    def inference_many_sync(
        self,
        items: Iterable[In],
        *,
        return_exceptions: Literal[False] = ...,
        **call: Unpack[CallOptions],
    ) -> list[Out]: ...

    @overload
    def inference_many_sync(
        self, items: Iterable[In], *, return_exceptions: bool, **call: Unpack[CallOptions]
    ) -> list[Out | Exception]: ...

    def inference_many_sync(
        self,
        items: Iterable[In],
        *,
        return_exceptions: bool = False,
        **call: Unpack[CallOptions],
    ) -> list[Out] | list[Out | Exception]:
        """Blocking `inference_many`, for plain threads: each item batched like a call
        of its own, the results in order. Goes through the proxy's loop like
        `inference_sync()`, and ends like it (`timeout` bounds the whole call, an
        interrupted wait withdraws every item)."""
        self._require_init()
        _refuse_single(items)
        check_call("inference_many_sync()", call)
        seconds = self._sync_seconds(call)
        _validate.priority(call.get("priority", 0))
        batch = list(items)
        if not batch:
            return []

        def make() -> Coroutine[Any, Any, list[Out] | list[Out | Exception]]:
            return self.inference_many(batch, return_exceptions=return_exceptions, **call)

        results: list[Out] | list[Out | Exception] = self._wait(
            *self._from_thread("inference_many_sync", make), seconds
        )
        return results

    def stream_sync(self, item: In, **call: Unpack[CallOptions]) -> Generator[Out, None, None]:
        """Blocking `stream`, for plain threads: `for chunk in proxy.stream_sync(item)`,
        best inside `contextlib.closing(...)`. Each chunk is read on the proxy's loop
        (as `inference_sync` routes a call); leaving early and closing the iterator,
        or an interrupted wait, withdraws the call. `timeout` bounds the whole
        stream. On a proxy that does not stream, its one result. Checked here."""
        self._require_init()
        check_call("stream_sync()", call)
        seconds = self._sync_seconds(call)
        self._intake.refuse_own_model(self._binder.current, "stream_sync")

        def run(make: Callable[[], Coroutine[Any, Any, T]]) -> T:
            return self._wait(*self._from_thread("stream_sync", make), seconds)

        return chunks_from_thread(lambda: self.stream(item, **call), run)

    def _sync_seconds(self, call: CallOptions) -> float | None:
        """The bound on a blocking call: its `timeout`, else the proxy's (checked)."""
        timeout = call.get("timeout")
        return self._options.timeout if timeout is None else _validate.timeout("timeout", timeout)

    def _wait(
        self,
        future: concurrent.futures.Future[T],
        bridge: LoopBridge | None,
        seconds: float | None,
    ) -> T:
        """Block for a call routed from a plain thread; `DeadlineExceeded` past `seconds`."""
        # the proxy's loop enforces the deadline; the extra wait here only guards
        # against a loop too busy to answer at all
        if bridge is not None and not bridge.wait(
            future, None if seconds is None else seconds + 0.5
        ):
            assert seconds is not None  # only a bounded wait ends without the result
            raise DeadlineExceeded(self.name, seconds)
        return future.result()

    def _from_thread(
        self, method: str, make: Callable[[], Coroutine[Any, Any, T]]
    ) -> tuple[concurrent.futures.Future[T], LoopBridge | None]:
        """Route a call from a plain thread (`submit`, `inference_sync`,
        `inference_many_sync`): `make()` runs on the proxy's loop."""
        self._intake.refuse_own_model(self._binder.current, method)
        # here, in the caller's thread: a first call made just before the interpreter
        # exits would otherwise start the thread during the exit (refused on 3.12+)
        self._start_worker()
        return self._binder.from_thread(method, make)


def _refuse_single(items: object) -> None:
    """`inference_many` takes an iterable of items, not one string, bytes or mapping."""
    if isinstance(items, (str, bytes, bytearray, Mapping)):
        raise TypeError(
            f"inference_many takes an iterable of items, got {type(items).__name__}; "
            f"wrap a single item in a list or call inference()"
        )


class WithArguments(Generic[In, Out]):
    """`proxy.with_args(...)`: the proxy's call methods, each call with these per-batch
    arguments for `_inference` (its batch key). The keywords are `inference`'s."""

    __slots__ = ("_key", "_proxy")

    def __init__(self, proxy: CallForms[In, Out], key: ArgumentsKey) -> None:
        self._proxy = proxy
        self._key = key

    def inference(self, item: In, **call: Unpack[UnkeyedCallOptions]) -> Coroutine[Any, Any, Out]:
        check_call("with_args(...).inference()", call, keyed=False)
        return self._proxy.inference(item, key=self._key, **call)

    async def inference_many(
        self,
        items: Iterable[In],
        *,
        return_exceptions: bool = False,
        **call: Unpack[UnkeyedCallOptions],
    ) -> list[Any]:
        check_call("with_args(...).inference_many()", call, keyed=False)
        return await self._proxy.inference_many(
            items, key=self._key, return_exceptions=return_exceptions, **call
        )

    def submit(
        self, item: In, **call: Unpack[UnkeyedCallOptions]
    ) -> concurrent.futures.Future[Out]:
        check_call("with_args(...).submit()", call, keyed=False)
        return self._proxy.submit(item, key=self._key, **call)

    def inference_sync(self, item: In, **call: Unpack[UnkeyedCallOptions]) -> Out:
        check_call("with_args(...).inference_sync()", call, keyed=False)
        return self._proxy.inference_sync(item, key=self._key, **call)

    def inference_many_sync(
        self,
        items: Iterable[In],
        *,
        return_exceptions: bool = False,
        **call: Unpack[UnkeyedCallOptions],
    ) -> list[Any]:
        check_call("with_args(...).inference_many_sync()", call, keyed=False)
        return self._proxy.inference_many_sync(
            items, key=self._key, return_exceptions=return_exceptions, **call
        )

    def __repr__(self) -> str:
        arguments = ", ".join(f"{name}={value!r}" for name, value in self._key)
        return f"<{self._proxy!r} with_args({arguments})>"
