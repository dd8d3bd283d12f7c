"""A progress bar on stderr, for the command line only (the library prints nothing)."""

from __future__ import annotations

import sys
from typing import TextIO

__all__ = ["Bar"]

WIDTH = 30


class Bar:
    """`bar(done, total)` redraws `what [#####.....] done/total` on one line of a terminal;
    elsewhere (a log, a pipe) it writes a line at each quarter."""

    def __init__(self, what: str, stream: TextIO | None = None) -> None:
        self.what = what
        self.stream = stream if stream is not None else sys.stderr
        self.terminal = self.stream.isatty()
        self._quarter = -1

    def __call__(self, done: int, total: int) -> None:
        total = max(total, 1)
        filled = WIDTH * done // total
        text = f"{self.what} [{'#' * filled}{'.' * (WIDTH - filled)}] {done}/{total}"
        if self.terminal:
            end = "\n" if done >= total else ""
            self.stream.write(f"\r{text}{end}")
        else:
            quarter = 4 * done // total
            if quarter == self._quarter:
                return
            self._quarter = quarter
            self.stream.write(text + "\n")
        self.stream.flush()
