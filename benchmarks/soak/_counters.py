"""The soak-through-a-host's counters that outlive their process: a tally in a file
(`mmap`), written by a host or a client as it goes, read by the driver even after the
process was killed.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence
from pathlib import Path

from benchmarks.soak import _mix

# -- counters that outlive their process ---------------------------------------------------

TALLY = ["issued", "succeeded", "failed", "cancelled", "rejected", "timed_out", "unavailable"]
TALLY += ["wrong"]
HOST = ["accepted", "rejected", "shed", "succeeded", "error", "timed_out", "cancelled"]
HOST += ["reconfigurations"]


class Counters:
    """Named int64 counters in a file mapped `MAP_SHARED`: each write is in the page cache
    at once, so another process reads them while this one runs, or after it was killed."""

    def __init__(self, path: str | Path, names: Sequence[str], *, create: bool = False) -> None:
        self.index = {name: i for i, name in enumerate(names)}
        size = 8 * len(names)
        with open(path, "w+b" if create else "r+b") as file:
            if create:
                file.truncate(size)
            self.map = mmap.mmap(file.fileno(), size)
        self.view = memoryview(self.map).cast("q")

    def __getitem__(self, name: str) -> int:
        return int(self.view[self.index[name]])

    def __setitem__(self, name: str, value: int) -> None:
        self.view[self.index[name]] = value

    def add(self, name: str, count: int = 1) -> None:
        self.view[self.index[name]] += count

    def read(self) -> dict[str, int]:
        return {name: int(self.view[i]) for name, i in self.index.items()}

    def close(self) -> None:
        self.view.release()
        self.map.close()


def read_counters(path: Path, names: Sequence[str]) -> dict[str, int]:
    counters = Counters(path, names)
    try:
        return counters.read()
    finally:
        counters.close()


def _slot(name: str) -> property:
    return property(
        lambda self: self.counters[name], lambda self, v: self.counters.__setitem__(name, v)
    )


class SharedTally(_mix.Tally):
    """A `_mix.Tally` whose counts live in `Counters` (its `unexpected` list stays here)."""

    def __init__(self, counters: Counters) -> None:
        self.counters = counters
        super().__init__()


for _name in TALLY:
    setattr(SharedTally, _name, _slot(_name))
