"""GPTQ's inner loop: quantize one block of (at most 128) weight columns left to right, each column's rounding
error spread over the block's later columns through the inverse Hessian's upper Cholesky factor (brrr/quant/
gptq.py does the rest: the Hessian, the factor, the block-to-block update as one matmul).

Rows are independent inside the sweep (a column's update touches only its own row), so the Triton kernel gives
each program a strip of rows held in registers and walks the block's columns in one launch, where the torch
reference spends ~15 small ops a column (launch-bound on a GPU). Both compute
the same fp32 operations in the same order (correctly rounded divisions, no fused multiply-adds), so they give
the same codes.

Groups: `group_of[c]` is column c's group. Static groups (act-order) come with their scale and zero; otherwise
(`lazy`) a group's scale and zero are computed when the sweep reaches its first column, from the block's current
(error-corrected) columns, as the reference GPTQ does.
"""
from __future__ import annotations

import torch

from brrr.kernels.dispatch import next_power_of_2, use_triton
from brrr.kernels.quant.layouts import int4_params, int4_round


def gptq_block_ref(w1, hinv1, scale, zero, group_of, group_size: int, lazy: bool, symmetric: bool):
    """w1 [rows, b] fp32 (updated in place), hinv1 [b, b] upper factor, scale/zero [rows, groups] fp32 (lazy:
    written here), group_of [b] int -> (codes [rows, b] fp32, err [rows, b]: each column's scaled error)."""
    codes, err1 = torch.zeros_like(w1), torch.zeros_like(w1)
    for i in range(w1.shape[1]):
        g = int(group_of[i])
        if lazy and i % group_size == 0:
            scale[:, g], zero[:, g] = int4_params(w1[:, i:i + group_size], symmetric)
        q = int4_round(w1[:, i], scale[:, g], zero[:, g])
        codes[:, i] = q
        err = (w1[:, i] - (q - zero[:, g]) * scale[:, g]) / hinv1[i, i]
        w1[:, i:] -= err[:, None] * hinv1[i, i:][None, :]
        err1[:, i] = err
    return codes, err1


try:
    import triton
    import triton.language as tl
except Exception:
    triton = None

if triton is not None:

    @triton.jit
    def _round_even(v):
        """Round to nearest, ties to even (torch.round), for |v| < 2^22; larger values stay far out of [0, 15]."""
        return (v + 12582912.0) - 12582912.0

    @triton.jit
    def _by_constant(x, d: tl.constexpr, RECIPROCAL: tl.constexpr):
        """x / d as torch rounds `tensor / python_number`: times the fp32 reciprocal on CUDA, divided on the CPU."""
        if RECIPROCAL:
            return x * (1.0 / d)
        return tl.math.div_rn(x, tl.full(x.shape, d, tl.float32))

    @triton.jit
    def _gptq_block_kernel(W, H, S, Z, G, Q, E, rows, cols, groups, stride_w, stride_h, GROUP: tl.constexpr,
                           LAZY: tl.constexpr, SYMMETRIC: tl.constexpr, RECIPROCAL: tl.constexpr,
                           BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        c = tl.arange(0, BLOCK_C)
        r_ok, c_ok = r < rows, c < cols
        ptrs = r.to(tl.int64)[:, None] * stride_w + c[None, :]
        mask = r_ok[:, None] & c_ok[None, :]
        w = tl.load(W + ptrs, mask=mask, other=0.0)
        err_all = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
        s = tl.full((BLOCK_R,), 1.0, tl.float32)
        z = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for i in range(cols):
            g = tl.load(G + i)
            if LAZY:
                if i % GROUP == 0:  # this group's scale and zero from the block's current columns, kept for its rest
                    in_group = ((c >= i) & (c < i + GROUP))[None, :]
                    if SYMMETRIC:
                        amax = tl.max(tl.where(in_group, tl.abs(w), 0.0), axis=1)
                        s = tl.maximum(_by_constant(amax, 7.0, RECIPROCAL), 1e-12)
                        z = tl.full(amax.shape, 8.0, tl.float32)
                    else:
                        hi = tl.maximum(tl.max(tl.where(in_group, w, -float("inf")), axis=1), 0.0)
                        lo = tl.minimum(tl.min(tl.where(in_group, w, float("inf")), axis=1), 0.0)
                        s = tl.maximum(_by_constant(hi - lo, 15.0, RECIPROCAL), 1e-12)
                        z = tl.minimum(tl.maximum(_round_even(tl.math.div_rn(-lo, s)), 0.0), 15.0)
                    tl.store(S + r * groups + g, s, mask=r_ok)
                    tl.store(Z + r * groups + g, z, mask=r_ok)
            else:
                s = tl.load(S + r * groups + g, mask=r_ok, other=1.0)
                z = tl.load(Z + r * groups + g, mask=r_ok, other=0.0)
            col = tl.sum(tl.where(c[None, :] == i, w, 0.0), axis=1)  # exact: one term
            q = tl.minimum(tl.maximum(_round_even(tl.math.div_rn(col, s) + z), 0.0), 15.0)
            d = tl.load(H + i * stride_h + i)
            err = tl.math.div_rn(col - (q - z) * s, tl.full(col.shape, 1.0, tl.float32) * d)
            h = tl.load(H + i * stride_h + c, mask=c_ok & (c >= i), other=0.0)
            w = w - err[:, None] * h[None, :]
            err_all = tl.where(c[None, :] == i, err[:, None], err_all)
            tl.store(Q + r.to(tl.int64) * stride_w + i, q, mask=r_ok)
        tl.store(E + ptrs, err_all, mask=mask)


def gptq_block_triton(w1, hinv1, scale, zero, group_of, group_size: int, lazy: bool, symmetric: bool):
    rows, cols = w1.shape
    hinv1 = hinv1.contiguous()  # torch's upper Cholesky factor comes column-major
    codes, err1 = torch.empty_like(w1), torch.empty_like(w1)
    block_r = 16
    # no fused multiply-adds: the same roundings as the reference's separate products and differences
    _gptq_block_kernel[(triton.cdiv(rows, block_r),)](
        w1, hinv1, scale, zero, group_of, codes, err1, rows, cols, scale.shape[1], w1.stride(0), hinv1.stride(0),
        GROUP=group_size, LAZY=lazy, SYMMETRIC=symmetric, RECIPROCAL=w1.is_cuda, BLOCK_R=block_r,
        BLOCK_C=next_power_of_2(cols), num_warps=4, enable_fp_fusion=False)
    return codes, err1


def gptq_block(w1, hinv1, scale, zero, group_of, group_size: int, lazy: bool, symmetric: bool):
    """The block sweep: Triton on CUDA, the torch loop elsewhere; arguments and results as `gptq_block_ref`'s, but
    the kernel leaves w1 as it was (the caller needs none of its columns after the block)."""
    args = (w1, hinv1, scale, zero, group_of)
    if use_triton(*args) and w1.is_contiguous() and scale.is_contiguous() and zero.is_contiguous() \
            and w1.shape[1] <= 128:
        return gptq_block_triton(*args, group_size, lazy, symmetric)
    return gptq_block_ref(*args, group_size, lazy, symmetric)
