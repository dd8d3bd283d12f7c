"""What the scale-out benchmark runs: its sizes (`Config`), the targets, and Ray when it is
installed (started once, with the GIL-bound model's module pickled by value).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

from batchproxy import ModelFactory
from benchmarks.scaleout import _gil_model

if TYPE_CHECKING:
    from batchproxy.integrations.ray import RayActors


CALLERS = 64
BATCH_SIZE = 16
WORKERS = 2  # worker processes, Ray actors; one CPU each
TARGET_PROCESSES_VS_THREAD = 1.6

DISPATCH_ITEMS = list(range(BATCH_SIZE))
PAYLOAD_ARRAYS = 16
PAYLOAD_FLOATS = 250_000  # float32: 1 MB per array
PAYLOAD_MB = PAYLOAD_ARRAYS * PAYLOAD_FLOATS * 4 / 1e6  # each way


@dataclass(frozen=True)
class Config:
    rounds: int  # turns per side, per phase
    round_seconds: float
    warmup_seconds: float
    calibration_batches: int
    ceiling_rounds: int
    ceiling_seconds: float
    dispatch_batches: int
    dispatch_warmup: int
    payload_round_trips: int


FULL = Config(
    rounds=8,
    round_seconds=1.25,
    warmup_seconds=1.0,
    calibration_batches=40,
    ceiling_rounds=4,
    ceiling_seconds=1.0,
    dispatch_batches=1_000,
    dispatch_warmup=50,
    payload_round_trips=20,
)
QUICK = Config(
    rounds=2,
    round_seconds=1.0,
    warmup_seconds=0.3,
    calibration_batches=5,
    ceiling_rounds=1,
    ceiling_seconds=0.5,
    dispatch_batches=100,
    dispatch_warmup=10,
    payload_round_trips=3,
)


# -- Ray, when installed -------------------------------------------------------------------


def import_ray() -> ModuleType | None:
    try:
        import ray
    except ImportError:
        return None
    return ray


def start_ray(ray: ModuleType) -> None:
    # actors unpickle the factories: send _gil_model by value, not by a name they may
    # not be able to import
    ray.cloudpickle.register_pickle_by_value(_gil_model)
    ray.init(
        num_cpus=WORKERS,
        include_dashboard=False,
        log_to_driver=False,
        logging_level=logging.WARNING,
    )


def ray_actors(factory: ModelFactory) -> RayActors:
    from batchproxy.integrations.ray import RayActors

    return RayActors(factory, WORKERS, num_cpus=1, name="scaleout")
