"""Synthetic benchmark workloads: prompts as token ids drawn from a pool, with the output length each should get.

`random`: every prompt independent, lengths uniform in [len * (1 - range_ratio), len * (1 + range_ratio)].
`prefix`: `num_prefixes` shared prefixes of `prefix_len` tokens, prompt i starting with prefix i % num_prefixes
followed by a random suffix - the workload a prefix cache is for (system prompts, few-shot headers).
The pool is any list of valid token ids (a tokenizer's ordinary tokens, or what a server's /tokenize returned).
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from brrr.errors import BrrrError

DATASETS = ("random", "prefix")


@dataclass
class BenchPrompt:
    token_ids: list[int]
    output_len: int

    @property
    def input_len(self) -> int:
        return len(self.token_ids)


def _lengths(rng: random.Random, n: int, mean: int, range_ratio: float) -> list[int]:
    low, high = max(1, round(mean * (1 - range_ratio))), max(1, round(mean * (1 + range_ratio)))
    return [rng.randint(low, high) for _ in range(n)]


def synthetic_prompts(dataset: str, pool: list[int], num_prompts: int, input_len: int, output_len: int,
                      range_ratio: float = 0.0, prefix_len: int = 0, num_prefixes: int = 1,
                      seed: int = 0) -> list[BenchPrompt]:
    if dataset not in DATASETS:
        raise BrrrError(f"dataset must be one of {', '.join(DATASETS)}, got {dataset!r}")
    if not pool:
        raise BrrrError("the token pool is empty: nothing to build prompts from")
    for name, value, low in (("num_prompts", num_prompts, 1), ("input_len", input_len, 1),
                             ("output_len", output_len, 1), ("prefix_len", prefix_len, 0),
                             ("num_prefixes", num_prefixes, 1)):
        if value < low:
            raise BrrrError(f"{name} must be >= {low}, got {value}")
    if not 0 <= range_ratio < 1:
        raise BrrrError(f"range_ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)
    inputs = _lengths(rng, num_prompts, input_len, range_ratio)
    outputs = _lengths(rng, num_prompts, output_len, range_ratio)
    prefixes = [[rng.choice(pool) for _ in range(prefix_len)] for _ in range(num_prefixes)] \
        if dataset == "prefix" else [[]]
    return [BenchPrompt(prefixes[i % len(prefixes)] + [rng.choice(pool) for _ in range(n_in)], n_out)
            for i, (n_in, n_out) in enumerate(zip(inputs, outputs))]


def pseudo_text(num_words: int, seed: int = 0) -> str:
    """Pronounceable nonsense words: text any tokenizer splits into ordinary tokens, never special ones."""
    rng = random.Random(seed)
    consonants, vowels = "bcdfghjklmnprstvwz", "aeiou"
    words = ("".join(rng.choice(consonants) + rng.choice(vowels) for _ in range(rng.randint(1, 3)))
             for _ in range(num_words))
    return " ".join(words)
