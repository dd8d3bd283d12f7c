"""Test doubles shared by the test modules (import as `from _support import Recorder`)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib.util
import os
import subprocess
import sys
import threading
import time
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Iterator,
    Mapping,
    Sequence,
)
from pathlib import Path
from types import CodeType, ModuleType
from typing import Any, NoReturn, TypeVar

from typing_extensions import override

import batchproxy

T = TypeVar("T")


class Recorder(batchproxy.Proxy[Any, Any]):
    """An async test model: records every batch, answers with `respond(items)`.

    Default answer: `("out", item)` per item, so a caller can check it got its own.
    `delay` (seconds) is awaited inside the model call, so it runs on the (virtual)
    clock under looptime.
    """

    def __init__(
        self,
        respond: Callable[[list[Any]], Sequence[Any]] | None = None,
        *,
        delay: float = 0.0,
        **options: Any,
    ) -> None:
        super().__init__(**options)
        self.batches: list[list[Any]] = []
        self.started_at: list[float] = []
        self.respond = respond or (lambda items: [("out", item) for item in items])
        self.delay = delay

    @override
    async def _inference(self, items: list[Any]) -> Sequence[Any]:
        self.batches.append(list(items))
        self.started_at.append(asyncio.get_running_loop().time())
        if self.delay:
            await asyncio.sleep(self.delay)
        return self.respond(items)


class Hangs(batchproxy.Proxy[Any, Any]):
    """Answers at once, except for items named "hang", which sleep for an hour.

    With `stubborn`, a hanging call swallows its cancellation and goes on sleeping
    until `release` is set."""

    def __init__(self, *, stubborn: bool = False, **options: Any) -> None:
        super().__init__(**options)
        self.stubborn = stubborn
        self.release = asyncio.Event()
        self.cancelled = 0
        self.finished = 0

    async def _inference(self, items: list[Any]) -> list[Any]:
        if "hang" in items:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.cancelled += 1
                if not self.stubborn:
                    raise
                await self.release.wait()
            self.finished += 1
        return [("out", item) for item in items]


def batch_tasks(proxy: batchproxy.Proxy[Any, Any]) -> set[asyncio.Task[Any]]:
    """The proxy's batch tasks still running (by their name), on this loop."""
    name = f"batchproxy-{proxy.name}-batch"
    return {t for t in asyncio.all_tasks() if t.get_name() == name and not t.done()}


def cancel_batches_before_they_run(
    proxy: batchproxy.Proxy[Any, Any], which: Callable[[int], bool]
) -> None:
    """Cancel the proxy's n-th batch task (counting from 0) right after it is created,
    before its first step, for every n with `which(n)`: "cancel every other task"
    reaching a batch task that has not run yet. Call before the proxy's first call
    (a binding's scheduler keeps the start callback it finds when it is made)."""
    runner = proxy._runner
    start_batch = runner.start_batch
    started = 0

    def start_and_cancel(binding: Any, requests: Any) -> None:
        nonlocal started
        before = set(binding.batch_tasks)
        start_batch(binding, requests)
        if which(started):
            for task in binding.batch_tasks - before:
                task.cancel()  # before it ever runs
        started += 1

    runner.start_batch = start_and_cancel  # type: ignore[method-assign]


def scheduler_of(proxy: batchproxy.Proxy[Any, Any]) -> Any:
    """The scheduler of the proxy's current binding (for white-box scheduler tests)."""
    binding = proxy._binder.current
    assert binding is not None
    return binding.scheduler


class RaisingListener(batchproxy.Listener):
    """Raises `kind("listener broke in <hook>")` from every hook."""

    def __init__(self, kind: type[BaseException] = RuntimeError) -> None:
        self.kind = kind

    def _broke(self, hook: str) -> NoReturn:
        raise self.kind(f"listener broke in {hook}")

    def request_queued(self, proxy: str, queue_depth: int) -> None:
        self._broke("request_queued")

    def request_rejected(self, proxy: str, count: int) -> None:
        self._broke("request_rejected")

    def request_shed(self, proxy: str) -> None:
        self._broke("request_shed")

    def request_deduplicated(self, proxy: str, cached: bool) -> None:
        self._broke("request_deduplicated")

    def batch_started(self, proxy: str, size: int, queue_waits: Sequence[float]) -> None:
        self._broke("batch_started")

    def batch_finished(
        self, proxy: str, size: int, model_seconds: float, error: BaseException | None
    ) -> None:
        self._broke("batch_finished")

    def request_finished(self, proxy: str, outcome: str, seconds: float) -> None:
        self._broke("request_finished")

    def error(self, proxy: str, error: BaseException, size: int) -> None:
        self._broke("error")

    def batch_timed_out(self, proxy: str, size: int, timeout: float) -> None:
        self._broke("batch_timed_out")

    def batch_split(self, proxy: str, size: int, reason: str) -> None:
        self._broke("batch_split")


class ThreadRecorder(batchproxy.Proxy[Any, Any]):
    """A plain-`def` test model (runs on the proxy's worker thread, never the loop).

    Records every batch and the thread it ran on (`.threads`); answers like
    `Recorder`. When `gate` is given, each batch blocks until it is set.
    """

    def __init__(
        self,
        respond: Callable[[list[Any]], Sequence[Any]] | None = None,
        *,
        gate: threading.Event | None = None,
        **options: Any,
    ) -> None:
        super().__init__(**options)
        self.batches: list[list[Any]] = []
        self.threads: list[int] = []
        self.respond = respond or (lambda items: [("out", item) for item in items])
        self.gate = gate
        self.entered = threading.Event()

    @override
    def _inference(self, items: list[Any]) -> Sequence[Any]:
        self.batches.append(list(items))
        self.threads.append(threading.get_ident())
        self.entered.set()
        if self.gate is not None and not self.gate.wait(timeout=30):
            raise RuntimeError("test gate never opened")
        return self.respond(items)


def outcome(task: asyncio.Future[Any]) -> str:
    """How a finished caller ended: "ok", "cancelled", or its exception's class name."""
    assert task.done(), f"{task!r} has not ended"
    if task.cancelled():
        return "cancelled"
    error = task.exception()
    return "ok" if error is None else type(error).__name__


def assert_settled(stats: batchproxy.ProxyStats) -> None:
    """Every accepted request ended exactly once, and nothing is queued or running."""
    ended = stats.succeeded + stats.errors + stats.timed_out + stats.cancelled
    assert stats.requests == ended, f"requests {stats.requests} != ended {ended}: {stats}"
    assert stats.queue_depth == 0, stats
    assert stats.in_flight == 0, stats


async def peak_in_flight(
    proxy: batchproxy.Proxy[Any, Any], items: Sequence[Any]
) -> tuple[int, list[Any]]:
    """Call `proxy.inference` on every item at once; return the most batches seen in
    flight meanwhile (polled every 5 ms of real time) and the results."""
    calls = [asyncio.ensure_future(proxy.inference(item)) for item in items]
    peak = 0
    while not all(call.done() for call in calls):
        peak = max(peak, proxy.stats.in_flight)
        await asyncio.sleep(0.005)
    return peak, list(await asyncio.gather(*calls))


def nothing_frozen() -> bool:
    """Whether no object is frozen but those the interpreter parks there itself.

    CPython 3.12 moves the immortal objects a collection meets into the permanent
    generation (375 on 3.12.1, at startup and after any full pass), so a bare
    `gc.get_freeze_count() == 0` holds or not by when the collector last ran. This
    compares the count after a full pass with the one after a thaw and a full pass.
    """
    gc.collect()
    count = gc.get_freeze_count()
    gc.unfreeze()
    gc.collect()
    return count == gc.get_freeze_count()


async def wait_until(condition: Callable[[], bool], *, seconds: float = 10.0) -> None:
    """Poll `condition` without blocking the loop (for events set by worker threads).

    Real time: do not use under looptime.
    """
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    while not condition():
        assert loop.time() < end, "condition never became true"
        await asyncio.sleep(0.002)


def wait_for(condition: Callable[[], bool], seconds: float = 10.0) -> None:
    """Poll `condition` from a plain thread (for state changed by another thread)."""
    end = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < end, "condition never became true"
        time.sleep(0.002)


def blocked_in(thread: int, code: CodeType) -> bool:
    """Whether `thread` is blocked in threading's waits called (at any depth) from `code`."""
    frame = sys._current_frames().get(thread)
    if frame is None or frame.f_code.co_filename != threading.__file__:
        return False
    while frame is not None and frame.f_code is not code:
        frame = frame.f_back
    return frame is not None


def descriptors() -> dict[str, str]:
    """This process's open descriptors, and what each names (as /proc/self/fd's links
    do: a path, `socket:[inode]`, `pipe:[inode]`); one closed meanwhile is left out."""
    named = {}
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            named[fd] = os.readlink(f"/proc/self/fd/{fd}")
    return named


def threads_since(before: set[threading.Thread]) -> list[threading.Thread]:
    """The threads started since `before` that still run, but not a `_DummyThread`: a
    thread Python did not start (Ray's C++ threads) that called into Python stays
    listed for ever, and is not this library's to stop."""
    return [
        thread
        for thread in set(threading.enumerate()) - before
        if thread.is_alive() and type(thread).__name__ != "_DummyThread"
    ]


def thread_alive(name: str) -> bool:
    """Whether a live thread called `name` exists."""
    return any(thread.name == name and thread.is_alive() for thread in threading.enumerate())


class LoopThread:
    """An event loop running forever in a thread of its own: "another loop" for tests.

    `with LoopThread() as other:` starts it; leaving the block stops the loop,
    cancels what still runs there, closes it and joins the thread.
    """

    def __init__(self, name: str = "test-loop-thread") -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)

    def _main(self) -> None:
        loop = self.loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
        finally:
            tasks = asyncio.all_tasks(loop)
            for task in tasks:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 10.0) -> T:
        """Run `coro` on the thread's loop; block the calling thread for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def arun(self, coro: Coroutine[Any, Any, T], timeout: float = 10.0) -> T:
        """Run `coro` on the thread's loop; await its result from another loop."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return await asyncio.wait_for(asyncio.wrap_future(future), timeout)

    def __enter__(self) -> LoopThread:
        self.thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
        assert not self.thread.is_alive(), "the test loop thread did not stop"


def tag_with_thread(items: list[Any]) -> list[tuple[str, Any]]:
    """A `respond` function: `(name of the thread the model ran on, item)` per item."""
    name = threading.current_thread().name
    return [(name, item) for item in items]


@contextlib.contextmanager
def loop_errors() -> Iterator[list[dict[str, Any]]]:
    """Collect what reaches the running loop's exception handler (a crashed callback,
    a task's exception nobody retrieved) instead of only logging it."""
    loop = asyncio.get_running_loop()
    seen: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: seen.append(context))
    try:
        yield seen
    finally:
        loop.set_exception_handler(previous)


@contextlib.contextmanager
def batchproxy_cycles() -> Iterator[list[str]]:
    """What batchproxy left in reference cycles in the block: the objects of its own
    types, and the tasks and coroutines of its code, that only the cyclic garbage
    collector could free (found with collection off, then one `DEBUG_SAVEALL` pass).
    Each request that leaves such a cycle adds to the collector's full passes, which
    hold the GIL, and so stall the model's thread, for as long as they walk the heap.
    Only what the block made counts: an earlier test's proxy (a proxy is in cycles by
    design) that a thread lets go of meanwhile is not this block's."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    before = {id(thing) for thing in gc.get_objects()}
    found: list[str] = []
    try:
        yield found
    finally:
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            gc.collect()
            made = (thing for thing in gc.garbage if id(thing) not in before)
            found.extend(name for name in map(_ours, made) if name is not None)
        finally:
            gc.garbage.clear()
            gc.set_debug(0)
            gc.collect()  # (what was saved above is garbage again: freed now)
            if enabled:
                gc.enable()


async def fails_with(call: Awaitable[Any], *errors: type[BaseException]) -> None:
    """Await `call`, which must raise one of `errors`. For the cycle tests: unlike
    `pytest.raises`, it keeps nothing of the error, whose traceback holds the frames it
    went through (a cycle that `batchproxy_cycles` would find)."""
    try:
        await call
    except errors:
        return
    raise AssertionError(f"{call!r} did not raise any of {errors}")


async def in_a_task_of_its_own(calls: Coroutine[Any, Any, T]) -> T:
    """Await `calls` in a task of the loop's own class. (Under Python 3.10 the test runs
    in `backports.asyncio.runner`'s pure-Python task, whose `__wakeup` frame keeps the
    future it raised from: an error that reaches the test's own task is in a cycle there
    that is not batchproxy's, which `batchproxy_cycles` would find.)"""
    return await asyncio.get_running_loop().create_task(calls)


def _ours(thing: object) -> str | None:
    """`thing`'s name if it is batchproxy's: an instance of its types, or a task or
    coroutine running its code."""
    kind = type(thing)
    if kind.__module__.startswith("batchproxy"):
        return f"{kind.__module__}.{kind.__qualname__}"
    coroutine = thing.get_coro() if isinstance(thing, asyncio.Task) else thing
    code = getattr(coroutine, "cr_code", None)
    if code is not None and f"{os.sep}batchproxy{os.sep}" in code.co_filename:
        return f"{kind.__name__} of {code.co_name}"
    return None


EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run_script(
    name: str, *args: str, timeout: float = 120, env: Mapping[str, str] | None = None
) -> str:
    """Run `examples/<name>.py` in a fresh interpreter; assert it succeeded; its stdout."""
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / f"{name}.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=None if env is None else {**os.environ, **env},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def load_example(name: str) -> ModuleType:
    """Import `examples/<name>.py` as a module (registered, as dataclasses need)."""
    spec = importlib.util.spec_from_file_location(f"{name}_example", EXAMPLES / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@contextlib.asynccontextmanager
async def on_uvicorn(app: Any) -> AsyncIterator[tuple[Any, int]]:
    """`app` under uvicorn on 127.0.0.1, on a free port, in the running event loop:
    yield (the server, its port); stopped on exit, even when the test fails."""
    import uvicorn  # only the tests that serve need it

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            assert not task.done(), "uvicorn did not start"
            await asyncio.sleep(0.01)
        yield server, server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        await task


def modules_after(code: str) -> set[str]:
    """The top-level packages in `sys.modules` once `code` has run in a fresh
    interpreter: what an import really loads, whatever this process loaded already."""
    probe = f"{code}\nimport sys\nprint(*sorted({{m.partition('.')[0] for m in sys.modules}}))"
    ran = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    return set(ran.stdout.splitlines()[-1].split())
