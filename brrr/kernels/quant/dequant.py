"""Dequantization: the Triton helpers that turn packed codes into values (inline PTX on the GPU for 16-bit
outputs, plain casts under Triton's interpreter and for fp32, both exact), and the kernels that write a whole
16-bit weight for the large-M path (then the vendor GEMM)."""
from __future__ import annotations

import math

import torch

from brrr.kernels.quant import ptx
from brrr.kernels.quant.layouts import packed_strides
from brrr.kernels.quant.launch import fast_dequant

try:
    import triton
    import triton.language as tl
except Exception:  # the dispatcher takes the reference when triton is missing
    triton = None

if triton is not None:
    _INT8_TO_BF16 = tl.constexpr(ptx.int8_to_16bit(ptx.BF16))
    _INT8_TO_F16 = tl.constexpr(ptx.int8_to_16bit(ptx.F16))
    _NIBBLES_BF16 = tl.constexpr(ptx.nibbles(ptx.BF16))
    _NIBBLES_F16 = tl.constexpr(ptx.nibbles(ptx.F16))
    _PREFETCH_L2 = tl.constexpr(ptx.PREFETCH_L2)

    @triton.jit
    def packed_col(step, stride_pc, STEP: tl.constexpr, PER_CHUNK: tl.constexpr):
        """Offset within a row of the kernel layout (`packed_strides`) of packed column step * STEP (STEP divides
        PER_CHUNK). Written as multiples of STEP and of stride_pc so the compiler still sees 16-byte alignment: a
        remainder of the column itself made it assume none, and the loads ran 2-3x slower."""
        STEPS: tl.constexpr = PER_CHUNK // STEP
        return (step // STEPS) * stride_pc + (step % STEPS) * STEP

    @triton.jit
    def chunk_cols(cols, stride_pc):
        """Offsets of a tile's byte columns `cols` (an arange from 0: loop-invariant) in the kernel layout; a tile
        that starts at column t * BLOCK_K then adds t * (BLOCK_K // 64) * stride_pc."""
        return (cols // 64) * stride_pc + cols % 64

    @triton.jit
    def _dequant_int4(p, z, s, DTYPE: tl.constexpr, FAST: tl.constexpr):
        """uint8 tile [BN, g/2] and the group's zero points and scales (fp32 [BN]) -> the weights of the group's
        low-nibble and high-nibble halves, (q - z) * s rounded once to DTYPE (as the reference rounds them): q - z
        is exact in DTYPE (`codes_minus_zero`), so one DTYPE multiply by s (its fp32 product exact, then rounded
        once; on sm_90 a packed multiply) gives the reference's bits."""
        lo, hi = codes_minus_zero(p, z, DTYPE, FAST)
        if FAST:
            sc = tl.broadcast_to(s.to(DTYPE)[:, None], p.shape)
            return lo * sc, hi * sc
        return ((lo.to(tl.float32) * s[:, None]).to(DTYPE), (hi.to(tl.float32) * s[:, None]).to(DTYPE))

    @triton.jit
    def group_weights(p, Z, S, g, N, offs_n, n_ok, BLOCK_N: tl.constexpr, HAS_ZEROS: tl.constexpr,
                       DTYPE: tl.constexpr, FAST: tl.constexpr):
        """Group g's packed tile p [BLOCK_N, g/2] (rows offs_n) -> its two halves' weights, with the group's zero
        points (8 when symmetric) and scales loaded from the [K/g, N] tensors."""
        if HAS_ZEROS:
            z = tl.load(Z + g * N + offs_n, mask=n_ok, other=0).to(tl.float32)
        else:
            z = tl.full((BLOCK_N,), 8.0, tl.float32)
        s = tl.load(S + g * N + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        return _dequant_int4(p, z, s, DTYPE, FAST)

    @triton.jit
    def int8_to(q, DTYPE: tl.constexpr, FAST: tl.constexpr):
        """int8 tile -> exact values in DTYPE. FAST (bf16/fp16): the inline PTX of `ptx.int8_to_16bit`, no
        int-to-float instruction."""
        if FAST:
            if DTYPE == tl.bfloat16:
                w = tl.inline_asm_elementwise(asm=_INT8_TO_BF16, constraints="=r,=r,r", args=[q], dtype=tl.bfloat16,
                                              is_pure=True, pack=4)
            else:
                w = tl.inline_asm_elementwise(asm=_INT8_TO_F16, constraints="=r,=r,r", args=[q], dtype=tl.float16,
                                              is_pure=True, pack=4)
        else:  # through fp32: the interpreter casts int -> bf16 as int -> uint16
            w = q.to(tl.float32).to(DTYPE)
        return w

    @triton.jit
    def fp8_to(q, DTYPE: tl.constexpr):
        """E4M3 bytes (read as int8) -> their exact values in DTYPE."""
        return q.to(tl.float8e4nv, bitcast=True).to(DTYPE)

    @triton.jit
    def codes_minus_zero(p, z, DTYPE: tl.constexpr, FAST: tl.constexpr):
        """uint8 tile [R, g/2] and its rows' zero points (fp32 [R]) -> q - z of the low and high nibbles, exact in
        DTYPE (|q - z| <= 15). FAST: per 4 bytes two prmt and two shifts spread the nibbles into 16-bit
        halves, four lop3 OR in the bits of 128 (bf16 0x4300; fp16 1024, 0x6400) so each half reads 128 + q, and
        four packed adds of -(128 + z)."""
        if FAST:
            BIAS: tl.constexpr = 128.0 if DTYPE == tl.bfloat16 else 1024.0
            nz = tl.broadcast_to((-(z + BIAS)).to(DTYPE)[:, None], p.shape)
            if DTYPE == tl.bfloat16:
                lo, hi = tl.inline_asm_elementwise(asm=_NIBBLES_BF16, constraints="=r,=r,=r,=r,r,r,r", args=[p, nz],
                                                   dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
            else:
                lo, hi = tl.inline_asm_elementwise(asm=_NIBBLES_F16, constraints="=r,=r,=r,=r,r,r,r", args=[p, nz],
                                                   dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
        else:
            lo = ((p & 15).to(tl.float32) - z[:, None]).to(DTYPE)
            hi = ((p >> 4).to(tl.float32) - z[:, None]).to(DTYPE)
        return lo, hi

    @triton.jit
    def prefetch_l2(ptrs, mask):
        """Ask L2 for the line at each pointer where mask is set; nothing waits for it and no register holds it."""
        tl.inline_asm_elementwise(asm=_PREFETCH_L2, constraints="=r,l,r", args=[ptrs, mask.to(tl.int32)],
                                  dtype=tl.int32, is_pure=False, pack=1)

    # ---- dequantize to a 16-bit weight (large M: then the vendor GEMM) -------------------------------------------
    # At M >= a few hundred a GEMM is compute-bound and cuBLAS's bf16 tensor-core kernels beat a mixed-input one, so
    # writing the whole weight once (4.25 or 8 bits read, 16 written per weight) and calling F.linear wins; the
    # tuner decides where per shape. The values are the references' exactly: (q - z) * s in fp32, rounded once.
    @triton.jit
    def _dequant_w4_kernel(P, S, Z, W, N, stride_pn, stride_pc, stride_wn, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                           HAS_ZEROS: tl.constexpr, FAST: tl.constexpr):
        pid_n, g = tl.program_id(0), tl.program_id(1)  # BLOCK_N rows x one group
        HALF: tl.constexpr = GROUP // 2
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_h = tl.arange(0, HALF)
        n_mask = offs_n < N
        mask = n_mask[:, None] & (offs_h[None, :] < HALF)
        p = tl.load(P + offs_n.to(tl.int64)[:, None] * stride_pn + packed_col(g, stride_pc, HALF, 64)
                    + offs_h[None, :], mask=mask, other=0)
        lo, hi = group_weights(p, Z, S, g, N, offs_n, n_mask, BLOCK_N, HAS_ZEROS, W.dtype.element_ty, FAST)
        w_ptrs = W + offs_n.to(tl.int64)[:, None] * stride_wn + g * GROUP + offs_h[None, :]
        tl.store(w_ptrs, lo, mask=mask)
        tl.store(w_ptrs + HALF, hi, mask=mask)

    @triton.jit
    def _dequant_w8_kernel(Q, S, W, N, K, stride_qn, stride_pc, stride_wn, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, FP8: tl.constexpr):
        pid_n, pid_k = tl.program_id(0), tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tl.arange(0, BLOCK_K)
        offs_k = pid_k * BLOCK_K + cols
        mask = (offs_n < N)[:, None] & (offs_k < K)[None, :]
        rows = offs_n.to(tl.int64)[:, None]
        q = tl.load(Q + rows * stride_qn + pid_k * (BLOCK_K // 64) * stride_pc + chunk_cols(cols, stride_pc)[None, :],
                    mask=mask, other=0)
        s = tl.load(S + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
        v = fp8_to(q, tl.float32) if FP8 else q.to(tl.float32)
        tl.store(W + rows * stride_wn + offs_k[None, :], (v * s[:, None]).to(W.dtype.element_ty), mask=mask)


def dequantize_w4_triton(qweight, scales, zeros, group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """The weight [N, K] in `dtype` from the int4 kernel layout: dequantize_w4's values, rounded once to dtype."""
    n, k = qweight.shape[0], 2 * math.prod(qweight.shape[1:])
    w = torch.empty(n, k, dtype=dtype, device=qweight.device)
    _dequant_w4_kernel[(triton.cdiv(n, 64), k // group_size)](
        qweight, scales, scales if zeros is None else zeros, w, n, *packed_strides(qweight), w.stride(0),
        GROUP=group_size, BLOCK_N=64, HAS_ZEROS=zeros is not None, FAST=fast_dequant(dtype))
    return w


def dequantize_w8_triton(qweight, scales, dtype: torch.dtype) -> torch.Tensor:
    """The weight [N, K] in `dtype` from int8 or float8_e4m3fn bytes (by rows or chunk-major) and row scales."""
    fp8 = qweight.dtype == torch.float8_e4m3fn
    return dequantize_w8_codes(qweight.view(torch.int8) if fp8 else qweight, scales, dtype, fp8)


def dequantize_w8_codes(qweight, scales, dtype: torch.dtype, fp8: bool) -> torch.Tensor:
    """`dequantize_w8_triton` of int8 bytes, holding E4M3 codes when fp8."""
    n, k = qweight.shape[0], math.prod(qweight.shape[1:])
    w = torch.empty(n, k, dtype=dtype, device=qweight.device)
    _dequant_w8_kernel[(triton.cdiv(n, 32), triton.cdiv(k, 256))](qweight, scales, w, n, k, *packed_strides(qweight),
                                                                  w.stride(0), BLOCK_N=32, BLOCK_K=256, FP8=fp8)
    return w

