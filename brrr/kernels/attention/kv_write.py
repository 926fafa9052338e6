"""The new tokens' K/V scattered into the paged cache by slot (the Triton form of `reference.write_kv_ref`); into an
fp8 cache quantized on the way (x / scale, saturated to the format's range, as `kv_quant.quantize`)."""
from __future__ import annotations

import math

import torch

from brrr.kernels.attention.kv_quant import fp8_max
from brrr.kernels.dispatch import next_power_of_2
from brrr.kernels.pdl import pdl_on

try:
    import triton
    import triton.language as tl
except Exception:
    triton = None

if triton is not None:
    from brrr.kernels.pdl import wait_previous

    @triton.jit
    def _to_fp8(x, scale, fp8_max, MANT: tl.constexpr, EMIN: tl.constexpr):
        """fp32 x / scale, saturated to +-fp8_max and rounded to nearest even at the format's precision (MANT
        mantissa bits, smallest normal exponent EMIN; subnormals a fixed step) in fp32 arithmetic, so the cast that
        follows is exact. The hardware's cast rounds the same way; Triton's interpreter does not carry a rounding
        into the exponent (7.9 -> 4.0 in e4m3), so the rounding is done here for both."""
        # correctly rounded: Triton's fp32 `/` is an approximate division on CUDA, off by an ulp now and then
        x = tl.minimum(tl.maximum(tl.math.div_rn(x, tl.zeros_like(x) + scale), -fp8_max), fp8_max)
        a = tl.abs(x)
        top = a.to(tl.int32, bitcast=True) & 0x7F800000  # 2^floor(log2 a): the exponent bits alone
        ulp = tl.maximum(top - (MANT << 23), (EMIN - MANT + 127) << 23).to(tl.float32, bitcast=True)
        r = ((a / ulp + 12582912.0) - 12582912.0) * ulp  # + 1.5 * 2^23 rounds the small integer part to even
        # x's sign bit onto r by bits: Triton negates a float as 0 - r, which turns -0.0 into +0.0 where torch's
        # cast keeps it (an exact -0.0, or a tiny negative rounded to zero)
        sign = x.to(tl.int32, bitcast=True) & -2147483648
        return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)

    @triton.jit
    def _write_kv_kernel(K, V, KC, VC, KS, VS, SLOTS, stride_kn, stride_kh, stride_vn, stride_vh,
                         stride_cb, stride_ct, stride_ch, block_size, n_kv, fp8_max,
                         HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
                         KV_FP8: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr):
        wait_previous(PDL)
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(SLOTS + t).to(tl.int64)
        if slot < 0:  # a padded row (CUDA-graph batches): nothing to write
            return
        heads = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        mask = (heads < n_kv)[:, None] & (d < HEAD_DIM)[None, :]
        dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_ct
        dst = dst + heads[:, None] * stride_ch + d[None, :]
        k = tl.load(K + t * stride_kn + heads[:, None] * stride_kh + d[None, :], mask=mask)
        v = tl.load(V + t * stride_vn + heads[:, None] * stride_vh + d[None, :], mask=mask)
        if KV_FP8:  # saturating: an outlier becomes the largest finite value, not inf or NaN
            k = _to_fp8(k.to(tl.float32), tl.load(KS), fp8_max, MANT, EMIN).to(KC.dtype.element_ty)
            v = _to_fp8(v.to(tl.float32), tl.load(VS), fp8_max, MANT, EMIN).to(VC.dtype.element_ty)
        tl.store(KC + dst, k, mask=mask)
        tl.store(VC + dst, v, mask=mask)


def write_kv_triton(k, v, k_cache, v_cache, slot_mapping, scales=None):
    """Scatter the new tokens' K/V [N, KVH, D] into the paged cache; negative slots (padding) are skipped. scales:
    (k_scale, v_scale) fp32 [1] of an fp8 cache."""
    n, n_kv, dim = k.shape
    if n == 0:
        return
    pdl = pdl_on(k)
    ks, vs = scales if scales is not None else (k, k)
    top = fp8_max(k_cache.dtype) if scales is not None else 0.0
    # mantissa bits from the format's resolution at 1.0 (eps = 2^-mant), smallest normal exponent from tiny
    fmt = torch.finfo(k_cache.dtype) if scales is not None else None
    mant, emin = (-int(math.log2(fmt.eps)), int(math.log2(fmt.tiny))) if fmt is not None else (0, 0)
    _write_kv_kernel[(n,)](k, v, k_cache, v_cache, ks, vs, slot_mapping, k.stride(0), k.stride(1), v.stride(0),
                           v.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.shape[1], n_kv,
                           top, HEAD_DIM=dim, BLOCK_H=next_power_of_2(n_kv), BLOCK_D=next_power_of_2(dim),
                           num_warps=4, PDL=pdl, launch_pdl=pdl > 0, KV_FP8=scales is not None,
                           MANT=mant, EMIN=emin)
