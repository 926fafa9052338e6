"""The proposer contract for speculative decoding: the config (vLLM's names), what a proposer sees per sequence, and
the interface every method (ngram, draft, eagle) implements. No engine imports here: proposers stay testable alone."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from brrr.errors import BrrrError

if TYPE_CHECKING:
    import torch

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


@dataclass
class SpecInput:
    seq_id: int                   # stable per sequence (Sequence.seq_id)
    token_ids: list[int]          # prompt + committed output; the last token is not yet in the target's KV cache
    hidden: "torch.Tensor | None" = None
    # eagle only (else None): the target's final hidden states (the model's forward output, after the final norm,
    # before lm_head) [n, hidden_size] for positions L-1-n .. L-2 (L = len(token_ids)): the n positions the target
    # computed and kept since this sequence's previous propose call (n >= 1). Row i pairs with the token it
    # predicted, token_ids[L-n+i].


class Proposer(ABC):
    needs_hidden: bool = False    # eagle: True (the engine then fills SpecInput.hidden)
    device_drafts: bool = False   # it also has `propose_on_device` (drafts left on the device: verify.DeviceDrafts)

    @abstractmethod
    def propose(self, inputs: list[SpecInput], k: int) -> list[list[int]]:
        """Up to k draft tokens per input (fewer or none allowed: that sequence then decodes normally)."""

    def release(self, seq_id: int) -> None:
        """The sequence finished or was preempted: drop any state kept for it."""

    def draft_graph_steps(self) -> int | None:
        """How many of its steps (a draft model's) or proposals (an EAGLE head's) replayed a CUDA graph; None for a
        proposer that has no graphs to replay."""
        return None

    def kv_bytes_per_block(self, block_size: int) -> int:
        """Bytes of the proposer's own cache per block of block_size target tokens (counted when the engine sizes
        the target's KV cache, before `allocate_cache`); 0: it keeps none."""
        return 0

    def allocate_cache(self, num_blocks: int, block_size: int, cuda_graphs: bool, max_batch: int,
                       max_num_batched_tokens: int, k: int, max_model_len: int) -> None:
        """The engine has sized the target's cache (num_blocks of block_size tokens): take the proposer's own,
        and with cuda_graphs capture its graphs for up to max_batch speculating sequences of k drafts."""
