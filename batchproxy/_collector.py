"""The process's garbage-collector freeze, and who holds it.

A service freezes what is alive once its model is loaded (the model, torch, the
framework: hundreds of thousands of objects), so that the collector's full passes,
which walk every tracked object, skip them: unfrozen, one pass takes 100-200 ms in a
process with transformers loaded, a pause every caller in flight waits out. `Serving`,
`python -m batchproxy.host` and `python -m batchproxy.tune` (which measures the model
as it will be served) hold the freeze here, and only here.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

__all__ = ["freezes"]


class _Freezes:
    """The freeze, held by those that made it.

    `hold()` collects once (what loading left as garbage is freed, not frozen), then
    freezes what is alive; `release()` by the last holder unfreezes (every frozen
    object, as `gc.unfreeze()` does), so a process that outlives its holders keeps
    nothing frozen. Holders may start and end on several threads' loops: a lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.holders = 0  # changed by hold() and release() only

    def hold(self) -> None:
        gc.collect()  # (outside the lock: the finalizers it runs are user code)
        with self._lock:
            gc.freeze()
            self.holders += 1

    def release(self) -> None:
        with self._lock:
            self.holders -= 1
            if self.holders == 0:
                gc.unfreeze()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Hold the freeze for a block (`hold()`, then `release()` however it ends)."""
        self.hold()
        try:
            yield
        finally:
            self.release()


freezes = _Freezes()
