"""The lean decode kernel: one program a query head, the whole context (<= plan.LEAN_CONTEXT keys) read before
the PDL wait in one tile on CUDA cores, RoPE and the cache write inside, no split to combine. `plan.decode_plan`
picks it for batch-small steps of decodes."""
from __future__ import annotations

import torch

from brrr.kernels.attention.helpers import LOG2E
from brrr.kernels.attention.plan import DecodePlan
from brrr.kernels.dispatch import next_power_of_2
from brrr.kernels.pdl import pdl_on

try:
    import triton
    import triton.language as tl
except Exception:
    triton = None

if triton is not None:
    from brrr.kernels.attention.helpers import (_decode_row, _paged_rows, _rope, _rope_factors, _store_in_place)
    from brrr.kernels.pdl import wait_previous

    @triton.jit
    def _warp_keys(c: tl.constexpr, R: tl.constexpr, W: tl.constexpr):
        """Context positions of chunk c as [2, W, R]. Triton orders a tile's axes after the head's (the last) by
        index, so a [2, W, R, 128] tile of 16-bit keys puts 16 lanes on the head, 2 on axis 0 and the W warps on
        axis 1: a warp's keys are (0-1, w, r), its R rows in each thread's registers."""
        j = tl.arange(0, 2)[:, None, None]
        w = tl.arange(0, W)[None, :, None]
        r = tl.arange(0, R)[None, None, :]
        return c * (R * W * 2) + r * (2 * W) + w * 2 + j

    @triton.jit
    def _warp_tile(KC, VC, BT, b, n, lo, hi, d4, dm4, kvh, stride_bt, stride_cb, stride_ct, stride_ch,
                   BLOCK_SIZE: tl.constexpr):
        """Keys and values [2, W, R, D] at positions n [2, W, R] (masked outside [lo, hi)) of kv head kvh."""
        nm = (n >= lo) & (n < hi)
        rows = _paged_rows(BT, b, stride_bt, n, nm, kvh, BLOCK_SIZE, stride_cb, stride_ct, stride_ch)[:, :, :, None]
        mask = nm[:, :, :, None] & dm4
        return tl.load(KC + rows + d4, mask=mask, other=0.0), tl.load(VC + rows + d4, mask=mask, other=0.0), nm

    @triton.jit
    def _warp_s(q4, k, nm, qk_scale):
        """Base-2 scores [2, W, R] of one chunk (-inf where masked); the sum over the head is inside each warp."""
        return tl.where(nm, tl.sum(q4 * k.to(tl.float32), 3) * qk_scale, float("-inf"))

    @triton.jit
    def _warp_max(s):
        """Each warp's max over its keys of a chunk: [W]."""
        return tl.max(tl.max(s, 2), 0)

    @triton.jit
    def _warp_p(s, v, m, total, acc):
        """Softmax weights of one chunk at each warp's max m [W], added to the running sums (total [2, W, R], acc
        [2, W, R, D])."""
        p = tl.math.exp2(s - m[None, :, None])
        return total + p, acc + p[:, :, :, None] * v.to(tl.float32)

    @triton.jit
    def _lean_decode_kernel(Q, KC, VC, O, SCR, CU_Q, CTX, BT, K, V, COS, SIN, SLOTS,
                            stride_qn, stride_qh, stride_on, stride_oh, stride_cb, stride_ct, stride_ch, stride_bt,
                            stride_kn, stride_kh, stride_vn, stride_vh, stride_cos, qk_scale, window,
                            BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                            BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr, W: tl.constexpr,
                            SLIDING: tl.constexpr, PDL: tl.constexpr, FUSED: tl.constexpr,
                            ASM_STORES: tl.constexpr = False):
        """One program: one query head of a sequence with one new token, its whole context (< BLOCK_N cached keys)
        read before the PDL wait (the cache is an input) in CHUNKS (1, 2 or 4) chunks, scores and weighted sums on
        CUDA cores in fp32: no split, so no partials between programs, and no MMA operand round trips through shared
        memory. After the wait only q and the new k/v are loaded (unrotated, as `_decode_kernel`'s ROPE; the first
        query head of each kv head writes the new key and value to the cache), and chunks past the context are
        skipped (a branch a context level, its chunks computed together).

        A chunk is a [2, W, R, D] tile with the W axis on the program's W warps (`_warp_keys`), so each warp keeps a
        softmax of its own: its scores, max, weights and weighted sums never leave it (shuffles only). The warps'
        partials (weighted sums, max, sum of weights) then go to this program's slice of SCR [D + 2, W], transposed,
        and after a barrier each thread merges its columns' W partials itself (a `tl.sum` across the warps of the
        [W, D] sums is several times slower: Triton's scratch for it puts a warp's columns on one shared-memory bank).
        q, the new key and value are [2, W, 1, D] tiles of the chunks' layout (as 1-D vectors they took another, a
        conversion through shared memory each); the new key counts in every warp's max and in warp 0's sums.
        ASM_STORES (a GPU launch): the warps' maxima and totals, and the output, are stored in the layouts they are
        in (`_store_in_place`), without the conversions through shared memory Triton put before their stores. FUSED
        (a GPU launch): FMA contraction on, so the dot products are FFMAs (the rotation's products stay rounded,
        `_rope`'s MUL_RN)."""
        b = tl.program_id(0)
        h = tl.program_id(1)
        kvh = h // GROUP
        q_row, single, ctx, lo, hi = _decode_row(CU_Q, CTX, b, window, SLIDING)
        lane = _warp_keys(0, 1, W)  # [2, W, 1]: 0 is warp 0's first lane pair
        d = (lane * 0)[:, :, :, None] + tl.arange(0, BLOCK_D)[None, None, None, :]  # [2, W, 1, D]
        dm = d < HEAD_DIM
        c, sn, swap, sign = _rope_factors(COS, SIN, q_row, stride_cos, d, dm, HEAD_DIM)
        slot = tl.load(SLOTS + q_row).to(tl.int64)
        C: tl.constexpr = BLOCK_N // CHUNKS
        R: tl.constexpr = C // (2 * W)
        args = (lo, hi, d, dm, kvh, stride_bt, stride_cb, stride_ct, stride_ch, BLOCK_SIZE)
        k0, v0, nm0 = _warp_tile(KC, VC, BT, b, _warp_keys(0, R, W), *args)
        if CHUNKS > 1:
            k1, v1, nm1 = _warp_tile(KC, VC, BT, b, _warp_keys(1, R, W), *args)
        if CHUNKS > 2:
            k2, v2, nm2 = _warp_tile(KC, VC, BT, b, _warp_keys(2, R, W), *args)
            k3, v3, nm3 = _warp_tile(KC, VC, BT, b, _warp_keys(3, R, W), *args)
        wait_previous(PDL)
        if single:  # else a prefill chunk: the prefill kernel's
            q = _rope(Q + q_row.to(tl.int64) * stride_qn + h * stride_qh, d, dm, c, sn, swap, sign,
                      FUSED).to(tl.float32)
            nkm = dm & (d < tl.where(ctx > 0, HEAD_DIM, 0))
            k_new = _rope(K + q_row.to(tl.int64) * stride_kn + kvh * stride_kh, d, nkm, c, sn, swap, sign, FUSED)
            v_new = tl.load(V + q_row.to(tl.int64) * stride_vn + kvh * stride_vh + d, mask=nkm, other=0.0)
            s_new = tl.where(ctx > 0, tl.sum(q * k_new.to(tl.float32), 3) * qk_scale, float("-inf"))  # [2, W, 1]
            s1 = tl.full([2, W, R], float("-inf"), tl.float32)
            s2, s3 = s1, s1
            if CHUNKS > 2:
                if hi > 2 * C:
                    s0, s1 = _warp_s(q, k0, nm0, qk_scale), _warp_s(q, k1, nm1, qk_scale)
                    s2, s3 = _warp_s(q, k2, nm2, qk_scale), _warp_s(q, k3, nm3, qk_scale)
                elif hi > C:
                    s0, s1 = _warp_s(q, k0, nm0, qk_scale), _warp_s(q, k1, nm1, qk_scale)
                else:
                    s0 = _warp_s(q, k0, nm0, qk_scale)
            elif CHUNKS > 1:
                if hi > C:
                    s0, s1 = _warp_s(q, k0, nm0, qk_scale), _warp_s(q, k1, nm1, qk_scale)
                else:
                    s0 = _warp_s(q, k0, nm0, qk_scale)
            else:
                s0 = _warp_s(q, k0, nm0, qk_scale)
            m = tl.maximum(_warp_max(tl.maximum(tl.maximum(s0, s1), tl.maximum(s2, s3))), _warp_max(s_new))  # [W]
            m = tl.where(m == float("-inf"), 0.0, m)  # no key at all (padding): zeros out
            total = tl.zeros([2, W, R], tl.float32)
            acc = tl.zeros([2, W, R, BLOCK_D], tl.float32)
            total, acc = _warp_p(s0, v0, m, total, acc)
            if CHUNKS > 2:
                if hi > 2 * C:
                    total, acc = _warp_p(s1, v1, m, total, acc)
                    total, acc = _warp_p(s2, v2, m, total, acc)
                    total, acc = _warp_p(s3, v3, m, total, acc)
                elif hi > C:
                    total, acc = _warp_p(s1, v1, m, total, acc)
            elif CHUNKS > 1:
                if hi > C:
                    total, acc = _warp_p(s1, v1, m, total, acc)
            first = lane == 0
            p_new = tl.where(first, tl.math.exp2(s_new - m[None, :, None]), 0.0)  # [2, W, 1]
            total = tl.sum(tl.sum(total, 2), 0) + tl.sum(tl.sum(p_new, 2), 0)  # [W]
            acc = tl.sum(tl.sum(acc, 2), 0) + tl.sum(tl.sum(p_new[:, :, :, None] * v_new.to(tl.float32), 2), 0)
            base = SCR + (b * tl.num_programs(1) + h) * (BLOCK_D + 2) * W
            wi = tl.arange(0, W)
            # the sums through tl.store's conversion: in place (8 scalar stores a thread) or by rows in 16-byte stores
            # (then read across rows) were slower
            tl.store(base + tl.arange(0, BLOCK_D)[None, :] * W + wi[:, None], acc)
            _store_in_place(base + BLOCK_D * W + wi, m, wi < W, ASM_STORES)
            _store_in_place(base + (BLOCK_D + 1) * W + wi, total, wi < W, ASM_STORES)
            tl.debug_barrier()  # the CTA's global writes are visible to its threads after it
            cols = tl.arange(0, BLOCK_D)[:, None]
            ws = tl.arange(0, W)[None, :]
            m_t = tl.load(base + BLOCK_D * W + ws + cols * 0)  # [D, W], each row every warp's max
            scale = tl.math.exp2(m_t - tl.max(m_t, 1)[:, None])
            total = tl.sum(tl.load(base + (BLOCK_D + 1) * W + ws + cols * 0) * scale, 1)
            acc = tl.sum(tl.load(base + cols * W + ws) * scale, 1)
            if (h % GROUP == 0) & (slot >= 0) & (ctx > 0):  # a padded row has no slot
                dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct + kvh * stride_ch + d
                one = first[:, :, :, None] & dm  # one lane's columns each
                tl.store(KC + dst, k_new, mask=one)
                tl.store(VC + dst, v_new, mask=one)
            out = acc / tl.where(total == 0.0, 1.0, total)
            dd = tl.arange(0, BLOCK_D)
            _store_in_place(O + q_row.to(tl.int64) * stride_on + h * stride_oh + dd, out.to(O.dtype.element_ty),
                            dd < HEAD_DIM, ASM_STORES)


def lean_decode(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale, sliding_window, out, rope,
                plan: DecodePlan):
    """`decode.decode_attention_triton` with rope through `_lean_decode_kernel` (grid: sequences x query heads)."""
    batch, (n_heads, dim), n_kv = cu_seqlens_q.shape[0] - 1, q.shape[1:], k_cache.shape[2]
    k, v, cos, sin, slots = rope
    pdl = pdl_on(q)
    warps, chunks, block_n = plan.num_warps, plan.chunks, plan.block_n
    assert block_n // chunks >= 2 * warps, "a lean chunk holds a row of keys a warp"
    scratch = torch.empty(batch * n_heads * (next_power_of_2(dim) + 2) * warps, dtype=torch.float32, device=q.device)
    fused = q.is_cuda
    _lean_decode_kernel[(batch, n_heads)](
        q, k_cache, v_cache, out, scratch, cu_seqlens_q, context_lens, block_tables, k, v, cos, sin, slots,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), block_tables.stride(0), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        scale * LOG2E, sliding_window or 0, BLOCK_SIZE=k_cache.shape[1], GROUP=n_heads // n_kv, HEAD_DIM=dim,
        BLOCK_D=next_power_of_2(dim), BLOCK_N=block_n, CHUNKS=chunks, SLIDING=sliding_window is not None,
        W=warps, PDL=pdl, FUSED=fused, ASM_STORES=q.is_cuda, num_warps=warps, num_stages=1,
        enable_fp_fusion=fused, launch_pdl=pdl > 0)
    return out
