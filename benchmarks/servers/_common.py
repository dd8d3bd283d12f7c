"""What every server of the benchmark shares: the settings, the model, the port, the exit.

Each server module runs in a child process that `run.py` starts (with its stack's
Python: the project's, or a peer's own virtual environment, which holds torch,
transformers and the model package but not batchproxy's extras). It imports this
module first. Every server runs as `python -m benchmarks.servers.<module>` with the
repository's root on `$PYTHONPATH` (`run.py` sets it: this checkout's batchproxy, for a
peer's environment too), and the package puts `examples/` on `sys.path`, so every stack
loads the model through `examples/minilm.py` (the same weights, tokenizer, pooling and
normalisation); `load` sets torch to THREADS threads.

The model is `$BENCH_MODEL` (the driver's `--model`): `minilm` (the default), or
`gpu-sim` (`_gpu_sim.py`: MiniLM's tokenizer in front of a model shaped like a GPU's).
Every stack runs it through `load`, `encode_texts`, `encode` and `reference` here.

The servers' protocol is the one of `examples/demo.py`'s `serve_app`: the first line on
stdout is `PORT n` (a free port on 127.0.0.1), and the server stops when its stdin
closes (the driver closed it, or died). A server whose framework starts processes of
its own is started as the leader of a process group, and takes that group down.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
from typing import Any

from benchmarks.servers._gpu_sim import NAME as GPU_SIM
from benchmarks.servers._gpu_sim import GpuSim

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

THREADS = 2  # torch's intra-op threads, in every stack and the ceiling
BATCH_SIZE = 64  # the largest batch, where a stack batches
WINDOW_MS = 5.0  # how long a stack may wait to fill a batch, where it has such a window
REQUEST_TIMEOUT_S = 120.0  # a stack's own per-request deadline, where it has one
LOG_VARIABLE = "BENCH_SERVER_LOG"  # where the server writes its stderr (the driver sets it)
# uvicorn's health check of its workers (`timeout_worker_healthcheck`, 5 s by default):
# a spawned worker answers only once it has imported the server's module (torch and
# transformers for the host's workers), which takes longer on a loaded machine; one that
# does not answer in time is killed and started again, and the server never comes up
WORKER_HEALTHCHECK_S = 120
MODEL_VARIABLE = "BENCH_MODEL"  # which model every stack serves (the driver sets it)
MODELS = ("minilm", GPU_SIM)


def log_to_file() -> None:
    """Send this process's stderr (and its children's) to `$BENCH_SERVER_LOG`, if set."""
    path = os.environ.get(LOG_VARIABLE)
    if path:
        log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, 2)
        os.close(log)


def set_threads() -> None:
    import torch

    torch.set_num_threads(THREADS)


def model_name() -> str:
    """`$BENCH_MODEL`, one of MODELS (`minilm` when unset)."""
    name = os.environ.get(MODEL_VARIABLE) or MODELS[0]
    if name not in MODELS:
        raise ValueError(f"${MODEL_VARIABLE}={name!r}: not one of {MODELS}")
    return name


def load() -> tuple[Any, Any]:
    """The tokenizer and the model (`examples/minilm.py`, or `_gpu_sim.GpuSim` behind the
    same tokenizer), torch on THREADS threads."""
    set_threads()
    if model_name() == GPU_SIM:
        from minilm import load_tokenizer

        return load_tokenizer(), GpuSim()
    from minilm import load_minilm

    return load_minilm()


def encode(model: Any, input_ids: Any, attention_mask: Any) -> Any:
    """The model on an (n, L) batch padded on the right: (n, 384) unit vectors."""
    if isinstance(model, GpuSim):
        return model.encode(input_ids, attention_mask)
    from minilm import encode as encode_minilm

    return encode_minilm(model, input_ids, attention_mask)


def encode_texts(tokenizer: Any, model: Any, texts: list[str]) -> Any:
    """A batch of texts, tokenized together (padded on the right, as the proxy pads):
    an (n, 384) tensor of unit vectors."""
    from minilm import MAX_TOKENS

    batch = tokenizer(
        texts, padding=True, truncation=True, max_length=MAX_TOKENS, return_tensors="pt"
    )
    return encode(model, batch["input_ids"], batch["attention_mask"])


def reference(tokenizer: Any, model: Any, text: str) -> Any:
    """The text run alone, unpadded, no proxy (`minilm.reference_embedding`'s way): what
    every batched answer must equal."""
    from minilm import tokenize

    item = tokenize(tokenizer, text)
    return encode(model, item["input_ids"].unsqueeze(0), item["attention_mask"].unsqueeze(0))[0]


def run_workers(factory: str, port: int, workers: int) -> None:
    """uvicorn's supervisor and `workers` workers of the app `factory` ("module:function")
    on `port`, as the multi-worker stacks (host, floor2) run them."""
    import uvicorn

    uvicorn.run(
        factory,
        factory=True,
        host="127.0.0.1",
        port=port,
        workers=workers,
        log_level="warning",
        access_log=False,
        timeout_keep_alive=300,
        backlog=4096,
        timeout_worker_healthcheck=WORKER_HEALTHCHECK_S,
    )


def announce_port() -> int:
    """For a server that binds its own socket: pick a free port on 127.0.0.1, print
    `PORT n` (the one line the driver reads), then send stdout to stderr. Watches stdin:
    at its end, SIGTERM to this process's group (the driver started it as its leader)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    print(f"PORT {port}", flush=True)
    os.dup2(2, 1)  # the driver reads one line; the frameworks' own output goes to the log
    # the pipe is read on a descriptor of its own, unbuffered, and stdin becomes /dev/null:
    # a thread blocked in sys.stdin.read() holds its lock, and a child that multiprocessing
    # forks closes sys.stdin first thing: it would wait on that lock for ever
    pipe = os.dup(0)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)

    def stop_when_the_parent_goes() -> None:
        while os.read(pipe, 4096):
            pass
        os.killpg(os.getpgrp(), signal.SIGTERM)

    threading.Thread(target=stop_when_the_parent_goes, daemon=True).start()
    return port
