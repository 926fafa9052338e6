"""Multi-head latent attention over a paged latent cache (DeepSeek-V2/V3): the torch reference, and the dispatch of
its decode to the Triton kernel.

The cache holds one row per token and layer: the normed latent c (kv_lora_rank) and the rotated shared key k_r
(qk_rope_head_dim), [blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]: 576 values for DeepSeek-V3 where the
expanded keys and values would be 2 x 128 heads x 192. Head h's key is [W_kb^h c, k_r] and its value W_vb^h c,
with W_kb^h [nope, r] and W_vb^h [v, r] the two parts of kv_b_proj's rows for the head.

Decode (one new token) absorbs the weights instead of expanding the cache (DeepSeek-V2's paper, section 2.1.3):
  q_n . (W_kb c) = (W_kb^T q_n) . c, so with q_lat = W_kb^T q_n [r] the score is [q_lat, q_r] . [c, k_r], one
  MQA head of width r + rope that every query head shares; the output is W_vb (sum_t p_t c_t): attention over
  the latents with the latent itself as the value, then each head's W_vb. Per token read: r + rope values, not
  2 x heads x (nope + rope).
Prefill chunks (many new tokens) expand the context's latents into per-head keys and values and attend as MHA:
  the expansion is paid once per chunk and the attention FLOPs stay at nope + rope per head, not r + rope.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from brrr.errors import BrrrError
from brrr.kernels.attention.meta import AttnMeta
from brrr.kernels.dispatch import use_triton
from brrr.kernels.mla_decode import mla_decode_latent_triton, mla_decode_ok


def write_latent_ref(c: torch.Tensor, k_rope: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor):
    """c [N, r], k_rope [N, rope] (rotated) -> the cache rows at slot_mapping."""
    cache.view(-1, cache.shape[-1]).index_copy_(0, slot_mapping, torch.cat((c, k_rope), dim=-1))


def mla_decode_ref(q_nope, q_rope, cache, block_tables, context_lens, w_kb, w_vb, scale):
    """The absorbed decode, vectorised over a batch of one new token each: q_nope [B, H, nope], q_rope [B, H, rope]
    (rotated), cache [blocks, bs, 1, r + rope], context_lens [B] (device) -> [B, H, v]. The one latent head is
    never repeated per query head: scores [B, H, T] come from one batched product with the gathered rows."""
    batch, rank = q_nope.shape[0], w_kb.shape[-1]
    q = torch.cat((torch.einsum("bhd,hdr->bhr", q_nope, w_kb), q_rope), dim=-1)  # [B, H, r + rope]
    rows = cache.index_select(0, block_tables.long().flatten()).view(batch, -1, cache.shape[-1])  # [B, T, r + rope]
    valid = torch.arange(rows.shape[1], device=q.device)[None, :] < context_lens[:, None]
    # slots past a row's context may hold anything (an uninitialized cache: NaN), and 0 * NaN is NaN
    rows = rows.masked_fill(~valid[..., None], 0)
    scores = torch.einsum("bhd,btd->bht", q.float(), rows.float()) * scale
    probs = scores.masked_fill(~valid[:, None, :], float("-inf")).softmax(dim=-1)
    o_lat = torch.einsum("bht,btr->bhr", probs, rows[..., :rank].float()).to(q.dtype)
    return torch.einsum("bhr,hvr->bhv", o_lat, w_vb)


def mla_decode(q_nope, q_rope, cache, block_tables, context_lens, w_kb, w_vb, scale, max_context=None):
    """`mla_decode_ref`'s contract; the latent attention in Triton (brrr/kernels/mla_decode.py) where it runs, the
    two weight absorptions as batched matmuls around it. max_context: a host-known bound of context_lens."""
    rank = w_kb.shape[-1]
    if not (use_triton(q_nope, cache) and mla_decode_ok(q_nope, cache, rank)):
        return mla_decode_ref(q_nope, q_rope, cache, block_tables, context_lens, w_kb, w_vb, scale)
    q = torch.cat((torch.einsum("bhd,hdr->bhr", q_nope, w_kb), q_rope), dim=-1)
    o_lat = mla_decode_latent_triton(q, cache, block_tables, context_lens, rank, scale, max_context=max_context)
    return torch.einsum("bhr,hvr->bhv", o_lat, w_vb)


def _expanded_one(q_nope, q_rope, rows, w_kb, w_vb, scale):
    """One sequence's Tq new tokens, the last Tq of the Tk latent rows [Tk, r + rope] -> [Tq, H, v]."""
    rank = w_kb.shape[-1]
    c, k_rope = rows[:, :rank], rows[:, rank:]
    k_nope = torch.einsum("tr,hdr->htd", c, w_kb)
    k = torch.cat((k_nope, k_rope[None].expand(k_nope.shape[0], -1, -1)), dim=-1)
    v = torch.einsum("tr,hvr->htv", c, w_vb)
    q = torch.cat((q_nope, q_rope), dim=-1).transpose(0, 1)
    tq, tk = q.shape[1], k.shape[1]
    mask = torch.arange(tk, device=q.device)[None, :] <= torch.arange(tk - tq, tk, device=q.device)[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).transpose(0, 1)


def mla_attention(q_nope, q_rope, cache, meta: AttnMeta, w_kb, w_vb, scale):
    """q_nope [N, H, nope], q_rope [N, H, rope] (rotated) of the step's new tokens, whose latent rows are already
    in `cache`; w_kb [H, nope, r], w_vb [H, v, r] -> [N, H, v]. Decode rows absorb, prefill chunks expand."""
    if meta.context_lens is None and meta.max_seqlen_q > 1:
        raise BrrrError("latent attention has no captured multi-token (speculative verify) step yet: serve this "
                        "model without speculative decoding, or with cuda_graphs=False")
    if meta.context_lens is None or meta.max_seqlen_q == 1:  # all decodes (a captured graph's device-only meta too)
        return mla_decode(q_nope, q_rope, cache, meta.block_tables, meta.device_context_lens(q_nope.device),
                          w_kb, w_vb, scale, meta.context_bound(cache.shape[1]))
    out = q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], w_vb.shape[1])
    block_size, start = cache.shape[1], 0
    for b, q_len in enumerate(meta.seqlens_q):
        end, ctx = start + q_len, meta.context_lens[b]
        if q_len == 1:
            out[start:end] = mla_decode(q_nope[start:end], q_rope[start:end], cache, meta.block_tables[b:b + 1],
                                        meta.device_context_lens(q_nope.device)[b:b + 1], w_kb, w_vb, scale, ctx)
        else:
            blocks = meta.block_tables[b, : -(-ctx // block_size)].long()
            rows = cache.index_select(0, blocks).flatten(0, 2)[:ctx]
            out[start:end] = _expanded_one(q_nope[start:end], q_rope[start:end], rows, w_kb, w_vb, scale)
        start = end
    return out
