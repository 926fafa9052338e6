"""Causal attention over a flattened varlen batch, optionally through a paged KV cache.

Every path describes a step with one `AttnMeta`. A contiguous per-sequence cache is the paged layout with one
block per sequence (block_size = its capacity), so the reference generator and the paged engine share this op.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttnMeta:
    cu_seqlens_q: torch.Tensor  # [B+1] int32: where each sequence's new tokens start in the flattened batch
    seqlens_q: list[int]  # host copy of the query lengths (the reference loops over sequences)
    context_lens: list[int] | None = None  # tokens of K/V each sequence attends to, new ones included
    slot_mapping: torch.Tensor | None = None  # [N] int64: cache slot (block * block_size + offset) of each new token
    block_tables: torch.Tensor | None = None  # [B, max_blocks] int32
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per layer (k, v): [blocks, block_size, kv_heads, hd]

    @classmethod
    def causal(cls, seqlens: list[int], device) -> "AttnMeta":
        """No cache: each sequence attends causally to its own tokens (training, one-shot scoring)."""
        cu = torch.zeros(len(seqlens) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(seqlens).cumsum(0)
        return cls(cu_seqlens_q=cu.to(device), seqlens_q=list(seqlens))

    @property
    def max_seqlen_q(self) -> int:
        return max(self.seqlens_q)


def write_kv_ref(k, v, k_cache, v_cache, slot_mapping):
    k_cache.view(-1, *k_cache.shape[2:])[slot_mapping] = k
    v_cache.view(-1, *v_cache.shape[2:])[slot_mapping] = v


def attention_ref(q, k, v, meta: AttnMeta, layer: int, scale: float, sliding_window: int | None = None):
    """q [N, H, D], k/v [N, KVH, D] for the new tokens -> [N, H * D]."""
    n_heads, n_kv = q.shape[1], k.shape[1]
    if meta.kv_caches is None and len(set(meta.seqlens_q)) == 1 and len(meta.seqlens_q) > 1:
        return _causal_uniform(q, k, v, len(meta.seqlens_q), scale, n_heads // n_kv, sliding_window)
    if meta.kv_caches is not None:
        k_cache, v_cache = meta.kv_caches[layer]
        write_kv_ref(k, v, k_cache, v_cache, meta.slot_mapping)
        block_size = k_cache.shape[1]
    out = torch.empty(q.shape[0], n_heads * q.shape[2], dtype=q.dtype, device=q.device)
    start = 0
    for b, q_len in enumerate(meta.seqlens_q):
        end = start + q_len
        if meta.kv_caches is None:
            kb, vb = k[start:end], v[start:end]
        else:
            ctx = meta.context_lens[b]
            blocks = meta.block_tables[b, : -(-ctx // block_size)].long()
            kb = k_cache[blocks].flatten(0, 1)[:ctx]
            vb = v_cache[blocks].flatten(0, 1)[:ctx]
        out[start:end] = _sdpa_one(q[start:end], kb, vb, scale, n_heads // n_kv, sliding_window)
        start = end
    return out


def _causal_uniform(q, k, v, batch, scale, groups, sliding_window):
    """No cache, equal lengths (training batches): one batched SDPA call instead of a loop over sequences."""
    t = q.shape[0] // batch
    q, k, v = (x.view(batch, t, x.shape[1], x.shape[2]).transpose(1, 2) for x in (q, k, v))
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    mask = None
    if sliding_window is not None and t > sliding_window:
        pos = torch.arange(t, device=q.device)
        mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - sliding_window)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale)
    return o.transpose(1, 2).reshape(batch * t, -1)


def _sdpa_one(q, k, v, scale, groups, sliding_window):
    """One sequence: q [Tq, H, D] are the last Tq of the Tk positions in k/v [Tk, KVH, D]."""
    tq, tk = q.shape[0], k.shape[0]
    if groups > 1:  # GQA: kv head j serves query heads j*groups .. (j+1)*groups-1
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    mask, causal = None, False
    if sliding_window is not None and tk > sliding_window or (tq > 1 and tq != tk):
        q_pos = torch.arange(tk - tq, tk, device=q.device)[:, None]
        k_pos = torch.arange(tk, device=q.device)[None, :]
        mask = k_pos <= q_pos
        if sliding_window is not None:
            mask &= k_pos > q_pos - sliding_window
    elif tq > 1:
        causal = True
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)
    return o.squeeze(0).transpose(0, 1).reshape(tq, -1)


def attention(q, k, v, meta: AttnMeta, layer: int, scale: float, sliding_window: int | None = None):
    return attention_ref(q, k, v, meta, layer, scale, sliding_window)
