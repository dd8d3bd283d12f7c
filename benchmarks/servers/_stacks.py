"""What `run.py` measures: the stacks (each a server module of this folder, its path,
a peer's own requirements), the levels, rounds and times, the check's tolerance.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks import pythonpath
from benchmarks.servers._common import THREADS
from benchmarks.servers._gpu_sim import DESCRIPTION as GPU_SIM

HERE = Path(__file__).resolve().parent
LEVELS = (1, 8, 32, 150)
QUICK_LEVELS = (1, 8)
ROUNDS = 3
QUICK_ROUNDS = 1
SECONDS = 15.0  # closed loop per stack, level and round
QUICK_SECONDS = 2.0
WARMUP_SECONDS = 3.0  # at the highest level, after each start, before the check
QUICK_WARMUP_SECONDS = 1.0
MIN_WORDS, MAX_WORDS = 5, 60
TEXTS = 2000  # the sentences the clients cycle through (and the ceiling's batches)
CHECK_TEXTS = 64
DIMENSION = 384
TOLERANCE = 2e-7  # max |stack's vector - the sentence alone, in process|, per component
STARTUP_TIMEOUT = 300.0
CEILING_TIMEOUT = 600.0
TORCH = "torch==2.13.0"  # pinned in every pip command: the CPU build, no CUDA packages
VENVS = HERE / ".venvs"
LOGS = HERE / ".logs"
SERVER_ENV = {
    "OMP_NUM_THREADS": str(THREADS),
    "MKL_NUM_THREADS": str(THREADS),
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONPATH": pythonpath(),  # (a peer's environment has neither batchproxy nor this)
}
CEILING = "ceiling"


@dataclass(frozen=True)
class Stack:
    name: str
    label: str
    module: str  # the server: benchmarks.servers.<module>, run with `python -m`
    path: str  # where it answers POST {"text": ...} with {"embedding": [...]}
    requirements: tuple[str, ...] = ()  # a peer's own packages: its own virtual environment
    model: bool = True  # False: a floor (no vectors to check)
    workers: int = 1  # the processes that serve HTTP (a floor is the floor of its count)
    args: tuple[str, ...] = ()  # the server's command-line arguments

    @property
    def peer(self) -> bool:
        return bool(self.requirements)


STACKS = {
    stack.name: stack
    for stack in (
        Stack("batchproxy", "batchproxy (TensorProxy)", "batchproxy_server", "/embed"),
        Stack("host", "batchproxy, 2 web workers + model host", "host_server", "/embed",
              workers=2),
        Stack("regular", "regular FastAPI", "regular_server", "/embed"),
        Stack("litserve", "LitServe", "litserve_server", "/predict", ("litserve==0.2.19",)),
        Stack("mosec", "mosec", "mosec_server", "/inference", ("mosec==0.9.8",)),
        Stack("floor", "HTTP floor (no model)", "floor_server", "/embed", model=False),
        Stack("floor2", "HTTP floor, 2 workers (no model)", "floor_server", "/embed",
              model=False, workers=2, args=("--workers", "2")),
    )
}  # fmt: skip
ALL = (*STACKS, CEILING)
# minilm: on 2 cores, torch takes both and more web workers only add processes; gpu-sim:
# the model leaves the CPU, the case the host with several web workers is for
DEFAULT = {
    "minilm": tuple(name for name in ALL if name not in ("host", "floor2")),
    "gpu-sim": ALL,
}
MODEL_LABELS = {"minilm": "all-MiniLM-L6-v2", "gpu-sim": GPU_SIM}


def log(message: str) -> None:
    print(f"[servers {time.strftime('%H:%M:%S')}] {message}", flush=True)
