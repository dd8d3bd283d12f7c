"""A `TensorProxy` over token sequences of different lengths: 100 callers, a few batches.

Run it with `python examples/tensors.py` (NumPy only, no model download).

Each caller sends its own int64 token array (3 to 40 tokens). The proxy pads a
batch of them on the right, hands the padded `(n, L)` batch to `_forward` once,
and splits the outputs back per caller: the token-level output (a running sum
per position, shape `(n, L)`) is cut back to each caller's own length, the
pooled output (the sum of the real tokens, shape `(n,)`) is row i as it is.
"""

from __future__ import annotations

import asyncio
import random

import numpy as np
from typing_extensions import override

from batchproxy import TensorProxy
from batchproxy.tensors import Collated

CALLERS = 100
BATCH_SIZE = 16

Tokens = np.ndarray  # 1-D int64 token ids
Output = tuple[np.ndarray, np.ndarray]  # (running sums, one per token), pooled total


class ToyEncoder(TensorProxy[Tokens, Output]):
    """Token ids in; per-token running sums and their total out, a padded batch at a time."""

    def __init__(self) -> None:
        # length_aware=True (the default): batches of similar lengths, little padding
        super().__init__(batch_size=BATCH_SIZE, pad_value=0, padding_side="right")

    @override
    def _forward(self, batch: Collated, /) -> tuple[np.ndarray, np.ndarray]:
        tokens = batch.data  # (n, padded_length) int64, pad_value after each item's end
        real = batch.mask if batch.mask is not None else np.ones(tokens.shape, dtype=bool)
        token_level = np.cumsum(tokens, axis=1)  # (n, L): split cuts it to each caller's length
        pooled = np.where(real, tokens, 0).sum(axis=1)  # (n,): the real tokens only
        return token_level, pooled


async def main() -> bool:
    rng = random.Random(0)
    inputs = [
        np.array([rng.randrange(1, 1000) for _ in range(rng.randint(3, 40))], dtype=np.int64)
        for _ in range(CALLERS)
    ]
    async with ToyEncoder() as proxy:
        outputs = await asyncio.gather(*(proxy.inference(tokens) for tokens in inputs))
        stats = proxy.stats
    own = all(
        running.shape == tokens.shape
        and running.dtype == np.int64
        and np.array_equal(running, np.cumsum(tokens))
        and int(total) == int(tokens.sum())
        for tokens, (running, total) in zip(inputs, outputs, strict=True)
    )
    lengths = [len(tokens) for tokens in inputs]
    print(f"callers:       {CALLERS} (token arrays of {min(lengths)} to {max(lengths)} tokens)")
    print(f"model calls:   {stats.batches} batches of at most {BATCH_SIZE}")
    print(f"own output:    {'every caller got its own un-padded output' if own else 'MISMATCH'}")
    first_running, first_total = outputs[0]
    print(f"caller 0:      {len(inputs[0])} tokens in -> {first_running.shape} running sums out")
    print(f"               total {int(first_total)}")
    waste = stats.padding_waste
    print(f"padding waste: {'n/a' if waste is None else f'{waste:.1%}'} of the padded batch")
    return own


if __name__ == "__main__":
    raise SystemExit(0 if asyncio.run(main()) else 1)
