"""The MMA GEMVs (M = 1): mma.sync on the 16 bytes each thread loaded, with x as every column of the right operand,
so the tensor core sums each quad's products; int4 g128 and int8/E4M3 (K a multiple of 64). Their epilogue also
takes, at batch-1 decode, SiLU-and-mul of a packed gate/up projection (`GATED`), the RMSNorm before the GEMV
(`NORM`: x a PendingNorm, brrr/kernels/rms_norm.py) and the residual add with the next norm's inputs
(`RESIDUAL`)."""
from __future__ import annotations

try:
    import triton
    import triton.language as tl
except Exception:  # the dispatcher takes the reference when triton is missing
    triton = None

if triton is not None:
    from brrr.kernels.pdl import release_dependents, wait_previous
    from brrr.kernels.quant import ptx
    from brrr.kernels.quant.epilogue import split_range, store_output, sum_partials

    _MMA_GEMV_BF16 = tl.constexpr(ptx.mma_gemv_w4(ptx.BF16))
    _MMA_GEMV_F16 = tl.constexpr(ptx.mma_gemv_w4(ptx.F16))
    _MMA_GEMV_IO = tl.constexpr(ptx.MMA_GEMV_W4_IO)
    _MMA_GEMV8_BF16 = tl.constexpr(ptx.mma_gemv_w8(ptx.BF16))
    _MMA_GEMV8_F16 = tl.constexpr(ptx.mma_gemv_w8(ptx.F16))
    _MMA_GEMV8_FP8_BF16 = tl.constexpr(ptx.mma_gemv_w8(ptx.BF16, fp8=True))
    _MMA_GEMV8_FP8_F16 = tl.constexpr(ptx.mma_gemv_w8(ptx.F16, fp8=True))
    _MMA_GEMV8_IO = tl.constexpr(ptx.MMA_GEMV_W8_IO)

    # ---- int4 MMA GEMV (M = 1, g128): one mma.sync per 32 weights of 8 rows, fed from the bytes each thread loaded
    # A [R, 16] tile of int32 words is one g128 group of R rows (64 bytes each); Triton lays it out with 16 bytes per
    # thread, 4 threads a row and 8 rows a warp (lane = 4 * row + chunk), which is the register layout of mma.sync
    # m16n8k16's operands up to a relabeling of K. Each thread pairs its word w of row r (tile A) with word w of row r
    # of a second tile (B): the MMA's rows 0-7 are tile A's rows, rows 8-15 tile B's, and its 16 K indices are the 4
    # threads' columns j, j+1 (k = 2c, 2c+1) and j+2, j+3 (k = 2c+8, 2c+9), j = the word's first column: exactly the
    # pairs `ptx.word_nibbles` makes from a word. Every column of the MMA's right operand is x at the same columns,
    # one 8-byte load per word, so the tensor core sums the quad's 32 products per row in fp32 and each thread of the
    # quad gets its row's sum: no shuffles, no fp32 fma per weight. Per 8 weights: 12 instructions of dequantization
    # (exact q - z) and half an MMA (the fewest instructions a weight of the decode kernels). The group's scale
    # multiplies the sum once; a quarter of it goes to each of the quad's threads
    # (exact), and the accumulators are summed across the row after the K loop. The kernel waits on memory
    # (Nsight Compute: long-scoreboard stalls dominate), so with AHEAD the next group's bytes, x, scales and zero
    # points load before this group is computed.
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
    def _mma_gemv_consts(g, pa, pb, sa, sb, za, zb, N, stride_pc, HAS_ZEROS: tl.constexpr):
        """Group g (of each row's K slice) of both tiles' words, and the rows' scales and zero points (fp32; sa..zb
        point at the slice's first group): constants, so a PDL kernel may load them before its wait. Read once a
        forward, they are loaded evict-first, so the small things read every step (the KV cache, block tables,
        norms' weights, activations) can stay in L2."""
        s_a = tl.load(sa + g * N, eviction_policy="evict_first").to(tl.float32)
        s_b = tl.load(sb + g * N, eviction_policy="evict_first").to(tl.float32)
        if HAS_ZEROS:
            z_a = tl.load(za + g * N, eviction_policy="evict_first").to(tl.float32)
            z_b = tl.load(zb + g * N, eviction_policy="evict_first").to(tl.float32)
        else:
            z_a = tl.full(s_a.shape, 8.0, tl.float32)
            z_b = z_a
        return (tl.load(pa + g * stride_pc, eviction_policy="evict_first"),
                tl.load(pb + g * stride_pc, eviction_policy="evict_first"), s_a, s_b, z_a, z_b)

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
        """NORM: x's row sum of squares as the n_sq partials `write_output`'s RESIDUAL left, loaded right after the wait
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
        """Both tiles' row sums, in row order, through `store_output` (RESIDUAL: `write_output`'s); GATED: through
        `_gated_store`."""
        if GATED:
            _gated_store(sum_a, sum_b, B, Y, WS, LOCKS, N, split_k, BLOCK_N // 2, HAS_BIAS, SPLIT, PDL)
        else:
            out = tl.reshape(tl.permute(tl.join(sum_a, sum_b), (1, 0)), (BLOCK_N,))
            offs_m = tl.arange(0, BLOCK_M)
            offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
            store_output(out[None, :], B, Y, WS, LOCKS, offs_m, offs_n, offs_m < M, offs_n < N, M, N, stride_ym,
                         split_k, HAS_BIAS, SPLIT, PDL, res, nw, SQ, XN, RESIDUAL, ROUND)

    @triton.jit
    def _gated_store(gate, up, B, Y, WS, LOCKS, N, split_k, HALF_N: tl.constexpr, HAS_BIAS: tl.constexpr,
                     SPLIT: tl.constexpr, PDL: tl.constexpr):
        """y[i] = silu(gate[i]) * up[i] for this program's HALF_N outputs (M = 1, N = 2 x outputs), split K as in
        `store_output`: the partials of both halves in WS [split_k, N], the last program to arrive adds them in
        order."""
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
                gate = sum_partials(ws, mask, split_k, N, 16)
                up = sum_partials(ws + half, mask, split_k, N, 16)
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

    @triton.jit(do_not_specialize=["split_k", "stride_sn"])
    def _w4a16_mma_gemv_kernel(X, P, S, Z, B, Y, WS, LOCKS, M, N, K, stride_xm, stride_pn, stride_ym, split_k,
                               stride_sn, stride_pc, R, SQ, NW, XN, SQ_IN, n_sq, eps, BLOCK_M: tl.constexpr,
                               BLOCK_N: tl.constexpr, AHEAD: tl.constexpr, SPLIT: tl.constexpr, HAS_ZEROS: tl.constexpr,
                               HAS_BIAS: tl.constexpr, FAST: tl.constexpr, PDL: tl.constexpr, GATED: tl.constexpr,
                               LAST_STEP_RELEASE: tl.constexpr, KW: tl.constexpr,
                               NORM: tl.constexpr = False, RESIDUAL: tl.constexpr = False,
                               BLOCK_SQ: tl.constexpr = 1):
        """M = 1, group 128. P: the int4 kernel layout as int32 words (a group is one chunk). A program's BLOCK_N rows
        are two tiles of BLOCK_N / 2 (the MMA's rows 0-7 and 8-15); rows past N read row N - 1 and are not stored.
        KW > 1: the program's K range is cut into KW equal slices, one per warp (`_mma_gemv_tiles`; the launcher
        makes them equal). NORM: X is a PendingNorm's xw, its row sums times 1 / rms from SQ_IN (`_norm_sums`).
        RESIDUAL (not GATED): plus R, with the next norm's inputs (weight NW) in XN and SQ (`write_output`)."""
        g_begin, g_end = split_range(K // 128, split_k)
        per = tl.maximum(g_end - g_begin, 0) // KW
        last = tl.maximum(per - 1, 0)
        ra, rb, part, words, pa, pb, x8, acc_a, acc_b = _mma_gemv_tiles(X, P, N, stride_pn, BLOCK_N, GATED, KW)
        first, first_col = _k_slices(part, g_begin, per, K // 128, KW)
        pa, pb = pa + first_col * stride_pc, pb + first_col * stride_pc
        x8, xs = x8 + first_col * 32, X + first_col * 128
        sa, sb = S + first * N + ra * stride_sn, S + first * N + rb * stride_sn
        za, zb = Z + first * N + ra * stride_sn, Z + first * N + rb * stride_sn
        wa, wb, s_a, s_b, z_a, z_b = _mma_gemv_consts(0, pa, pb, sa, sb, za, zb, N, stride_pc, HAS_ZEROS)
        wait_previous(PDL)  # the loads above read constants: under PDL their latency overlaps the previous kernel
        sq = _norm_sums(SQ_IN, n_sq, NORM, BLOCK_SQ)
        res, nw = _residual(R, NW, N, BLOCK_N, RESIDUAL)
        x_lo, x_hi = _mma_gemv_x(0, x8)
        for g in range(0, per):
            _release_at_last_step(g, last, PDL, LAST_STEP_RELEASE)
            nxt = tl.minimum(g + 1, last)  # the last iteration reloads the last group, unused
            if AHEAD:  # group g + 1 loads while g computes
                ahead = _mma_gemv_consts(nxt, pa, pb, sa, sb, za, zb, N, stride_pc, HAS_ZEROS)
                x_ahead = _mma_gemv_x(nxt, x8)
            acc_a, acc_b = _mma_gemv_group_pair(acc_a, acc_b, wa, wb, x_lo, x_hi, s_a, s_b, z_a, z_b, g, xs, words,
                                                FAST)
            if not AHEAD:
                ahead = _mma_gemv_consts(nxt, pa, pb, sa, sb, za, zb, N, stride_pc, HAS_ZEROS)
                x_ahead = _mma_gemv_x(nxt, x8)
            wa, wb, s_a, s_b, z_a, z_b = ahead
            x_lo, x_hi = x_ahead
        rstd = _rstd(sq, K, eps, NORM)
        _mma_gemv_store(_slice_sums(acc_a, rstd, KW), _slice_sums(acc_b, rstd, KW), B, Y, WS, LOCKS, M, N,
                        stride_ym, split_k, BLOCK_M, BLOCK_N, HAS_BIAS, SPLIT, PDL, GATED, res, nw, SQ, XN, RESIDUAL,
                        X.dtype.element_ty)

    # ---- W8A16 MMA GEMV (M = 1): the same pairing for int8 weights, one mma.sync per 32 weights of 8 rows ----------
    # A [R, 16] tile of int32 words is 64 int8 weights of R rows; a thread's word w of row r pairs with word w of row r
    # of the second tile as in the int4 kernel, its 4 bytes are the MMA's K indices 2c, 2c+1, 2c+8, 2c+9 and x at the
    # word's 4 columns is one 8-byte load. bf16 has 7 mantissa bits, so a signed byte cannot become 2^7 + q with one
    # OR: each byte pair is spread into 16-bit halves (prmt), its low 7 bits ORed into 128 (fp16: 1024) and its sign
    # bit into 128 or 256 (fp16: 1024 or 1152), and the difference of the two is q, exactly (2 instructions a
    # weight). The scale is per row, so the MMA accumulates across the whole K loop and the scale multiplies once.
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
    def _mma_gemv8_load(t, pa, pb, x8, stride_qc):
        """Step t's words of both tiles and x at their columns."""
        return (tl.load(pa + t * stride_qc, eviction_policy="evict_first"),
                tl.load(pb + t * stride_qc, eviction_policy="evict_first"), tl.load(x8 + t * 16))

    @triton.jit(do_not_specialize=["split_k"])
    def _w8a16_mma_gemv_kernel(X, Q, S, B, Y, WS, LOCKS, M, N, K, stride_xm, stride_qn, stride_ym, split_k,
                               stride_qc, R, SQ, NW, XN, SQ_IN, n_sq, eps, BLOCK_M: tl.constexpr,
                               BLOCK_N: tl.constexpr, AHEAD: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                               FAST: tl.constexpr, PDL: tl.constexpr, GATED: tl.constexpr,
                               LAST_STEP_RELEASE: tl.constexpr, KW: tl.constexpr, FP8: tl.constexpr = False,
                               NORM: tl.constexpr = False, RESIDUAL: tl.constexpr = False,
                               BLOCK_SQ: tl.constexpr = 1):
        """M = 1, K a multiple of 64. Q: int8 (FP8: E4M3) [N, K] as int32 words, word column c of row n at
        n * stride_qn + (c // 16) * stride_qc + c % 16 (by rows: stride_qc = 16). Tiles, rows past N and K slices
        (KW) as in the int4 kernel. The first step's weights and the scales are loaded before the PDL wait (they
        are constants). NORM, RESIDUAL: as in the int4 kernel."""
        s_begin, s_end = split_range(K // 64, split_k)
        per = tl.maximum(s_end - s_begin, 0) // KW
        last = tl.maximum(per - 1, 0)
        ra, rb, part, words, pa, pb, x8, acc_a, acc_b = _mma_gemv_tiles(X, Q, N, stride_qn, BLOCK_N, GATED, KW)
        first, first_col = _k_slices(part, s_begin, per, K // 64, KW)
        pa, pb = pa + first_col * stride_qc, pb + first_col * stride_qc
        x8, xs = x8 + first_col * 16, X + first_col * 64
        wa, wb = tl.load(pa, eviction_policy="evict_first"), tl.load(pb, eviction_policy="evict_first")
        if AHEAD == 2:
            second = (tl.load(pa + tl.minimum(1, last) * stride_qc, eviction_policy="evict_first"),
                      tl.load(pb + tl.minimum(1, last) * stride_qc, eviction_policy="evict_first"))
        s_a = tl.load(S + ra).to(tl.float32) * 0.25  # four copies of each row's sum (exact)
        s_b = tl.load(S + rb).to(tl.float32) * 0.25
        wait_previous(PDL)  # the loads above read constants: under PDL their latency overlaps the previous kernel
        sq = _norm_sums(SQ_IN, n_sq, NORM, BLOCK_SQ)
        res, nw = _residual(R, NW, N, BLOCK_N, RESIDUAL)
        if AHEAD == 2:  # steps t + 1 and t + 2 in flight while t computes; x (L1 hits) loads where it is used
            for t in range(0, per):
                _release_at_last_step(t, last, PDL, LAST_STEP_RELEASE)
                nxt = tl.minimum(t + 2, last)
                third = (tl.load(pa + nxt * stride_qc, eviction_policy="evict_first"),
                         tl.load(pb + nxt * stride_qc, eviction_policy="evict_first"))
                acc_a, acc_b = _mma_gemv8_step(acc_a, acc_b, wa, wb, tl.load(x8 + t * 16), t, xs, words, FAST, FP8)
                wa, wb = second
                second = third
        else:
            x = tl.load(x8)
            for t in range(0, per):
                _release_at_last_step(t, last, PDL, LAST_STEP_RELEASE)
                nxt = tl.minimum(t + 1, last)  # the last iteration reloads the last step, unused
                if AHEAD:  # step t + 1 loads while t computes
                    ahead = _mma_gemv8_load(nxt, pa, pb, x8, stride_qc)
                acc_a, acc_b = _mma_gemv8_step(acc_a, acc_b, wa, wb, x, t, xs, words, FAST, FP8)
                wa, wb, x = ahead if AHEAD else _mma_gemv8_load(nxt, pa, pb, x8, stride_qc)
        rstd = _rstd(sq, K, eps, NORM)
        _mma_gemv_store(_slice_sums(acc_a, s_a * rstd, KW), _slice_sums(acc_b, s_b * rstd, KW), B, Y, WS, LOCKS, M,
                        N, stride_ym, split_k, BLOCK_M, BLOCK_N, HAS_BIAS, SPLIT, PDL, GATED, res, nw, SQ, XN,
                        RESIDUAL, X.dtype.element_ty)
