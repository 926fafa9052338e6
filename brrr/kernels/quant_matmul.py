"""Quantized matmuls: y = x @ W^T (+ bias) with int4 group-wise (W4A16) or int8 per-channel (W8A16) weights
dequantized in registers, and the per-token activation quantization that W8A8 (int8, FP8) runs before its GEMM.

Weight layouts (brrr/quant/linear.py converts the checkpoint's to these at load):
  int4  qweight uint8 [N, K/2]. Within each group of g input columns, byte j holds column j in its low nibble and
        column j + g/2 in its high nibble: a group's two halves then multiply two contiguous slices of x, so the
        kernel never interleaves nibbles in registers. scales [K/g, N] (bf16 for bf16 models, else fp32), zeros
        uint8 [K/g, N] or None (symmetric, zero 8): w[n, k] = (q[n, k] - zeros[k/g, n]) * scales[k/g, n].
        QuantLinear stores it `chunk_major` (a view [N, K/128, 64]: every row's first 64 bytes, then the next 64);
        every int4 kernel reads either layout through a row stride and a chunk stride.
  int8  qweight int8 [N, K], scales fp32 [N]: w[n, k] = q[n, k] * scales[n]. Weight-only int8 is stored
        `chunk_major` too (W8A8's torch._int_mm needs rows).

One Triton kernel per format for three config families, plus a GEMV kernel per format and a dequantize kernel:
  small M (decode, M <= 16): 16-row tensor-core tiles, narrow column strips (16-64 rows of W per program, so the
        8B shapes give 64-900 programs without splitting K) and optional split K for the shapes that still give
        too few.
  mid M (16 < M <= 128, batched decode): 32-64-row tiles, the same narrow strips and split K.
  tiled (prefill): 64-128 x 64-256 output tiles in grouped order (row tiles that share a weight strip run
        together, so the strip is read from HBM about once).
  dequantize (M > 16): the weight written once in 16 bits, then F.linear: at a few hundred rows cuBLAS's bf16
        GEMM beats any of the mixed-input tiles (on the H200, 8B shapes at M = 2048: about 2x).
Each weight is dequantized in registers to (q - z) * s rounded once to the input dtype (what the reference does)
and goes to the tensor cores. On the GPU, bf16/fp16 codes come from a magic-number trick on packed pairs (inline
PTX: no int-to-float instructions); under Triton's interpreter and for fp32 the same values come from plain casts.
  MMA decode (M <= 16, int4, tuning candidates beside the small-M ones): the weight tile as wgmma's left operand
        straight from registers, rows and K relabeled so each thread's fragment is the bytes it loaded; see the
        section "MMA decode path" below.
  GEMV (M <= 4, tuning candidates beside the small-M ones): CUDA cores in fp32, each code turned into exact fp32
        with a magic-number trick (no int-to-float instruction) and multiplied by every row of x; see the section
        "GEMV path" below.
  MMA GEMV (M = 1; int4 g128 and int8, K a multiple of 64): mma.sync on the 16 bytes each thread loaded, every
        column of the right operand x, so the tensor core sums each quad's products; the sections "MMA GEMV path"
        and "W8A16 MMA GEMV" below. The tuner picks it for every 8B shape at M = 1.
Configs are timed once per (shape, path) on the GPU and the fastest kept (`_pick`).
"""
from __future__ import annotations

import functools
import math
import os

import torch
import torch.nn.functional as F

from brrr.bench.timing import graph_time_us
from brrr.kernels.activation import silu_and_mul
from brrr.kernels.dispatch import arrival_counts, next_power_of_2, num_sms, use_triton
from brrr.kernels.pdl import pdl_on
from brrr.kernels.rms_norm import PendingNorm

SMALL_M = 16  # rows at or below which the small-M (decode) path runs
INT4_GROUPS = (32, 64, 128)
FAST_DEQUANT = os.environ.get("BRRR_QUANT_FAST_DEQUANT", "1") != "0"  # inline-PTX nibble conversion on the GPU
GATED_GEMV = True  # batch-1 gate/up with SiLU-and-mul in the MMA GEMV's epilogue (benchmarks turn it off for A/B)
# Under PDL an MMA GEMV lets the next kernel launch from its epilogue, or (candidates with LAST_STEP_RELEASE) when each
# program starts its last K step: with the split-K tail down to ~1.25 us (`_sum_partials`), a launch from the epilogue
# no longer finished before the GEMV did (the next program's first wait 0.75-1 us after the end, 0.25-0.5 before).
# On the H200 the last-step release made the W8A16 + lm_head step 2554 -> 2501 us, but int4 configs loading a group
# ahead much slower (bench/results/gemv_timeline_release_h200.jsonl), so the tuner picks per shape. False: no such
# candidates (benchmarks' A/B).
LAST_STEP_RELEASE = True
# A caller may ask for the last-step release whatever the tuner picked (`release_early`): the packed q/k/v projection,
# whose next kernel, decode attention, reads its first keys before its wait. The tuner times each GEMV in a chain of
# its own shape, where the epilogue release won for q/k/v; in the W4A16 + lm_head step the last-step one was 14 us
# shorter (1659.1 against 1673.0 us, bench/results/pdl_decode_floors_h200.jsonl). False: as tuned (A/B).
EARLY_RELEASE_HINT = True
# The MMA GEMVs' weights (words, scales, zero points) are read once a forward: loaded as L2 evict-first, so the
# small things read every step (the KV cache, block tables, norms' weights, activations) can stay in L2.
WEIGHT_EVICT = "evict_first"
MAX_QUANT_ROW = 32768  # the per-token quantization kernel holds one row in registers
CHUNK = 64  # bytes of a row per block of the chunk-major int4 layout (`chunk_major`)


# ---- int4 kernel layout --------------------------------------------------------------------------------------------
def pack_int4_kernel(codes: torch.Tensor, group_size: int) -> torch.Tensor:
    """codes [N, K] in [0, 15] -> uint8 [N, K/2] in the kernel layout (per group: low nibbles = first half)."""
    n, k = codes.shape
    halves = codes.to(torch.uint8).view(n, k // group_size, 2, group_size // 2)
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, k // 2)


def chunk_major(packed: torch.Tensor) -> torch.Tensor:
    """A weight of N rows of bytes (int4 [N, K/2], int8 [N, K]) as a view [N, bytes / CHUNK, CHUNK] whose storage
    holds every row's first 64 bytes (128 int4 or 64 int8 codes), then every row's next 64, ...: at M = 1 a warp's
    loads (8 rows x 64 bytes) are one 512-byte run instead of 8 half-used lines a row apart, and each step of a
    program reads one contiguous block (on the H200 the int4 MMA GEMV ran 1.19x faster on gate_up, 1.49x on the
    128256-row lm_head, bench/results/quant_speed_h200_chunk_major.jsonl; the int8 one 1.6x on gate_up,
    quant_decode_sweep_w8_h200.jsonl). Kernels take the layout from the strides (`_packed_strides`); rows that are
    not whole chunks stay [N, bytes] by rows."""
    n = packed.shape[0]
    if math.prod(packed.shape[1:]) % CHUNK:
        return packed
    return packed.reshape(n, -1, CHUNK).transpose(0, 1).contiguous().transpose(0, 1)


def _packed_strides(packed: torch.Tensor) -> tuple[int, int]:
    """(row stride, chunk stride) of a kernel-layout tensor, [N, K/2] by rows or `chunk_major`, in its elements
    (bytes, or words for an int32 view): column c of row n is at n * row + (c // per_chunk) * chunk + c % per_chunk."""
    if packed.dim() == 3:
        return packed.stride(0), packed.stride(1)
    return packed.stride(0), CHUNK // packed.element_size()


def unpack_int4_kernel(packed: torch.Tensor, group_size: int) -> torch.Tensor:
    """uint8 [N, K/2] kernel layout (or its `chunk_major` view) -> codes uint8 [N, K]."""
    packed = packed.reshape(packed.shape[0], -1)
    n, half_k = packed.shape
    p = packed.view(n, 2 * half_k // group_size, group_size // 2)
    return torch.cat([p & 0xF, p >> 4], dim=2).reshape(n, 2 * half_k)


def dequantize_w4(qweight, scales, zeros, group_size) -> torch.Tensor:
    """float32 [N, K] from the int4 kernel layout."""
    codes = unpack_int4_kernel(qweight, group_size).float()
    n, k = codes.shape
    z = 8.0 if zeros is None else zeros.t().float()[:, :, None]
    return ((codes.view(n, k // group_size, group_size) - z) * scales.t().float()[:, :, None]).view(n, k)


# ---- references ----------------------------------------------------------------------------------------------------
def w4a16_matmul_ref(x, qweight, scales, zeros, group_size, bias=None):
    w = dequantize_w4(qweight, scales, zeros, group_size)
    return F.linear(x, w.to(x.dtype), None if bias is None else bias.to(x.dtype))


def w8a16_matmul_ref(x, qweight, scales, bias=None):
    w = qweight.reshape(qweight.shape[0], -1).float() * scales.float()[:, None]
    return F.linear(x, w.to(x.dtype), None if bias is None else bias.to(x.dtype))


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
    from brrr.kernels.pdl import release_dependents, wait_previous

    @triton.jit
    def _tile_ids(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWIZZLE: tl.constexpr):
        """(row tile, column tile) of this program; SWIZZLE row tiles run next to each other per column tile."""
        pid = tl.program_id(0)
        grid_m, grid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
        width = SWIZZLE * grid_n
        first_m = (pid // width) * SWIZZLE
        size_m = tl.minimum(grid_m - first_m, SWIZZLE)
        return first_m + (pid % width) % size_m, (pid % width) // size_m

    @triton.jit
    def _split_range(steps, split_k):
        """The K steps [begin, end) of this program's slice when split_k programs share a tile's K loop."""
        per_split = tl.cdiv(steps, split_k)
        begin = tl.program_id(1) * per_split
        return begin, tl.minimum(begin + per_split, steps)

    @triton.jit
    def _packed_col(step, stride_pc, STEP: tl.constexpr, PER_CHUNK: tl.constexpr):
        """Offset within a row of the kernel layout (`_packed_strides`) of packed column step * STEP (STEP divides
        PER_CHUNK). Written as multiples of STEP and of stride_pc so the compiler still sees 16-byte alignment: a
        remainder of the column itself made it assume none, and the loads ran 2-3x slower."""
        STEPS: tl.constexpr = PER_CHUNK // STEP
        return (step // STEPS) * stride_pc + (step % STEPS) * STEP

    @triton.jit
    def _chunk_cols(cols, stride_pc):
        """Offsets of a tile's byte columns `cols` (an arange from 0: loop-invariant) in the kernel layout; a tile
        that starts at column t * BLOCK_K then adds t * (BLOCK_K // 64) * stride_pc."""
        return (cols // 64) * stride_pc + cols % 64

    @triton.jit
    def _dequant_int4(p, z, s, DTYPE: tl.constexpr, FAST: tl.constexpr):
        """uint8 tile [BN, g/2] and the group's zero points and scales (fp32 [BN]) -> the weights of the group's
        low-nibble and high-nibble halves, (q - z) * s rounded once to DTYPE (as the reference rounds them): q - z
        is exact in DTYPE (`_codes_minus_zero`), so one DTYPE multiply by s (its fp32 product exact, then rounded
        once; on sm_90 a packed multiply) gives the reference's bits."""
        lo, hi = _codes_minus_zero(p, z, DTYPE, FAST)
        if FAST:
            sc = tl.broadcast_to(s.to(DTYPE)[:, None], p.shape)
            return lo * sc, hi * sc
        return ((lo.to(tl.float32) * s[:, None]).to(DTYPE), (hi.to(tl.float32) * s[:, None]).to(DTYPE))

    @triton.jit
    def _group_weights(p, Z, S, g, N, offs_n, n_ok, BLOCK_N: tl.constexpr, HAS_ZEROS: tl.constexpr,
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
    def _int8_to(q, DTYPE: tl.constexpr, FAST: tl.constexpr):
        """int8 tile -> exact values in DTYPE. FAST (bf16/fp16, inline PTX): per 4 bytes, flip the sign bits
        (q + 128), then one prmt per byte builds the fp32 2^23 + q + 128 (byte under the exponent bits 0x4B),
        one subtraction makes it q, and one cvt packs two: 2.75 instructions a weight, no int-to-float."""
        if FAST:
            if DTYPE == tl.bfloat16:
                w = tl.inline_asm_elementwise(
                    asm="""{
                    .reg .b32 u, magic, f0, f1, f2, f3;
                    xor.b32 u, $2, 0x80808080;
                    mov.b32 magic, 0x4B000000;
                    prmt.b32 f0, u, magic, 0x7440;
                    prmt.b32 f1, u, magic, 0x7441;
                    prmt.b32 f2, u, magic, 0x7442;
                    prmt.b32 f3, u, magic, 0x7443;
                    sub.f32 f0, f0, 0f4B000080;
                    sub.f32 f1, f1, 0f4B000080;
                    sub.f32 f2, f2, 0f4B000080;
                    sub.f32 f3, f3, 0f4B000080;
                    cvt.rn.bf16x2.f32 $0, f1, f0;
                    cvt.rn.bf16x2.f32 $1, f3, f2;
                    }""",
                    constraints="=r,=r,r", args=[q], dtype=tl.bfloat16, is_pure=True, pack=4)
            else:
                w = tl.inline_asm_elementwise(
                    asm="""{
                    .reg .b32 u, magic, f0, f1, f2, f3;
                    xor.b32 u, $2, 0x80808080;
                    mov.b32 magic, 0x4B000000;
                    prmt.b32 f0, u, magic, 0x7440;
                    prmt.b32 f1, u, magic, 0x7441;
                    prmt.b32 f2, u, magic, 0x7442;
                    prmt.b32 f3, u, magic, 0x7443;
                    sub.f32 f0, f0, 0f4B000080;
                    sub.f32 f1, f1, 0f4B000080;
                    sub.f32 f2, f2, 0f4B000080;
                    sub.f32 f3, f3, 0f4B000080;
                    cvt.rn.f16x2.f32 $0, f1, f0;
                    cvt.rn.f16x2.f32 $1, f3, f2;
                    }""",
                    constraints="=r,=r,r", args=[q], dtype=tl.float16, is_pure=True, pack=4)
        else:  # through fp32: the interpreter casts int -> bf16 as int -> uint16
            w = q.to(tl.float32).to(DTYPE)
        return w

    @triton.jit
    def _fp8_to(q, DTYPE: tl.constexpr):
        """E4M3 bytes (read as int8) -> their exact values in DTYPE."""
        return q.to(tl.float8e4nv, bitcast=True).to(DTYPE)

    @triton.jit(do_not_specialize=["M", "split_k"])  # one compile for every M and split, not one for M = 1
    def _w4a16_kernel(X, P, S, Z, B, Y, WS, LOCKS, M, N, K, stride_xm, stride_pn, stride_ym, split_k, stride_pc,
                      GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      GROUPS_PER_ITER: tl.constexpr, SPLIT: tl.constexpr, SWIZZLE: tl.constexpr,
                      HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr, FAST: tl.constexpr,
                      IEEE: tl.constexpr, PDL: tl.constexpr, SWAP: tl.constexpr = False):
        pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, SWIZZLE)
        HALF: tl.constexpr = GROUP // 2
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_h = tl.arange(0, HALF)
        m_mask, n_mask = offs_m < M, offs_n < N
        n_groups = K // GROUP
        g_begin, g_end = _split_range(n_groups, split_k)
        wait_previous(PDL)
        x_ptrs = X + offs_m.to(tl.int64)[:, None] * stride_xm + offs_h[None, :]
        p_ptrs = P + offs_n.to(tl.int64)[:, None] * stride_pn + offs_h[None, :]
        acc = tl.zeros((BLOCK_N, BLOCK_M) if SWAP else (BLOCK_M, BLOCK_N), dtype=tl.float32)
        for g0 in range(g_begin, g_end, GROUPS_PER_ITER):
            for t in tl.static_range(GROUPS_PER_ITER):
                g = g0 + t
                # this group exists (the last iteration may run past g_end); tensor compares keep masks boolean
                # under the interpreter, where a scalar compare gives a Python bool
                m_ok, n_ok = m_mask & (offs_m * 0 + g < g_end), n_mask & (offs_n * 0 + g < g_end)
                x_mask, w_mask = m_ok[:, None], n_ok[:, None]
                x_lo = tl.load(x_ptrs + g * GROUP, mask=x_mask, other=0.0)
                x_hi = tl.load(x_ptrs + g * GROUP + HALF, mask=x_mask, other=0.0)
                p = tl.load(p_ptrs + _packed_col(g, stride_pc, HALF, 64), mask=w_mask, other=0)
                w_lo, w_hi = _group_weights(p, Z, S, g, N, offs_n, n_ok, BLOCK_N, HAS_ZEROS, X.dtype.element_ty, FAST)
                if SWAP:  # y^T = W x^T: the dequantized weights are the MMA's left operand, from registers
                    acc = _dot(w_lo, x_lo, acc, IEEE)
                    acc = _dot(w_hi, x_hi, acc, IEEE)
                else:
                    acc = _dot(x_lo, w_lo, acc, IEEE)
                    acc = _dot(x_hi, w_hi, acc, IEEE)
        if SWAP:
            acc = tl.trans(acc)
        _store(acc, B, Y, WS, LOCKS, offs_m, offs_n, m_mask, n_mask, M, N, stride_ym, split_k, HAS_BIAS, SPLIT, PDL)

    @triton.jit
    def _dot(a, b, acc, IEEE: tl.constexpr):
        """acc + a @ b^T. IEEE: in fp32 with exact products (fp32 models, where tf32 would round the inputs; and
        16-bit inputs under the interpreter, whose dot multiplies bf16 bit patterns as integers)."""
        if IEEE:
            return tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc, input_precision="ieee")
        return tl.dot(a, tl.trans(b), acc)

    @triton.jit
    def _store(acc, B, Y, WS, LOCKS, offs_m, offs_n, m_mask, n_mask, M, N, stride_ym, split_k,
               HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr, res=None, nw=None, SQ=None, XN=None,
               RESIDUAL: tl.constexpr = False, ROUND: tl.constexpr = None):
        """Write y = acc (+ bias). Split K (SPLIT): each of the split_k programs of a tile stores its partial sum in the
        fp32 workspace WS [split_k, M, N] and counts itself in LOCKS[tile]; the last to arrive adds the partials in
        index order (deterministic), writes y and resets the count for the next launch. One launch, no zeroed
        output and no second pass. RESIDUAL (M = 1): `_write`'s."""
        release_dependents(PDL)
        mask = m_mask[:, None] & n_mask[None, :]
        if SPLIT:
            pid_k, tile = tl.program_id(1), tl.program_id(0)
            ws_ptrs = WS + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
            tl.store(ws_ptrs + pid_k * M * N, acc, mask=mask)
            tl.debug_barrier()  # every thread's partial is written before the count says so (acq_rel below)
            if tl.atomic_add(LOCKS + tile, 1, sem="acq_rel") == split_k - 1:
                acc = _sum_partials(ws_ptrs, mask, split_k, M * N, 16 if acc.numel <= 512 else 4)
                _write(acc, B, Y, offs_m, offs_n, n_mask, mask, stride_ym, HAS_BIAS, res, nw, SQ, XN, RESIDUAL, ROUND)
                tl.atomic_xchg(LOCKS + tile, 0, sem="relaxed")  # ordered by the kernel's end
        else:
            _write(acc, B, Y, offs_m, offs_n, n_mask, mask, stride_ym, HAS_BIAS, res, nw, SQ, XN, RESIDUAL, ROUND)

    @triton.jit
    def _sum_partials(ptrs, mask, split_k, stride, UNROLL: tl.constexpr):
        """The sum of the split_k partials ptrs[k * stride], added in k order. UNROLL loads are in flight at once: a
        loop of one load then one add waited out an L2 round trip a partial (H200: 3.25 us from the last program's
        K loop to its end at split 16, 1.0-1.5 us now: bench/results/gemv_timeline_before_h200.jsonl and
        gemv_timeline_h200.jsonl). .cg: read through L2, never a stale L1 line."""
        acc = tl.zeros(ptrs.shape, tl.float32)
        for k0 in range(0, split_k, UNROLL):
            for j in tl.static_range(UNROLL):
                ok = mask & (tl.full(mask.shape, k0 + j, tl.int32) < split_k)  # a tensor: the interpreter's rule
                acc += tl.load(ptrs + (k0 + j) * stride, mask=ok, other=0.0, cache_modifier=".cg")
        return acc

    @triton.jit
    def _write(acc, B, Y, offs_m, offs_n, n_mask, mask, stride_ym, HAS_BIAS: tl.constexpr, res=None, nw=None,
               SQ=None, XN=None, RESIDUAL: tl.constexpr = False, ROUND: tl.constexpr = None):
        """RESIDUAL (M = 1): y is the new residual stream h = y + res, each rounded as the unfused `h + o_proj(a)`;
        the next RMSNorm's inputs go beside it (brrr/kernels/rms_norm.py's PendingNorm): nw * h in XN and the sum of
        h's squares at this tile's place in SQ. ROUND: y is rounded to this dtype first (x's), then stored as Y's:
        fp32 logits hold the values `.float()` of the 16-bit output would."""
        if HAS_BIAS:
            acc += tl.load(B + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if ROUND is not None:
            if ROUND != Y.dtype.element_ty:
                acc = acc.to(ROUND).to(tl.float32)
        y = acc.to(Y.dtype.element_ty)
        if RESIDUAL:
            y = (y.to(tl.float32) + res.to(tl.float32)[None, :]).to(Y.dtype.element_ty)
            h = tl.where(mask, y.to(tl.float32), 0.0)
            tl.store(SQ + tl.program_id(0), tl.sum(tl.sum(h * h, axis=1), axis=0))
            tl.store(XN + offs_n[None, :], (nw.to(tl.float32)[None, :] * h).to(Y.dtype.element_ty), mask=mask)
        tl.store(Y + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :], y, mask=mask)

    @triton.jit(do_not_specialize=["M", "split_k"])
    def _w8a16_kernel(X, Q, S, B, Y, WS, LOCKS, M, N, K, stride_xm, stride_qn, stride_ym, split_k, stride_pc,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                      SWIZZLE: tl.constexpr, HAS_BIAS: tl.constexpr, FAST: tl.constexpr, IEEE: tl.constexpr,
                      PDL: tl.constexpr, FP8: tl.constexpr = False):
        """FP8: the bytes are E4M3 codes (weight-only FP8), not int8."""
        pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, SWIZZLE)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_mask, n_mask = offs_m < M, offs_n < N
        k_tiles = tl.cdiv(K, BLOCK_K)
        t_begin, t_end = _split_range(k_tiles, split_k)
        wait_previous(PDL)
        x_ptrs = X + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
        q_ptrs = Q + offs_n.to(tl.int64)[:, None] * stride_qn + _chunk_cols(offs_k, stride_pc)[None, :]
        tl.static_assert(BLOCK_K % 64 == 0)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for t in range(t_begin, t_end):
            k_mask = (t * BLOCK_K + offs_k) < K
            x = tl.load(x_ptrs + t * BLOCK_K, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            q = tl.load(q_ptrs + t * (BLOCK_K // 64) * stride_pc, mask=n_mask[:, None] & k_mask[None, :], other=0)
            w = _fp8_to(q, X.dtype.element_ty) if FP8 else _int8_to(q, X.dtype.element_ty, FAST)
            acc = _dot(x, w, acc, IEEE)
        s = tl.load(S + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        _store(acc * s[None, :], B, Y, WS, LOCKS, offs_m, offs_n, m_mask, n_mask, M, N, stride_ym, split_k,
               HAS_BIAS, SPLIT, PDL)

    # ---- MMA decode path (M <= SMALL_M): the weight tile is the MMA's left operand, straight from registers -------
    # The weight tile [BLOCK_N, K] is the left operand and x^T [K, 16] the right one, so on sm_90 Triton emits wgmma
    # with the weights in registers: no shared-memory round trip for them. The tile's rows and K columns are
    # relabeled (the dot product does not care, as long as x's columns follow K's) so that each thread's wgmma
    # fragment is exactly the 16 contiguous bytes per row it loaded (`_mma_order`). Each byte gives two exact codes
    # q - z (1.5 instructions a weight, `_codes_minus_zero`); the group's scale multiplies the fp32 partial sum once.
    # sm_90 SASS: 2.5-3.4 thread-instructions a weight in the loop, against ~4.0-4.5 for the 16-row tensor-core
    # kernel and ~3.9-4.4 for the GEMV; on the H200 all three run at about the same weights per second (0.94-1.65 TB/s
    # against bf16's 2.7-4.0; neither the access pattern nor bytes in flight is why, docs/quantization.md), and the
    # tuner takes this one for some shapes (q/o, down at M = 1).
    def _word_nibbles_ptx(word: str, regs: tuple, out: tuple, nz: tuple, magic: str, kind: str) -> list[list[str]]:
        """PTX turning one 32-bit word of packed codes into four bf16x2/f16x2 pairs q - z, in four stages (callers
        converting two words interleave them stage by stage): two prmt and two shifts spread the nibbles into the
        16-bit halves of `regs` (bytes 0-1 low, 2-3 low, 0-1 high, 2-3 high nibbles), four lop3 OR in `magic` (128
        or 1024, so each half reads magic + q) and four fma add nz = -(magic + z) into `out`. Needs registers
        `zero` (0) and `one` (1.0 in both halves)."""
        t0, t1, u0, u1 = regs
        return [[f"prmt.b32 {t0}, {word}, zero, 0x4140;", f"prmt.b32 {t1}, {word}, zero, 0x4342;"],
                [f"shr.b32 {u0}, {t0}, 4;", f"shr.b32 {u1}, {t1}, 4;"],
                [f"lop3.b32 {r}, {r}, 0x000F000F, {magic}, 0xEA;" for r in regs],
                [f"fma.rn.{kind} {o}, {r}, one, {n};" for o, r, n in zip(out, regs, nz)]]

    def _nibbles_asm(one: str, magic: str, kind: str) -> str:
        """`_codes_minus_zero`'s PTX for one 16-bit type: `one` and `magic` are its 1.0 and 128 (bf16) or 1024
        (fp16) in both halves, `kind` the packed type of the fma."""
        lines = [".reg .b32 zero, one, t0, t1, u0, u1;", "mov.b32 zero, 0;", f"mov.b32 one, {one};"]
        for stage in _word_nibbles_ptx("$4", ("t0", "t1", "u0", "u1"), ("$0", "$1", "$2", "$3"), ("$5", "$6") * 2,
                                       magic, kind):
            lines += stage
        return "{\n" + "\n".join(lines) + "\n}"

    _NIBBLES_BF16 = tl.constexpr(_nibbles_asm("0x3F803F80", "0x43004300", "bf16x2"))
    _NIBBLES_F16 = tl.constexpr(_nibbles_asm("0x3C003C00", "0x64006400", "f16x2"))

    @triton.jit
    def _codes_minus_zero(p, z, DTYPE: tl.constexpr, FAST: tl.constexpr):
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
    def _mma_rows(BLOCK_N: tl.constexpr, NW: tl.constexpr):
        """The tile row (load order) that each MMA row holds. A [BLOCK_N, 64-byte] uint8 load gives warp w rows 8w +
        lane/4 (+ 8 NW per repeat); wgmma wants 16w + lane/4 and 16w + 8 + lane/4: with load row 16 NW b + 8 NW a +
        8w + i as MMA row 16 NW b + 16w + 8a + i each thread keeps the rows it loaded."""
        r = tl.arange(0, BLOCK_N)
        return tl.reshape(tl.permute(tl.reshape(r, (BLOCK_N // (16 * NW), 2, NW, 8)), (0, 2, 1, 3)), (BLOCK_N,))

    @triton.jit
    def _k_order(t, R: tl.constexpr, HALF: tl.constexpr):
        """Columns [R, HALF] -> the MMA's K order: a wgmma thread (lane % 4 = c) takes K pairs 2c + {0, 1} + 8h + 16t;
        giving K index 16t + 8h + 2c + r the column 16c + 4t + 2h + r makes them one 16-byte run per thread."""
        return tl.reshape(tl.permute(tl.reshape(t, (R, 4, HALF // 16, 2, 2)), (0, 2, 3, 1, 4)), (R, HALF))

    @triton.jit
    def _mma_order(w, BLOCK_N: tl.constexpr, NW: tl.constexpr, HALF: tl.constexpr):
        """Weight tile, load order -> MMA rows (`_mma_rows`) and K order (`_k_order`)."""
        w = tl.reshape(tl.permute(tl.reshape(w, (BLOCK_N // (16 * NW), 2, NW, 8, HALF)), (0, 2, 1, 3, 4)),
                       (BLOCK_N, HALF))
        return _k_order(w, BLOCK_N, HALF)

    @triton.jit
    def _prefetch_l2(ptrs, mask):
        """Ask L2 for the line at each pointer where mask is set; nothing waits for it and no register holds it."""
        tl.inline_asm_elementwise(
            asm="{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.b32 $0, 0; }",
            constraints="=r,l,r", args=[ptrs, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _mma_side(g, X, S, Z, N, x_ptrs, rows, row_ok, offs_n, n_mask, m_mask, GROUP: tl.constexpr,
                  BLOCK_N: tl.constexpr, HAS_ZEROS: tl.constexpr):
        """Group g's inputs besides its bytes: x's two half-groups, the rows' zero points and scales (fp32)."""
        HALF: tl.constexpr = GROUP // 2
        x_lo = tl.load(x_ptrs + g * GROUP, mask=m_mask[:, None], other=0.0)
        x_hi = tl.load(x_ptrs + g * GROUP + HALF, mask=m_mask[:, None], other=0.0)
        if HAS_ZEROS:
            z = tl.load(Z + g * N + rows, mask=row_ok, other=0).to(tl.float32)
        else:
            z = tl.full((BLOCK_N,), 8.0, tl.float32)
        s = tl.load(S + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        return x_lo, x_hi, z, s

    @triton.jit
    def _mma_group(acc, p, x_lo, x_hi, z, s, DTYPE: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, NW: tl.constexpr, FAST: tl.constexpr, IEEE: tl.constexpr):
        """acc + one group's products: its bytes p [BLOCK_N, g/2] (load order) and `_mma_side`'s inputs."""
        HALF: tl.constexpr = GROUP // 2
        lo, hi = _codes_minus_zero(p, z, DTYPE, FAST)
        part = _dot(_mma_order(lo, BLOCK_N, NW, HALF), _k_order(x_lo, BLOCK_M, HALF),
                    tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32), IEEE)
        part = _dot(_mma_order(hi, BLOCK_N, NW, HALF), _k_order(x_hi, BLOCK_M, HALF), part, IEEE)
        return acc + part * s[:, None]

    @triton.jit(do_not_specialize=["M", "split_k"])
    def _w4a16_mma_kernel(X, P, S, Z, B, Y, WS, LOCKS, M, N, K, stride_xm, stride_pn, stride_ym, split_k,
                          stride_pc, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          NW: tl.constexpr, PAIR: tl.constexpr, PREFETCH: tl.constexpr, AHEAD: tl.constexpr,
                          SPLIT: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr, FAST: tl.constexpr,
                          IEEE: tl.constexpr, PDL: tl.constexpr):
        pid_n = tl.program_id(0)
        HALF: tl.constexpr = GROUP // 2
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # load order
        offs_n = pid_n * BLOCK_N + _mma_rows(BLOCK_N, NW)  # MMA order: the accumulator's rows
        offs_m = tl.arange(0, BLOCK_M)
        offs_h = tl.arange(0, HALF)
        row_ok, n_mask, m_mask = rows < N, offs_n < N, offs_m < M
        n_groups = K // GROUP
        g_begin, g_end = _split_range(n_groups, split_k)
        wait_previous(PDL)
        p_ptrs0 = P + rows.to(tl.int64) * stride_pn
        p_ptrs = p_ptrs0[:, None] + offs_h[None, :]
        x_ptrs = X + offs_m.to(tl.int64)[:, None] * stride_xm + offs_h[None, :]
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        DTYPE: tl.constexpr = X.dtype.element_ty
        if AHEAD:  # the next group's x, zeros and scales load while this group computes
            x_lo, x_hi, z, s = _mma_side(g_begin, X, S, Z, N, x_ptrs, rows, row_ok & (rows * 0 + g_begin < g_end),
                                         offs_n, n_mask & (offs_n * 0 + g_begin < g_end),
                                         m_mask & (offs_m * 0 + g_begin < g_end), GROUP, BLOCK_N, HAS_ZEROS)
        for g in range(g_begin, g_end, 1 + PAIR):
            if PREFETCH and FAST:  # L2 fetches the bytes PREFETCH groups ahead: more in flight than the loads hold
                for t in tl.static_range(1 + PAIR):
                    ahead = rows * 0 + g + PREFETCH + t < g_end
                    _prefetch_l2(p_ptrs0 + _packed_col(g + PREFETCH + t, stride_pc, HALF, 64), row_ok & ahead)
                    _prefetch_l2(S + (g + PREFETCH + t) * N + rows, row_ok & ahead & (rows % 64 == 0))
            # PAIR: both groups' loads are issued before either is unpacked (more bytes in flight per thread)
            p = tl.load(p_ptrs + _packed_col(g, stride_pc, HALF, 64), mask=row_ok[:, None], other=0)
            if PAIR:
                second = rows * 0 + g + 1 < g_end  # past g_end (or K): zero bytes, zero x, zero scales
                p2 = tl.load(p_ptrs + _packed_col(g + 1, stride_pc, HALF, 64),
                             mask=row_ok[:, None] & second[:, None], other=0)
            if AHEAD:
                nxt = g + 1 + PAIR
                x_lo2, x_hi2, z2, s2 = _mma_side(nxt, X, S, Z, N, x_ptrs, rows, row_ok & (rows * 0 + nxt < g_end),
                                                 offs_n, n_mask & (offs_n * 0 + nxt < g_end),
                                                 m_mask & (offs_m * 0 + nxt < g_end), GROUP, BLOCK_N, HAS_ZEROS)
            else:
                x_lo, x_hi, z, s = _mma_side(g, X, S, Z, N, x_ptrs, rows, row_ok, offs_n, n_mask, m_mask, GROUP,
                                             BLOCK_N, HAS_ZEROS)
            acc = _mma_group(acc, p, x_lo, x_hi, z, s, DTYPE, GROUP, BLOCK_M, BLOCK_N, NW, FAST, IEEE)
            if PAIR:
                second_n = offs_n * 0 + g + 1 < g_end
                x_lo, x_hi, z, s = _mma_side(g + 1, X, S, Z, N, x_ptrs, rows, row_ok & second, offs_n,
                                             n_mask & second_n, m_mask & (offs_m * 0 + g + 1 < g_end), GROUP,
                                             BLOCK_N, HAS_ZEROS)
                acc = _mma_group(acc, p2, x_lo, x_hi, z, s, DTYPE, GROUP, BLOCK_M, BLOCK_N, NW, FAST, IEEE)
            if AHEAD:
                x_lo, x_hi, z, s = x_lo2, x_hi2, z2, s2
        _store(tl.trans(acc), B, Y, WS, LOCKS, offs_m, offs_n, m_mask, n_mask, M, N, stride_ym, split_k, HAS_BIAS,
               SPLIT, PDL)

    # ---- GEMV path (M <= GEMV_M): CUDA cores, fp32, no tensor cores and no shared memory --------------------------
    # Weights are read as int32 words, 16 bytes (4 words) per thread per row per step; a thread holds R rows and
    # loads the x its words multiply once for all of them. A code becomes fp32 without an int-to-float instruction:
    # each half word under the exponent bits of 2^23 (`_halves`: 0x4B00xxxx), a code at bit p masked out (one lop3)
    # reads 2^23 + code * 2^p, and one fma with 2^-p and -(2^(23-p) + zero) (both exact) leaves code - zero exactly;
    # one more fma per row of x accumulates it. int8: each byte as 2^23 + q + 128 (`_bytes`), one subtraction. int4
    # threads sum a chunk's 32 products and scale the sum by the group's scale once; the accumulators are reduced
    # across threads once, after the K loop. Main loop on sm_90 (SASS, M = 1): ~3.9-4.4 instructions a weight
    # (int4 g128), ~3.8-4.1 (int8), depending on R.
    @triton.jit
    def _f32(bits):
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _halves(w, FAST: tl.constexpr):
        """Each half of the int32 words under the exponent bits of 2^23: (0x4B00 << 16) | bits 0-15, and the same
        for bits 16-31. FAST: one prmt each (in plain Triton, ptxas folds the OR back into every code's lop3 and
        then needs the magic constant in a register, which it re-materializes with a mov per code)."""
        if FAST:
            lo, hi = tl.inline_asm_elementwise(
                asm="""{
                .reg .b32 magic;
                mov.b32 magic, 0x4B000000;
                prmt.b32 $0, $2, magic, 0x7610;
                prmt.b32 $1, $2, magic, 0x7632;
                }""",
                constraints="=r,=r,r", args=[w], dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
        else:
            lo = (w & 0xFFFF) | 0x4B000000
            hi = (w.to(tl.uint32, bitcast=True) >> 16).to(tl.int32, bitcast=True) | 0x4B000000
        return lo, hi

    @triton.jit
    def _bytes(w, FAST: tl.constexpr):
        """Each byte b of the int32 words as the fp32 bits of 2^23 + (b ^ 0x80), i.e. 2^23 + q + 128 for an int8 q.
        FAST: one xor per word and one prmt per byte (the byte under the exponent bits 0x4B)."""
        if FAST:
            b0, b1, b2, b3 = tl.inline_asm_elementwise(
                asm="""{
                .reg .b32 u, magic;
                xor.b32 u, $4, 0x80808080;
                mov.b32 magic, 0x4B000000;
                prmt.b32 $0, u, magic, 0x7540;
                prmt.b32 $1, u, magic, 0x7541;
                prmt.b32 $2, u, magic, 0x7542;
                prmt.b32 $3, u, magic, 0x7543;
                }""",
                constraints="=r,=r,=r,=r,r", args=[w], dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
                is_pure=True, pack=1)
        else:
            b0 = (w & 0xFF) ^ 0x4B000080
            b1 = ((w >> 8) & 0xFF) ^ 0x4B000080
            b2 = ((w >> 16) & 0xFF) ^ 0x4B000080
            b3 = ((w >> 24) & 0xFF) ^ 0x4B000080
        return b0, b1, b2, b3

    @triton.jit
    def _load(ptrs, mask, ALL: tl.constexpr):
        """tl.load with zeros where masked; ALL: every element is in bounds (no predicates, no zero fill)."""
        if ALL:
            return tl.load(ptrs)
        return tl.load(ptrs, mask=mask, other=0)

    @triton.jit
    def _fma_rows(p0, p1, p2, p3, d, xp, x_mask, stride_xm, ROWS: tl.constexpr, X_ALL: tl.constexpr):
        """p_m + d * x_m for each row m < ROWS of x: one dequantized tile `d` [BLOCK_N, CHUNKS, 4] serves every row.
        xp, x_mask [CHUNKS, 4]: row 0's columns of x."""
        p0 = tl.fma(d, _load(xp, x_mask, X_ALL).to(tl.float32)[None, :, :], p0)
        if ROWS > 1:
            p1 = tl.fma(d, _load(xp + stride_xm, x_mask, X_ALL).to(tl.float32)[None, :, :], p1)
        if ROWS > 2:
            p2 = tl.fma(d, _load(xp + 2 * stride_xm, x_mask, X_ALL).to(tl.float32)[None, :, :], p2)
        if ROWS > 3:
            p3 = tl.fma(d, _load(xp + 3 * stride_xm, x_mask, X_ALL).to(tl.float32)[None, :, :], p3)
        return p0, p1, p2, p3

    @triton.jit
    def _gemv_out(acc0, acc1, acc2, acc3, BLOCK_M: tl.constexpr, ROWS: tl.constexpr):
        """The per-row accumulators [BLOCK_N, CHUNKS] -> the y tile [BLOCK_M, BLOCK_N] (fp32)."""
        offs_m = tl.arange(0, BLOCK_M)
        out = tl.where(offs_m[:, None] == 0, tl.sum(acc0, axis=1)[None, :], 0.0)
        if ROWS > 1:
            out = tl.where(offs_m[:, None] == 1, tl.sum(acc1, axis=1)[None, :], out)
        if ROWS > 2:
            out = tl.where(offs_m[:, None] == 2, tl.sum(acc2, axis=1)[None, :], out)
        if ROWS > 3:
            out = tl.where(offs_m[:, None] == 3, tl.sum(acc3, axis=1)[None, :], out)
        return out

    @triton.jit(do_not_specialize=["split_k", "stride_sn"])
    def _w4a16_gemv_kernel(X, P, S, Z, B, Y, WS, LOCKS, M, N, K, stride_xm, stride_pn, stride_ym, split_k, stride_sn,
                           stride_pc, GROUP: tl.constexpr, ROWS: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr, SPLIT: tl.constexpr, HAS_ZEROS: tl.constexpr,
                           HAS_BIAS: tl.constexpr, FAST: tl.constexpr, EVEN_N: tl.constexpr, PREFETCH: tl.constexpr,
                           STAGES: tl.constexpr, PDL: tl.constexpr):
        """P: the int4 kernel layout viewed as int32 words (strides in words; a step's 4 x CHUNKS words never
        cross a chunk). One loop iteration is one group: its scales and zeros are loaded once, then GROUP/32/CHUNKS
        steps of CHUNKS 16-byte chunks (32 codes each) per row. K is a multiple of GROUP, so only rows are masked.
        Scales and zeros are loaded as [BLOCK_N, CHUNKS] tiles (each thread the rows it holds) through stride_sn,
        their stride along N (1) left unspecialized: known contiguous, the compiler would load them in a layout of
        their own and convert it through shared memory on every group."""
        pid_n = tl.program_id(0)
        SUB: tl.constexpr = GROUP // 32 // CHUNKS
        HALF: tl.constexpr = GROUP // 2
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_c = tl.arange(0, CHUNKS)
        offs_i = tl.arange(0, 4)
        n_mask = offs_n < N
        n_groups = K // GROUP
        g_begin, g_end = _split_range(n_groups, split_k)
        wait_previous(PDL)
        p_ptrs = (P + offs_n.to(tl.int64)[:, None, None] * stride_pn + (offs_c * 4)[None, :, None]
                  + offs_i[None, None, :])
        w_mask = n_mask[:, None, None] & (offs_i[None, None, :] < 4)
        xo = (offs_c * 16)[:, None] + (offs_i * 4)[None, :]  # byte 0's column of each word in a step
        sz_offs = offs_n[:, None] * stride_sn + offs_c[None, :] * 0
        sz_mask = n_mask[:, None] & (offs_c[None, :] < CHUNKS)
        x_mask = xo >= 0  # unused: K is a multiple of GROUP, x is always in bounds
        acc0 = tl.zeros((BLOCK_N, CHUNKS), dtype=tl.float32)
        acc1, acc2, acc3 = acc0, acc0, acc0
        for g in tl.range(g_begin, g_end, num_stages=STAGES):
            if PREFETCH and FAST:  # the group PREFETCH ahead: one line per row (GROUP / 2 <= 64 bytes)
                ahead = _packed_col(g + PREFETCH, stride_pc, GROUP // 8, 16)
                _prefetch_l2(P + offs_n.to(tl.int64) * stride_pn + ahead,
                             n_mask & (offs_n * 0 + g + PREFETCH < g_end))
            s = _load(S + g * N + sz_offs, sz_mask, EVEN_N).to(tl.float32)
            if HAS_ZEROS:
                z = _load(Z + g * N + sz_offs, sz_mask, EVEN_N).to(tl.int32)
            else:
                z = tl.full((BLOCK_N, CHUNKS), 8, tl.int32)
            # -(2^(23-p) + z) for the nibble positions p = 0, 4, 8, 12: sign, exponent 150 - p, z at bit p
            nz0 = _f32(z - 0x35000000)[:, :, None]  # 0xCB000000
            nz4 = _f32((z << 4) - 0x37000000)[:, :, None]  # 0xC9000000
            nz8 = _f32((z << 8) - 0x39000000)[:, :, None]  # 0xC7000000
            nz12 = _f32((z << 12) - 0x3B000000)[:, :, None]  # 0xC5000000
            for sub in tl.static_range(SUB):
                w = _load(p_ptrs + _packed_col(g * SUB + sub, stride_pc, CHUNKS * 4, 16), w_mask, EVEN_N)
                lo, hi = _halves(w, FAST)  # 0x4B00xxxx; then one lop3 with one constant per code
                xp = X + (g * GROUP + sub * (CHUNKS * 16)) + xo
                # one code position at a time, each used by every row of x at once: few values live per thread
                p0 = tl.zeros((BLOCK_N, CHUNKS, 4), dtype=tl.float32)
                p1, p2, p3 = p0, p0, p0
                d = _f32(lo & -65521) + nz0  # byte 0 low nibble: column 0 of the word's 4
                p0, p1, p2, p3 = _fma_rows(p0, p1, p2, p3, d, xp, x_mask, stride_xm, ROWS, True)
                d = tl.fma(_f32(lo & -65296), 0.0625, nz4)  # byte 0 high nibble: column HALF
                p0, p1, p2, p3 = _fma_rows(p0, p1, p2, p3, d, xp + HALF, x_mask, stride_xm, ROWS, True)
                d = tl.fma(_f32(lo & -61696), 0.00390625, nz8)
                p0, p1, p2, p3 = _fma_rows(p0, p1, p2, p3, d, xp + 1, x_mask, stride_xm, ROWS, True)
                d = tl.fma(_f32(lo & -4096), 0.000244140625, nz12)
                p0, p1, p2, p3 = _fma_rows(p0, p1, p2, p3, d, xp + 1 + HALF, x_mask, stride_xm, ROWS, True)
                d = _f32(hi & -65521) + nz0
                p0, p1, p2, p3 = _fma_rows(p0, p1, p2, p3, d, xp + 2, x_mask, stride_xm, ROWS, True)
                d = tl.fma(_f32(hi & -65296), 0.0625, nz4)
                p0, p1, p2, p3 = _fma_rows(p0, p1, p2, p3, d, xp + 2 + HALF, x_mask, stride_xm, ROWS, True)
                d = tl.fma(_f32(hi & -61696), 0.00390625, nz8)
                p0, p1, p2, p3 = _fma_rows(p0, p1, p2, p3, d, xp + 3, x_mask, stride_xm, ROWS, True)
                d = tl.fma(_f32(hi & -4096), 0.000244140625, nz12)
                p0, p1, p2, p3 = _fma_rows(p0, p1, p2, p3, d, xp + 3 + HALF, x_mask, stride_xm, ROWS, True)
                # the sum over a thread's 4 words stays in the thread; one scale multiply per row and chunk
                acc0 = tl.fma(tl.sum(p0, axis=2), s, acc0)
                if ROWS > 1:
                    acc1 = tl.fma(tl.sum(p1, axis=2), s, acc1)
                if ROWS > 2:
                    acc2 = tl.fma(tl.sum(p2, axis=2), s, acc2)
                if ROWS > 3:
                    acc3 = tl.fma(tl.sum(p3, axis=2), s, acc3)
        out = _gemv_out(acc0, acc1, acc2, acc3, BLOCK_M, ROWS)
        offs_m = tl.arange(0, BLOCK_M)
        _store(out, B, Y, WS, LOCKS, offs_m, offs_n, offs_m < M, n_mask, M, N, stride_ym, split_k, HAS_BIAS, SPLIT, PDL)

    @triton.jit(do_not_specialize=["split_k"])
    def _w8a16_gemv_kernel(X, Q, S, B, Y, WS, LOCKS, M, N, K, stride_xm, stride_qn, stride_ym, split_k, stride_pc,
                           ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr,
                           SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, FAST: tl.constexpr, EVEN_N: tl.constexpr,
                           EVEN_K: tl.constexpr, PREFETCH: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr):
        """Q: int8 [N, K] (or `chunk_major`) viewed as int32 words (strides in words); a step is CHUNKS 16-byte chunks
        per row (EVEN_K: K a multiple of the step, else the last step is masked by word; EVEN_N: N a multiple of
        BLOCK_N, no row mask). Each byte becomes the fp32 2^23 + q + 128 (`_bytes`), one subtraction makes q."""
        pid_n = tl.program_id(0)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_c = tl.arange(0, CHUNKS)
        offs_i = tl.arange(0, 4)
        n_mask = offs_n < N
        k_words = K // 4
        steps = tl.cdiv(k_words, CHUNKS * 4)
        s_begin, s_end = _split_range(steps, split_k)
        wait_previous(PDL)
        words = (offs_c * 4)[:, None] + offs_i[None, :]  # [CHUNKS, 4]
        q_ptrs = Q + offs_n.to(tl.int64)[:, None, None] * stride_qn + words[None, :, :]
        w_mask = n_mask[:, None, None] & (words[None, :, :] >= 0)
        acc0 = tl.zeros((BLOCK_N, CHUNKS, 4), dtype=tl.float32)
        acc1, acc2, acc3 = acc0, acc0, acc0
        for step in tl.range(s_begin, s_end, num_stages=STAGES):
            if PREFETCH and FAST:  # the step PREFETCH ahead: CHUNKS * 16 bytes a row, one line per 128
                for line in tl.static_range(0, CHUNKS * 4, 32):
                    ahead = _packed_col(step + PREFETCH, stride_pc, CHUNKS * 4, 16) + line
                    _prefetch_l2(Q + offs_n.to(tl.int64) * stride_qn + ahead,
                                 n_mask & (offs_n * 0 + step + PREFETCH < s_end))
            word = step * (CHUNKS * 4) + words
            x_mask = word < k_words
            w = _load(q_ptrs + _packed_col(step, stride_pc, CHUNKS * 4, 16), w_mask & x_mask[None, :, :],
                      EVEN_N and EVEN_K)
            b0, b1, b2, b3 = _bytes(w, FAST)
            xp = X + word * 4
            # one byte position at a time, each used by every row of x at once: few values live per thread. No
            # per-group scale: the products go straight into the [BLOCK_N, CHUNKS, 4] accumulators.
            d = _f32(b0) - 8388736.0  # - (2^23 + 128): q
            acc0, acc1, acc2, acc3 = _fma_rows(acc0, acc1, acc2, acc3, d, xp, x_mask, stride_xm, ROWS, EVEN_K)
            d = _f32(b1) - 8388736.0
            acc0, acc1, acc2, acc3 = _fma_rows(acc0, acc1, acc2, acc3, d, xp + 1, x_mask, stride_xm, ROWS, EVEN_K)
            d = _f32(b2) - 8388736.0
            acc0, acc1, acc2, acc3 = _fma_rows(acc0, acc1, acc2, acc3, d, xp + 2, x_mask, stride_xm, ROWS, EVEN_K)
            d = _f32(b3) - 8388736.0
            acc0, acc1, acc2, acc3 = _fma_rows(acc0, acc1, acc2, acc3, d, xp + 3, x_mask, stride_xm, ROWS, EVEN_K)
        s = _load(S + offs_n, n_mask, EVEN_N).to(tl.float32)
        out = _gemv_out(tl.sum(acc0, axis=2), tl.sum(acc1, axis=2), tl.sum(acc2, axis=2), tl.sum(acc3, axis=2),
                        BLOCK_M, ROWS) * s[None, :]
        offs_m = tl.arange(0, BLOCK_M)
        _store(out, B, Y, WS, LOCKS, offs_m, offs_n, offs_m < M, n_mask, M, N, stride_ym, split_k, HAS_BIAS, SPLIT, PDL)

    # ---- MMA GEMV path (M = 1, int4 g128): one mma.sync per 32 weights of 8 rows, fed from the bytes each thread loaded
    # A [R, 16] tile of int32 words is one g128 group of R rows (64 bytes each); Triton lays it out with 16 bytes per
    # thread, 4 threads a row and 8 rows a warp (lane = 4 * row + chunk), which is the register layout of mma.sync
    # m16n8k16's operands up to a relabeling of K. Each thread pairs its word w of row r (tile A) with word w of row r
    # of a second tile (B): the MMA's rows 0-7 are tile A's rows, rows 8-15 tile B's, and its 16 K indices are the 4
    # threads' columns j, j+1 (k = 2c, 2c+1) and j+2, j+3 (k = 2c+8, 2c+9), j = the word's first column: exactly the
    # pairs `_nibbles_asm`'s PTX makes from a word. Every column of the MMA's right operand is x at the same columns,
    # one 8-byte load per word, so the tensor core sums the quad's 32 products per row in fp32 and each thread of the
    # quad gets its row's sum: no shuffles, no fp32 fma per weight. Per 8 weights: 12 instructions of dequantization
    # (exact q - z) and half an MMA (sm_90 SASS loop: 2.4-2.5 instructions a weight, against 3.05-4.6 for the other
    # decode kernels). The group's scale multiplies the sum once; a quarter of it goes to each of the quad's threads
    # (exact), and the accumulators are summed across the row after the K loop. The kernel waits on memory
    # (Nsight Compute: long-scoreboard stalls dominate), so with AHEAD the next group's bytes, x, scales and zero
    # points load before this group is computed.
    def _mma_gemv_asm(one: str, magic: str, kind: str) -> str:
        """PTX for one thread's 4 words of tiles A and B ($8-$11, $12-$15): x at each word's low and high columns
        ($16-$19, $20-$23, 8 bytes each), the rows' -(magic + z) pairs ($24, $28), scales / 4 ($32, $36) and
        accumulators ($40-$47 in, $0-$7 out; the group's sum goes to the first of each row's four)."""
        mma = f"mma.sync.aligned.m16n8k16.row.col.f32.{kind[:-2]}.{kind[:-2]}.f32"
        body = []
        for m in range(4):
            tile_a = _word_nibbles_ptx(f"${8 + m}", ("t0", "t1", "u0", "u1"), ("t0", "t1", "u0", "u1"), ("$24",) * 4,
                                       magic, kind)
            tile_b = _word_nibbles_ptx(f"${12 + m}", ("v0", "v1", "y0", "y1"), ("v0", "v1", "y0", "y1"), ("$28",) * 4,
                                       magic, kind)
            for a, b in zip(tile_a, tile_b):
                body += a + b
            body += [f"mov.b64 {{xa, xb}}, ${16 + m};",
                     f"{mma} {{d0, d1, d2, d3}}, {{t0, v0, t1, v1}}, {{xa, xb}}, {{d0, d1, d2, d3}};",
                     f"mov.b64 {{xa, xb}}, ${20 + m};",
                     f"{mma} {{e0, e1, e2, e3}}, {{u0, y0, u1, y1}}, {{xa, xb}}, {{e0, e1, e2, e3}};"]
        head = [".reg .b32 zero, one, t0, t1, u0, u1, v0, v1, y0, y1, xa, xb;",
                ".reg .f32 d0, d1, d2, d3, e0, e1, e2, e3;", "mov.b32 zero, 0;", f"mov.b32 one, {one};"]
        head += [f"mov.f32 {r}, 0f00000000;" for r in ("d0", "d1", "d2", "d3", "e0", "e1", "e2", "e3")]
        tail = ["add.f32 d0, d0, e0;", "add.f32 d2, d2, e2;", "fma.rn.f32 $0, d0, $32, $40;",
                "fma.rn.f32 $4, d2, $36, $44;"] + [f"mov.b32 ${i}, ${40 + i};" for i in (1, 2, 3, 5, 6, 7)]
        return "{\n" + "\n".join(head + body + tail) + "\n}"

    _MMA_GEMV_BF16 = tl.constexpr(_mma_gemv_asm("0x3F803F80", "0x43004300", "bf16x2"))
    _MMA_GEMV_F16 = tl.constexpr(_mma_gemv_asm("0x3C003C00", "0x64006400", "f16x2"))
    _MMA_GEMV_IO = tl.constexpr(",".join(["=f"] * 8 + ["r"] * 8 + ["l"] * 8 + ["r"] * 8 + ["f"] * 16))

    @triton.jit
    def _mma_gemv_group(acc, w, z, s, words, g, X):
        """Portable form of one tile's group (interpreter, fp32): acc [R, 16] + the group's row sums, scaled, in
        each row's first accumulator. w [R, 16] int32 words; z, s [R] fp32; X points at x's first column of each
        row's K slice (`_k_slices`)."""
        part = tl.zeros((w.shape[0],), dtype=tl.float32)
        for b in tl.static_range(4):
            byte = (w >> (8 * b)) & 0xFF
            xl = tl.load(X + g * 128 + words[None, :] * 4 + b).to(tl.float32)
            xh = tl.load(X + g * 128 + 64 + words[None, :] * 4 + b).to(tl.float32)
            part += tl.sum(((byte & 15).to(tl.float32) - z[:, None]) * xl, axis=1)
            part += tl.sum(((byte >> 4).to(tl.float32) - z[:, None]) * xh, axis=1)
        return acc + tl.where(words[None, :] == 0, (part * s)[:, None], 0.0)

    @triton.jit
    def _mma_gemv_consts(g, pa, pb, sa, sb, za, zb, N, stride_pc, HAS_ZEROS: tl.constexpr, EVICT: tl.constexpr):
        """Group g (of each row's K slice) of both tiles' words, and the rows' scales and zero points (fp32; sa..zb
        point at the slice's first group): constants, so a PDL kernel may load them before its wait. EVICT: the
        loads' L2 eviction policy (`WEIGHT_EVICT`)."""
        s_a = tl.load(sa + g * N, eviction_policy=EVICT).to(tl.float32)
        s_b = tl.load(sb + g * N, eviction_policy=EVICT).to(tl.float32)
        if HAS_ZEROS:
            z_a = tl.load(za + g * N, eviction_policy=EVICT).to(tl.float32)
            z_b = tl.load(zb + g * N, eviction_policy=EVICT).to(tl.float32)
        else:
            z_a = tl.full(s_a.shape, 8.0, tl.float32)
            z_b = z_a
        return (tl.load(pa + g * stride_pc, eviction_policy=EVICT), tl.load(pb + g * stride_pc, eviction_policy=EVICT),
                s_a, s_b, z_a, z_b)

    @triton.jit
    def _mma_gemv_x(g, x8):
        """x at group g's low and high 64 columns, as 8-byte words."""
        return tl.load(x8 + g * 32), tl.load(x8 + g * 32 + 16)

    @triton.jit
    def _rows_of(x, like):
        """x broadcast to the tile's shape: x [16] is every row's, x [R, 16] (K split over warps) per row."""
        if len(x.shape) == 1:
            rows = tl.broadcast_to(x[None, :], like.shape)
        else:
            rows = tl.broadcast_to(x, like.shape)
        return rows

    @triton.jit
    def _mma_gemv_group_pair(acc_a, acc_b, wa, wb, x_lo, x_hi, s_a, s_b, z_a, z_b, g, X, words, FAST: tl.constexpr):
        """Group g of both tiles into their accumulators."""
        DTYPE: tl.constexpr = X.dtype.element_ty
        if FAST:
            BIAS: tl.constexpr = 128.0 if DTYPE == tl.bfloat16 else 1024.0
            ha = (-(z_a + BIAS)).to(DTYPE).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
            hb = (-(z_b + BIAS)).to(DTYPE).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
            args = [wa, wb, _rows_of(x_lo, wa), _rows_of(x_hi, wa),
                    tl.broadcast_to((ha | (ha << 16))[:, None], wa.shape),
                    tl.broadcast_to((hb | (hb << 16))[:, None], wa.shape),
                    tl.broadcast_to((s_a * 0.25)[:, None], wa.shape), tl.broadcast_to((s_b * 0.25)[:, None], wa.shape),
                    acc_a, acc_b]
            # one call per asm: Triton 3.6 cannot select the asm string
            if DTYPE == tl.bfloat16:
                acc_a, acc_b = tl.inline_asm_elementwise(asm=_MMA_GEMV_BF16, constraints=_MMA_GEMV_IO, args=args,
                                                         dtype=(tl.float32, tl.float32), is_pure=True, pack=4)
            else:
                acc_a, acc_b = tl.inline_asm_elementwise(asm=_MMA_GEMV_F16, constraints=_MMA_GEMV_IO, args=args,
                                                         dtype=(tl.float32, tl.float32), is_pure=True, pack=4)
        else:
            acc_a = _mma_gemv_group(acc_a, wa, z_a, s_a, words, g, X)
            acc_b = _mma_gemv_group(acc_b, wb, z_b, s_b, words, g, X)
        return acc_a, acc_b

    @triton.jit
    def _mma_gemv_tiles(X, W, N, stride_wn, BLOCK_N: tl.constexpr, GATED: tl.constexpr, KW: tl.constexpr):
        """A program's two tiles of BLOCK_N / 2 rows (clamped to the last row; not stored past it), their word
        pointers at the first chunk, x as 8-byte words and both tiles' zeroed accumulators. GATED (W = [gate; up],
        N rows): the tiles are gate rows and the same up rows, so the epilogue has both halves of SiLU-and-mul.
        KW > 1: the program's warps split its K range KW ways. A tile then has BLOCK_N / 2 x KW rows (8 a warp);
        tile row t is output row (t // (8 KW)) * 8 + t % 8 and takes K slice (t // 8) % KW (`part`), so each warp's
        rows share one slice and the MMA's right operand, x, stays one column for the warp."""
        HALF_N: tl.constexpr = BLOCK_N // 2
        t = tl.arange(0, HALF_N * KW)
        local = (t // (8 * KW)) * 8 + t % 8
        part = (t // 8) % KW
        if GATED:
            rows_a = tl.program_id(0) * HALF_N + local
            ra = tl.minimum(rows_a, N // 2 - 1)
            rb = ra + N // 2
        else:
            rows_a = tl.program_id(0) * BLOCK_N + local
            ra, rb = tl.minimum(rows_a, N - 1), tl.minimum(rows_a + HALF_N, N - 1)
        words = tl.arange(0, 16)
        pa = W + ra.to(tl.int64)[:, None] * stride_wn + words[None, :]
        pb = W + rb.to(tl.int64)[:, None] * stride_wn + words[None, :]
        x8 = X.to(tl.pointer_type(tl.int64), bitcast=True) + words  # 4 columns of x per 8 bytes
        acc = tl.zeros((HALF_N * KW, 16), dtype=tl.float32)
        return ra, rb, part, words, pa, pb, x8, acc, acc

    @triton.jit
    def _norm_sums(SQ_IN, n_sq, NORM: tl.constexpr, BLOCK_SQ: tl.constexpr):
        """NORM: x's row sum of squares as the n_sq partials `_write`'s RESIDUAL left, loaded right after the wait
        and summed after the K loop (`_rstd`): summed here, the sum's cross-warp step held the loop's first x loads
        back by an L2 round trip."""
        offs = tl.arange(0, BLOCK_SQ)
        if NORM:
            sq = tl.load(SQ_IN + offs, mask=offs < n_sq, other=0.0)
        else:  # unused
            sq = tl.zeros((BLOCK_SQ,), tl.float32)
        return sq

    @triton.jit
    def _rstd(sq, K, eps, NORM: tl.constexpr):
        """NORM: 1 / rms of x's row (K columns) from `_norm_sums`; else 1."""
        if NORM:
            rstd = tl.rsqrt(tl.sum(sq, axis=0) / K + eps)
        else:
            rstd = 1.0
        return rstd

    @triton.jit
    def _residual(R, NW, N, BLOCK_N: tl.constexpr, RESIDUAL: tl.constexpr):
        """RESIDUAL: the residual and the next norm's weight at this program's outputs, loaded right after the wait
        for the epilogue."""
        if RESIDUAL:
            offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
            res = tl.load(R + offs_n, mask=offs_n < N, other=0.0)
            nw = tl.load(NW + offs_n, mask=offs_n < N, other=0.0)
        else:  # unused (Triton 3.6 cannot return None)
            res = tl.zeros((BLOCK_N,), tl.float32)
            nw = res
        return res, nw

    @triton.jit
    def _k_slices(part, begin, per, steps, KW: tl.constexpr):
        """The first K step of each tile row's slice: a scalar for KW = 1, else [R] and as a column [R, 1]. A split
        program left with no steps gets the last one, so its loads stay in bounds (and are unused)."""
        if KW == 1:  # one return: a Triton function's returns must agree in type
            first = tl.minimum(begin, steps - 1)
            col = first
        else:
            first = tl.minimum(begin + part * per, steps - 1)
            col = first[:, None]
        return first, col

    @triton.jit
    def _slice_sums(acc, scale, KW: tl.constexpr):
        """Each output row's sum from the tile's [R, 16] accumulators: over a row's 16, times `scale` (the W8 rows'),
        then over its KW slices (the cross-warp step goes through shared memory, not the split-K workspace)."""
        rows = tl.sum(acc, axis=1) * scale
        if KW > 1:
            R: tl.constexpr = acc.shape[0]
            rows = tl.reshape(tl.sum(tl.reshape(rows, (R // (8 * KW), KW, 8)), axis=1), (R // KW,))
        return rows

    @triton.jit
    def _mma_gemv_store(sum_a, sum_b, B, Y, WS, LOCKS, M, N, stride_ym, split_k, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr,
                        GATED: tl.constexpr, res, nw, SQ, XN, RESIDUAL: tl.constexpr, ROUND: tl.constexpr = None):
        """Both tiles' row sums, in row order, through `_store` (RESIDUAL: `_write`'s); GATED: through
        `_gated_store`."""
        if GATED:
            _gated_store(sum_a, sum_b, B, Y, WS, LOCKS, N, split_k, BLOCK_N // 2, HAS_BIAS, SPLIT, PDL)
        else:
            out = tl.reshape(tl.permute(tl.join(sum_a, sum_b), (1, 0)), (BLOCK_N,))
            offs_m = tl.arange(0, BLOCK_M)
            offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
            _store(out[None, :], B, Y, WS, LOCKS, offs_m, offs_n, offs_m < M, offs_n < N, M, N, stride_ym, split_k,
                   HAS_BIAS, SPLIT, PDL, res, nw, SQ, XN, RESIDUAL, ROUND)

    @triton.jit
    def _gated_store(gate, up, B, Y, WS, LOCKS, N, split_k, HALF_N: tl.constexpr, HAS_BIAS: tl.constexpr,
                     SPLIT: tl.constexpr, PDL: tl.constexpr):
        """y[i] = silu(gate[i]) * up[i] for this program's HALF_N outputs (M = 1, N = 2 x outputs), split K as in
        `_store`: the partials of both halves in WS [split_k, N], the last program to arrive adds them in order."""
        release_dependents(PDL)
        half = N // 2
        rows = tl.program_id(0) * HALF_N + tl.arange(0, HALF_N)
        mask = rows < half
        if SPLIT:
            ws = WS + rows
            tl.store(ws + tl.program_id(1) * N, gate, mask=mask)
            tl.store(ws + tl.program_id(1) * N + half, up, mask=mask)
            tl.debug_barrier()  # every thread's partial is written before the count says so (acq_rel below)
            if tl.atomic_add(LOCKS + tl.program_id(0), 1, sem="acq_rel") == split_k - 1:
                gate = _sum_partials(ws, mask, split_k, N, 16)
                up = _sum_partials(ws + half, mask, split_k, N, 16)
                _gated_write(gate, up, B, Y, rows, mask, half, HAS_BIAS)
                tl.atomic_xchg(LOCKS + tl.program_id(0), 0, sem="relaxed")
        else:
            _gated_write(gate, up, B, Y, rows, mask, half, HAS_BIAS)

    @triton.jit
    def _gated_write(gate, up, B, Y, rows, mask, half, HAS_BIAS: tl.constexpr):
        """Rounded where the unfused path rounds: the GEMM's outputs, silu's, then the product (silu_and_mul)."""
        if HAS_BIAS:
            gate += tl.load(B + rows, mask=mask, other=0.0).to(tl.float32)
            up += tl.load(B + half + rows, mask=mask, other=0.0).to(tl.float32)
        dt = Y.dtype.element_ty
        g = gate.to(dt).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        tl.store(Y + rows, (s * up.to(dt).to(tl.float32)).to(dt), mask=mask)

    @triton.jit
    def _release_at_last_step(step, last, PDL: tl.constexpr, LAST_STEP_RELEASE: tl.constexpr):
        """A config releasing the next launch at its last K step (`LAST_STEP_RELEASE`) does so here."""
        if LAST_STEP_RELEASE:
            if step == last:
                release_dependents(PDL)

    @triton.jit
    def _stamp(TRACE, slot: tl.constexpr, after):
        """Benchmarks' timeline (`TRACE`: int64 [programs, 4], None in the engine): the global ns clock, read once
        `after` (a value computed from the phase's loads) is ready, in this program's `slot`."""
        if TRACE is not None:
            t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer; // $1", "=l,r", [after.to(tl.int32)],
                                          dtype=tl.int64, is_pure=False, pack=1)
            tl.store(TRACE + (tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)) * 4 + slot, t)

    @triton.jit(do_not_specialize=["split_k", "stride_sn"])
    def _w4a16_mma_gemv_kernel(X, P, S, Z, B, Y, WS, LOCKS, M, N, K, stride_xm, stride_pn, stride_ym, split_k,
                               stride_sn, stride_pc, TRACE, R, SQ, NW, XN, SQ_IN, n_sq, eps, BLOCK_M: tl.constexpr,
                               BLOCK_N: tl.constexpr, AHEAD: tl.constexpr, SPLIT: tl.constexpr, HAS_ZEROS: tl.constexpr,
                               HAS_BIAS: tl.constexpr, FAST: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr,
                               GATED: tl.constexpr, LAST_STEP_RELEASE: tl.constexpr, KW: tl.constexpr,
                               NORM: tl.constexpr = False, RESIDUAL: tl.constexpr = False,
                               BLOCK_SQ: tl.constexpr = 1, EVICT: tl.constexpr = ""):
        """M = 1, group 128. P: the int4 kernel layout as int32 words (a group is one chunk). A program's BLOCK_N rows
        are two tiles of BLOCK_N / 2 (the MMA's rows 0-7 and 8-15); rows past N read row N - 1 and are not stored.
        KW > 1: the program's K range is cut into KW equal slices, one per warp (`_mma_gemv_tiles`; the launcher
        makes them equal). NORM: X is a PendingNorm's xw, its row sums times 1 / rms from SQ_IN (`_norm_sums`).
        RESIDUAL (not GATED): plus R, with the next norm's inputs (weight NW) in XN and SQ (`_write`)."""
        g_begin, g_end = _split_range(K // 128, split_k)
        per = tl.maximum(g_end - g_begin, 0) // KW
        last = tl.maximum(per - 1, 0)
        _stamp(TRACE, 0, last)
        if not EARLY:
            wait_previous(PDL)
        ra, rb, part, words, pa, pb, x8, acc_a, acc_b = _mma_gemv_tiles(X, P, N, stride_pn, BLOCK_N, GATED, KW)
        first, first_col = _k_slices(part, g_begin, per, K // 128, KW)
        pa, pb = pa + first_col * stride_pc, pb + first_col * stride_pc
        x8, xs = x8 + first_col * 32, X + first_col * 128
        sa, sb = S + first * N + ra * stride_sn, S + first * N + rb * stride_sn
        za, zb = Z + first * N + ra * stride_sn, Z + first * N + rb * stride_sn
        wa, wb, s_a, s_b, z_a, z_b = _mma_gemv_consts(0, pa, pb, sa, sb, za, zb, N, stride_pc, HAS_ZEROS, EVICT)
        if EARLY:
            wait_previous(PDL)
        sq = _norm_sums(SQ_IN, n_sq, NORM, BLOCK_SQ)
        res, nw = _residual(R, NW, N, BLOCK_N, RESIDUAL)
        _stamp(TRACE, 1, last)
        x_lo, x_hi = _mma_gemv_x(0, x8)
        for g in range(0, per):
            _release_at_last_step(g, last, PDL, LAST_STEP_RELEASE)
            nxt = tl.minimum(g + 1, last)  # the last iteration reloads the last group, unused
            if AHEAD:  # group g + 1 loads while g computes
                ahead = _mma_gemv_consts(nxt, pa, pb, sa, sb, za, zb, N, stride_pc, HAS_ZEROS, EVICT)
                x_ahead = _mma_gemv_x(nxt, x8)
            acc_a, acc_b = _mma_gemv_group_pair(acc_a, acc_b, wa, wb, x_lo, x_hi, s_a, s_b, z_a, z_b, g, xs, words,
                                                FAST)
            if not AHEAD:
                ahead = _mma_gemv_consts(nxt, pa, pb, sa, sb, za, zb, N, stride_pc, HAS_ZEROS, EVICT)
                x_ahead = _mma_gemv_x(nxt, x8)
            wa, wb, s_a, s_b, z_a, z_b = ahead
            x_lo, x_hi = x_ahead
        _stamp(TRACE, 2, tl.sum(acc_a) + tl.sum(acc_b))
        rstd = _rstd(sq, K, eps, NORM)
        _mma_gemv_store(_slice_sums(acc_a, rstd, KW), _slice_sums(acc_b, rstd, KW), B, Y, WS, LOCKS, M, N,
                        stride_ym, split_k, BLOCK_M, BLOCK_N, HAS_BIAS, SPLIT, PDL, GATED, res, nw, SQ, XN, RESIDUAL,
                        X.dtype.element_ty)
        _stamp(TRACE, 3, last)

    # ---- W8A16 MMA GEMV (M = 1): the same pairing for int8 weights, one mma.sync per 32 weights of 8 rows ----------
    # A [R, 16] tile of int32 words is 64 int8 weights of R rows; a thread's word w of row r pairs with word w of row r
    # of the second tile as in the int4 kernel, its 4 bytes are the MMA's K indices 2c, 2c+1, 2c+8, 2c+9 and x at the
    # word's 4 columns is one 8-byte load. bf16 has 7 mantissa bits, so a signed byte cannot become 2^7 + q with one
    # OR: each byte pair is spread into 16-bit halves (prmt), its low 7 bits ORed into 128 (fp16: 1024) and its sign
    # bit into 128 or 256 (fp16: 1024 or 1152), and the difference of the two is q, exactly (2 instructions a
    # weight). The scale is per row, so the MMA accumulates across the whole K loop and the scale multiplies once.
    def _word_bytes_ptx(word: str, lo: str, hi: str, magic: str, kind: str) -> list[str]:
        """PTX turning one word of 4 signed bytes into the packed pairs (q0, q1) in `lo` and (q2, q3) in `hi`.
        Needs registers `zero` (0), `nego` (-1.0 in both halves) and scratch `l7`, `sg`."""
        out = []
        for reg, sel in ((lo, "0x4140"), (hi, "0x4342")):
            out += [f"prmt.b32 {reg}, {word}, zero, {sel};",
                    f"lop3.b32 l7, {reg}, 0x007F007F, {magic}, 0xEA;",
                    f"lop3.b32 sg, {reg}, 0x00800080, {magic}, 0xEA;",
                    f"fma.rn.{kind} {reg}, sg, nego, l7;"]
        return out

    def _word_fp8_ptx(word: str, lo: str, hi: str, kind: str) -> list[str]:
        """PTX turning one word of 4 E4M3 bytes into the exact pairs (b0, b1) in `lo` and (b2, b3) in `hi`. fp16:
        one cvt a pair. bf16 has no such cvt on sm_90: each byte goes to the top of a 16-bit half (prmt), its low 7
        bits move down under bf16's exponent and mantissa (E4M3's 4 + 3 bits as the low bits of bf16's 8 + 7), the
        sign stays, and a multiply by 2^120 moves E4M3's exponent bias (7) to bf16's (127); E4M3's subnormals are
        bf16 subnormals there, exact too. Needs registers `zero` (0), `big` (2^120, bf16) and scratch `sg`; fp16
        needs 16-bit `h0`, `h1`."""
        if kind == "f16x2":
            return [f"mov.b32 {{h0, h1}}, {word};", f"cvt.rn.f16x2.e4m3x2 {lo}, h0;", f"cvt.rn.f16x2.e4m3x2 {hi}, h1;"]
        out = []
        for reg, sel in ((lo, "0x1404"), (hi, "0x3424")):
            out += [f"prmt.b32 {reg}, {word}, zero, {sel};", f"shr.b32 sg, {reg}, 4;", "and.b32 sg, sg, 0x07F007F0;",
                    f"lop3.b32 {reg}, {reg}, 0x80008000, sg, 0xEA;", f"fma.rn.bf16x2 {reg}, {reg}, big, nzero;"]
        return out

    def _mma_gemv8_asm(nego: str, magic: str, kind: str, fp8: bool = False) -> str:
        """PTX for one step: a thread's 4 words of tiles A and B ($8-$11, $12-$15), x at each word's 4 columns
        ($16-$19, 8 bytes each), accumulators $20-$27 in and $0-$7 out (each row's running sum in the first of a
        thread's four; the MMA's C operand, so no add per step)."""
        mma = f"mma.sync.aligned.m16n8k16.row.col.f32.{kind[:-2]}.{kind[:-2]}.f32"
        body = []
        for m in range(4):
            d = "d" if m % 2 == 0 else "e"  # two accumulator chains
            if fp8:
                body += _word_fp8_ptx(f"${8 + m}", "t0", "t1", kind) + _word_fp8_ptx(f"${12 + m}", "v0", "v1", kind)
            else:
                body += _word_bytes_ptx(f"${8 + m}", "t0", "t1", magic, kind)
                body += _word_bytes_ptx(f"${12 + m}", "v0", "v1", magic, kind)
            body += [f"mov.b64 {{xa, xb}}, ${16 + m};",
                     f"{mma} {{{d}0, {d}1, {d}2, {d}3}}, {{t0, v0, t1, v1}}, {{xa, xb}}, {{{d}0, {d}1, {d}2, {d}3}};"]
        # fp8: `_word_fp8_ptx`'s registers too (2^120 and -0.0 as bf16 pairs, the fp16 cvt's 16-bit halves)
        fp8_regs = [".reg .b32 big, nzero;", ".reg .b16 h0, h1;"] if fp8 else []
        fp8_movs = ["mov.b32 big, 0x7B807B80;", "mov.b32 nzero, 0x80008000;"] if fp8 else []
        head = [".reg .b32 zero, nego, t0, t1, v0, v1, l7, sg, xa, xb;",
                ".reg .f32 d0, d1, d2, d3, e0, e1, e2, e3;", *fp8_regs, "mov.b32 zero, 0;", f"mov.b32 nego, {nego};",
                *fp8_movs, "mov.f32 d0, $20;", "mov.f32 d2, $24;"]
        head += [f"mov.f32 {r}, 0f00000000;" for r in ("d1", "d3", "e0", "e1", "e2", "e3")]
        tail = ["add.f32 $0, d0, e0;", "add.f32 $4, d2, e2;"]
        tail += [f"mov.b32 ${i}, ${20 + i};" for i in (1, 2, 3, 5, 6, 7)]
        return "{\n" + "\n".join(head + body + tail) + "\n}"

    _MMA_GEMV8_BF16 = tl.constexpr(_mma_gemv8_asm("0xBF80BF80", "0x43004300", "bf16x2"))
    _MMA_GEMV8_F16 = tl.constexpr(_mma_gemv8_asm("0xBC00BC00", "0x64006400", "f16x2"))
    _MMA_GEMV8_FP8_BF16 = tl.constexpr(_mma_gemv8_asm("0xBF80BF80", "0x43004300", "bf16x2", fp8=True))
    _MMA_GEMV8_FP8_F16 = tl.constexpr(_mma_gemv8_asm("0xBC00BC00", "0x64006400", "f16x2", fp8=True))
    _MMA_GEMV8_IO = tl.constexpr(",".join(["=f"] * 8 + ["r"] * 8 + ["l"] * 4 + ["f"] * 8))

    @triton.jit
    def _mma_gemv8_step(acc_a, acc_b, wa, wb, x, step, X, words, FAST: tl.constexpr, FP8: tl.constexpr):
        """One 64-column step of both tiles into their accumulators (each thread's first accumulator of a row holds
        the row's running sum: a quarter of the row's total after the sum over its 16). FP8: E4M3 bytes."""
        if FAST:
            args = [wa, wb, _rows_of(x, wa), acc_a, acc_b]
            # one call per asm: Triton 3.6 cannot select the asm string
            if X.dtype.element_ty == tl.bfloat16 and FP8:
                acc_a, acc_b = tl.inline_asm_elementwise(asm=_MMA_GEMV8_FP8_BF16, constraints=_MMA_GEMV8_IO,
                                                         args=args, dtype=(tl.float32, tl.float32), is_pure=True,
                                                         pack=4)
            elif FP8:
                acc_a, acc_b = tl.inline_asm_elementwise(asm=_MMA_GEMV8_FP8_F16, constraints=_MMA_GEMV8_IO,
                                                         args=args, dtype=(tl.float32, tl.float32), is_pure=True,
                                                         pack=4)
            elif X.dtype.element_ty == tl.bfloat16:
                acc_a, acc_b = tl.inline_asm_elementwise(asm=_MMA_GEMV8_BF16, constraints=_MMA_GEMV8_IO, args=args,
                                                         dtype=(tl.float32, tl.float32), is_pure=True, pack=4)
            else:
                acc_a, acc_b = tl.inline_asm_elementwise(asm=_MMA_GEMV8_F16, constraints=_MMA_GEMV8_IO, args=args,
                                                         dtype=(tl.float32, tl.float32), is_pure=True, pack=4)
        else:  # portable (interpreter, fp32): the same sums, in the same four places a row
            part_a = tl.zeros((wa.shape[0],), dtype=tl.float32)
            part_b = tl.zeros((wa.shape[0],), dtype=tl.float32)
            for b in tl.static_range(4):
                xv = tl.load(X + step * 64 + words[None, :] * 4 + b).to(tl.float32)
                part_a += tl.sum(_byte_value((wa << (24 - 8 * b)) >> 24, FP8) * xv, axis=1)
                part_b += tl.sum(_byte_value((wb << (24 - 8 * b)) >> 24, FP8) * xv, axis=1)
            first = words[None, :] % 4 == 0
            acc_a += tl.where(first, part_a[:, None], 0.0)
            acc_b += tl.where(first, part_b[:, None], 0.0)
        return acc_a, acc_b

    @triton.jit
    def _byte_value(b, FP8: tl.constexpr):
        """A sign-extended byte (int32) as fp32: the int8 code, or the E4M3 value of its bits."""
        if FP8:
            return b.to(tl.int8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        return b.to(tl.float32)

    @triton.jit
    def _mma_gemv8_load(t, pa, pb, x8, stride_qc, EVICT: tl.constexpr):
        """Step t's words of both tiles and x at their columns."""
        return (tl.load(pa + t * stride_qc, eviction_policy=EVICT), tl.load(pb + t * stride_qc, eviction_policy=EVICT),
                tl.load(x8 + t * 16))

    @triton.jit(do_not_specialize=["split_k"])
    def _w8a16_mma_gemv_kernel(X, Q, S, B, Y, WS, LOCKS, M, N, K, stride_xm, stride_qn, stride_ym, split_k,
                               stride_qc, TRACE, R, SQ, NW, XN, SQ_IN, n_sq, eps, BLOCK_M: tl.constexpr,
                               BLOCK_N: tl.constexpr, AHEAD: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                               FAST: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr, GATED: tl.constexpr,
                               LAST_STEP_RELEASE: tl.constexpr, KW: tl.constexpr, FP8: tl.constexpr = False,
                               NORM: tl.constexpr = False, RESIDUAL: tl.constexpr = False,
                               BLOCK_SQ: tl.constexpr = 1, EVICT: tl.constexpr = ""):
        """M = 1, K a multiple of 64. Q: int8 (FP8: E4M3) [N, K] as int32 words, word column c of row n at
        n * stride_qn + (c // 16) * stride_qc + c % 16 (by rows: stride_qc = 16). Tiles, rows past N and K slices
        (KW) as in the int4 kernel. EARLY: the first step's weights and the scales are loaded before the PDL wait
        (they are constants), so under PDL their latency overlaps the previous kernel. NORM, RESIDUAL: as in the
        int4 kernel."""
        s_begin, s_end = _split_range(K // 64, split_k)
        per = tl.maximum(s_end - s_begin, 0) // KW
        last = tl.maximum(per - 1, 0)
        _stamp(TRACE, 0, last)
        if not EARLY:
            wait_previous(PDL)
        ra, rb, part, words, pa, pb, x8, acc_a, acc_b = _mma_gemv_tiles(X, Q, N, stride_qn, BLOCK_N, GATED, KW)
        first, first_col = _k_slices(part, s_begin, per, K // 64, KW)
        pa, pb = pa + first_col * stride_qc, pb + first_col * stride_qc
        x8, xs = x8 + first_col * 16, X + first_col * 64
        wa, wb = tl.load(pa, eviction_policy=EVICT), tl.load(pb, eviction_policy=EVICT)
        if AHEAD == 2:
            second = (tl.load(pa + tl.minimum(1, last) * stride_qc, eviction_policy=EVICT),
                      tl.load(pb + tl.minimum(1, last) * stride_qc, eviction_policy=EVICT))
        s_a = tl.load(S + ra).to(tl.float32) * 0.25  # four copies of each row's sum (exact)
        s_b = tl.load(S + rb).to(tl.float32) * 0.25
        if EARLY:
            wait_previous(PDL)
        sq = _norm_sums(SQ_IN, n_sq, NORM, BLOCK_SQ)
        res, nw = _residual(R, NW, N, BLOCK_N, RESIDUAL)
        _stamp(TRACE, 1, last)
        if AHEAD == 2:  # steps t + 1 and t + 2 in flight while t computes; x (L1 hits) loads where it is used
            for t in range(0, per):
                _release_at_last_step(t, last, PDL, LAST_STEP_RELEASE)
                nxt = tl.minimum(t + 2, last)
                third = (tl.load(pa + nxt * stride_qc, eviction_policy=EVICT),
                         tl.load(pb + nxt * stride_qc, eviction_policy=EVICT))
                acc_a, acc_b = _mma_gemv8_step(acc_a, acc_b, wa, wb, tl.load(x8 + t * 16), t, xs, words, FAST, FP8)
                wa, wb = second
                second = third
        else:
            x = tl.load(x8)
            for t in range(0, per):
                _release_at_last_step(t, last, PDL, LAST_STEP_RELEASE)
                nxt = tl.minimum(t + 1, last)  # the last iteration reloads the last step, unused
                if AHEAD:  # step t + 1 loads while t computes
                    ahead = _mma_gemv8_load(nxt, pa, pb, x8, stride_qc, EVICT)
                acc_a, acc_b = _mma_gemv8_step(acc_a, acc_b, wa, wb, x, t, xs, words, FAST, FP8)
                wa, wb, x = ahead if AHEAD else _mma_gemv8_load(nxt, pa, pb, x8, stride_qc, EVICT)
        _stamp(TRACE, 2, tl.sum(acc_a) + tl.sum(acc_b))
        rstd = _rstd(sq, K, eps, NORM)
        _mma_gemv_store(_slice_sums(acc_a, s_a * rstd, KW), _slice_sums(acc_b, s_b * rstd, KW), B, Y, WS, LOCKS, M,
                        N, stride_ym, split_k, BLOCK_M, BLOCK_N, HAS_BIAS, SPLIT, PDL, GATED, res, nw, SQ, XN,
                        RESIDUAL, X.dtype.element_ty)
        _stamp(TRACE, 3, last)

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
        p = tl.load(P + offs_n.to(tl.int64)[:, None] * stride_pn + _packed_col(g, stride_pc, HALF, 64)
                    + offs_h[None, :], mask=mask, other=0)
        lo, hi = _group_weights(p, Z, S, g, N, offs_n, n_mask, BLOCK_N, HAS_ZEROS, W.dtype.element_ty, FAST)
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
        q = tl.load(Q + rows * stride_qn + pid_k * (BLOCK_K // 64) * stride_pc + _chunk_cols(cols, stride_pc)[None, :],
                    mask=mask, other=0)
        s = tl.load(S + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
        v = _fp8_to(q, tl.float32) if FP8 else q.to(tl.float32)
        tl.store(W + rows * stride_wn + offs_k[None, :], (v * s[:, None]).to(W.dtype.element_ty), mask=mask)

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


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# ---- configs and the once-per-shape choice among them ----------------------------------------------------------------
# (BLOCK_N, input columns per iteration, SPLIT_K, warps, stages). SPLIT_K "auto": enough K slices for ~2 programs
# per SM ("auto4", "auto8": ~4, ~8). Small M always uses 16-row tiles (the smallest tensor-core tile). The
# candidates trade column-strip width against programs per SM (shared memory per program = stages x (x tile +
# weight tile)); the first, the default when nothing is timed, won most int4 shapes on the H200.
SMALL_CONFIGS = [(64, 256, "auto4", 4, 4), (128, 256, "auto", 4, 3), (64, 256, "auto", 4, 4), (128, 256, "auto", 8, 3),
                 (128, 512, "auto", 4, 2), (64, 512, "auto", 4, 3), (32, 256, "auto", 4, 4), (128, 256, "auto4", 4, 3),
                 (32, 256, "auto4", 4, 4), (64, 256, "auto8", 4, 4), (64, 512, "auto4", 4, 3), (128, 256, 1, 4, 3)]
TILED_CONFIGS = [(128, 128, 128, 8, 3), (128, 256, 128, 8, 2), (64, 256, 128, 4, 3), (64, 128, 128, 4, 4)]
# SMALL_M < M <= MID_M (batched decode): 32-64-row tiles over narrow column strips with split K, as the small-M
# ones: the tiled configs give too few programs there (8B q/o at M = 64: 32). (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K,
# warps, stages)
MID_M = 128
MID_CONFIGS = [(32, 64, 256, "auto4", 4, 3), (64, 64, 128, "auto4", 4, 3), (32, 128, 256, "auto", 4, 3),
               (64, 128, 128, "auto", 4, 3)]
DEQUANT = {"DEQUANT": True}  # candidate for M > SMALL_M: dequantize the weight once, then F.linear (cuBLAS)
# Swapped int4 tiles (`SWAP`: y^T = W x^T, so the dequantized weight tile is the wgmma's left operand straight from
# registers and only x goes through shared memory; BLOCK_M rows of x are the MMA's N, 16-256), appended after each
# M range's candidates: (BLOCK_M, BLOCK_N, input columns per iteration, SPLIT_K, warps, stages). A range takes the
# ones whose BLOCK_M fits it (`_swap_configs`). On the H200 they win gate_up at M = 128 (106.5 against 113.1 us)
# and M = 256 (141.5 against 186.2, the dequantize + cuBLAS candidate) and lose or tie the other 8B shapes
# (bench/results/quant_swap_tiles_h200.jsonl, quant_swap_tiles_rerun_h200.jsonl).
SWAP_CONFIGS = [(16, 64, 128, "auto4", 4, 4), (16, 128, 128, "auto4", 8, 3), (32, 64, 128, "auto4", 4, 4),
                (64, 64, 128, "auto4", 4, 3), (64, 128, 128, "auto4", 8, 3), (128, 128, 128, "auto", 8, 3),
                (128, 128, 128, 1, 8, 3), (256, 128, 128, 1, 8, 3), (128, 256, 128, 1, 8, 3)]
# MMA decode candidates for M <= SMALL_M, after the tensor-core ones (the default stays the first of those):
# (BLOCK_N, warps, SPLIT_K, two groups an iteration, L2 prefetch distance in groups or 0, the next group's x, zeros
# and scales loaded a group ahead). BLOCK_N is a multiple of 16 x warps (`_mma_rows`).
MMA_CONFIGS = [(64, 4, "auto4", False, 4, False), (64, 4, "auto8", True, 4, False), (64, 4, "auto4", False, 8, False),
               (128, 8, "auto4", False, 4, False), (64, 4, "auto4", False, 0, False), (128, 8, "auto8", True, 2, False),
               (64, 4, "auto4", False, 4, True)]
# GEMV candidates for M <= GEMV_M, appended after the split-K ones (the default stays the split-K config; the tuner
# picks per shape): (BLOCK_N, 16-byte chunks per row per step, SPLIT_K, warps, L2 prefetch distance in loop steps
# or 0). STAGES (Triton's software pipelining of the K loop through shared memory) stays 1: 2 and 3 ran up to 24%
# slower on the H200 and never gave a shape's fastest candidate (bench/results/quant_decode_sweep_h200.jsonl).
# Rows of W per thread R = BLOCK_N * CHUNKS / (32 * warps): a thread's x loads and conversions are shared by its R rows,
# and fewer chunks per step (int4) share a group's scale and zeros over more codes, at the cost of registers (R * M
# accumulators), so larger M keeps the smaller R. Instructions per weight in the main loop (sm_90 SASS, M = 1, bf16):
# int4 g128 3.9-4.4, int8 3.8-4.1.
GEMV_M = 4
GEMV_CONFIGS = [(256, 4, "auto4", 4, 0), (128, 4, "auto4", 4, 0), (256, 2, "auto4", 2, 0), (128, 2, "auto8", 2, 0),
                (128, 4, "auto8", 2, 0), (64, 4, "auto8", 2, 0), (512, 4, "auto", 8, 0), (256, 4, "auto4", 4, 4),
                (128, 4, "auto8", 2, 4), (128, 4, "auto8", 2, 8)]


# MMA GEMV candidates for M = 1 and group 128, after the GEMV ones: (BLOCK_N, warps, SPLIT_K, the next group's loads
# issued before this one computes, KW warps splitting a program's K range). On the H200 these ran slower for int4 and
# are not candidates: two groups ahead (5-40%), two groups an iteration in registers of their own (fewer instructions,
# 80-88 registers), Triton's shared-memory pipelining (up to 3x, also with KW), the weights by TMA through tensor
# descriptors in a pipelined loop (1.35-1.8x), a TMA ring fed by a producer warp in Gluon (1.04-1.16x)
# (bench/results/quant_decode_sweep_mma_gemv_h200.jsonl, gemv_timeline_ahead2_h200.jsonl,
# gemv_timeline_unroll2_h200.jsonl, gemv_timeline_stages_h200.jsonl, quant_decode_sweep_tma_h200.jsonl,
# quant_decode_sweep_tma_cpasync_h200.jsonl, quant_ws_gemv_h200.jsonl). BLOCK_N / 2 x KW is a multiple of 8 x warps
# (each tile's rows fill whole warps, 8 rows a warp) and KW divides warps (a warp's rows share a K slice). KW > 1 sums a
# row's slices in shared memory at the program's end instead of across programs through the workspace (split K's combine
# tail, ~1-1.5 us).
MMA_GEMV_CONFIGS = [(128, 8, "auto4", False, 1), (64, 4, "auto8", False, 1), (128, 8, "auto4", True, 1),
                    (64, 4, "auto8", True, 1), (128, 8, "auto8", False, 1), (128, 8, "auto2", True, 1),
                    (16, 8, 1, False, 8), (16, 8, 1, True, 8), (16, 16, 1, True, 16), (32, 8, 1, True, 4),
                    (32, 16, 1, False, 8), (16, 8, "auto4", True, 8), (16, 4, 1, True, 4)]
K_SLICE_WARPS = True  # offer the KW > 1 candidates (benchmarks turn it off for the A/B)
# W8A16 MMA GEMV candidates for M = 1 and K a multiple of 64: the int4 ones, 256-row tiles (int8 holds fewer
# registers a row), and 4 warps splitting K with two steps in flight (AHEAD = 2: steps t + 1 and t + 2 load while t
# computes, x loads where it is used) capped at 72 registers a thread (sixth field, `maxnreg`; 80 uncapped). In a
# chain on the H200 that one took the int8 gate/up from 32.06 to 30.48 us; for int4, and for the other int8 shapes,
# two groups ahead was never faster (bench/results/gemv_timeline_ahead2_h200.jsonl).
MMA_GEMV8_CONFIGS = MMA_GEMV_CONFIGS + [(256, 8, "auto4", False, 1), (16, 4, 1, 2, 4, 72)]


def _mma_gemv_dicts(table) -> list[dict]:
    """The table's configs releasing the next kernel from their epilogue, then (`LAST_STEP_RELEASE`) those with
    KW = 1 from their last K step. A KW > 1 warp has only a few steps, so its last one comes early: in the chain
    tuning such configs won, in the decode step they lost (H200, W8A16 + lm_head step 2503 us with them, 2459
    without; W4A16 1720-1725 against 1727; bench/results/pdl_decode_kw_release_h200.jsonl)."""
    return [dict(MMA_GEMV=True, BLOCK_M=1, BLOCK_N=bn, AHEAD=ahead, SPLIT_K=sk, KW=kw, LAST_STEP_RELEASE=last,
                 num_warps=w, num_stages=1, **({"maxnreg": regs[0]} if regs else {}))
            for last in (False, True)[:1 + LAST_STEP_RELEASE]
            for bn, w, sk, ahead, kw, *regs in table if (kw == 1 or K_SLICE_WARPS) and not (last and kw > 1)]


def _mma_gemv_configs(m: int, group_size: int) -> list[dict]:
    return _mma_gemv_dicts(MMA_GEMV_CONFIGS) if m == 1 and group_size == 128 else []


def _mma_gemv8_configs(m: int, k: int) -> list[dict]:
    return _mma_gemv_dicts(MMA_GEMV8_CONFIGS) if m == 1 and k % 64 == 0 else []


def _gemv_configs(m: int) -> list[dict]:
    if m > GEMV_M:
        return []
    max_rows = 16 if m == 1 else 8 if m == 2 else 4  # R * M accumulators per thread
    return [dict(BLOCK_M=next_power_of_2(m), ROWS=m, BLOCK_N=bn, CHUNKS=c, SPLIT_K=sk, PREFETCH=ahead, STAGES=1,
                 num_warps=w, num_stages=1) for bn, c, sk, w, ahead in GEMV_CONFIGS if bn * c // (32 * w) <= max_rows]


def _swap_configs(m: int, group_size: int) -> list[dict]:
    """The swapped int4 tiles for M rows: none up to GEMV_M (the GEMVs own those), BLOCK_M 16 up to SMALL_M,
    32-128 (at most M rounded up) up to MID_M, 128 and up above."""
    if m <= GEMV_M:
        return []
    lo, hi = (16, 16) if m <= SMALL_M else (32, next_power_of_2(m)) if m <= MID_M else (128, 256)
    return [dict(BLOCK_M=bm, BLOCK_N=bn, GROUPS_PER_ITER=max(1, bk // group_size), SPLIT_K=sk,
                 SWIZZLE=8 if m > MID_M else 1, SWAP=True, num_warps=w, num_stages=st)
            for bm, bn, bk, sk, w, st in SWAP_CONFIGS if lo <= bm <= hi]


def w4_configs(m: int, group_size: int, gemv: bool = True) -> list[dict]:
    """Candidates for the int4 kernel; the first is the default (interpreter, CUDA-graph capture). For M <= SMALL_M
    the MMA decode ones (an `MMA` key) follow the tensor-core ones, then the swapped tiles (`SWAP`), and GEMV
    candidates (a `CHUNKS` key) come last, for M <= GEMV_M. Above SMALL_M the swapped tiles come last."""
    per = lambda bk: max(1, bk // group_size)  # noqa: E731  (whole groups per iteration)
    if m <= SMALL_M:
        return ([dict(BLOCK_M=16, BLOCK_N=bn, GROUPS_PER_ITER=per(bk), SPLIT_K=sk, SWIZZLE=1, num_warps=w,
                      num_stages=st) for bn, bk, sk, w, st in SMALL_CONFIGS]
                + [dict(MMA=True, BLOCK_M=16, BLOCK_N=bn, NW=w, PAIR=pair, PREFETCH=dist, AHEAD=ahead, SPLIT_K=sk,
                        num_warps=w, num_stages=1) for bn, w, sk, pair, dist, ahead in MMA_CONFIGS]
                + _swap_configs(m, group_size) + (_gemv_configs(m) + _mma_gemv_configs(m, group_size) if gemv else []))
    tiled = [dict(BLOCK_M=bm, BLOCK_N=bn, GROUPS_PER_ITER=per(bk), SPLIT_K=1, SWIZZLE=8, num_warps=w, num_stages=st)
             for bm, bn, bk, w, st in TILED_CONFIGS]
    mid = [dict(BLOCK_M=bm, BLOCK_N=bn, GROUPS_PER_ITER=per(bk), SPLIT_K=sk, SWIZZLE=1, num_warps=w, num_stages=st)
           for bm, bn, bk, sk, w, st in MID_CONFIGS] if m <= MID_M else []
    return tiled + mid + [DEQUANT] + _swap_configs(m, group_size)


def w8_configs(m: int, gemv: bool = True, k: int | None = None, cuda_core: bool = True) -> list[dict]:
    """Candidates for the int8 kernel, the first the default; GEMV ones (M <= GEMV_M; cuda_core False: none, FP8)
    and MMA GEMV ones (M = 1, K a multiple of 64; k None: as if it were) last, when the weight can be read as int32
    words (`gemv`)."""
    if m <= SMALL_M:
        gemvs = ((_gemv_configs(m) if cuda_core else []) + _mma_gemv8_configs(m, 64 if k is None else k)
                 if gemv else [])
        return [dict(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sk, SWIZZLE=1, num_warps=w, num_stages=st)
                for bn, bk, sk, w, st in SMALL_CONFIGS] + gemvs
    tiled = [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk // 2, SPLIT_K=1, SWIZZLE=8, num_warps=w, num_stages=st)
             for bm, bn, bk, w, st in TILED_CONFIGS]
    mid = [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk // 2, SPLIT_K=sk, SWIZZLE=1, num_warps=w, num_stages=st)
           for bm, bn, bk, sk, w, st in MID_CONFIGS] if m <= MID_M else []
    return tiled + mid + [DEQUANT]


def _split_k(cfg: dict, m: int, n: int, k_steps: int, device) -> int:
    split = cfg["SPLIT_K"]
    if isinstance(split, str):  # "auto", "auto4", "auto8": about 2, 4, 8 programs per SM
        tiles = triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"])
        sms = num_sms(device.index or 0) if device.type == "cuda" else 4
        split = max(1, min(16, (int(split[4:] or 2) * sms) // tiles))
    split = max(1, min(split, k_steps))
    kw = cfg.get("KW", 1)  # MMA GEMV warps splitting a program's K range: every slice the same length
    if k_steps % kw:
        raise ValueError(f"KW = {kw} warps cannot split {k_steps} K steps evenly")
    return max(s for s in range(1, split + 1) if k_steps % (s * kw) == 0) if kw > 1 else split


_TUNED: dict[tuple, dict] = {}
TIMINGS: dict[tuple, list[tuple[dict, float]]] = {}  # every timed candidate, for benchmarks to report
TRACE: torch.Tensor | None = None  # bench/gemv_timeline.py: the MMA GEMVs stamp their phases here (`_stamp`)


# Decode shapes (M <= SMALL_M) are timed the way the engine runs them: a CUDA graph of back-to-back launches (PDL
# overlaps each with the one before) over copies of the weight that together exceed L2 twice, so every call reads
# HBM. Timed alone with L2 flushed (do_bench), near-equal candidates swapped ranks from run to run and the pick
# could be the slower one in the step. On the H200 (bench/results/pdl_decode_chain_tuning_h200.jsonl,
# quant_speed_h200_chain_tuning.jsonl), batch-1 W4A16 + lm_head steps: chain 1960-1973 us, alone 1978-2078;
# batch 16 (M 5-16 share a bucket, tuned at whichever M comes first): W8A16 chain 3518-3526 against alone
# 3797-4247, W4A16 3360-3668 against 3381-3968. Benchmarks turn it off for the A/B.
CHAIN_TUNING = True
CHAIN_CALLS = 16  # launches a graph


def _chain_ms(run, cfg: dict, copies: list) -> float:
    """Device ms of one `run(cfg, weight)` in a captured chain of CHAIN_CALLS launches cycling over `copies`."""
    calls = [lambda w=copies[i % len(copies)]: run(cfg, w) for i in range(CHAIN_CALLS)]
    return graph_time_us(calls, replays=5) / 1e3


def _weight_copies(weight: torch.Tensor) -> list:
    """The weight and enough clones (same strides) that the set is at least twice L2."""
    l2 = torch.cuda.get_device_properties(weight.device).L2_cache_size or 50 << 20
    n = max(2, min(16, -(-2 * l2 // (weight.numel() * weight.element_size()))))
    return [weight] + [weight.clone() for _ in range(n - 1)]


def _pick(key: tuple, candidates, run, weight: torch.Tensor | None = None, m: int = 0) -> dict:
    """The fastest of `candidates()` for `key` (the list is built only on a miss: ~30 us of Python, paid by every
    eager call, prefill's included, when it was built first), timed once on the GPU: `run(cfg, copy)` as a chain
    over weight copies for decode shapes (`CHAIN_TUNING`, weight given, m <= SMALL_M), else alone with L2 flushed
    between runs (a few ms each). The first config, untimed, under the interpreter or inside a CUDA-graph capture
    (timing there would break the capture; the engine's warm-up step before each capture tunes the same shapes)."""
    if key in _TUNED:
        return _TUNED[key]
    configs = candidates()
    if len(configs) == 1 or _interpreting() or torch.cuda.is_current_stream_capturing():
        return configs[0]
    copies = None
    if CHAIN_TUNING and weight is not None and 0 < m <= SMALL_M:
        try:
            copies = _weight_copies(weight)
        except torch.OutOfMemoryError:  # no room for the copies: timed alone
            copies = None
    times = []
    for cfg in configs:
        try:
            times.append(_chain_ms(run, cfg, copies) if copies else
                         triton.testing.do_bench(lambda: run(cfg), warmup=5, rep=20))
        except Exception:  # e.g. a config needing more shared memory than the GPU has
            times.append(float("inf"))
    del copies
    TIMINGS[key] = list(zip(configs, times))
    _TUNED[key] = configs[min(range(len(configs)), key=times.__getitem__)]
    return _TUNED[key]


def _bucket(m: int) -> int:
    """Tuning bucket of M: each M <= GEMV_M alone (the GEMV candidates are compiled per M and cost grows with M),
    then the rest of the small-M path, then powers of two."""
    return m if m <= GEMV_M else 0 if m <= SMALL_M else min(next_power_of_2(m), 8192)


def _launch(kernel, x2, n, k_steps, out_dtype, cfg, args, consts, extra=()):
    """Launch `kernel` with config `cfg` (split K resolved here); returns y [M, N]. `extra`: arguments after
    split_k."""
    cfg = dict(cfg)
    warps, stages = cfg.pop("num_warps"), cfg.pop("num_stages")
    m = x2.shape[0]
    split = _split_k(cfg, m, n, k_steps, x2.device)
    del cfg["SPLIT_K"]
    tiles = triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"])
    y = torch.empty(m, n // 2 if consts.get("GATED") else n, dtype=out_dtype, device=x2.device)
    ws = torch.empty(split, m, n, dtype=torch.float32, device=x2.device) if split > 1 else y
    locks = arrival_counts(x2.device, tiles) if split > 1 else y
    x_arg, w_arg, s_arg, *rest = args
    # PDL (brrr/kernels/pdl.py): at M <= GEMV_M the next kernel may launch from the epilogue (3); above, not early
    # at all (1): on the H200 an early launch after a 16-row W8A16 GEMM made the step slower (bench/pdl_decode.py)
    pdl = pdl_on(x2)
    pdl = 3 if pdl == 2 and m <= GEMV_M else min(pdl, 1)
    kernel[(tiles, split)](x_arg, w_arg, s_arg, *rest, y, ws, locks, m, n, x2.shape[1], x2.stride(0),
                           w_arg.stride(0), y.stride(0), split, *extra, SPLIT=split > 1, num_warps=warps,
                           num_stages=stages, PDL=pdl, launch_pdl=pdl > 0, **consts, **cfg)
    return y


# ---- Triton entry points ------------------------------------------------------------------------------------------
def _rows(x):
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _words(qweight: torch.Tensor):
    """The byte weights viewed as int32 words for the GEMV kernels, or None when the rows or chunks do not start on
    4-byte boundaries (then only the tensor-core configs are candidates)."""
    if (qweight.stride(-1) != 1 or qweight.shape[-1] % 4 or qweight.storage_offset() % 4
            or any(st % 4 for st in qweight.stride()[:-1])):
        return None
    return qweight.view(torch.int32)


def with_norm_and_residual(matmul, x, residual: torch.Tensor | None = None, next_norm: tuple | None = None):
    """The unfused form of the MMA GEMV's NORM and RESIDUAL: matmul of x, or of the rows a PendingNorm x stands for;
    with a residual, (h = y + residual, PendingNorm.of(h, *next_norm))."""
    y = matmul(x.apply() if isinstance(x, PendingNorm) else x)
    if residual is None:
        return y
    h = y + residual
    return h, PendingNorm.of(h, *next_norm)


MAX_NORM_PARTS = 4096  # a PendingNorm's sums of squares are read whole by every program (`_norm_sums`)
MAX_FUSED_REGS = 64  # registers a thread for MMA GEMVs taking a norm or a residual (`_fused_args`)


def _fusable(x2, norm: PendingNorm | None, residual: torch.Tensor | None, next_norm: tuple | None) -> bool:
    """The MMA GEMV takes the norm and the residual add: one row, 16-bit or fp32, a contiguous residual in x's
    dtype and norm weight."""
    return (x2.shape[0] == 1 and x2.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and (norm is None or (norm.sq.is_contiguous() and norm.sq.numel() <= MAX_NORM_PARTS))
            and (residual is None or (residual.dtype == x2.dtype and residual.is_contiguous()
                                      and next_norm[0].is_contiguous())))


def _fused_args(x2, n: int, cfg: dict, norm: PendingNorm | None = None, residual: torch.Tensor | None = None,
                next_norm: tuple | None = None):
    """(kernel arguments R, SQ, NW, XN, SQ_IN, n_sq, eps; their constexprs; the PendingNorm RESIDUAL writes or None)
    for `_fusable` calls."""
    pending = None
    if residual is not None:
        sq = torch.empty(1, triton.cdiv(n, cfg["BLOCK_N"]), dtype=torch.float32, device=x2.device)
        pending = PendingNorm(torch.empty(1, n, dtype=x2.dtype, device=x2.device), sq, next_norm[1])
    args = (None, None, None, None) if residual is None else (residual, pending.sq, next_norm[0], pending.xw)
    args += (None, 0, 0.0) if norm is None else (norm.sq, norm.sq.numel(), norm.eps)
    consts = dict(NORM=norm is not None, RESIDUAL=residual is not None,
                  BLOCK_SQ=1 if norm is None else next_power_of_2(norm.sq.numel()))
    if (norm is not None or residual is not None) and "maxnreg" not in cfg:
        # the plain configs compile to <= 64 registers a thread (sm_90); the residual and the next norm's weight,
        # held through the K loop, took a 16-warp one to 76 and its programs from 2 an SM to 1: o 4.9 -> 7.2 us
        consts["maxnreg"] = MAX_FUSED_REGS
    return args, consts, pending


def _gemv(cfg: dict) -> bool:
    return "CHUNKS" in cfg


def _gemv_chunks(cfg: dict, group_size: int) -> dict:
    """An int4 GEMV step never spans groups: at most group_size / 32 chunks."""
    return dict(cfg, CHUNKS=min(cfg["CHUNKS"], group_size // 32))


def w4a16_matmul_triton(x, qweight, scales, zeros, group_size, bias=None, config: dict | None = None,
                        gated: bool = False, release_early: bool = False, residual: torch.Tensor | None = None,
                        next_norm: tuple | None = None, out_dtype: torch.dtype | None = None):
    """x [..., K] -> [..., N]. `config` forces one (tests); else the tuned one. gated (M = 1, group 128; N = 2 x I
    rows, gate then up): silu(x @ W_gate^T) * (x @ W_up^T) [..., I] from the MMA GEMV's epilogue. release_early:
    an MMA GEMV config releases the next kernel at its last K step (`EARLY_RELEASE_HINT`). x a PendingNorm: of the
    rows it stands for. residual (next_norm: the next RMSNorm's (weight, eps)): (h = y + residual, the PendingNorm
    of h). Those two in the MMA GEMV at M = 1 (the tuner picks among its configs), else `with_norm_and_residual`.
    out_dtype (fp32 logits): the MMA GEMV stores y rounded to x's dtype, widened; the other kernels give x's dtype."""
    norm, x = (x, x.xw) if isinstance(x, PendingNorm) else (None, x)
    k, n = x.shape[-1], qweight.shape[0]
    x2 = _rows(x)
    m = x2.shape[0]
    fuse = norm is not None or residual is not None
    if fuse and not (group_size == 128 and _words(qweight) is not None and _fusable(x2, norm, residual, next_norm)):
        run = functools.partial(w4a16_matmul_triton, qweight=qweight, scales=scales, zeros=zeros,
                                group_size=group_size, bias=bias, config=config, gated=gated,
                                release_early=release_early)
        return with_norm_and_residual(run, x if norm is None else norm, residual, next_norm)
    if m == 0:
        return x.new_empty(*x.shape[:-1], n)
    fast = FAST_DEQUANT and x.dtype in (torch.bfloat16, torch.float16) and not _interpreting()
    consts = dict(GROUP=group_size, HAS_ZEROS=zeros is not None, HAS_BIAS=bias is not None, FAST=fast,
                  IEEE=x.dtype == torch.float32 or _interpreting())
    words = _words(qweight)

    def run(cfg, qweight=qweight, fused=True):  # qweight: a copy of the weight when the tuner times a chain
        words = _words(qweight)
        chunk_stride = _packed_strides(qweight)[1]
        word_chunk_stride = None if words is None else _packed_strides(words)[1]
        # unused pointer arguments get a real tensor (scales) so every launch has the same signature
        args = (x2, qweight, scales, scales if zeros is None else zeros, scales if bias is None else bias)
        if (gated or fused and fuse) and not cfg.get("MMA_GEMV"):  # a config given (tests) that cannot take them
            raise ValueError("only the MMA GEMV takes gated, a PendingNorm or a residual")
        if cfg.get("DEQUANT"):
            return F.linear(x2, dequantize_w4_triton(qweight, scales, zeros, group_size, x.dtype), bias)
        if cfg.get("MMA"):
            return _launch(_w4a16_mma_kernel, x2, n, k // group_size, x.dtype,
                           {key: v for key, v in cfg.items() if key != "MMA"}, args, consts, extra=(chunk_stride,))
        if (cfg.get("MMA_GEMV") or _gemv(cfg)) and words is None:
            raise ValueError("the GEMV kernel reads qweight as int32 words: rows must be 4-byte aligned")
        if cfg.get("MMA_GEMV"):
            # no FMA contraction (the MMAs are inline PTX anyway): the epilogue rounds the scaled sum before the
            # bias, gated or not, so the gated GEMV is the plain one then silu_and_mul bit for bit
            xa = x2 if x2.data_ptr() % 8 == 0 else x2.clone()  # x is read 8 bytes at a time
            fused_args, fused_consts, pending = _fused_args(xa, n, cfg, *(norm, residual, next_norm) if fused else ())
            y = _launch(_w4a16_mma_gemv_kernel, xa, n, k // group_size, (fused and out_dtype) or x.dtype,
                        {key: v for key, v in cfg.items() if key != "MMA_GEMV"}, (xa, words, *args[2:]),
                        dict(HAS_ZEROS=zeros is not None, HAS_BIAS=bias is not None, FAST=fast,
                             EARLY=True, GATED=gated, EVICT=WEIGHT_EVICT, enable_fp_fusion=False,
                             **fused_consts),
                        extra=(scales.stride(1), word_chunk_stride, TRACE, *fused_args))
            return y if pending is None else (y, pending)
        if _gemv(cfg):
            gemv_consts = dict(GROUP=group_size, HAS_ZEROS=zeros is not None, HAS_BIAS=bias is not None,
                               FAST=FAST_DEQUANT and not _interpreting(), EVEN_N=n % cfg["BLOCK_N"] == 0)
            return _launch(_w4a16_gemv_kernel, x2, n, k // group_size, x.dtype, _gemv_chunks(cfg, group_size),
                           (x2, words, *args[2:]), gemv_consts, extra=(scales.stride(1), word_chunk_stride))
        return _launch(_w4a16_kernel, x2, n, k // group_size, x.dtype, cfg, args, consts, extra=(chunk_stride,))

    if config is None:  # fp32 (tests, CPU-made models on a GPU) runs the default config: no tuning cost
        key = ("w4", _bucket(m), n, k, group_size, x.dtype, zeros is not None, bias is not None, fast, gated)
        candidates = lambda: (_mma_gemv_configs(m, group_size) if gated  # noqa: E731
                              else w4_configs(m, group_size, gemv=words is not None))
        config = _tuned(key, candidates, run, qweight, m, x.dtype, fuse, lambda: _mma_gemv_configs(m, group_size))
    return _shaped(run(_hinted(config, release_early)), x, n // 2 if gated else n)


def _tuned(key, candidates, run, qweight, m: int, dtype, fuse: bool, mma_gemvs) -> dict:
    """The config for `key`: the default for fp32 (tests, CPU-made models on a GPU: no tuning cost), else the tuned
    one. A call with the norm or the residual in the GEMV (fuse) runs the plain shape's pick, tuned without them
    (they change a few loads and the epilogue, not the loop; tuned apart, near-equal candidates swapped ranks by
    noise, H200: bench/results/pdl_decode_norms_h200.jsonl), when it is an MMA GEMV; else the fastest MMA GEMV."""
    if dtype == torch.float32:
        configs = mma_gemvs() if fuse else candidates()
        return configs[0]
    config = _pick(key, candidates, lambda cfg, w=qweight: run(cfg, w, fused=False), qweight, m)
    if fuse and not config.get("MMA_GEMV"):
        config = _pick(key + ("fused",), mma_gemvs, run, qweight, m)
    return config


def _shaped(out, x, n: int):
    """y as [..., n] (x's leading dims); with a residual, (h, its PendingNorm)."""
    if isinstance(out, tuple):
        return out[0].view(*x.shape[:-1], n), out[1]
    return out.view(*x.shape[:-1], n)


def _hinted(cfg: dict, release_early: bool) -> dict:
    if release_early and EARLY_RELEASE_HINT and cfg.get("MMA_GEMV") and not cfg.get("LAST_STEP_RELEASE"):
        return {**cfg, "LAST_STEP_RELEASE": True}
    return cfg


def w8a16_matmul_triton(x, qweight, scales, bias=None, config: dict | None = None, gated: bool = False,
                        release_early: bool = False, residual: torch.Tensor | None = None,
                        next_norm: tuple | None = None, out_dtype: torch.dtype | None = None):
    """As `w4a16_matmul_triton`; gated, a PendingNorm x, residual: M = 1, K a multiple of 64. A float8_e4m3fn
    qweight (weight-only FP8) runs the same kernels on its bytes, converting E4M3 instead of int8 (no CUDA-core
    GEMV candidates)."""
    norm, x = (x, x.xw) if isinstance(x, PendingNorm) else (None, x)
    k, n = x.shape[-1], qweight.shape[0]
    x2 = _rows(x)
    m = x2.shape[0]
    fuse = norm is not None or residual is not None
    if fuse and not (k % 64 == 0 and _words(qweight) is not None and _fusable(x2, norm, residual, next_norm)):
        run = functools.partial(w8a16_matmul_triton, qweight=qweight, scales=scales, bias=bias, config=config,
                                gated=gated, release_early=release_early)
        return with_norm_and_residual(run, x if norm is None else norm, residual, next_norm)
    fp8 = qweight.dtype == torch.float8_e4m3fn
    qweight = qweight.view(torch.int8) if fp8 else qweight
    if m == 0:
        return x.new_empty(*x.shape[:-1], n)
    fast = FAST_DEQUANT and x.dtype in (torch.bfloat16, torch.float16) and not _interpreting()
    consts = dict(HAS_BIAS=bias is not None, FAST=fast, IEEE=x.dtype == torch.float32 or _interpreting(), FP8=fp8)
    words = _words(qweight)

    def run(cfg, qweight=qweight, fused=True):  # qweight: a copy of the weight when the tuner times a chain
        words = _words(qweight)
        chunk_stride = _packed_strides(qweight)[1]
        args = (x2, qweight, scales, scales if bias is None else bias)
        if (gated or fused and fuse) and not cfg.get("MMA_GEMV"):  # a config given (tests) that cannot take them
            raise ValueError("only the MMA GEMV takes gated, a PendingNorm or a residual")
        if cfg.get("DEQUANT"):
            return F.linear(x2, _dequantize_w8(qweight, scales, x.dtype, fp8), bias)
        if (cfg.get("MMA_GEMV") or _gemv(cfg)) and words is None:
            raise ValueError("the GEMV kernel reads qweight as int32 words: K must be a multiple of 4")
        if cfg.get("MMA_GEMV"):
            if k % 64:
                raise ValueError(f"the int8 MMA GEMV reads K in steps of 64 columns; K = {k}")
            xa = x2 if x2.data_ptr() % 8 == 0 else x2.clone()  # x is read 8 bytes at a time (fp fusion: as int4)
            fused_args, fused_consts, pending = _fused_args(xa, n, cfg, *(norm, residual, next_norm) if fused else ())
            y = _launch(_w8a16_mma_gemv_kernel, xa, n, k // 64, (fused and out_dtype) or x.dtype,
                        {key: v for key, v in cfg.items() if key != "MMA_GEMV"}, (xa, words, *args[2:]),
                        dict(HAS_BIAS=bias is not None, FAST=fast, EARLY=True, GATED=gated,
                             FP8=fp8, EVICT=WEIGHT_EVICT, enable_fp_fusion=False, **fused_consts),
                        extra=(_packed_strides(words)[1], TRACE, *fused_args))
            return y if pending is None else (y, pending)
        if _gemv(cfg):
            if fp8:
                raise ValueError("the CUDA-core GEMV reads int8 codes only; FP8 weights take the other kernels")
            gemv_consts = dict(HAS_BIAS=bias is not None, FAST=FAST_DEQUANT and not _interpreting(),
                               EVEN_N=n % cfg["BLOCK_N"] == 0, EVEN_K=k % (16 * cfg["CHUNKS"]) == 0)
            return _launch(_w8a16_gemv_kernel, x2, n, triton.cdiv(k, 16 * cfg["CHUNKS"]), x.dtype, cfg,
                           (x2, words, *args[2:]), gemv_consts, extra=(_packed_strides(words)[1],))
        return _launch(_w8a16_kernel, x2, n, triton.cdiv(k, cfg["BLOCK_K"]), x.dtype, cfg, args, consts,
                       extra=(chunk_stride,))

    if config is None:
        candidates = lambda: (_mma_gemv8_configs(m, k) if gated  # noqa: E731
                              else w8_configs(m, gemv=words is not None, k=k, cuda_core=not fp8))
        key = ("w8", _bucket(m), n, k, x.dtype, bias is not None, fast, gated, fp8)
        config = _tuned(key, candidates, run, qweight, m, x.dtype, fuse, lambda: _mma_gemv8_configs(m, k))
    return _shaped(run(_hinted(config, release_early)), x, n // 2 if gated else n)


def dequantize_w4_triton(qweight, scales, zeros, group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """The weight [N, K] in `dtype` from the int4 kernel layout: dequantize_w4's values, rounded once to dtype."""
    n, k = qweight.shape[0], 2 * math.prod(qweight.shape[1:])
    w = torch.empty(n, k, dtype=dtype, device=qweight.device)
    fast = FAST_DEQUANT and dtype in (torch.bfloat16, torch.float16) and not _interpreting()
    _dequant_w4_kernel[(triton.cdiv(n, 64), k // group_size)](
        qweight, scales, scales if zeros is None else zeros, w, n, *_packed_strides(qweight), w.stride(0),
        GROUP=group_size, BLOCK_N=64, HAS_ZEROS=zeros is not None, FAST=fast)
    return w


def dequantize_w8_triton(qweight, scales, dtype: torch.dtype) -> torch.Tensor:
    """The weight [N, K] in `dtype` from int8 or float8_e4m3fn bytes (by rows or chunk-major) and row scales."""
    fp8 = qweight.dtype == torch.float8_e4m3fn
    return _dequantize_w8(qweight.view(torch.int8) if fp8 else qweight, scales, dtype, fp8)


def _dequantize_w8(qweight, scales, dtype: torch.dtype, fp8: bool) -> torch.Tensor:
    n, k = qweight.shape[0], math.prod(qweight.shape[1:])
    w = torch.empty(n, k, dtype=dtype, device=qweight.device)
    _dequant_w8_kernel[(triton.cdiv(n, 32), triton.cdiv(k, 256))](qweight, scales, w, n, k, *_packed_strides(qweight),
                                                                  w.stride(0), BLOCK_N=32, BLOCK_K=256, FP8=fp8)
    return w


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


# ---- dispatchers ----------------------------------------------------------------------------------------------------
def _dtype_ok(x) -> bool:
    return x.dtype in (torch.bfloat16, torch.float16, torch.float32)


def w4a16_matmul(x, qweight, scales, zeros, group_size, bias=None, release_early: bool = False,
                 residual: torch.Tensor | None = None, next_norm: tuple | None = None,
                 out_dtype: torch.dtype | None = None):
    """x @ W^T (+ bias), W int4 group-wise in the kernel layout. Triton on CUDA, the reference elsewhere. x may be
    a PendingNorm, and a residual with the next norm's (weight, eps) gives (h, its PendingNorm): as
    `w4a16_matmul_triton`. out_dtype (no residual): y in that dtype, its values those of x's dtype (fp32 logits)."""
    x1 = PendingNorm.rows(x)
    tensors = [x1, qweight, scales] + [t for t in (zeros, bias) if t is not None]
    if group_size in INT4_GROUPS and x1.shape[-1] % group_size == 0 and _dtype_ok(x1) and use_triton(*tensors):
        y = w4a16_matmul_triton(x, qweight, scales, zeros, group_size, bias, release_early=release_early,
                                residual=residual, next_norm=next_norm, out_dtype=out_dtype)
    else:
        y = with_norm_and_residual(lambda x: w4a16_matmul_ref(x, qweight, scales, zeros, group_size, bias), x,
                                   residual, next_norm)
    return y if out_dtype is None else y.to(out_dtype)


def w8a16_matmul(x, qweight, scales, bias=None, release_early: bool = False, residual: torch.Tensor | None = None,
                 next_norm: tuple | None = None, out_dtype: torch.dtype | None = None):
    x1 = PendingNorm.rows(x)
    tensors = [x1, qweight, scales] + ([bias] if bias is not None else [])
    if _dtype_ok(x1) and qweight.stride(-1) == 1 and use_triton(*tensors):
        y = w8a16_matmul_triton(x, qweight, scales, bias, release_early=release_early, residual=residual,
                                next_norm=next_norm, out_dtype=out_dtype)
    else:
        y = with_norm_and_residual(lambda x: w8a16_matmul_ref(x, qweight, scales, bias), x, residual, next_norm)
    return y if out_dtype is None else y.to(out_dtype)


def _gated_ok(x, qweight, *tensors) -> bool:
    """The fused gate/up GEMV runs: one row of x, 16-bit (its epilogue rounds as the unfused bf16/fp16 path does),
    weights readable as int32 words, Triton."""
    return (x.numel() == x.shape[-1] and x.dtype in (torch.bfloat16, torch.float16) and qweight.shape[0] % 2 == 0
            and _words(qweight) is not None and use_triton(x, qweight, *tensors))


def w4a16_gated_matmul(x, qweight, scales, zeros, group_size, bias=None):
    """silu(x @ W_gate^T) * (x @ W_up^T) for W = [gate; up] int4 (a packed gate/up projection): [..., N / 2]. One
    row of x (batch-1 decode): the MMA GEMV with the activation in its epilogue, one kernel; else the GEMM, then
    silu_and_mul. x may be a PendingNorm."""
    tensors = [scales] + [t for t in (zeros, bias) if t is not None]
    x1 = PendingNorm.rows(x)
    if GATED_GEMV and group_size == 128 and x1.shape[-1] % 128 == 0 and _gated_ok(x1, qweight, *tensors):
        return w4a16_matmul_triton(x, qweight, scales, zeros, group_size, bias, gated=True)
    return silu_and_mul(*w4a16_matmul(x, qweight, scales, zeros, group_size, bias).chunk(2, -1))


def w8a16_gated_matmul(x, qweight, scales, bias=None):
    """As `w4a16_gated_matmul`, int8 weights."""
    tensors = [scales] + ([bias] if bias is not None else [])
    x1 = PendingNorm.rows(x)
    if GATED_GEMV and x1.shape[-1] % 64 == 0 and qweight.stride(-1) == 1 and _gated_ok(x1, qweight, *tensors):
        return w8a16_matmul_triton(x, qweight, scales, bias, gated=True)
    return silu_and_mul(*w8a16_matmul(x, qweight, scales, bias).chunk(2, -1))


def quantize_per_token(x: torch.Tensor, dtype: torch.dtype):
    """x [M, K] -> (int8 or float8_e4m3fn codes [M, K], fp32 scales [M, 1]), one scale per row."""
    if x.shape[-1] <= MAX_QUANT_ROW and x.stride(-1) == 1 and _dtype_ok(x) and use_triton(x):
        return quantize_per_token_triton(x, dtype)
    return quantize_per_token_ref(x, dtype)
