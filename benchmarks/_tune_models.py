"""The models `benchmarks/tune.py` checks the tuner on, each as the tuner sees one: a
factory of its proxy (given the options to try) and a sample of its items.

- `minilm`: all-MiniLM-L6-v2 behind the demo's `TensorProxy` (length-aware, on its
  worker thread), items tokenized sentences of 8 to 60 words (`examples/sample_text.py`).
- `gpu-sim`: the GPU-shaped model of `benchmarks/servers` (another change adds it there);
  until it lands, asking for it says so. To add it: a `ModelUnderTest` whose `build`
  returns that model's proxy with the given options, registered in `MODELS`.

Also usable from the command line, e.g. from `benchmarks/`:
`python -m batchproxy.tune _tune_models:minilm --sample _tune_models:minilm_sample`.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

from sample_text import make_sentences  # sets HF_HUB_OFFLINE (examples/minilm.py does too)

SAMPLE_SIZE = 400


@dataclass(frozen=True)
class ModelUnderTest:
    name: str
    build: Callable[..., Any]
    """`build(**options)`: a fresh proxy of the model with these options."""
    sample: Callable[[], list[Any]]
    """The items to call it with."""


@functools.cache
def _minilm_weights() -> tuple[Any, Any]:
    from minilm import load_minilm

    return load_minilm()


def minilm(**options: Any) -> Any:
    """The MiniLM embedder (`offload=True`, length-aware), the weights loaded once."""
    from minilm import MiniLMEmbedder

    tokenizer, model = _minilm_weights()
    options.setdefault("batch_size", 32)
    return MiniLMEmbedder(tokenizer, model, offload=True, **options)


def minilm_sample() -> list[Any]:
    from minilm import tokenize

    tokenizer, _ = _minilm_weights()
    return [tokenize(tokenizer, text) for text in make_sentences(SAMPLE_SIZE, seed=7)]


def _gpu_sim(**options: Any) -> Any:
    raise SystemExit(
        "gpu-sim: the GPU-shaped model of benchmarks/servers is not here yet; register it "
        "in benchmarks/_tune_models.py MODELS once it lands"
    )


MODELS: dict[str, ModelUnderTest] = {
    "minilm": ModelUnderTest("minilm", minilm, minilm_sample),
    "gpu-sim": ModelUnderTest("gpu-sim", _gpu_sim, lambda: []),
}
