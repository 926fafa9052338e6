"""MLA's absorbed decode over the paged latent cache in Triton: `mla_decode_ref` (brrr/kernels/mla_attention.py) as
one split-context kernel and a combine.

Every query head attends to the same latent rows (one MQA head of width r + rope: 512 + 64 for DeepSeek-V2/V3), so
a program takes BLOCK_H query heads of one sequence as the rows of its dot products and streams one part of that
sequence's context once for all of them: scores = q_lat . c + q_rope . k_r (two tl.dots, r and rope each a power of
two), an online softmax in base 2, and acc += p . c (the latent is its own value). The bytes a step reads are the
cache rows, (r + rope) x 2 per token, once per head group; with every head in one group (16 for V2-Lite) that is the
whole step. Parts: a fixed count per launch (`mla_decode_splits`, from the batch and a bound of the contexts, both
known on the host, so a CUDA graph keeps it), each sequence cutting its own context into that many from its length
on the device; each part stores (acc, max, sum) in fp32 and `_mla_combine_kernel` merges them in order. One program
streams only ~15 GB/s (its loop steps are latency-bound: a block-table load, then the rows), so the bandwidth comes
from having every SM hold two programs: that, not the context's length, sets the parts.

Checked against the reference under Triton's interpreter (tests/kernels/test_mla_decode.py) and on the GPU; the
serving path takes it through `mla_decode` (brrr/kernels/mla_attention.py) wherever Triton runs.
"""
from __future__ import annotations

import torch

from brrr.kernels.attention.helpers import LOG2E, precision
from brrr.kernels.dispatch import next_power_of_2, sm_count

try:
    import triton
    import triton.language as tl
except Exception:
    triton = None

MIN_PART = 128  # the fewest cache rows a part of the context takes

if triton is not None:

    @triton.jit
    def _mla_split_kernel(Q, CACHE, BT, CTX, ACC, M, L, n_heads, num_splits, qk_scale, stride_qb, stride_qh,
                          stride_cb, stride_ct, stride_bt, RANK: tl.constexpr, ROPE: tl.constexpr,
                          BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                          PREC: tl.constexpr):
        b, group, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        heads = group * BLOCK_H + tl.arange(0, BLOCK_H)
        h_ok = heads < n_heads
        r = tl.arange(0, RANK)
        p_ = tl.arange(0, ROPE)
        q_base = Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh
        q_lat = tl.load(q_base + r[None, :], mask=h_ok[:, None], other=0.0)
        q_rope = tl.load(q_base + RANK + p_[None, :], mask=h_ok[:, None], other=0.0)
        ctx = tl.load(CTX + b)
        part = tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N  # whole loop steps a part
        lo = split * part
        hi = tl.minimum(ctx, lo + part)
        m = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
        l = tl.zeros((BLOCK_H,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_H, RANK), dtype=tl.float32)
        for t0 in range(lo, hi, BLOCK_N):
            t = t0 + tl.arange(0, BLOCK_N)
            t_ok = t < hi
            block = tl.load(BT + b.to(tl.int64) * stride_bt + t // BLOCK_SIZE, mask=t_ok, other=0).to(tl.int64)
            row = CACHE + block * stride_cb + (t % BLOCK_SIZE) * stride_ct
            c = tl.load(row[:, None] + r[None, :], mask=t_ok[:, None], other=0.0)
            k_r = tl.load(row[:, None] + RANK + p_[None, :], mask=t_ok[:, None], other=0.0)
            s = tl.dot(q_lat, tl.trans(c), input_precision=PREC) + tl.dot(q_rope, tl.trans(k_r), input_precision=PREC)
            s = tl.where(t_ok[None, :], s * qk_scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, None])
            l = l * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=PREC)
            m = m_new
        out = (b.to(tl.int64) * num_splits + split) * n_heads + heads
        tl.store(M + out, m, mask=h_ok)
        tl.store(L + out, l, mask=h_ok)
        tl.store(ACC + out[:, None] * RANK + r[None, :], acc, mask=h_ok[:, None])

    @triton.jit
    def _mla_combine_kernel(ACC, M, L, O, n_heads, num_splits, stride_ob, stride_oh, RANK: tl.constexpr):
        b, h = tl.program_id(0), tl.program_id(1)
        r = tl.arange(0, RANK)
        first = b.to(tl.int64) * num_splits * n_heads + h
        m_all = tl.full((1,), float("-inf"), dtype=tl.float32)
        for s in range(0, num_splits):  # the running max over the parts (an empty part holds -inf)
            m_all = tl.maximum(m_all, tl.load(M + first + s * n_heads + tl.zeros((1,), dtype=tl.int32)))
        total = tl.zeros((1,), dtype=tl.float32)
        acc = tl.zeros((RANK,), dtype=tl.float32)
        for s in range(0, num_splits):  # in part order: the same bits on every run
            at = first + s * n_heads
            m_s = tl.load(M + at + tl.zeros((1,), dtype=tl.int32))
            w = tl.where(m_s == float("-inf"), 0.0, tl.exp2(m_s - m_all))
            total += w * tl.load(L + at + tl.zeros((1,), dtype=tl.int32))
            acc += tl.sum(w[:, None] * tl.load(ACC + at * RANK + r)[None, :], axis=0)
        o = acc / tl.sum(total, axis=0)
        tl.store(O + b.to(tl.int64) * stride_ob + h * stride_oh + r, o.to(O.dtype.element_ty))


def mla_decode_splits(batch: int, head_groups: int, max_context: int, sms: int = 132) -> int:
    """Context parts per sequence: at most one wave of two programs per SM (a third does not fit beside two; a
    second, partial wave cost 30% at 64 x 4k on the H200), no part under 128 tokens (shorter ones lose more to
    the combine than they gain), at most 64."""
    return max(1, min(2 * sms // (batch * head_groups), max_context // MIN_PART, 64))


def launch_config(block_h: int) -> dict:
    """The split kernel's tiles: 16 heads stream (memory-bound), 64 are bound by their dot products."""
    if block_h <= 16:
        return dict(BLOCK_N=32, num_warps=4, num_stages=2)
    return dict(BLOCK_N=64, num_warps=8, num_stages=3)


def mla_decode_ok(q_nope: torch.Tensor, cache: torch.Tensor, rank: int) -> bool:
    rope = cache.shape[-1] - rank
    return (triton is not None and q_nope.dtype == cache.dtype and q_nope.dtype in (torch.float16, torch.bfloat16,
                                                                                    torch.float32)
            and rank >= 16 and rope >= 16 and rank == next_power_of_2(rank) and rope == next_power_of_2(rope)
            and cache.stride(-1) == 1)


def mla_decode_latent_triton(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                             context_lens: torch.Tensor, rank: int, scale: float, splits: int | None = None,
                             max_context: int | None = None) -> torch.Tensor:
    """q [B, H, r + rope] (q_lat and the rotated q_rope), cache [blocks, bs, 1, r + rope] -> the attention over
    the latents [B, H, r] in q's dtype (before W_vb). context_lens [B] int32 on the device (>= 1 each);
    max_context: a bound of them known on the host (the block table's width when None), which sets the parts."""
    batch, heads = q.shape[:2]
    rope = q.shape[-1] - rank
    block_h = 16 if heads <= 16 else 64  # tl.dot's 16-row minimum; over 64 heads: more groups
    groups = triton.cdiv(heads, block_h)
    sms = sm_count(q.device)
    if splits is None:
        bound = block_tables.shape[1] * cache.shape[1] if max_context is None else max_context
        splits = mla_decode_splits(batch, groups, bound, sms)
    acc = torch.empty(batch, splits, heads, rank, dtype=torch.float32, device=q.device)
    m = torch.empty(batch, splits, heads, dtype=torch.float32, device=q.device)
    lse = torch.empty_like(m)
    _mla_split_kernel[(batch, groups, splits)](
        q, cache, block_tables, context_lens, acc, m, lse, heads, splits, scale * LOG2E, q.stride(0), q.stride(1),
        cache.stride(0), cache.stride(1), block_tables.stride(0), RANK=rank, ROPE=rope, BLOCK_SIZE=cache.shape[1],
        BLOCK_H=block_h, PREC=precision(q), **launch_config(block_h))
    out = torch.empty(batch, heads, rank, dtype=q.dtype, device=q.device)
    _mla_combine_kernel[(batch, heads)](acc, m, lse, out, heads, splits, out.stride(0), out.stride(1), RANK=rank,
                                        num_warps=4)
    return out

