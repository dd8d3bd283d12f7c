"""The models `benchmarks/models/tune.py` checks the tuner on, each as the tuner sees one: a
factory of its proxy (given the options to try) and a sample of its items.

- `minilm`: all-MiniLM-L6-v2 behind the demo's `TensorProxy` (length-aware, on its
  worker thread), items tokenized sentences of 8 to 60 words (`examples/sample_text.py`).
- `gpu-sim`: the GPU-shaped model of `benchmarks/servers` (`servers/_gpu_sim.py`: a 4 ms
  GIL-bound launch per batch, a device that takes 1 + 0.3 ms a row and no CPU) behind
  the same proxy and tokenizer as MiniLM, on the same items.

Also usable from the command line, e.g. from `benchmarks/`:
`python -m batchproxy.tune _tune_models:minilm --sample _tune_models:minilm_sample`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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


@functools.cache
def _gpu_sim_parts() -> tuple[type[Any], Any]:
    """The proxy class in front of gpu-sim, and the tokenizer (loaded once)."""
    from minilm import MiniLMEmbedder, load_tokenizer

    class GpuSimEmbedder(MiniLMEmbedder):
        """MiniLM's proxy (length-aware, on its worker thread) whose model is gpu-sim."""

        def _forward(self, batch: Any, /) -> Any:
            return self.model.encode(batch.data["input_ids"], batch.data["attention_mask"])

    return GpuSimEmbedder, load_tokenizer()


def gpu_sim(**options: Any) -> Any:
    """The GPU-shaped model behind MiniLM's proxy (`offload=True`, length-aware)."""
    embedder, tokenizer = _gpu_sim_parts()
    from benchmarks.servers._gpu_sim import GpuSim

    options.setdefault("batch_size", 32)
    return embedder(tokenizer, GpuSim(), offload=True, **options)


def gpu_sim_sample() -> list[Any]:
    from minilm import tokenize

    _, tokenizer = _gpu_sim_parts()
    return [tokenize(tokenizer, text) for text in make_sentences(SAMPLE_SIZE, seed=7)]


MODELS: dict[str, ModelUnderTest] = {
    "minilm": ModelUnderTest("minilm", minilm, minilm_sample),
    "gpu-sim": ModelUnderTest("gpu-sim", gpu_sim, gpu_sim_sample),
}
