"""A model host in its own process, for the model-host tests and benchmarks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def environment(**extra: str) -> dict[str, str]:
    paths = [str(TESTS), str(ROOT), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p), **extra}


class HostProcess:
    """`python -m batchproxy.host _host_models:FACTORY --socket PATH`, started and
    stopped here (killed on failure)."""

    def __init__(self, path: str, delay: float = 0.0, factory: str = "tagged", *flags: str) -> None:
        self.path = path
        command = [sys.executable, "-m", "batchproxy.host", f"_host_models:{factory}"]
        self.process = subprocess.Popen(
            [*command, "--socket", path, *flags],
            env=environment(HOST_MODEL_DELAY=str(delay)),
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.process.stderr is not None
        line = self.process.stderr.readline()  # "serving ... on PATH" once listening
        assert "serving" in line, line

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=30)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
