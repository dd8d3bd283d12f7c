"""The public surface, pinned (as httpx's `test_exported_members.py` does): a name
added to or dropped from `batchproxy` is a decision, made here too."""

from __future__ import annotations

import subprocess
import sys
import types

import batchproxy

PUBLIC = [
    "END",
    "BackgroundLoop",
    "BatchProxyError",
    "BatchSizeMismatch",
    "BatchTimeout",
    "Batched",
    "CostEstimate",
    "DeadlineExceeded",
    "Executor",
    "GenerationProxy",
    "Health",
    "InferenceError",
    "Last",
    "Listener",
    "ModelFactory",
    "Options",
    "Percentiles",
    "ProcessWorkers",
    "Proxy",
    "ProxyClosed",
    "ProxyStats",
    "QueueFull",
    "Slot",
    "Step",
    "StreamBufferFull",
    "StreamEnd",
    "TensorProxy",
    "WorkerDied",
    "WorkerThread",
    "__version__",
    "batch",
]
"""Everything `from batchproxy import ...` offers; the modules `tensors`, `simulation`
and `integrations.*` are public too, imported by name."""


def test_the_public_names_are_exactly_these() -> None:
    assert batchproxy.__all__ == PUBLIC


def test_every_public_name_is_exported_and_nothing_else_is_public() -> None:
    for name in PUBLIC:
        assert getattr(batchproxy, name) is not None
    public_modules = {"tensors", "simulation", "integrations"}
    exposed = {
        name
        for name, value in vars(batchproxy).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert exposed <= set(PUBLIC), exposed - set(PUBLIC)
    modules = {
        name
        for name, value in vars(batchproxy).items()
        if not name.startswith("_") and isinstance(value, types.ModuleType)
    }
    assert modules <= public_modules, modules - public_modules


def test_importing_batchproxy_loads_no_numpy() -> None:
    """NumPy (about half of the import time, and its BLAS threads) loads with the
    tensor features only."""
    code = (
        "import sys, batchproxy; "
        "assert 'numpy' not in sys.modules, 'numpy loaded'; "
        "batchproxy.TensorProxy; "
        "assert 'numpy' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
