"""What the GPU sections `_generation.py` and `_graphs.py` share: the dtypes
by name, the model's thread, cuDNN attention off, and running a section alone."""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from batchproxy import WorkerThread

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def worker_thread(name: str, device: str) -> WorkerThread:
    """The model's thread: on CUDA, bound to the GPU, with a stream of its own, and
    overlapping (as in the published run of 2026-11-26)."""
    cuda = device == "cuda"
    return WorkerThread(name=name, device="cuda:0" if cuda else None, overlap=cuda)


@contextlib.contextmanager
def no_cudnn_attention(device: str) -> Iterator[None]:
    """Without cuDNN's attention while the section runs (restored after): torch may pick
    it for float16/bfloat16 on Hopper, and it builds an execution plan per new shape, some
    30 ms each, so every step whose key length is new (every decode step, every new
    padded length) would pay for one."""
    if device != "cuda":
        yield
        return
    enabled = torch.backends.cuda.cudnn_sdp_enabled()  # type: ignore[no-untyped-call]
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(enabled)


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend, or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def run_alone(
    run: Callable[[argparse.Namespace], dict[str, Any]],
    name: str,
    description: str | None,
    argv: Sequence[str] | None,
) -> int:
    """A section run alone (for testing it): its result as `name`.json beside its plot;
    1 if it reports an error."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu"))
    args = parser.parse_args(argv)
    result = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    return 1 if result.get("error") else 0
