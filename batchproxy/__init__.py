"""batchproxy: asyncio-native dynamic batching for model serving.

Many coroutines each `await proxy.inference(x)`; the proxy groups them into
batches by size and delay, runs the model once per batch, and hands each caller
exactly its own result.
"""

from ._background_loop import BackgroundLoop
from ._cost_model import CostEstimate
from ._decorator import Batched, batch
from ._errors import (
    BatchProxyError,
    BatchSizeMismatch,
    BatchTimeout,
    DeadlineExceeded,
    InferenceError,
    ProxyClosed,
    QueueFull,
    StreamBufferFull,
    WorkerDied,
)
from ._executor import Executor, ModelFactory
from ._generation import GenerationProxy, Slot, Step
from ._listeners import Listener
from ._options import Options
from ._process_workers import ProcessWorkers
from ._proxy import Proxy
from ._stats import Health, Percentiles, ProxyStats
from ._streaming import END, Last, StreamEnd
from ._tensor_proxy import TensorProxy
from ._worker_thread import WorkerThread

__version__ = "0.1.0"

__all__ = [
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
