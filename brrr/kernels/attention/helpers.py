"""Triton helpers the attention kernels share: the online-softmax step, paged-cache row offsets, RoPE of a row as
torch rounds it, a decode row's bounds, stores in the layout a value is held in.

Softmax in base 2: scores are scaled by scale * log2(e) and exponentiated with exp2, the running max m and sum l
rescaled by exp2(m_old - m_new) (FlashAttention-2's online softmax). fp32 inputs take exact ("ieee") dot products;
fp16/bf16 ones the tensor cores, with p cast to the input dtype for the P @ V product.
"""
from __future__ import annotations

import torch

LOG2E = 1.4426950408889634

try:
    import triton
    import triton.language as tl
except Exception:
    triton = None


def precision(q: torch.Tensor) -> str:
    """tl.dot's input precision for q's dtype."""
    return "ieee" if q.dtype == torch.float32 else "tf32"


if triton is not None:

    @triton.jit
    def _online_softmax_step(s, m_i, l_i, acc, v, PREC: tl.constexpr):
        """Fold one tile of base-2 scores s [M, N] (masked entries -inf) and its values v [N, D] into (m, l, acc).
        A row with every score masked so far keeps m = -inf without producing NaN."""
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_use)
        p = tl.math.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PREC)
        return m_new, l_i, acc

    @triton.jit
    def _paged_rows(BT, b, stride_bt, n, mask, kvh, block_size, stride_cb, stride_ct, stride_ch):
        """Element offset of key position n's row (one kv head) in a paged cache [blocks, block_size, kvh, D]."""
        blk = tl.load(BT + b * stride_bt + n // block_size, mask=mask, other=0).to(tl.int64)
        return blk * stride_cb + (n % block_size) * stride_ct + kvh * stride_ch

    @triton.jit
    def _rope_factors(COS, SIN, row, stride_cos, d, dm, HEAD_DIM: tl.constexpr):
        """cos and sin at the token's position over the head's dims, the partner dim (d + D/2 mod D) and the sign
        of rotate-half: x_rot[d] = x[d] * cos[d] + sign[d] * x[partner] * sin[d]."""
        HALF: tl.constexpr = HEAD_DIM // 2
        c = tl.load(COS + row * stride_cos + d, mask=dm, other=0.0).to(tl.float32)
        sn = tl.load(SIN + row * stride_cos + d, mask=dm, other=0.0).to(tl.float32)
        return c, sn, (d + HALF) % HEAD_DIM, tl.where(d < HALF, -1.0, 1.0)

    @triton.jit
    def _mul_rn(a, b):
        """a * b rounded on its own: PTX's mul.rn is never contracted into an FMA."""
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True,
                                         pack=1)

    @triton.jit
    def _store_in_place(ptrs, v, mask, ASM: tl.constexpr):
        """tl.store(ptrs, v, mask) (v fp32 or 16-bit), each element stored by the threads that hold it (ASM, a GPU
        launch: PTX st.global). tl.store lets Triton's coalescing pick the store's layout: for the lean kernel's
        [W] maxima and totals (each held by every lane of its warp) and its output, a conversion through shared
        memory before each store, which in place it skips."""
        if ASM:
            if v.dtype == tl.float32:
                tl.inline_asm_elementwise(
                    "{ .reg .pred p; setp.ne.s32 p, $3, 0; @p st.global.f32 [$1], $2; mov.u32 $0, 0; }", "=r,l,f,r",
                    [ptrs.to(tl.int64), v, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
            else:
                tl.inline_asm_elementwise(
                    "{ .reg .pred p; setp.ne.s32 p, $3, 0; @p st.global.b16 [$1], $2; mov.u32 $0, 0; }", "=r,l,h,r",
                    [ptrs.to(tl.int64), v.to(tl.int16, bitcast=True), mask.to(tl.int32)], dtype=tl.int32, is_pure=False,
                    pack=1)
        else:
            tl.store(ptrs, v, mask=mask)

    @triton.jit
    def _rope(ptrs, d, mask, c, sn, swap, sign, MUL_RN: tl.constexpr = False):
        """The rotated rows at ptrs (+ d): each product rounded to the activation dtype, then the sum, as torch's
        `x * cos + rotate_half(x) * sin` and the rotary kernel round: the launch turns FMA contraction off, or
        (MUL_RN, a GPU launch with it on) the products are `_mul_rn`'s."""
        dt = ptrs.dtype.element_ty
        x = tl.load(ptrs + d, mask=mask, other=0.0).to(tl.float32)
        xs = tl.load(ptrs + swap, mask=mask, other=0.0).to(tl.float32)
        if MUL_RN:
            xc, xss = _mul_rn(x, c), _mul_rn(sign * xs, sn)
        else:
            xc, xss = x * c, sign * xs * sn
        return (xc.to(dt).to(tl.float32) + xss.to(dt).to(tl.float32)).to(dt)

    @triton.jit
    def _decode_row(CU_Q, CTX, b, window, SLIDING: tl.constexpr):
        """Sequence b of a decode step: its query row, whether it has one new token, its context, and the cached
        keys [lo, hi) it attends to besides the new one (position hi = ctx - 1, from registers)."""
        q_row = tl.load(CU_Q + b)
        single = tl.load(CU_Q + b + 1) - q_row == 1
        ctx = tl.load(CTX + b)
        lo = 0
        if SLIDING:
            lo = tl.maximum(0, ctx - window)
        return q_row, single, ctx, lo, tl.maximum(ctx - 1, 0)
