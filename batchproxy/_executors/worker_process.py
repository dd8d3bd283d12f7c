"""The body of a worker process: build the model once, then run batches until told
to stop or until the proxy's process is gone.

Replies: ``("ready", pid)`` after the factory ran, ``("failed", exc, traceback)``
if it raised; then per batch ``("ok", results)`` or ``("raised", exc, traceback)``.
A stop message (None) or a closed pipe ends the loop. A watchdog thread, started
before the factory runs, ends the process as soon as its parent is gone, even
while the factory or a batch still runs. SIGINT is ignored: a
Ctrl-C in the terminal reaches the whole process group, and shutting the
workers down is the parent's job.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import multiprocessing
import os
import pickle
import signal
import threading
import traceback
from multiprocessing.connection import Connection
from typing import Any

from . import ipc
from .base import ModelFactory

__all__ = ["serve"]


def serve(conn: Connection, factory: ModelFactory) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_parent()
    try:
        model = factory()
    except BaseException as exc:
        _reply(conn, ("failed", *_portable(exc)))
        return
    _reply(conn, ("ready", os.getpid()))
    loop: asyncio.AbstractEventLoop | None = None
    try:
        while True:
            try:
                frames = ipc.receive(conn)
            except (EOFError, OSError):
                return  # the proxy's process is gone
            try:
                items = ipc.decode(frames)
            except Exception as exc:  # e.g. a class this process cannot import
                error = TypeError(f"the batch could not be unpickled in the worker: {exc!r}")
                error.__cause__ = exc
                _reply(conn, ("raised", *_portable(error)))
                continue
            if items is None:
                return
            try:
                results = model(items)
                if inspect.isawaitable(results):
                    loop = loop or asyncio.new_event_loop()
                    results = loop.run_until_complete(_awaited(results))
                reply: tuple[Any, ...] = ("ok", results)
            except BaseException as exc:
                reply = ("raised", *_portable(exc))
            _reply(conn, reply)
    finally:
        if loop is not None:
            loop.close()


def _exit_with_parent() -> None:
    """End this process when its parent is gone, whatever the main thread is doing.

    The pipe tells the main thread only when it next reads it, which is after the
    factory returns and between batches. `multiprocessing` gives a spawned child a
    sentinel of its parent (a pipe end on POSIX, a process handle on Windows) that
    becomes ready when the parent exits, however it ends: a daemon thread waits on
    it. (Linux's PR_SET_PDEATHSIG would follow the parent's thread that started
    this process, not the parent process, so it is not used.)"""
    parent = multiprocessing.parent_process()
    if parent is None:  # not started by multiprocessing: nothing to watch
        return

    def watch() -> None:
        parent.join()
        os._exit(1)  # no cleanup: the factory or a batch may hold any lock

    threading.Thread(target=watch, name="batchproxy-parent-watchdog", daemon=True).start()


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def _reply(conn: Connection, message: tuple[Any, ...]) -> None:
    try:
        frames = ipc.encode(message)
    except Exception as exc:  # results (or an exception) that cannot be pickled
        try:
            if message[0] != "ok":
                raise
            frames = ipc.encode(("ok", _each_portable(message[1])))
        except Exception:  # not a batch's results, or not one by one either
            error = TypeError(f"the worker's reply could not be pickled: {exc!r}")
            frames = ipc.encode(("raised", *_portable(error)))
    with contextlib.suppress(OSError):  # the proxy's process is gone; nobody waits
        ipc.send(conn, frames)


def _each_portable(results: Any) -> list[Any]:
    """A batch's results, each one that cannot be pickled replaced by a TypeError,
    so that only its own caller fails. Raises if `results` is not a sequence."""
    if isinstance(results, (str, bytes)) or not hasattr(results, "__len__"):
        raise TypeError("not a sequence of results")
    portable = list(results)
    for index, result in enumerate(portable):
        try:
            ipc.encode(result)
        except Exception as exc:
            portable[index] = TypeError(
                f"the result could not be pickled to return from the worker process: {exc!r}"
            )
    return portable


def _portable(exc: BaseException) -> tuple[BaseException, str]:
    """The exception, or a RuntimeError standing in for one that cannot be pickled,
    with its traceback as text (tracebacks do not cross processes)."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}"), text
    return exc, text
