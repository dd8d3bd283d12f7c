"""The ceiling: the same model in one process, no HTTP, fed full batches.

`python -m benchmarks.servers.ceiling < config.json`, the config
`{"seconds": 10, "texts": [...], "check": [...]}` on stdin (`run.py` starts it, with
the project's Python, in a child process of its own, as it starts each server): loads
the model (`_common.load`: torch on THREADS threads), runs one batch to warm up, then
for `seconds` tokenizes and embeds `texts` in full batches of BATCH_SIZE, one after the
other, and prints one JSON line: the texts per second. With `check`, also the
reference vector of each of those texts: the text run alone, unpadded
(`_common.reference`), which every stack's answer must equal. The model is
`$BENCH_MODEL`'s, as in every server.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from benchmarks.servers._common import BATCH_SIZE, encode_texts, load, reference


def measure(config: dict[str, Any]) -> dict[str, Any]:
    tokenizer, model = load()
    texts: list[str] = config["texts"]
    batches = [texts[i : i + BATCH_SIZE] for i in range(0, len(texts), BATCH_SIZE)]
    batches = [batch for batch in batches if len(batch) == BATCH_SIZE]  # full ones only
    encode_texts(tokenizer, model, batches[0])  # warm-up
    done = 0
    began = time.perf_counter()
    while time.perf_counter() - began < config["seconds"] or done == 0:
        encode_texts(tokenizer, model, batches[done % len(batches)])
        done += 1
    elapsed = time.perf_counter() - began
    result: dict[str, Any] = {"throughput": done * BATCH_SIZE / elapsed, "batches": done}
    if config.get("check"):
        result["reference"] = [
            reference(tokenizer, model, text).tolist() for text in config["check"]
        ]
    return result


if __name__ == "__main__":
    print(json.dumps(measure(json.load(sys.stdin))), flush=True)
