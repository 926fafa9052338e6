"""Decode attention: sequences with one new token against the paged cache. `decode_attention_triton` launches the
kernel its `plan.DecodePlan` names; this module holds the split-KV kernel (FlashDecoding: a sequence's context cut
into parts, the last part to arrive combining them), optionally with RoPE and the cache write inside."""
from __future__ import annotations

import torch

from brrr.kernels.attention.helpers import LOG2E, precision
from brrr.kernels.attention.lean import lean_decode
from brrr.kernels.attention.lean_mma import lean_mma_decode
from brrr.kernels.attention.plan import (DECODE_LONG_PART, DECODE_MIN_PART, DecodePlan, decode_plan, split_plan)
from brrr.kernels.dispatch import arrival_counts, next_power_of_2
from brrr.kernels.pdl import pdl_on

try:
    import triton
    import triton.language as tl
except Exception:
    triton = None

if triton is not None:
    from brrr.kernels.attention.helpers import (_online_softmax_step, _paged_rows, _rope, _rope_factors)
    from brrr.kernels.pdl import wait_previous

    @triton.jit
    def _decode_kernel(Q, KC, VC, KS, VS, O, OP, MLP, COUNTS, CU_Q, CTX, BT, K, V, COS, SIN, SLOTS,
                       stride_qn, stride_qh, stride_on, stride_oh, stride_cb, stride_ct, stride_ch, stride_bt,
                       stride_kn, stride_kh, stride_vn, stride_vh, stride_cos,
                       qk_scale, window, n_heads, num_splits, wave, min_part, long_part, BLOCK_SIZE: tl.constexpr,
                       GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_N: tl.constexpr, UNROLL: tl.constexpr, SPLIT: tl.constexpr,
                       SLIDING: tl.constexpr, PREC: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr,
                       ROPE: tl.constexpr, WHOLE: tl.constexpr, KV_FP8: tl.constexpr = False):
        """One program: one sequence with a single new token, one kv head (its GROUP query heads as the rows of
        the dot products), one part of the context. The grid has num_splits parts a sequence (a bound fixed on the
        host, so graphs keep it); each sequence cuts its own context into `_decode_parts` of them, read from its
        length on the device, and the programs past those return. A sequence in one part writes its output; in
        several, each part stores (acc, m, l) and the last to arrive combines them. One launch, no host sync.
        ROPE: q and the new k/v come unrotated from this step's projection (K, V, COS, SIN, SLOTS): each program
        rotates its q heads, and the last part rotates the new key, writes it and v to the cache at the token's slot
        and folds it in from registers (its loop stops one key short), the rotary kernel's work in this one.
        KV_FP8 (never with ROPE: the new K/V are quantized by the cache write before): the cache is float8, each
        tile cast in registers to fp16 (bf16 q is rounded to fp16, saturating: fp8 -> fp16 is one exact conversion
        a pair of values, -> bf16 several) and the scales (KS, VS) multiply the scores and the output, not tiles."""
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        if not EARLY:
            wait_previous(PDL)
        # The step's lengths and block table are inputs, not the previous kernel's outputs: with EARLY they and the
        # first tile's cache rows are read before the wait. No program returns before it (a kernel must not
        # complete before the one it follows).
        q_row = tl.load(CU_Q + b)
        single = tl.load(CU_Q + b + 1) - q_row == 1
        ctx = tl.load(CTX + b)
        lo = 0
        if SLIDING:  # the query sits at ctx - 1 and sees keys > ctx - 1 - window
            lo = tl.maximum(0, ctx - window)
        parts, part = 1, ctx - lo
        if SPLIT:
            parts, part = _decode_parts(ctx - lo, num_splits, wave, min_part, long_part, BLOCK_N, WHOLE)
        lo += split * part
        hi = tl.minimum(ctx, lo + part)
        n = lo + tl.arange(0, BLOCK_N)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        dm = d < HEAD_DIM
        if ROPE:  # cos/sin and the slot are inputs too (made at the start of the forward)
            c, sn, swap, sign = _rope_factors(COS, SIN, q_row, stride_cos, d, dm, HEAD_DIM)
            slot = tl.load(SLOTS + q_row).to(tl.int64)
            new_key = (split == parts - 1) & (ctx > 0)  # this part ends at the new token's position ctx - 1
            hi = tl.where(new_key, hi - 1, hi)  # the new key comes from registers, after the loop
            if EARLY:  # so every cached key is an input too: the part's first tile is read before the wait
                nm0 = n < hi
                rows = _paged_rows(BT, b, stride_bt, n, nm0, kvh, BLOCK_SIZE, stride_cb, stride_ct, stride_ch)
                kt0 = tl.load(KC + rows[None, :] + d[:, None], mask=nm0[None, :] & dm[:, None], other=0.0)
                v0 = tl.load(VC + rows[:, None] + d[None, :], mask=nm0[:, None] & dm[None, :], other=0.0)
        if EARLY:
            wait_previous(PDL)
        if not single:  # a prefill chunk: the prefill kernel's
            return
        if split >= parts:
            return
        heads = kvh * GROUP + g
        gm = g < GROUP
        q_ptrs = Q + q_row.to(tl.int64) * stride_qn + heads[:, None] * stride_qh
        if ROPE:
            q = _rope(q_ptrs, d, gm[:, None] & dm[None, :], c[None, :], sn[None, :], swap[None, :], sign[None, :])
            # the new key and value load beside q: one round trip to L2 after the wait, not a second after the loop
            nkm = dm & (d < tl.where(new_key, HEAD_DIM, 0))  # (dm & new_key is int32 under the interpreter)
            k_new = _rope(K + q_row.to(tl.int64) * stride_kn + kvh * stride_kh, d, nkm, c, sn, swap, sign)
            v_new = tl.load(V + q_row.to(tl.int64) * stride_vn + kvh * stride_vh + d, mask=nkm, other=0.0)
        else:
            q = tl.load(q_ptrs + d[None, :], mask=gm[:, None] & dm[None, :], other=0.0)
        if KV_FP8:
            if q.dtype == tl.bfloat16:  # fp16 dots: e4m3/e5m2 -> fp16 is one exact conversion (bf16 is not)
                q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        if ROPE:
            if EARLY:  # the first tile, loaded before the wait
                s0 = tl.dot(q, kt0, input_precision=PREC) * qk_scale
                s0 = tl.where(nm0[None, :], s0, float("-inf"))
                m_i, l_i, acc = _online_softmax_step(s0, m_i, l_i, acc, v0, PREC)
                lo += BLOCK_N
                n += BLOCK_N
        if KV_FP8:  # the per-tensor scales act on whole products: K's joins the score scale, V's the output's
            qk_scale = qk_scale * tl.load(KS)
        for start in range(lo, hi, BLOCK_N):
            nm = n < hi
            rows = _paged_rows(BT, b, stride_bt, n, nm, kvh, BLOCK_SIZE, stride_cb, stride_ct, stride_ch)
            kt = tl.load(KC + rows[None, :] + d[:, None], mask=nm[None, :] & dm[:, None], other=0.0)
            s = tl.dot(q, kt.to(q.dtype), input_precision=PREC) * qk_scale
            s = tl.where(nm[None, :], s, float("-inf"))
            v = tl.load(VC + rows[:, None] + d[None, :], mask=nm[:, None] & dm[None, :], other=0.0)
            m_i, l_i, acc = _online_softmax_step(s, m_i, l_i, acc, v.to(q.dtype), PREC)
            n += BLOCK_N
        if KV_FP8:
            acc = acc * tl.load(VS)
        if ROPE:
            if new_key:
                if slot >= 0:  # a padded row has none
                    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct + kvh * stride_ch + d
                    tl.store(KC + dst, k_new, mask=dm)
                    tl.store(VC + dst, v_new, mask=dm)
                # the new key as one more online-softmax step, from registers (p rounded as the dot's input is)
                s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], axis=1) * qk_scale
                m_new = tl.maximum(m_i, s_new)
                alpha = tl.math.exp2(m_i - m_new)
                p_new = tl.math.exp2(s_new - m_new).to(v_new.dtype).to(tl.float32)
                l_i = l_i * alpha + p_new
                acc = acc * alpha[:, None] + p_new[:, None] * v_new.to(tl.float32)[None, :]
                m_i = m_new
        o_ptrs = O + q_row.to(tl.int64) * stride_on + heads[:, None] * stride_oh + d[None, :]
        o_mask = gm[:, None] & dm[None, :]
        if not SPLIT:  # its own branch: unsplit launches pass no counters, so the atomics below must not compile
            _write_out(acc, l_i, o_ptrs, o_mask)
        elif parts == 1:
            _write_out(acc, l_i, o_ptrs, o_mask)
        else:
            base = (b * n_heads + heads).to(tl.int64) * num_splits  # partials [B, H, S]
            tl.store(OP + (base + split)[:, None] * BLOCK_D + d[None, :], acc, mask=gm[:, None])
            tl.store(MLP + 2 * (base + split), m_i, mask=gm)
            tl.store(MLP + 2 * (base + split) + 1, l_i, mask=gm)
            tl.debug_barrier()  # every thread's partial is written before the count says so (acq_rel below)
            count = COUNTS + b * tl.num_programs(1) + kvh
            if tl.atomic_add(count, 1, sem="acq_rel") == parts - 1:
                _combine_parts(OP, MLP, base, parts, o_ptrs, o_mask, gm, d, BLOCK_G, BLOCK_D, UNROLL)
                tl.atomic_xchg(count, 0, sem="relaxed")  # the next launch reads it after this one ends

    @triton.jit
    def _write_out(acc, l_i, o_ptrs, o_mask):
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # an empty context (padding) gives zeros
        tl.store(o_ptrs, out.to(o_ptrs.dtype.element_ty), mask=o_mask)

    @triton.jit
    def _decode_parts(span, num_splits, wave, min_part, long_part, BLOCK_N: tl.constexpr, WHOLE: tl.constexpr):
        """(parts, keys a part) for a context of `span` keys: parts of min_part keys up to one wave of programs
        (batch x kv heads x wave fill the GPU once), past that parts of long_part keys up to num_splits. Up to WHOLE
        parts' worth is read by one program (one program over two tiles is cheaper than two and their combine). A
        part is whole key tiles, and no part is empty."""
        parts = tl.maximum(tl.minimum(wave, tl.cdiv(span, min_part)), tl.cdiv(span, long_part))
        parts = tl.where(span <= WHOLE * min_part, 1, tl.minimum(parts, num_splits))
        part = tl.maximum(BLOCK_N, tl.cdiv(tl.cdiv(span, parts), BLOCK_N) * BLOCK_N)
        return tl.maximum(1, tl.cdiv(span, part)), part

    @triton.jit
    def _combine_parts(OP, MLP, base, parts, o_ptrs, o_mask, gm, d, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                       UNROLL: tl.constexpr):
        """The output of GROUP heads from their `parts` partials (acc, m, l), in one pass: a running max rescales
        what is summed so far (as the online softmax does), so no load waits on another and UNROLL parts' loads are
        in flight together (reading every part's m first, two passes, was slower). Read through L2 (.cg): other
        programs wrote them. Tiles stay [BLOCK_G, BLOCK_D], the main loop's: a [heads, parts, dim] one cost every
        launch, combining or not."""
        m_run = tl.full([BLOCK_G], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_G], tl.float32)
        out = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for c in range(0, parts, UNROLL):
            for u in tl.static_range(UNROLL):
                t = base * 0 + c + u  # part c + u, one per row
                ok = gm & (t < parts)
                m_t = tl.load(MLP + 2 * (base + t), mask=ok, other=float("-inf"), cache_modifier=".cg")
                l_t = tl.load(MLP + 2 * (base + t) + 1, mask=ok, other=0.0, cache_modifier=".cg")
                acc = tl.load(OP + (base + t)[:, None] * BLOCK_D + d[None, :], mask=ok[:, None], other=0.0,
                              cache_modifier=".cg")
                m_new = tl.maximum(m_run, m_t)
                m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # no keys yet: every weight 0
                alpha, beta = tl.math.exp2(m_run - m_ref), tl.math.exp2(m_t - m_ref)
                out = out * alpha[:, None] + acc * beta[:, None]
                total = total * alpha + l_t * beta
                m_run = m_new
        out = out / tl.where(total == 0.0, 1.0, total)[:, None]
        tl.store(o_ptrs, out.to(o_ptrs.dtype.element_ty), mask=o_mask)


def decode_attention_triton(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale,
                            sliding_window=None, max_context_len=None, out=None, num_splits=None,
                            block_n=None, num_warps=None, num_stages=None, min_part=DECODE_MIN_PART, rope=None,
                            plan: DecodePlan | None = None, kv_scales=None):
    """Sequences with one new token: q [N, H, D] (row cu_seqlens_q[b] is sequence b's query when it has one new
    token; other sequences are skipped), paged k/v cache, context_lens [B] int32 on the device -> out [N, H, D].
    No host synchronisation and a grid fixed by (B, heads, max_context_len): CUDA-graph capturable.
    rope: (k, v, cos, sin, slot_mapping) of this step when q and k are not rotated yet and k/v not in the cache
    (every sequence one new token): the kernel does both. The launch is `plan.decode_plan`'s, or `plan`; num_splits,
    block_n, num_warps, num_stages and min_part override the split kernel's (`plan.split_plan`). kv_scales:
    (k_scale, v_scale) fp32 [1] of an fp8 cache: the split kernel, without rope (the cache write quantizes first)."""
    batch = cu_seqlens_q.shape[0] - 1
    n_heads, dim = q.shape[1], q.shape[2]
    n_kv, block_size = k_cache.shape[2], k_cache.shape[1]
    if out is None:
        out = torch.empty_like(q)
    if max_context_len is None:
        max_context_len = block_tables.shape[1] * block_size
    if plan is None:
        if num_splits is None and block_n is None and num_warps is None and num_stages is None:
            plan = decode_plan(batch, max_context_len, n_heads, n_kv, dim, q.dtype, block_size, q.device,
                               rope is not None, kv_fp8=kv_scales is not None)
        else:
            plan = split_plan(batch, n_kv, dim, max_context_len, q.device, rope is not None, num_splits, block_n,
                              num_warps, num_stages, min_part, kv_fp8=kv_scales is not None)
    assert plan.rope == (rope is not None), "a plan with RoPE in the kernel takes rope, and only it"
    assert kv_scales is None or (rope is None and plan.kernel == "split"), "an fp8 cache takes the split kernel"
    if plan.kernel == "lean":
        return lean_decode(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale, sliding_window,
                           out, rope, plan)
    if plan.kernel == "lean_mma":
        return lean_mma_decode(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale, sliding_window,
                               out, rope, plan)
    return _split_decode(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale, sliding_window, out,
                         rope, plan, kv_scales)


def _split_decode(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale, sliding_window, out, rope,
                  plan: DecodePlan, kv_scales=None):
    batch = cu_seqlens_q.shape[0] - 1
    n_heads, dim = q.shape[1], q.shape[2]
    n_kv = k_cache.shape[2]
    block_d = next_power_of_2(dim)
    splits = plan.splits
    group = n_heads // n_kv
    if splits > 1:
        partial = torch.empty(batch * n_heads * splits * block_d, dtype=torch.float32, device=q.device)
        max_sum = torch.empty(batch * n_heads * splits * 2, dtype=torch.float32, device=q.device)
        counts = arrival_counts(q.device, batch * n_kv)
    else:
        partial = max_sum = counts = out  # unused
    k, v, cos, sin, slots = rope if rope is not None else (q, q, q, q, cu_seqlens_q)
    ks, vs = kv_scales if kv_scales is not None else (q, q)
    pdl = pdl_on(q)
    # with rope, no FMA contraction: the rotation rounds where torch and the rotary kernel round
    _decode_kernel[(batch, n_kv, splits)](
        q, k_cache, v_cache, ks, vs, out, partial, max_sum, counts, cu_seqlens_q, context_lens, block_tables,
        k, v, cos, sin, slots, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        scale * LOG2E, sliding_window or 0, n_heads, splits, plan.wave, plan.min_part, DECODE_LONG_PART,
        BLOCK_SIZE=k_cache.shape[1], GROUP=group, HEAD_DIM=dim, BLOCK_G=max(16, next_power_of_2(group)),
        BLOCK_D=block_d, BLOCK_N=plan.block_n, UNROLL=4, SPLIT=splits > 1, SLIDING=sliding_window is not None,
        PREC=precision(q), num_warps=plan.num_warps, num_stages=plan.num_stages, PDL=pdl, EARLY=plan.early_loads,
        ROPE=rope is not None, WHOLE=plan.whole, KV_FP8=kv_scales is not None, enable_fp_fusion=rope is None,
        launch_pdl=pdl > 0)
    return out
