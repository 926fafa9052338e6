"""Per-token activation quantization, what W8A8 (int8, FP8) runs before its GEMM: each row of x scaled so its
absmax maps to the largest code."""
from __future__ import annotations

import torch

from brrr.kernels.dispatch import next_power_of_2, use_triton

MAX_QUANT_ROW = 32768  # the kernel holds one row in registers


def quantize_per_token_ref(x: torch.Tensor, dtype: torch.dtype):
    """x [M, K] -> (codes [M, K] int8 or float8_e4m3fn, scales [M, 1] fp32): each row's absmax maps to the largest
    code (127; 448 for E4M3). int8 rounds half to even, as torch.round does."""
    qmax = 127.0 if dtype == torch.int8 else 448.0
    x32 = x.float()
    # absmax times the fp32 reciprocal of qmax: torch on CUDA divides a tensor by a Python scalar that way (on the
    # CPU it divides), so writing the product keeps the kernel and both devices' references to the same bits
    scale = (x32.abs().amax(dim=-1, keepdim=True) * (1.0 / qmax)).clamp(min=1e-12)
    v = (x32 / scale).clamp(-qmax, qmax)
    return (v.round() if dtype == torch.int8 else v).to(dtype), scale


try:
    import triton
    import triton.language as tl
except Exception:  # the dispatcher takes the reference when triton is missing
    triton = None

if triton is not None:

    @triton.jit
    def _per_token_quant_kernel(X, Q, S, K, stride_x, stride_q, QMAX: tl.constexpr, QINV: tl.constexpr,
                                INT8: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < K
        x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=0)
        scale = tl.maximum(amax * QINV, 1e-12)
        v = tl.math.div_rn(x, scale)  # correctly rounded, as torch divides
        v = tl.minimum(tl.maximum(v, -QMAX), QMAX)
        if INT8:
            v = (v + 12582912.0) - 12582912.0  # round half to even (|v| <= 127 < 2^22)
        tl.store(Q + row * stride_q + offs, v.to(Q.dtype.element_ty), mask=mask)
        tl.store(S + row, scale)


def quantize_per_token_triton(x: torch.Tensor, dtype: torch.dtype):
    m, k = x.shape
    q = torch.empty(m, k, dtype=dtype, device=x.device)
    s = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m:
        block = next_power_of_2(k)
        qmax = 127.0 if dtype == torch.int8 else 448.0
        _per_token_quant_kernel[(m,)](x, q, s, k, x.stride(0), q.stride(0), QMAX=qmax, QINV=1.0 / qmax,
                                      INT8=dtype == torch.int8, BLOCK=block, num_warps=min(16, max(1, block // 1024)))
    return q, s


def quantize_per_token(x: torch.Tensor, dtype: torch.dtype):
    """x [M, K] -> (int8 or float8_e4m3fn codes [M, K], fp32 scales [M, 1]), one scale per row."""
    if (x.shape[-1] <= MAX_QUANT_ROW and x.stride(-1) == 1
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and use_triton(x)):
        return quantize_per_token_triton(x, dtype)
    return quantize_per_token_ref(x, dtype)
