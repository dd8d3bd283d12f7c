"""`submit` and `inference_sync`: calls from plain threads, routed to the proxy's loop."""

from __future__ import annotations

import concurrent.futures
import functools
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from . import _validate
from ._bridge import LoopBridge
from ._errors import DeadlineExceeded

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine

    from ._binding import Binder
    from ._intake import Intake
    from ._options import Options

__all__ = ["ThreadCalls"]

In = TypeVar("In")
Out = TypeVar("Out")


class ThreadCalls(Generic[In, Out]):
    """The thread-safe call methods of `Proxy` (a base of it, nothing on its own)."""

    if TYPE_CHECKING:  # what `Proxy` provides
        name: str
        _options: Options
        _intake: Intake[In]
        _binder: Binder[In]

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

    def submit(
        self,
        item: In,
        *,
        timeout: float | None = None,
        priority: int = 0,
        tenant: Hashable | None = None,
        key: Hashable | None = None,
    ) -> concurrent.futures.Future[Out]:
        """Thread-safe entry: queue `item` from any thread; returns a concurrent future.

        The call goes through the proxy's event loop if that runs in another
        thread; a proxy running in no event loop is started on the default
        `BackgroundLoop`. Calling this from the proxy's own loop thread is
        refused: blocking on the future would deadlock. The keywords are
        `inference`'s.
        """
        call = functools.partial(
            self.inference, item, timeout=timeout, priority=priority, tenant=tenant, key=key
        )
        future, _ = self._from_thread("submit", call)
        return future

    def inference_sync(
        self,
        item: In,
        *,
        timeout: float | None = None,
        priority: int = 0,
        tenant: Hashable | None = None,
        key: Hashable | None = None,
    ) -> Out:
        """Blocking `inference`, for plain threads (Flask, Django sync views, scripts).

        Goes through the proxy's loop like `submit()`. `timeout` bounds the whole
        call (`DeadlineExceeded`); a wait interrupted by `KeyboardInterrupt` or
        the like withdraws the call. If the proxy's loop ends first, the call gets
        `InferenceError` (`ProxyClosed` if the proxy was closed): it never blocks
        for ever. Refused on the proxy's own loop thread.
        """
        self._require_init()
        seconds = (
            self._options.timeout if timeout is None else _validate.timeout("timeout", timeout)
        )
        call = functools.partial(
            self.inference, item, timeout=timeout, priority=priority, tenant=tenant, key=key
        )
        future, bridge = self._from_thread("inference_sync", call)
        # the proxy's loop enforces the deadline; the extra wait here only guards
        # against a loop too busy to answer at all
        if bridge is not None and not bridge.wait(
            future, None if seconds is None else seconds + 0.5
        ):
            assert seconds is not None  # only a bounded wait ends without the result
            raise DeadlineExceeded(self.name, seconds)
        return future.result()

    def _from_thread(
        self, method: str, call: Callable[[], Coroutine[Any, Any, Out]]
    ) -> tuple[concurrent.futures.Future[Out], LoopBridge | None]:
        self._require_init()
        self._intake.refuse_own_model(self._binder.current, method)
        # here, in the caller's thread: a first call made just before the interpreter
        # exits would otherwise start the thread during the exit (refused on 3.12+)
        self._start_worker()
        return self._binder.from_thread(method, call)
