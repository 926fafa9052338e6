"""SmoothQuant's epilogue in one pass: y = acc * s_x[:, None] * s_w[None, :] (+ bias), cast to x's dtype, from the
int32 product `torch._int_mm` returns. torch's expression is four passes over the [M, N] result (int32 -> fp32 with
the first multiply, the second multiply, the bias, the cast), which at prefill sizes cost about as much as the
GEMM; the kernel reads the int32 once and writes the output once, with the same fp32 operations in the same order
(no FMA contraction), so its result is the reference's bit for bit.
"""
from __future__ import annotations

import torch

from brrr.kernels.dispatch import use_triton


def int8_rescale_ref(acc, sx, sw, bias, dtype):
    """acc int32 [M, N], sx fp32 [M, 1], sw [N], bias [N] or None -> [M, N] in dtype."""
    y = acc * sx * sw.float()[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(dtype)


try:
    import triton
    import triton.language as tl
except Exception:
    triton = None

if triton is not None:

    @triton.jit
    def _int8_rescale_kernel(A, SX, SW, B, Y, M, N, stride_am, stride_ym, HAS_BIAS: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        m_mask, n_mask = offs_m < M, offs_n < N
        mask = m_mask[:, None] & n_mask[None, :]
        rows = offs_m.to(tl.int64)[:, None]
        acc = tl.load(A + rows * stride_am + offs_n[None, :], mask=mask, other=0).to(tl.float32)
        sx = tl.load(SX + offs_m, mask=m_mask, other=0.0)
        sw = tl.load(SW + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        y = acc * sx[:, None] * sw[None, :]
        if HAS_BIAS:
            y = y + tl.load(B + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + rows * stride_ym + offs_n[None, :], y.to(Y.dtype.element_ty), mask=mask)


def int8_rescale_triton(acc, sx, sw, bias, dtype):
    m, n = acc.shape
    y = torch.empty(m, n, dtype=dtype, device=acc.device)
    if m:
        grid = (triton.cdiv(m, 32), triton.cdiv(n, 128))
        _int8_rescale_kernel[grid](acc, sx, sw, sw if bias is None else bias, y, m, n, acc.stride(0), y.stride(0),
                                   HAS_BIAS=bias is not None, BLOCK_M=32, BLOCK_N=128, num_warps=4,
                                   enable_fp_fusion=False)
    return y


def int8_rescale(acc, sx, sw, bias, dtype):
    """The dispatcher: Triton on CUDA (row-major acc, one fp32 scale per row), the reference elsewhere."""
    tensors = [acc, sx, sw] + ([bias] if bias is not None else [])
    if (acc.dim() == 2 and acc.stride(1) == 1 and sx.dtype == torch.float32 and sx.is_contiguous()
            and use_triton(*tensors)):
        return int8_rescale_triton(acc, sx, sw, bias, dtype)
    return int8_rescale_ref(acc, sx, sw, bias, dtype)
