"""W8A8 linears: 8-bit weights (one scale per output channel) times activations quantized per token at run time,
one scale per row (absmax / 127 for int8, / 448 for FP8 E4M3), so the GEMM itself runs on 8-bit tensor cores.

  int8 (SmoothQuant): codes x int8 codes through `torch._int_mm` (int32 accumulate, exact), then
      y = acc * s_x[:, None] * s_w[None, :] (one Triton pass on CUDA: brrr/kernels/quant/int8_rescale.py). Where `_int_mm` cannot run (CUDA needs M > 16 and K, N multiples of
      8; older CPU builds lack it) the same integers multiply exactly in float64 (< 2^53).
  fp8: `torch._scaled_mm` with row-wise scales on CUDA sm90+ (bf16 activations); elsewhere the dequantized
      reference (codes * scales, multiplied in fp32), the function `_scaled_mm` computes.
"""
from __future__ import annotations

import torch

from brrr.kernels.quant import quantize_per_token
from brrr.kernels.quant.int8_rescale import int8_rescale


def _int_mm(a: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """a [M, K] int8 @ b_t [K, N] int8 (b_t a column-major view) -> int32 [M, N]."""
    m, k = a.shape
    n = b_t.shape[1]
    if a.is_cuda and k % 8 == 0 and n % 8 == 0:
        pad = max(0, 17 - m)  # cuBLASLt's int8 path needs more than 16 rows
        if pad:
            a = torch.cat([a, a.new_zeros(pad, k)])
        return torch._int_mm(a, b_t)[:m]
    if not a.is_cuda:
        try:
            return torch._int_mm(a, b_t)
        except RuntimeError:  # CPU builds without it
            pass
    return int_mm_ref(a, b_t)


def int_mm_ref(a: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """Exact int32 product through float64 (every partial sum of K * 127 * 127 is an exact float64 integer)."""
    return (a.double() @ b_t.double()).to(torch.int32)


def int8_w8a8_linear(x, qweight, scales, bias=None):
    """x [..., K] float, qweight int8 [N, K], scales [N] -> [..., N] in x's dtype."""
    x2 = x.reshape(-1, x.shape[-1])
    xq, sx = quantize_per_token(x2, torch.int8)
    return int8_rescale(_int_mm(xq, qweight.t()), sx, scales, bias, x.dtype).view(*x.shape[:-1], -1)


def _scaled_mm_ok(x2, qweight) -> bool:
    return (x2.is_cuda and x2.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x2.device) >= (9, 0)
            and x2.shape[1] % 16 == 0 and qweight.shape[0] % 16 == 0)


def fp8_w8a8_linear(x, qweight, scales, bias=None):
    """x [..., K] float, qweight float8_e4m3fn [N, K], scales [N] (or [1]: per tensor) -> [..., N]."""
    x2 = x.reshape(-1, x.shape[-1])
    n = qweight.shape[0]
    xq, sx = quantize_per_token(x2, torch.float8_e4m3fn)
    sw = scales.float().expand(n).reshape(1, n).contiguous()
    if _scaled_mm_ok(x2, qweight):
        y = torch._scaled_mm(xq, qweight.t(), scale_a=sx, scale_b=sw, out_dtype=x.dtype)
        if bias is not None:  # (row-wise scaling takes no bias argument in every torch)
            y = y + bias
    else:
        y = (xq.float() * sx) @ (qweight.float() * sw.t()).t()
        if bias is not None:
            y = y + bias.float()
        y = y.to(x.dtype)
    return y.view(*x.shape[:-1], n)
