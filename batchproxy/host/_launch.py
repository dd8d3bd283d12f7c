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
- **A failed load is said, not retried.** A candidate whose load fails (the lock
  file, importing the factory's module, calling the factory, the socket) writes why
  on a pipe to the worker that started it (`--report-fd`) and exits with status
  `LOAD_FAILED`: that worker's `start()` raises it at once rather than starting
  candidates until `start_timeout`.

The worker reaps the candidates it started (`running`), so none stays a zombie.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import weakref

__all__ = ["LOAD_FAILED", "RELAUNCH_PAUSE_MAX", "Candidate", "hold_lock", "lock_is_free"]

LOAD_FAILED = 3
"""The exit status of `python -m batchproxy.host` when its load fails."""

RELAUNCH_PAUSE_MAX = 60.0
"""The longest pause, in seconds, before the health watch starts again a host whose
last start failed to load (the pause doubles from `health_every` up to this)."""


class Candidate:
    """A host process this worker started (it may have lost the race and exited, or
    failed to load: `failure`)."""

    def __init__(self, spec: str, path: str, exit_when_idle: float) -> None:
        read, write = os.pipe()  # the candidate's report, if its load fails
        command = [sys.executable, "-m", "batchproxy.host", spec, "--socket", path,
                   "--lock", "--exit-when-idle", repr(exit_when_idle), "--freeze-gc",
                   "--report-fd", str(write)]  # fmt: skip
        try:
            self.process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                cwd=os.getcwd(),
                pass_fds=(write,),
            )
        except BaseException:
            os.close(read)
            raise
        finally:
            os.close(write)
        self._report = read
        self._close_report = weakref.finalize(self, os.close, read)
        self.failure: str | None = None
        """Why it failed to load, once it has exited saying so (else None)."""

    @property
    def running(self) -> bool:
        """Whether it still runs (reaping it if it ended, and reading its `failure`)."""
        if self.process.poll() is None:
            return True
        if self._close_report.alive:
            try:
                if self.process.returncode == LOAD_FAILED:
                    self.failure = _read_report(self._report) or (
                        f"the host process exited with status {LOAD_FAILED}"
                    )
            finally:
                self._close_report()
        return False


def _read_report(fd: int) -> str:
    """What a candidate that has exited wrote on its report pipe (without waiting: a
    process it forked may still hold the pipe open)."""
    os.set_blocking(fd, False)
    try:
        return os.read(fd, 65536).decode("utf-8", "replace").strip()
    except BlockingIOError:
        return ""


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
