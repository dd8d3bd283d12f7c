"""Left padding gives a causal model the same outputs as unbatched runs; naive right padding
does not.

A tiny GPT-2 with random weights (built from a config, nothing downloaded). Every
caller's last-position logits from a left-padded batch must equal the logits of
its prompt run alone. The naive right-padded variant reads position -1, a pad for
every prompt shorter than the batch, which proves the comparison can fail.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from typing_extensions import override

from batchproxy import TensorProxy
from batchproxy.tensors import Collated

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ATOL = 1e-5
PROMPT_LENGTHS = [5, 12, 1, 9, 3, 16, 7, 2, 11, 4, 14, 6]


@pytest.fixture(scope="module")
def model() -> Any:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2,
        n_head=2,
        n_embd=32,
        vocab_size=100,
        n_positions=64,
        bos_token_id=1,
        eos_token_id=1,  # the defaults (50256) lie outside this vocabulary
    )
    return transformers.GPT2LMHeadModel(config).eval()


@pytest.fixture(scope="module")
def prompts() -> list[Any]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(1, 100, (n,), generator=generator) for n in PROMPT_LENGTHS]


def unbatched_logits(model: Any, prompt: Any) -> Any:
    with torch.inference_mode():
        return model(input_ids=prompt[None]).logits[0, -1]


class LastTokenLogits(TensorProxy[Any, Any]):
    """Next-token logits for each prompt: `(vocab,)` per caller.

    Position ids count real tokens only, so a left-padded prompt sees the same
    positions as when it runs alone. `naive=True` reads position -1 whatever the
    padding (wrong with right padding).
    """

    def __init__(self, model: Any, *, naive: bool = False, **options: Any) -> None:
        self.model = model
        self.naive = naive
        self.batch_sizes: list[int] = []
        self.padding_sides: set[str] = set()
        super().__init__(pad_value=0, **options)

    @override
    def _forward(self, batch: Collated, /) -> Any:
        input_ids = batch.data
        mask = batch.mask
        if mask is None:
            mask = torch.ones_like(input_ids, dtype=torch.bool)
        position_ids = (mask.long().cumsum(-1) - 1).clamp(min=0)
        self.batch_sizes.append(len(batch.lengths))
        if batch.mask is not None:
            self.padding_sides.add(batch.padding_side)
        with torch.inference_mode():
            logits = self.model(
                input_ids=input_ids, attention_mask=mask.long(), position_ids=position_ids
            ).logits
        if self.naive or batch.padding_side == "left":
            return logits[:, -1]
        last = torch.tensor(batch.lengths) - 1  # right padding read correctly
        return logits[torch.arange(len(last)), last]


async def run_concurrently(proxy: LastTokenLogits, prompts: list[Any]) -> list[Any]:
    async with proxy:
        calls = (proxy.inference(prompt) for prompt in prompts)
        return list(await asyncio.wait_for(asyncio.gather(*calls), 30))


async def test_left_padding_matches_unbatched_runs(model: Any, prompts: list[Any]) -> None:
    proxy = LastTokenLogits(model, padding_side="left", batch_size=4)
    results = await run_concurrently(proxy, prompts)
    assert sum(proxy.batch_sizes) == len(prompts)
    assert len(proxy.batch_sizes) >= 3  # several batches
    assert max(proxy.batch_sizes) > 1  # real batching happened
    assert proxy.padding_sides == {"left"}  # and real left padding
    for prompt, logits in zip(prompts, results, strict=True):
        assert logits.shape == (100,)
        torch.testing.assert_close(logits, unbatched_logits(model, prompt), rtol=0, atol=ATOL)


async def test_right_padding_read_at_each_length_matches_too(
    model: Any, prompts: list[Any]
) -> None:
    proxy = LastTokenLogits(model, padding_side="right", batch_size=4)
    results = await run_concurrently(proxy, prompts)
    assert proxy.padding_sides == {"right"}
    for prompt, logits in zip(prompts, results, strict=True):
        torch.testing.assert_close(logits, unbatched_logits(model, prompt), rtol=0, atol=ATOL)


async def test_naive_right_padding_is_wrong_for_shorter_prompts(
    model: Any, prompts: list[Any]
) -> None:
    """Position -1 of a right-padded row is a pad: the comparison above would catch it."""
    short, long = prompts[2], prompts[5]  # lengths 1 and 16
    proxy = LastTokenLogits(model, naive=True, padding_side="right", batch_size=2)
    async with proxy:
        got_short, got_long = await asyncio.wait_for(proxy.inference_many([short, long]), 30)
    assert proxy.batch_sizes == [2]
    torch.testing.assert_close(got_long, unbatched_logits(model, long), rtol=0, atol=ATOL)
    error = (got_short - unbatched_logits(model, short)).abs().max().item()
    assert error > 1e-3
