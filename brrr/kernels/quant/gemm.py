"""The quantized GEMMs on tensor cores: x [M, K] @ W^T with the weight dequantized in registers, for every M.

  small M (decode, M <= 16): 16-row tiles, narrow column strips (16-64 rows of W per program, so the 8B shapes give
        64-900 programs without splitting K) and optional split K for the shapes that still give too few.
  mid M (16 < M <= 128, batched decode): 32-64-row tiles, the same narrow strips and split K.
  tiled (prefill): 64-128 x 64-256 output tiles in grouped order (row tiles that share a weight strip run together,
        so the strip is read from HBM about once).
  swapped (`SWAP`): y^T = W x^T, the dequantized weight tile as the MMA's left operand from registers.
  MMA decode (`_w4a16_mma_kernel`, int4, M <= 16): wgmma with the weight tile relabeled to the bytes each thread
        loaded.
Each weight is dequantized to (q - z) * s rounded once to the input dtype (what the reference does) and goes to the
tensor cores (brrr/kernels/quant/dequant.py).
"""
from __future__ import annotations

try:
    import triton
    import triton.language as tl
except Exception:  # the dispatcher takes the reference when triton is missing
    triton = None

if triton is not None:
    from brrr.kernels.pdl import wait_previous
    from brrr.kernels.quant.dequant import (chunk_cols, codes_minus_zero, fp8_to, group_weights, int8_to, packed_col,
                                            prefetch_l2)
    from brrr.kernels.quant.epilogue import dot_bt, split_range, store_output, tile_ids

    @triton.jit(do_not_specialize=["M", "split_k"])  # one compile for every M and split, not one for M = 1
    def _w4a16_kernel(X, P, S, Z, B, Y, WS, LOCKS, M, N, K, stride_xm, stride_pn, stride_ym, split_k, stride_pc,
                      GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      GROUPS_PER_ITER: tl.constexpr, SPLIT: tl.constexpr, SWIZZLE: tl.constexpr,
                      HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr, FAST: tl.constexpr,
                      IEEE: tl.constexpr, PDL: tl.constexpr, SWAP: tl.constexpr = False):
        pid_m, pid_n = tile_ids(M, N, BLOCK_M, BLOCK_N, SWIZZLE)
        HALF: tl.constexpr = GROUP // 2
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_h = tl.arange(0, HALF)
        m_mask, n_mask = offs_m < M, offs_n < N
        n_groups = K // GROUP
        g_begin, g_end = split_range(n_groups, split_k)
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
                p = tl.load(p_ptrs + packed_col(g, stride_pc, HALF, 64), mask=w_mask, other=0)
                w_lo, w_hi = group_weights(p, Z, S, g, N, offs_n, n_ok, BLOCK_N, HAS_ZEROS, X.dtype.element_ty, FAST)
                if SWAP:  # y^T = W x^T: the dequantized weights are the MMA's left operand, from registers
                    acc = dot_bt(w_lo, x_lo, acc, IEEE)
                    acc = dot_bt(w_hi, x_hi, acc, IEEE)
                else:
                    acc = dot_bt(x_lo, w_lo, acc, IEEE)
                    acc = dot_bt(x_hi, w_hi, acc, IEEE)
        if SWAP:
            acc = tl.trans(acc)
        store_output(acc, B, Y, WS, LOCKS, offs_m, offs_n, m_mask, n_mask, M, N, stride_ym, split_k, HAS_BIAS, SPLIT,
                     PDL)

    @triton.jit(do_not_specialize=["M", "split_k"])
    def _w8a16_kernel(X, Q, S, B, Y, WS, LOCKS, M, N, K, stride_xm, stride_qn, stride_ym, split_k, stride_pc,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                      SWIZZLE: tl.constexpr, HAS_BIAS: tl.constexpr, FAST: tl.constexpr, IEEE: tl.constexpr,
                      PDL: tl.constexpr, FP8: tl.constexpr = False):
        """FP8: the bytes are E4M3 codes (weight-only FP8), not int8."""
        pid_m, pid_n = tile_ids(M, N, BLOCK_M, BLOCK_N, SWIZZLE)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_mask, n_mask = offs_m < M, offs_n < N
        k_tiles = tl.cdiv(K, BLOCK_K)
        t_begin, t_end = split_range(k_tiles, split_k)
        wait_previous(PDL)
        x_ptrs = X + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
        q_ptrs = Q + offs_n.to(tl.int64)[:, None] * stride_qn + chunk_cols(offs_k, stride_pc)[None, :]
        tl.static_assert(BLOCK_K % 64 == 0)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for t in range(t_begin, t_end):
            k_mask = (t * BLOCK_K + offs_k) < K
            x = tl.load(x_ptrs + t * BLOCK_K, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            q = tl.load(q_ptrs + t * (BLOCK_K // 64) * stride_pc, mask=n_mask[:, None] & k_mask[None, :], other=0)
            w = fp8_to(q, X.dtype.element_ty) if FP8 else int8_to(q, X.dtype.element_ty, FAST)
            acc = dot_bt(x, w, acc, IEEE)
        s = tl.load(S + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        store_output(acc * s[None, :], B, Y, WS, LOCKS, offs_m, offs_n, m_mask, n_mask, M, N, stride_ym, split_k,
                     HAS_BIAS, SPLIT, PDL)

    # ---- MMA decode (M <= small_m): the weight tile is the MMA's left operand, straight from registers ---------
    # The weight tile [BLOCK_N, K] is the left operand and x^T [K, 16] the right one, so on sm_90 Triton emits wgmma
    # with the weights in registers: no shared-memory round trip for them. The tile's rows and K columns are
    # relabeled (the dot product does not care, as long as x's columns follow K's) so that each thread's wgmma
    # fragment is exactly the 16 contiguous bytes per row it loaded (`_mma_order`). Each byte gives two exact codes
    # q - z (1.5 instructions a weight, `codes_minus_zero`); the group's scale multiplies the fp32 partial sum once.
    # It runs fewer instructions a weight than the 16-row tensor-core kernel and the GEMV, but about as many weights
    # a second (docs/quantization.md); the tuner takes it for some shapes.
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
        lo, hi = codes_minus_zero(p, z, DTYPE, FAST)
        part = dot_bt(_mma_order(lo, BLOCK_N, NW, HALF), _k_order(x_lo, BLOCK_M, HALF),
                      tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32), IEEE)
        part = dot_bt(_mma_order(hi, BLOCK_N, NW, HALF), _k_order(x_hi, BLOCK_M, HALF), part, IEEE)
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
        g_begin, g_end = split_range(n_groups, split_k)
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
                    prefetch_l2(p_ptrs0 + packed_col(g + PREFETCH + t, stride_pc, HALF, 64), row_ok & ahead)
                    prefetch_l2(S + (g + PREFETCH + t) * N + rows, row_ok & ahead & (rows % 64 == 0))
            # PAIR: both groups' loads are issued before either is unpacked (more bytes in flight per thread)
            p = tl.load(p_ptrs + packed_col(g, stride_pc, HALF, 64), mask=row_ok[:, None], other=0)
            if PAIR:
                second = rows * 0 + g + 1 < g_end  # past g_end (or K): zero bytes, zero x, zero scales
                p2 = tl.load(p_ptrs + packed_col(g + 1, stride_pc, HALF, 64),
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
        store_output(tl.trans(acc), B, Y, WS, LOCKS, offs_m, offs_n, m_mask, n_mask, M, N, stride_ym, split_k,
                     HAS_BIAS, SPLIT, PDL)
