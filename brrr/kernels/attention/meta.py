"""`AttnMeta`: what one step's attention needs to know about its batch and the paged KV cache.

A contiguous per-sequence cache is the paged layout with one block per sequence (block_size = its capacity), so the
reference generator and the paged engine share this op.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttnMeta:
    cu_seqlens_q: torch.Tensor  # [B+1] int32: where each sequence's new tokens start in the flattened batch
    seqlens_q: list[int]  # host copy of the query lengths (the reference loops over sequences)
    context_lens: list[int] | None = None  # tokens of K/V each sequence attends to, new ones included
    slot_mapping: torch.Tensor | None = None  # [N] int64: cache slot (block * block_size + offset) of each new token
    block_tables: torch.Tensor | None = None  # [B, max_blocks] int32
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per layer (k, v): [blocks, block_size, kv_heads, hd]
    # For the Triton kernels (optional: derived from the fields above on first use when left None).
    # A CUDA-graph decode step must set both, since nothing may be copied from the host inside a captured step:
    context_lens_t: torch.Tensor | None = None  # [B] int32 on the device: context_lens (a 0 row outputs zeros)
    # >= every context length: the context bound that fixes the decode kernel and its launch (`plan.decode_plan`);
    # a captured graph's bound
    max_context_len: int | None = None
    # attention computed elsewhere, after RoPE: attend(q, k, v, scale, sliding_window) -> [N, H * D] (context
    # parallel training's ring over the ranks, brrr/train/parallel/ring_attention.py); None: this op's own paths
    attend: object | None = None
    # called observe(layer, q, scale) after a layer's attention, with its rotated queries [N, H, D] and the new K/V
    # in the cache (SnapKV's scores and compaction, brrr/engine/snapkv.py); None: nothing to call
    observe: object | None = None
    _derived: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # per-step host facts

    @classmethod
    def causal(cls, seqlens: list[int], device) -> "AttnMeta":
        """No cache: each sequence attends causally to its own tokens (training, one-shot scoring)."""
        cu = torch.zeros(len(seqlens) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(seqlens).cumsum(0)
        return cls(cu_seqlens_q=cu.to(device), seqlens_q=list(seqlens))

    @property
    def max_seqlen_q(self) -> int:
        if "max_q" not in self._derived:
            self._derived["max_q"] = max(self.seqlens_q)
        return self._derived["max_q"]

    @property
    def has_single_token_rows(self) -> bool:
        """Whether some sequence has exactly one new token (a decode): those go to the decode kernel."""
        if "single" not in self._derived:
            self._derived["single"] = min(self.seqlens_q) == 1
        return self._derived["single"]

    def device_context_lens(self, device) -> torch.Tensor:
        if self.context_lens_t is None:
            self.context_lens_t = torch.tensor(self.context_lens, dtype=torch.int32, device=device)
        return self.context_lens_t

    def context_bound(self, block_size: int) -> int:
        """An upper bound of the context lengths, known on the host."""
        if self.max_context_len is not None:
            return self.max_context_len
        if self.context_lens is not None:
            if "max_ctx" not in self._derived:
                self._derived["max_ctx"] = max(self.context_lens)
            return self._derived["max_ctx"]
        return self.block_tables.shape[1] * block_size
