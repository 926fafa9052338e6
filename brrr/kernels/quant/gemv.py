"""The GEMVs (M <= 4) on CUDA cores: fp32 products of exact codes, no tensor cores and no shared memory."""
from __future__ import annotations

try:
    import triton
    import triton.language as tl
except Exception:  # the dispatcher takes the reference when triton is missing
    triton = None

if triton is not None:
    from brrr.kernels.pdl import wait_previous
    from brrr.kernels.quant import ptx
    from brrr.kernels.quant.dequant import packed_col, prefetch_l2
    from brrr.kernels.quant.epilogue import split_range, store_output

    _HALVES = tl.constexpr(ptx.HALVES)
    _BYTES = tl.constexpr(ptx.BYTES)

    # ---- GEMV (M <= gemv_m): CUDA cores, fp32, no tensor cores and no shared memory ------------------------------
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
            lo, hi = tl.inline_asm_elementwise(asm=_HALVES, constraints="=r,=r,r", args=[w],
                                               dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
        else:
            lo = (w & 0xFFFF) | 0x4B000000
            hi = (w.to(tl.uint32, bitcast=True) >> 16).to(tl.int32, bitcast=True) | 0x4B000000
        return lo, hi

    @triton.jit
    def _bytes(w, FAST: tl.constexpr):
        """Each byte b of the int32 words as the fp32 bits of 2^23 + (b ^ 0x80), i.e. 2^23 + q + 128 for an int8 q.
        FAST: one xor per word and one prmt per byte (the byte under the exponent bits 0x4B)."""
        if FAST:
            b0, b1, b2, b3 = tl.inline_asm_elementwise(asm=_BYTES, constraints="=r,=r,=r,=r,r", args=[w],
                                                       dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
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
        g_begin, g_end = split_range(n_groups, split_k)
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
                ahead = packed_col(g + PREFETCH, stride_pc, GROUP // 8, 16)
                prefetch_l2(P + offs_n.to(tl.int64) * stride_pn + ahead,
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
                w = _load(p_ptrs + packed_col(g * SUB + sub, stride_pc, CHUNKS * 4, 16), w_mask, EVEN_N)
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
        store_output(out, B, Y, WS, LOCKS, offs_m, offs_n, offs_m < M, n_mask, M, N, stride_ym, split_k, HAS_BIAS,
                     SPLIT, PDL)

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
        s_begin, s_end = split_range(steps, split_k)
        wait_previous(PDL)
        words = (offs_c * 4)[:, None] + offs_i[None, :]  # [CHUNKS, 4]
        q_ptrs = Q + offs_n.to(tl.int64)[:, None, None] * stride_qn + words[None, :, :]
        w_mask = n_mask[:, None, None] & (words[None, :, :] >= 0)
        acc0 = tl.zeros((BLOCK_N, CHUNKS, 4), dtype=tl.float32)
        acc1, acc2, acc3 = acc0, acc0, acc0
        for step in tl.range(s_begin, s_end, num_stages=STAGES):
            if PREFETCH and FAST:  # the step PREFETCH ahead: CHUNKS * 16 bytes a row, one line per 128
                for line in tl.static_range(0, CHUNKS * 4, 32):
                    ahead = packed_col(step + PREFETCH, stride_pc, CHUNKS * 4, 16) + line
                    prefetch_l2(Q + offs_n.to(tl.int64) * stride_qn + ahead,
                                n_mask & (offs_n * 0 + step + PREFETCH < s_end))
            word = step * (CHUNKS * 4) + words
            x_mask = word < k_words
            w = _load(q_ptrs + packed_col(step, stride_pc, CHUNKS * 4, 16), w_mask & x_mask[None, :, :],
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
        store_output(out, B, Y, WS, LOCKS, offs_m, offs_n, offs_m < M, n_mask, M, N, stride_ym, split_k, HAS_BIAS,
                     SPLIT, PDL)
