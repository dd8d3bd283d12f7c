"""Deterministic English-like sentences of varied length, for the demo, tests and benchmarks.

No heavy imports: a load generator can use it without loading torch.
"""

from __future__ import annotations

import random

MIN_WORDS, MAX_WORDS = 8, 60
_WORD_LIST = (
    "the a an of to in for on with at by from about into over after under between "
    "model batch token sentence vector request queue server client thread device "
    "memory cache signal network layer weight input output value result answer "
    "question system process window length padding order time second minute hour "
    "day week year city river mountain forest garden house street market station "
    "library museum school kitchen window table chair book letter story picture "
    "music song voice light shadow morning evening night summer winter spring "
    "autumn weather rain snow wind cloud sun moon star ocean island bridge road "
    "train car bicycle ship plane engine machine computer program function data "
    "quickly slowly quietly carefully easily often never always sometimes usually "
    "runs walks reads writes builds finds keeps takes gives makes sees knows "
    "thinks feels brings holds turns moves starts stops opens closes grows falls "
    "small large old new long short bright dark warm cold early late simple clear "
    "careful strange quiet busy empty full heavy light fast slow happy tired "
    "because while although when where before until unless since therefore"
)
WORDS = _WORD_LIST.split()


def make_sentences(
    count: int, seed: int = 0, min_words: int = MIN_WORDS, max_words: int = MAX_WORDS
) -> list[str]:
    """`count` sentences of `min_words`..`max_words` words, the same on every run."""
    rng = random.Random(seed)
    sentences = []
    for _ in range(count):
        words = [rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words))]
        sentences.append(" ".join(words).capitalize() + ".")
    return sentences
