"""After `os.fork()`: a child of a process that already ran proxies (on the default
background loop, on worker threads, on a `BackgroundLoop` of its own) gets answers
from them, on threads of its own, instead of hanging on the parent's dead threads.
This is what a `gunicorn --preload` server does after warming its models up."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import pytest
from _support import Recorder, ThreadRecorder

import batchproxy

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


def in_forked_child(work: Callable[[], Any], seconds: float = 30.0) -> Any:
    """Run `work()` in a forked child; its JSON-able result, or fail if it hangs."""
    read, write = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # 3.12+: fork with threads
        pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        code = 1
        try:
            os.close(read)
            os.write(write, json.dumps(work()).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    deadline = time.monotonic() + seconds
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(read)
            pytest.fail(f"the forked child hung for {seconds} s")
        time.sleep(0.01)
    with os.fdopen(read) as pipe:
        output = pipe.read()
    assert os.waitstatus_to_exitcode(done[1]) == 0, output
    return json.loads(output)


def test_proxies_used_before_a_fork_answer_in_the_child() -> None:
    synced = Recorder(name="synced")  # on the default background loop
    threaded = ThreadRecorder(name="threaded")  # a plain def: on a worker thread
    assert synced.inference_sync(1, timeout=10) == ("out", 1)

    async def warm_up() -> object:
        return await threaded.inference(2)

    assert asyncio.run(warm_up()) == ("out", 2)

    def child() -> list[Any]:
        async def call() -> object:
            return await asyncio.wait_for(threaded.inference(4), 10)

        return [synced.inference_sync(3, timeout=10), asyncio.run(call())]

    assert in_forked_child(child) == [["out", 3], ["out", 4]]  # (JSON makes lists)
    assert synced.inference_sync(5, timeout=10) == ("out", 5)  # the parent goes on
    assert asyncio.run(warm_up()) == ("out", 2)


def test_a_background_loop_started_before_a_fork_runs_in_the_child() -> None:
    with batchproxy.BackgroundLoop(name="before-fork") as loop:
        assert loop.run(asyncio.sleep(0, "parent"), timeout=10) == "parent"

        def child() -> str:
            return loop.run(asyncio.sleep(0, "child"), timeout=10)

        assert in_forked_child(child) == "child"
        assert loop.run(asyncio.sleep(0, "still"), timeout=10) == "still"


def test_a_fork_while_another_thread_holds_the_default_loops_lock_does_not_hang_the_child(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A thread creating the default background loop when the process forks holds its
    lock; that thread is gone in the child, so the child must not wait for the lock."""
    monkeypatch.setattr(batchproxy.BackgroundLoop, "_default", None)  # none made yet
    held, release = threading.Event(), threading.Event()

    def hold_the_lock() -> None:
        with batchproxy.BackgroundLoop._default_lock:
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold_the_lock)
    holder.start()
    try:
        assert held.wait(10)
        proxy = Recorder(name="after-fork")
        assert in_forked_child(lambda: proxy.inference_sync(1, timeout=10), seconds=15) == [
            "out",
            1,
        ]
    finally:
        release.set()
        holder.join()
