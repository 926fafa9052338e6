"""NF4 dequantization for QLoRA's frozen base (brrr/lora/qlora.py): the tensors `brrr.quant.formats.quantize_nf4`
stores -> the weight [out, in] in the compute dtype, once per layer in forward and again in backward, so the
full-precision weight of one projection exists only while its matmul runs.

The layout is formats.py's: codes two per byte along the flattened weight (element 2j in the low nibble), one int8
absmax per 64 weights, one fp32 scale per 256 absmaxes and their fp32 mean (double quantization). The reference is
`formats.dequantize_nf4`; the kernel does the same fp32 arithmetic, one element per lane.
"""
from __future__ import annotations

import torch

from brrr.kernels.dispatch import use_triton
from brrr.analysis.finetune import NF4_BLOCK, NF4_SCALE_BLOCK
from brrr.quant.formats import _nf4_levels, dequantize_nf4

try:
    import triton
    import triton.language as tl
except Exception:  # the dispatcher takes the reference when triton is missing
    triton = None

_BLOCK = 1024  # weights per program (16 absmax blocks)

if triton is not None:
    @triton.jit
    def _nf4_dequant_kernel(q_ptr, absq_ptr, scale2_ptr, mean_ptr, levels_ptr, out_ptr, n,
                            BLOCK: tl.constexpr, QBLOCK: tl.constexpr, SBLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        byte = tl.load(q_ptr + offs // 2, mask=mask, other=0).to(tl.int32)
        code = (byte >> ((offs % 2) * 4).to(tl.int32)) & 0xF
        level = tl.load(levels_ptr + code, mask=mask, other=0.0)
        block = offs // QBLOCK
        absmax = tl.load(absq_ptr + block, mask=mask, other=0).to(tl.float32)
        scale2 = tl.load(scale2_ptr + block // SBLOCK, mask=mask, other=0.0)
        absmax = absmax * scale2 + tl.load(mean_ptr)
        tl.store(out_ptr + offs, (level * absmax).to(out_ptr.dtype.element_ty), mask=mask)


def dequantize_nf4_ref(tensors: dict, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """formats.dequantize_nf4 with the shape given on the host (reading the stored one would sync with the GPU)."""
    return dequantize_nf4({**tensors, "shape": torch.tensor(shape)}).to(dtype)


def dequantize_nf4_triton(tensors: dict, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    q = tensors["qweight"]
    n = shape[0] * shape[1]
    out = torch.empty(shape, dtype=dtype, device=q.device)
    grid = (triton.cdiv(n, _BLOCK),)
    _nf4_dequant_kernel[grid](q, tensors["absmax_q"], tensors["absmax_scales"], tensors["absmax_mean"],
                              _nf4_levels(q.device), out, n, BLOCK=_BLOCK, QBLOCK=NF4_BLOCK, SBLOCK=NF4_SCALE_BLOCK)
    return out


def dequantize_nf4_weight(tensors: dict, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """The weight [out, in] in `dtype`: the Triton kernel on CUDA, the reference elsewhere."""
    if use_triton(tensors["qweight"]):
        return dequantize_nf4_triton(tensors, shape, dtype)
    return dequantize_nf4_ref(tensors, shape, dtype)
