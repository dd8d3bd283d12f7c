"""Out-of-memory back-off (opt-in: `Proxy(oom_backoff=True)`): what counts as out of
memory, and the batch cap it lowers.

When a batch runs out of memory, the proxy retries it in halves (recursively,
down to single items), so callers get results rather than the error; only an
item that does not fit alone fails, with the original error. Each out-of-memory
error lowers the effective batch cap to half the size that failed; after
`RECOVER_AFTER` batches in a row succeed at the cap, it creeps back up by a
quarter, never past the configured `batch_size`.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["RECOVER_AFTER", "BatchCap", "is_out_of_memory"]

RECOVER_AFTER = 8
"""Successful batches at the cap before it is raised again."""

OomPredicate = Callable[[BaseException], bool]


def is_out_of_memory(error: BaseException) -> bool:
    """`MemoryError`, any `...OutOfMemoryError` (e.g. `torch.cuda.OutOfMemoryError`,
    told by name so torch is not imported), or a `RuntimeError` saying "out of memory"
    (how older torch versions report it)."""
    if isinstance(error, MemoryError) or type(error).__name__.endswith("OutOfMemoryError"):
        return True
    return isinstance(error, RuntimeError) and "out of memory" in str(error).lower()


class BatchCap:
    """The largest batch to form now: `limit` until memory runs out, then lower."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.cap = limit
        self._successes = 0
        self._backed_off = False  # memory ran out; the cap has not crept back to the limit

    def set_limit(self, limit: int) -> None:
        """The configured batch size changed: the cap follows it, down at once, and up
        at once unless memory ran out (then it creeps back up, to the new limit)."""
        self.limit = limit
        self.cap = min(self.cap, limit) if self._backed_off else limit

    def out_of_memory(self, size: int) -> None:
        """A batch of `size` ran out of memory."""
        self.cap = max(1, min(self.cap, size // 2))
        self._successes = 0
        self._backed_off = True

    def succeeded(self, size: int) -> bool:
        """A batch of `size` ran; True when that raised the cap."""
        if self.cap >= self.limit or size < self.cap:
            return False
        self._successes += 1
        if self._successes < RECOVER_AFTER:
            return False
        self.cap = min(self.limit, self.cap + max(1, self.cap // 4))
        self._successes = 0
        self._backed_off = self.cap < self.limit
        return True
