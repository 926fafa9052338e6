"""Plain-torch attention: the oracle for the Triton kernels, and the path on CPU, under autograd and torch.compile."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from brrr.kernels.attention.kv_quant import as_bytes, dequantize, kv_scales, quantize
from brrr.kernels.attention.meta import AttnMeta


def write_kv_ref(k, v, k_cache, v_cache, slot_mapping, scales=None):
    """scales: (k_scale, v_scale) of an fp8 cache: the values are stored quantized (kv_quant.quantize)."""
    if scales is not None:
        k, v = (as_bytes(quantize(x, s, k_cache.dtype)) for x, s in zip((k, v), scales))
    # index_copy_/index_select rather than advanced indexing, which is far slower on CPU
    as_bytes(k_cache).view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    as_bytes(v_cache).view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)


def read_blocks(cache, blocks, scale, dtype):
    """cache[blocks] in `dtype`: an fp8 cache's bytes gathered, then dequantized."""
    if scale is None:
        return cache.index_select(0, blocks)
    return dequantize(as_bytes(cache).index_select(0, blocks).view(cache.dtype), scale, dtype)


def attention_ref(q, k, v, meta: AttnMeta, layer: int, scale: float, sliding_window: int | None = None):
    """q [N, H, D], k/v [N, KVH, D] for the new tokens -> [N, H * D]."""
    n_heads, n_kv = q.shape[1], k.shape[1]
    if meta.kv_caches is None and len(set(meta.seqlens_q)) == 1 and len(meta.seqlens_q) > 1:
        return _causal_uniform(q, k, v, len(meta.seqlens_q), scale, n_heads // n_kv, sliding_window)
    if meta.kv_caches is not None:
        k_cache, v_cache = meta.kv_caches[layer]
        scales = kv_scales(meta.kv_caches[layer])
        ks, vs = scales or (None, None)
        write_kv_ref(k, v, k_cache, v_cache, meta.slot_mapping, scales)
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
            kb = read_blocks(k_cache, blocks, ks, q.dtype).flatten(0, 1)[:ctx]
            vb = read_blocks(v_cache, blocks, vs, q.dtype).flatten(0, 1)[:ctx]
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


def paged_decode_ref(q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window=None, kv_scales=None):
    """One query token per sequence, vectorised over the batch: q [B, H, D] attends to the first
    context_lens[b] cached tokens of its block table. Reads block_tables.shape[1] whole blocks per sequence.
    kv_scales: (k_scale, v_scale) of an fp8 cache."""
    batch, n_heads, _ = q.shape
    n_kv = k_cache.shape[2]
    flat = block_tables.long().flatten()
    ks, vs = kv_scales or (None, None)
    k = read_blocks(k_cache, flat, ks, q.dtype).view(batch, -1, *k_cache.shape[2:])  # [B, blocks * bs, KVH, D]
    v = read_blocks(v_cache, flat, vs, q.dtype).view(batch, -1, *v_cache.shape[2:])
    pos = torch.arange(k.shape[1], device=q.device)
    mask = pos[None, :] < context_lens[:, None]
    if sliding_window is not None:
        mask &= pos[None, :] >= context_lens[:, None] - sliding_window
    groups = n_heads // n_kv
    k, v = (t.transpose(1, 2).repeat_interleave(groups, dim=1) for t in (k, v))
    o = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask[:, None, None, :], scale=scale)
    return o.reshape(batch, -1)


def paged_verify_ref(q, k, v, k_cache, v_cache, block_tables, context_lens, scale, sliding_window=None,
                     kv_scales=None):
    """Every sequence has the same number Q of new tokens (a captured verify step), vectorised over the batch:
    q [B*Q, H, D] attends to its cached prefix (the first context_lens[b] - Q slots of its block table) and
    causally to its own new k/v [B*Q, KVH, D]. The new keys come from k and v, not the cache: a row's padding
    tokens after its real ones wrote theirs to a spare block, and only later padding tokens see them. kv_scales:
    (k_scale, v_scale) of an fp8 cache (the new tokens' own k/v then enter as the cache holds them)."""
    batch = block_tables.shape[0]
    tq, n_heads, dim = q.shape[0] // batch, q.shape[1], q.shape[2]
    n_kv = k_cache.shape[2]
    flat = block_tables.long().flatten()
    ks, vs = kv_scales or (None, None)
    if kv_scales is not None:  # the new tokens as every later step reads them back
        k, v = (dequantize(quantize(x, s, k_cache.dtype), s, q.dtype) for x, s in ((k, ks), (v, vs)))
    keys = torch.cat([read_blocks(k_cache, flat, ks, q.dtype).view(batch, -1, n_kv, dim),
                      k.view(batch, tq, n_kv, dim)], 1)
    vals = torch.cat([read_blocks(v_cache, flat, vs, q.dtype).view(batch, -1, n_kv, dim),
                      v.view(batch, tq, n_kv, dim)], 1)
    span = keys.shape[1] - tq
    prefix = (context_lens - tq).long()
    q_pos = prefix[:, None] + torch.arange(tq, device=q.device)[None, :]  # [B, Q]
    cached = torch.arange(span, device=q.device)[None, :] < prefix[:, None]  # [B, span]
    causal = torch.ones(tq, tq, dtype=torch.bool, device=q.device).tril()
    mask = torch.cat([cached[:, None, :].expand(batch, tq, span), causal[None].expand(batch, tq, tq)], -1)
    if sliding_window is not None:
        k_pos = torch.cat([torch.arange(span, device=q.device)[None, :].expand(batch, span), q_pos], 1)
        mask &= k_pos[:, None, :] > q_pos[:, :, None] - sliding_window
    groups = n_heads // n_kv
    keys, vals = (t.transpose(1, 2).repeat_interleave(groups, dim=1) for t in (keys, vals))
    o = F.scaled_dot_product_attention(q.view(batch, tq, n_heads, dim).transpose(1, 2), keys, vals,
                                       attn_mask=mask[:, None], scale=scale)
    return o.transpose(1, 2).reshape(batch * tq, n_heads * dim)
