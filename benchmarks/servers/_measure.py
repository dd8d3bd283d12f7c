"""One stack measured: its server started (`StackService`), warmed up, its vectors
checked, every level run, stopped; and the ceiling (`ceiling.py`) in a child process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from demo import Service

from benchmarks._harness.clients import Clients, percentile_ms
from benchmarks.servers._common import LOG_VARIABLE, MODEL_VARIABLE, MODELS
from benchmarks.servers._stacks import (
    CEILING_TIMEOUT,
    LOGS,
    SERVER_ENV,
    STARTUP_TIMEOUT,
    TOLERANCE,
    Stack,
    log,
)

# ----------------------------------------------------------------------------- servers


class StackService(Service):
    """A stack's server (`demo.Service`: the `PORT n` line, stdin held open), leading a
    process group of its own, its stderr in benchmarks/servers/.logs/<stack>.log; ready
    once it has answered real requests for `ready_for` seconds in a row, each on a new
    connection, all 200 (the model loaded, every worker up: with several workers a
    connection reaches any one of them, and one answer says only that one is up; a
    worker still loading answers 503, and the clients of a run that began then would
    fail)."""

    ready_for = 1.0

    def __init__(self, stack: Stack, python: Path, model: str = MODELS[0]) -> None:
        LOGS.mkdir(parents=True, exist_ok=True)
        self.log = LOGS / f"{stack.name}.log"
        env = {**SERVER_ENV, LOG_VARIABLE: str(self.log), MODEL_VARIABLE: model}
        command = [str(python), "-m", f"benchmarks.servers.{stack.module}", *stack.args]
        super().__init__(command, STARTUP_TIMEOUT, env=env, own_group=True)
        self.path = stack.path

    def is_ready(self) -> bool:
        until = time.monotonic() + self.ready_for
        while self._answers():
            if time.monotonic() >= until:
                return True
        return False

    def _answers(self) -> bool:
        """One request, on a connection of its own: answered 200?"""
        try:
            answer = httpx.post(f"{self.base_url}{self.path}", json={"text": "Ready?"}, timeout=10)
        except httpx.TransportError:
            return False
        return answer.status_code == 200


@dataclass(frozen=True)
class Plan:
    model: str  # one of MODELS
    levels: tuple[int, ...]
    rounds: int
    seconds: float
    warmup_seconds: float
    texts: list[str] = field(repr=False)
    check: list[str] = field(repr=False)


def check_vectors(
    clients: Clients, stack: Stack, plan: Plan, reference: list[list[float]]
) -> dict[str, Any]:
    """CHECK_TEXTS sentences at once: each answer within TOLERANCE of its reference (the
    floor: 384 floats each)."""
    import numpy as np

    burst = clients.burst(stack.path, plan.check, 1)
    answers = burst["answers"]
    if burst["errors"] or any(not isinstance(answer, dict) for answer in answers):
        return {"ok": False, "errors": burst["errors"], "error": burst["error"]}
    got = np.array([answer["embedding"] for answer in answers], dtype=np.float64)
    expected = np.array(reference, dtype=np.float64)
    if got.shape != expected.shape:
        return {"ok": False, "error": f"shape {got.shape}, expected {expected.shape}"}
    if not stack.model:
        return {"ok": True, "texts": len(answers), "max_abs_diff": None}
    worst = float(np.abs(got - expected).max())
    return {"ok": worst <= TOLERANCE, "texts": len(answers), "max_abs_diff": worst}


def measure_stack(
    stack: Stack, python: Path, clients: Clients, plan: Plan, reference: list[list[float]]
) -> dict[str, Any]:
    """Start the stack, warm it up, check its vectors, run every level, stop it."""
    service = StackService(stack, python, plan.model)
    try:
        service.start()
        log(f"{stack.name}: ready at {service.base_url} in {service.startup_seconds:.1f} s")
        clients.open(service.base_url)
        clients.loop(stack.path, max(plan.levels), plan.warmup_seconds, 1, plan.texts)
        check = check_vectors(clients, stack, plan, reference)
        levels = {}
        for level in plan.levels:
            loop = clients.loop(stack.path, level, plan.seconds, 1, plan.texts)
            latencies = loop["latencies"]
            levels[level] = {
                "throughput": len(latencies) / plan.seconds,
                "p50_ms": percentile_ms(latencies, "p50"),
                "p99_ms": percentile_ms(latencies, "p99"),
                "requests": len(latencies),
                "errors": loop["errors"],
                "error": loop["error"],
            }
            log(
                f"{stack.name} c={level}: {levels[level]['throughput']:.1f} req/s, "
                f"p99 {levels[level]['p99_ms'] or float('nan'):.1f} ms, {loop['errors']} errors"
            )
        return {"startup_s": service.startup_seconds, "check": check, "levels": levels}
    finally:
        service.stop()


def run_ceiling(
    seconds: float, texts: list[str], check: list[str], model: str = MODELS[0]
) -> dict[str, Any]:
    """`ceiling.py` in a child process: texts/s in full batches (and the references)."""
    LOGS.mkdir(parents=True, exist_ok=True)
    config = json.dumps({"seconds": seconds, "texts": texts, "check": check})
    with (LOGS / "ceiling.log").open("a") as err:
        done = subprocess.run(
            [sys.executable, "-m", "benchmarks.servers.ceiling"],
            check=False,
            input=config,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            timeout=CEILING_TIMEOUT,
            env={**os.environ, **SERVER_ENV, MODEL_VARIABLE: model},
        )
    if done.returncode != 0:
        raise RuntimeError(f"ceiling.py failed ({done.returncode}): see {LOGS / 'ceiling.log'}")
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result
