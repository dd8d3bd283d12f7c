"""batchproxy: asyncio-native dynamic batching for model serving.

Many coroutines each `await proxy.inference(x)`; the proxy groups them into
batches by size and delay, runs the model once per batch, and hands each caller
exactly its own result.

NumPy (and torch) load with the tensor features only: `TensorProxy` and the
`batchproxy.tensors` module are imported on first use.
"""

from typing import TYPE_CHECKING as _TYPE_CHECKING
from typing import Any as _Any

from ._batch_args import BatchedArgs, batch_args
from ._decorator import Batched, batch
from ._errors import (
    BatchProxyError,
    BatchSizeMismatch,
    BatchSizeUnreachable,
    BatchTimeout,
    DeadlineExceeded,
    DrainDeadline,
    HostUnavailable,
    InferenceError,
    InvalidItem,
    PoolUnavailable,
    ProxyClosed,
    QueueFull,
    StreamBufferFull,
    WorkerDied,
)
from ._executors.autoscaling import Autoscaling
from ._executors.base import Executor, ModelFactory
from ._executors.process_workers import ProcessWorkers, WorkersStats
from ._executors.staged import StagedModel
from ._executors.worker_thread import WorkerThread
from ._generation import GenerationProxy, Slot, Step
from ._listeners import Listener
from ._loops.background_loop import BackgroundLoop
from ._option_values import BatchSizes, CallOptions, Dedup, Watchdog
from ._options import Options
from ._proxy import Proxy
from ._runs.callers import caller_contexts
from ._runs.keys import batch_key
from ._runs.streams import END, Last, StreamEnd
from ._stats import CostEstimate, Health, Percentiles, ProxyStats

if _TYPE_CHECKING:
    from . import tensors as tensors
    from ._tensor_proxy import TensorProxy

__version__ = "0.2.0"

__all__ = [
    "END",
    "Autoscaling",
    "BackgroundLoop",
    "BatchProxyError",
    "BatchSizeMismatch",
    "BatchSizeUnreachable",
    "BatchSizes",
    "BatchTimeout",
    "Batched",
    "BatchedArgs",
    "CallOptions",
    "CostEstimate",
    "DeadlineExceeded",
    "Dedup",
    "DrainDeadline",
    "Executor",
    "GenerationProxy",
    "Health",
    "HostUnavailable",
    "InferenceError",
    "InvalidItem",
    "Last",
    "Listener",
    "ModelFactory",
    "Options",
    "Percentiles",
    "PoolUnavailable",
    "ProcessWorkers",
    "Proxy",
    "ProxyClosed",
    "ProxyStats",
    "QueueFull",
    "Slot",
    "StagedModel",
    "Step",
    "StreamBufferFull",
    "StreamEnd",
    "TensorProxy",
    "Watchdog",
    "WorkerDied",
    "WorkerThread",
    "WorkersStats",
    "__version__",
    "batch",
    "batch_args",
    "batch_key",
    "caller_contexts",
]


def __getattr__(name: str) -> _Any:
    """`TensorProxy` and `tensors`, imported (with NumPy) when first asked for."""
    if name == "TensorProxy":
        from ._tensor_proxy import TensorProxy

        return TensorProxy
    if name == "tensors":
        import importlib

        return importlib.import_module(".tensors", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
