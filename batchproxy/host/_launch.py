"""Starting a model host from the web workers themselves: any worker that finds no host
on the socket starts a *candidate* (`python -m batchproxy.host SPEC --socket PATH
--lock --exit-when-idle S`), and the candidates race for one lock.

- **One host.** A candidate takes an exclusive `flock` on `PATH.lock` before it
  imports the factory's module or loads anything, and keeps it while it serves; a
  candidate that finds it taken exits at once, having loaded nothing. (The socket
  is the second guard: a live one is never replaced.)
- **Its own lifetime.** The host runs in a session of its own, so a signal to the
  worker that started it (Ctrl-C, uvicorn restarting one worker) does not reach it,
  and it outlives that worker while others are connected. It exits once no worker
  has been connected for `exit_when_idle` seconds: after the server's last worker
  stops, or if none ever connects. A web worker keeps a connection open while it
  serves (its `RemoteProxy`'s watch), so a rolling restart does not stop it.
- **Restarted when lost.** A worker whose watch finds no host starts a candidate
  again (one at a time per worker), unless the lock is held (a host is loading);
  so a host that died comes back.

The worker reaps the candidates it started (`reap`), so none stays a zombie.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys

__all__ = ["Candidate", "hold_lock", "lock_is_free"]


class Candidate:
    """A host process this worker started (it may have lost the race and exited)."""

    def __init__(self, spec: str, path: str, exit_when_idle: float) -> None:
        command = [sys.executable, "-m", "batchproxy.host", spec, "--socket", path,
                   "--lock", "--exit-when-idle", repr(exit_when_idle)]  # fmt: skip
        self.process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, start_new_session=True, cwd=os.getcwd()
        )

    @property
    def running(self) -> bool:
        """Whether it still runs (reaping it if it ended)."""
        return self.process.poll() is None


def hold_lock(path: str) -> int | None:
    """Take the host lock of socket `path` (`PATH.lock`, owner-only): its file
    descriptor, held until it is closed or this process ends; None if another host
    holds it. The empty lock file stays (removing it would let two candidates lock
    two files)."""
    fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def lock_is_free(path: str) -> bool:
    """Whether no host holds the lock of socket `path` now (then a candidate may take
    it; one loading its model holds it)."""
    try:
        fd = hold_lock(path)
    except OSError:  # no folder, say: the candidate will say why
        return True
    if fd is None:
        return False
    os.close(fd)  # (closing the descriptor releases the lock)
    return True
