"""Sampling parameters and the reference sampler (temperature -> top-k -> top-p, the order transformers applies)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from brrr.errors import BrrrError


@dataclass
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self):
        _check("max_tokens", self.max_tokens, int, lambda v: v >= 1, ">= 1")
        _check("temperature", self.temperature, (int, float), lambda v: 0 <= v <= 100, "in [0, 100]")
        _check("top_k", self.top_k, int, lambda v: v >= 0, ">= 0 (0 disables it)")
        _check("top_p", self.top_p, (int, float), lambda v: 0 < v <= 1, "in (0, 1]")
        if self.seed is not None:
            _check("seed", self.seed, int, lambda v: 0 <= v < 2**63, "in [0, 2**63)")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise BrrrError(f"stop_token_ids must be a list of non-negative ints, got {self.stop_token_ids!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def _check(name, value, types, ok, limit):
    if isinstance(value, bool) or not isinstance(value, types):
        raise BrrrError(f"{name} must be a number, got {value!r}")
    if not ok(value):
        raise BrrrError(f"{name} must be {limit}, got {value!r}")


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [B, vocab] (fp32) -> token ids [B]."""
    if params.greedy:
        return logits.argmax(dim=-1)
    logits = logits / params.temperature
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=False)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cum <= 1 - params.top_p  # drop the low tail whose mass is <= 1 - top_p; keep at least one
        drop_sorted[:, -1] = False
        logits = logits.masked_fill(drop_sorted.scatter(1, order, drop_sorted), float("-inf"))
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
