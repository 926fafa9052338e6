"""Triton pieces every quantized matmul kernel shares: which tile and K slice a program takes, the tensor-core dot,
and the epilogue that writes y (bias, split-K partials summed by the last program to arrive, the residual add and
the next RMSNorm's inputs at M = 1)."""
from __future__ import annotations

try:
    import triton
    import triton.language as tl
except Exception:  # the dispatcher takes the reference when triton is missing
    triton = None

if triton is not None:
    from brrr.kernels.pdl import release_dependents

    @triton.jit
    def tile_ids(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWIZZLE: tl.constexpr):
        """(row tile, column tile) of this program; SWIZZLE row tiles run next to each other per column tile."""
        pid = tl.program_id(0)
        grid_m, grid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
        width = SWIZZLE * grid_n
        first_m = (pid // width) * SWIZZLE
        size_m = tl.minimum(grid_m - first_m, SWIZZLE)
        return first_m + (pid % width) % size_m, (pid % width) // size_m

    @triton.jit
    def split_range(steps, split_k):
        """The K steps [begin, end) of this program's slice when split_k programs share a tile's K loop."""
        per_split = tl.cdiv(steps, split_k)
        begin = tl.program_id(1) * per_split
        return begin, tl.minimum(begin + per_split, steps)

    @triton.jit
    def dot_bt(a, b, acc, IEEE: tl.constexpr):
        """acc + a @ b^T. IEEE: in fp32 with exact products (fp32 models, where tf32 would round the inputs; and
        16-bit inputs under the interpreter, whose dot multiplies bf16 bit patterns as integers)."""
        if IEEE:
            return tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc, input_precision="ieee")
        return tl.dot(a, tl.trans(b), acc)

    @triton.jit
    def store_output(acc, B, Y, WS, LOCKS, offs_m, offs_n, m_mask, n_mask, M, N, stride_ym, split_k,
               HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr, res=None, nw=None, SQ=None, XN=None,
               RESIDUAL: tl.constexpr = False, ROUND: tl.constexpr = None):
        """Write y = acc (+ bias). Split K (SPLIT): each of the split_k programs of a tile stores its partial sum in the
        fp32 workspace WS [split_k, M, N] and counts itself in LOCKS[tile]; the last to arrive adds the partials in
        index order (deterministic), writes y and resets the count for the next launch. One launch, no zeroed
        output and no second pass. RESIDUAL (M = 1): `write_output`'s."""
        release_dependents(PDL)
        mask = m_mask[:, None] & n_mask[None, :]
        if SPLIT:
            pid_k, tile = tl.program_id(1), tl.program_id(0)
            ws_ptrs = WS + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
            tl.store(ws_ptrs + pid_k * M * N, acc, mask=mask)
            tl.debug_barrier()  # every thread's partial is written before the count says so (acq_rel below)
            if tl.atomic_add(LOCKS + tile, 1, sem="acq_rel") == split_k - 1:
                acc = sum_partials(ws_ptrs, mask, split_k, M * N, 16 if acc.numel <= 512 else 4)
                write_output(acc, B, Y, offs_m, offs_n, n_mask, mask, stride_ym, HAS_BIAS, res, nw, SQ, XN, RESIDUAL,
                             ROUND)
                tl.atomic_xchg(LOCKS + tile, 0, sem="relaxed")  # ordered by the kernel's end
        else:
            write_output(acc, B, Y, offs_m, offs_n, n_mask, mask, stride_ym, HAS_BIAS, res, nw, SQ, XN, RESIDUAL, ROUND)

    @triton.jit
    def sum_partials(ptrs, mask, split_k, stride, UNROLL: tl.constexpr):
        """The sum of the split_k partials ptrs[k * stride], added in k order. UNROLL loads are in flight at once: a
        loop of one load then one add waited out an L2 round trip a partial. .cg: read through L2, never a stale L1
        line."""
        acc = tl.zeros(ptrs.shape, tl.float32)
        for k0 in range(0, split_k, UNROLL):
            for j in tl.static_range(UNROLL):
                ok = mask & (tl.full(mask.shape, k0 + j, tl.int32) < split_k)  # a tensor: the interpreter's rule
                acc += tl.load(ptrs + (k0 + j) * stride, mask=ok, other=0.0, cache_modifier=".cg")
        return acc

    @triton.jit
    def write_output(acc, B, Y, offs_m, offs_n, n_mask, mask, stride_ym, HAS_BIAS: tl.constexpr, res=None, nw=None,
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
