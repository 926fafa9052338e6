"""The proposer contract for speculative decoding: what a proposer sees per sequence, and the interface every method
(ngram, draft, eagle) implements; its config is brrr/config/speculative.py. No engine imports here: proposers stay
testable alone."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


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
