"""Large buffers of the host's messages through POSIX shared memory.

A buffer of `THRESHOLD` bytes or more that a message carries out of band (a NumPy
array's data, a CPU tensor's) is copied once into a new segment, a file in
`DIRECTORY` (`/dev/shm`, memory only) named `bp-<pid>-<16 hex digits>`, mode 0600;
the message carries its `Segment` (name and size) instead of the bytes. Unpickling
the message at the other end maps the segment and hands pickle a buffer over the
mapping: the array received is the writer's bytes, not copied again, and writable.
The mapping is released when the last array made from it is collected. Where a
segment cannot be made (no `/dev/shm`, full: `ENOSPC`, not a `SIGBUS`, since it is
written with `write`, not through a mapping), that buffer travels in the message.

Who unlinks a segment: whichever end gets to it first.

- The reader, as it reads the message: it unlinks each segment the moment it has
  opened it (Linux keeps the mapping after the name is gone), in `read_message`,
  before the call the message belongs to runs, is cancelled or fails; a segment it
  cannot map is unlinked all the same (and fails that call alone, `SegmentLost`).
- The writer, for a segment no reader will get to: pickling that failed after a
  segment was made, a message sealed but never written (the call cancelled first,
  the connection already closed), and every segment it wrote on a connection that
  then closed with them unread. Each end keeps the names it wrote on a connection
  in a `Ledger`, forgets the ones the reader has unlinked (checked in sweeps whose
  cost is amortized over the writes, so the ledger holds about what is in flight),
  and unlinks the rest when the connection closes (a name already gone is no
  error). A host closing while its clients are still there first lets them read
  the answers already written (see `ModelHost`).

What is left behind: the segments of a process killed (`SIGKILL`) between making
them and writing them, and of messages in flight when both ends die. The ledgers
also unlink at interpreter exit; a forked child never unlinks its parent's.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import secrets
import weakref
from collections.abc import Iterable
from typing import Any

__all__ = ["THRESHOLD", "Ledger", "Segment", "SegmentLost", "attach", "put", "unlink"]

THRESHOLD: float = 1 << 20
"""A buffer of this many bytes or more goes through shared memory (`math.inf`: none)."""

DIRECTORY = "/dev/shm"
PREFIX = "bp-"
_NAME = re.compile(r"bp-[0-9]+-[0-9a-f]{16}")  # what a reader agrees to open and unlink
_SWEEP_MIN = 64  # a ledger this small is never swept


class SegmentLost(OSError):
    """A segment a message refers to could not be mapped (gone, or not one of ours)."""


class Segment:
    """A buffer in shared memory as a message carries it: unpickling it attaches it."""

    __slots__ = ("name", "size")

    def __init__(self, name: str, size: int) -> None:
        self.name = name
        self.size = size

    def __reduce__(self) -> tuple[Any, ...]:
        return attach, (self.name, self.size)


def put(view: memoryview) -> Segment | None:
    """A copy of `view` in a new segment, or None where shared memory cannot take it.
    The caller owns the segment: it writes it on a connection or unlinks it."""
    name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
    path = os.path.join(DIRECTORY, name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError:
        return None
    try:
        written = 0
        while written < view.nbytes:
            with view[written:] as rest:  # released here: no view outlives the call
                written += os.write(fd, rest)
    except BaseException as exc:
        _remove(path)
        if isinstance(exc, OSError):
            return None
        raise
    finally:
        os.close(fd)
    return Segment(name, view.nbytes)


def attach(name: str, size: int) -> mmap.mmap | SegmentLost:
    """The segment `name` mapped, and unlinked at once (what `Segment` unpickles to),
    or the error its call fails with."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        return SegmentLost(f"not a shared-memory segment of batchproxy: {name!r}")
    path = os.path.join(DIRECTORY, name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except OSError as exc:
        _remove(path)  # (an open that failed for want of descriptors leaves no segment)
        return SegmentLost(f"shared-memory segment {name}: {exc}")
    try:
        _remove(path)  # first thing: from here on only the mapping holds the memory
        if os.fstat(fd).st_size != size:  # past its end, a mapping faults (SIGBUS)
            return SegmentLost(f"shared-memory segment {name} is not {size} bytes")
        return mmap.mmap(fd, size)
    except (OSError, ValueError) as exc:
        return SegmentLost(f"shared-memory segment {name}: {exc}")
    finally:
        os.close(fd)


def unlink(names: Iterable[str]) -> None:
    """Remove these segments; one already gone (its reader got there first) is fine."""
    for name in names:
        _remove(os.path.join(DIRECTORY, name))


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


class Ledger:
    """The segments one end wrote on one connection that the other may not have read.

    `add` after writing them, `unlink_all` when the connection closes. A sweep
    forgets the names the reader has unlinked each time the ledger doubles, so the
    ledger stays about as long as what is in flight, at a cost amortized over the
    writes (one `lstat` per name per sweep)."""

    def __init__(self) -> None:
        self._names: set[str] = set()
        self._sweep_at = _SWEEP_MIN
        # the last resort, at exit or when the connection is dropped unclosed
        weakref.finalize(self, _unlink_in, os.getpid(), self._names)

    def __len__(self) -> int:
        return len(self._names)

    def add(self, names: Iterable[str]) -> None:
        self._names.update(names)
        if len(self._names) >= self._sweep_at:
            self.sweep()

    def sweep(self) -> int:
        """Forget the segments already unlinked; returns how many are left."""
        gone = [n for n in self._names if not os.path.lexists(os.path.join(DIRECTORY, n))]
        self._names.difference_update(gone)
        self._sweep_at = max(_SWEEP_MIN, 2 * len(self._names))
        return len(self._names)

    def unlink_all(self) -> None:
        names = list(self._names)
        self._names.clear()
        unlink(names)


def _unlink_in(pid: int, names: set[str]) -> None:
    if os.getpid() == pid:  # a forked child leaves its parent's segments alone
        unlink(list(names))
