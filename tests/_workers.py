"""Model factories for worker-process and actor tests: module-level, so picklable."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np


def tagging() -> Callable[[list[Any]], list[Any]]:
    """Each item comes back as (worker pid, item); "bad" fails alone, "boom" fails the
    batch; ("sleep", s) sleeps s seconds first, ("sleep", s, path) after creating the
    file `path` (the batch has reached the process)."""
    pid = os.getpid()

    def model(items: list[Any]) -> list[Any]:
        if "boom" in items:
            raise KeyError("boom in the batch")
        for item in items:
            if isinstance(item, tuple) and item[0] == "sleep":
                if len(item) > 2:
                    Path(item[2]).touch()
                time.sleep(item[1])
        return [
            ValueError(f"bad item {item!r}") if item == "bad" else (pid, item) for item in items
        ]

    return model


def doubling() -> Callable[[list[Any]], list[Any]]:
    """Arrays (or tensors) in, each doubled, plus whether it arrived writable."""

    def model(items: list[Any]) -> list[Any]:
        return [(item * 2, bool(np.asarray(item).flags.writeable)) for item in items]

    return model


def asynchronous() -> Callable[[list[Any]], Any]:
    async def model(items: list[Any]) -> list[Any]:
        return [item + 1 for item in items]

    return model


def failing() -> Callable[[list[Any]], list[Any]]:
    raise RuntimeError("no weights here")


def exiting() -> Callable[[list[Any]], list[Any]]:
    os._exit(3)


def unpicklable_results() -> Callable[[list[Any]], list[Any]]:
    def model(items: list[Any]) -> list[Any]:
        return [lambda item=item: item for item in items]

    return model


def hanging(pid_file: str) -> Callable[[list[Any]], list[Any]]:
    """A model load that never ends; writes its process id to `pid_file` first."""
    with open(pid_file + ".tmp", "w") as file:
        file.write(str(os.getpid()))
    os.replace(pid_file + ".tmp", pid_file)  # whole, or not there
    time.sleep(600)
    raise AssertionError("the test should have stopped this worker")


def hanging_after_first(pid_file: str) -> Callable[[list[Any]], list[Any]]:
    """`tagging` in the first worker to call it, `hanging(pid_file)` in the later ones."""
    try:
        with open(pid_file + ".first", "x"):
            pass
    except FileExistsError:
        return hanging(pid_file)
    return tagging()


def unpicklable_result_for_marker() -> Callable[[list[Any]], list[Any]]:
    """Each item back as it came, except "unpicklable", which comes back as a lambda."""

    def model(items: list[Any]) -> list[Any]:
        return [(lambda: None) if item == "unpicklable" else item for item in items]

    return model


def refuse_to_load() -> None:
    raise ValueError("this item cannot be rebuilt here")


class Unloadable:
    """Pickles, but cannot be unpickled."""

    def __reduce__(self) -> tuple[Any, ...]:
        return refuse_to_load, ()
