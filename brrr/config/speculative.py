"""`speculative_config` (vLLM's names and keys): which proposer drafts tokens, how many, and its checks. The
proposers themselves live in brrr/engine/spec/."""
from __future__ import annotations

from dataclasses import dataclass, fields

from brrr.errors import BrrrError

MAX_SPECULATIVE_TOKENS = 16
SPECULATIVE_METHODS = ("ngram", "draft", "eagle")


@dataclass(frozen=True)
class SpeculativeConfig:
    """LLM(..., speculative_config={...}) and `brrr serve --speculative-config JSON`, spelled as vLLM spells them."""
    method: str                   # "ngram" | "draft" | "eagle"
    num_speculative_tokens: int   # k: draft tokens proposed per step
    model: str | None = None      # draft / eagle: a directory
    prompt_lookup_min: int = 1    # ngram: shortest suffix matched
    prompt_lookup_max: int = 4    # ngram: longest suffix matched
    disable_by_batch_size: int | None = None   # speculation off when more sequences than this run

    def __post_init__(self):
        if self.method not in SPECULATIVE_METHODS:
            raise BrrrError(f"speculative_config.method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                            f"got {self.method!r}")
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
        _check_int("prompt_lookup_min", self.prompt_lookup_min, 1, None)
        _check_int("prompt_lookup_max", self.prompt_lookup_max, self.prompt_lookup_min, None)
        if self.disable_by_batch_size is not None:
            _check_int("disable_by_batch_size", self.disable_by_batch_size, 1, None)
        if self.method in ("draft", "eagle") and not self.model:
            raise BrrrError(f"speculative_config.model is required for method {self.method!r} (a directory)")
        if self.method == "ngram" and self.model is not None:
            raise BrrrError("speculative_config.model is not used by method 'ngram'; remove it")

    @classmethod
    def from_dict(cls, d: dict) -> "SpeculativeConfig":
        if not isinstance(d, dict):
            raise BrrrError(f"speculative_config must be a JSON object, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise BrrrError(f"speculative_config: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        for key in ("method", "num_speculative_tokens"):
            if key not in d:
                raise BrrrError(f"speculative_config.{key} is required")
        return cls(**d)


def _check_int(name: str, value, lo: int, hi: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BrrrError(f"speculative_config.{name} must be an integer, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        limit = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise BrrrError(f"speculative_config.{name} must be {limit}, got {value}")
