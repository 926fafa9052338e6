"""W4A16 GEMV (M = 1, group 128, sm_90+) with a producer warp: TMA copies of weights, scales and zero points into a
shared-memory ring, consumer warps that only compute (Gluon, Triton's explicit-layout dialect).

The MMA GEMV in quant_matmul.py loads its own next group into registers, so each warp has one or two groups in
flight and 64 registers a thread cap the warps an SM holds. Here one warp per program issues `cp.async.bulk.tensor`
copies STAGES steps ahead; the weights never pass through the consumers' registers until they are used, and a
program's first steps are requested before its PDL wait (they are constants). Each of the KW consumer warps takes
one group of every step ([KW, 8, 16] words a tile: warp w, group w, 8 rows, 64 bytes a row), with the MMA GEMV's
group math unchanged (`_MMA_GEMV_BF16`: mma.sync fed straight from the loaded words), and the warps' row sums
meet once at the end.
"""
from __future__ import annotations

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from brrr.kernels import quant_matmul as qm
    HAVE_GLUON = qm.triton is not None
except Exception:  # no triton, or one without Gluon
    HAVE_GLUON = False

if HAVE_GLUON:
    _ASM_BF16 = gl.constexpr(qm._MMA_GEMV_BF16.value)
    _ASM_IO = gl.constexpr(qm._MMA_GEMV_IO.value)

    @gluon.jit
    def _gdc(asm: gl.constexpr):
        gl.inline_asm_elementwise(asm, "=r", [], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _like(v, like):
        out, _ = gl.broadcast(v, like)
        return out

    @gluon.jit
    def _scales_at(buf, slot, sd):
        """Stage `slot` of a scales ring ([8, 8] bf16 slots: 128 bytes, a TMA destination's alignment) as the
        descriptor's [KW, 8] block."""
        return buf.index(slot).slice(0, sd.block_type.shape[0], dim=0)

    @gluon.jit
    def _producer(wd, sd, bufs, bars, ra0, rb0, g_begin, steps, KW: gl.constexpr):
        wa_s, wb_s, sa_s, sb_s = bufs
        ready, empty = bars
        STAGES: gl.constexpr = wa_s.type.shape[0]
        nbytes: gl.constexpr = 2 * (wd.block_type.nbytes + sd.block_type.nbytes)
        for i in range(steps):
            slot = i % STAGES
            mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)  # a fresh barrier passes phase 1
            bar = ready.index(slot)
            mbarrier.expect(bar, nbytes)
            g = g_begin + i * KW
            tma.async_copy_global_to_shared(wd, [g, ra0, 0], bar, wa_s.index(slot))
            tma.async_copy_global_to_shared(wd, [g, rb0, 0], bar, wb_s.index(slot))
            tma.async_copy_global_to_shared(sd, [g, ra0], bar, _scales_at(sa_s, slot, sd))
            tma.async_copy_global_to_shared(sd, [g, rb0], bar, _scales_at(sb_s, slot, sd))

    @gluon.jit
    def _consumer(X, Y, Z, sd, bufs, bars, ra0, rb0, N, g_begin, steps, KW: gl.constexpr, GATED: gl.constexpr,
                  PDL: gl.constexpr):
        wa_s, wb_s, sa_s, sb_s = bufs
        ready, empty = bars
        STAGES: gl.constexpr = wa_s.type.shape[0]
        L3: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 8, 4], [KW, 1, 1], [2, 1, 0])
        ROWS: gl.constexpr = gl.SliceLayout(2, L3)  # [KW, 8]: a tile's scales and zero points
        XW: gl.constexpr = gl.SliceLayout(1, L3)  # [KW, 16]: x as 8-byte words, one group a warp
        kk = gl.arange(0, KW, layout=gl.SliceLayout(1, XW))
        ww = gl.arange(0, 16, layout=gl.SliceLayout(0, XW))
        x8 = X.to(gl.pointer_type(gl.int64), bitcast=True) + (g_begin + kk)[:, None] * 32 + ww[None, :]
        if PDL > 0:
            _gdc("griddepcontrol.wait; // $0")
        if PDL == 2:
            _gdc("griddepcontrol.launch_dependents; // $0")
        acc_a = gl.zeros([KW, 8, 16], gl.float32, L3)
        acc_b = acc_a
        x_lo = gl.load(x8)
        x_hi = gl.load(x8 + 16)
        # zero points from global a step ahead: a TMA box must start 16-byte aligned, and a program's 8 rows of
        # uint8 zero points start 8 bytes in for half the programs
        gg = gl.arange(0, KW, layout=gl.SliceLayout(1, ROWS))
        rr = gl.arange(0, 8, layout=gl.SliceLayout(0, ROWS))
        za = Z + (g_begin + gg)[:, None] * N + ra0 + rr[None, :]
        zb = Z + (g_begin + gg)[:, None] * N + rb0 + rr[None, :]
        z_a = gl.load(za).to(gl.float32)
        z_b = gl.load(zb).to(gl.float32)
        for i in range(steps):
            slot = i % STAGES
            nxt = gl.minimum(i + 1, steps - 1) * KW * 32
            x_lo_n = gl.load(x8 + nxt)
            x_hi_n = gl.load(x8 + nxt + 16)
            z_a_n = gl.load(za + gl.minimum(i + 1, steps - 1) * KW * N)
            z_b_n = gl.load(zb + gl.minimum(i + 1, steps - 1) * KW * N)
            mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
            wa = wa_s.index(slot).load(L3)
            wb = wb_s.index(slot).load(L3)
            s_a = _scales_at(sa_s, slot, sd).load(ROWS).to(gl.float32)
            s_b = _scales_at(sb_s, slot, sd).load(ROWS).to(gl.float32)
            fence_async_shared()
            mbarrier.arrive(empty.index(slot), count=1)
            ha = (-(z_a + 128.0)).to(gl.bfloat16).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
            hb = (-(z_b + 128.0)).to(gl.bfloat16).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
            args = [wa, wb, _like(x_lo[:, None, :], wa), _like(x_hi[:, None, :], wa),
                    _like((ha | (ha << 16))[:, :, None], wa), _like((hb | (hb << 16))[:, :, None], wa),
                    _like((s_a * 0.25)[:, :, None], wa), _like((s_b * 0.25)[:, :, None], wa), acc_a, acc_b]
            acc_a, acc_b = gl.inline_asm_elementwise(asm=_ASM_BF16, constraints=_ASM_IO, args=args,
                                                     dtype=(gl.float32, gl.float32), is_pure=True, pack=4)
            x_lo = x_lo_n
            x_hi = x_hi_n
            z_a = z_a_n.to(gl.float32)
            z_b = z_b_n.to(gl.float32)
        if PDL == 3:
            _gdc("griddepcontrol.launch_dependents; // $0")
        sum_a = gl.sum(gl.sum(acc_a, axis=2), axis=0)
        sum_b = gl.sum(gl.sum(acc_b, axis=2), axis=0)
        rows = gl.arange(0, 8, layout=gl.SliceLayout(0, ROWS))
        dt: gl.constexpr = Y.dtype.element_ty
        if GATED:
            g = sum_a.to(dt).to(gl.float32)
            s = (g / (1.0 + gl.exp(-g))).to(dt).to(gl.float32)
            gl.store(Y + ra0 + rows, (s * sum_b.to(dt).to(gl.float32)).to(dt))
        else:
            gl.store(Y + ra0 + rows, sum_a.to(dt), mask=ra0 + rows < N)
            gl.store(Y + rb0 + rows, sum_b.to(dt), mask=rb0 + rows < N)

    @gluon.jit
    def _w4a16_ws_gemv_kernel(X, Y, Z, sd, wd, N, K, KW: gl.constexpr, STAGES: gl.constexpr,
                              GATED: gl.constexpr, PDL: gl.constexpr,
                              PRODUCER_REGS: gl.constexpr = 24):
        """One program: 16 rows (GATED: 8 gate rows and the same up rows) over all of K, KW groups a step."""
        if GATED:
            ra0 = gl.program_id(0) * 8
            rb0 = ra0 + N // 2
        else:
            ra0 = gl.program_id(0) * 16
            rb0 = ra0 + 8
        g_begin = 0
        steps = K // (128 * KW)
        wa_s = gl.allocate_shared_memory(gl.int32, [STAGES, KW, 8, 16], wd.layout)
        wb_s = gl.allocate_shared_memory(gl.int32, [STAGES, KW, 8, 16], wd.layout)
        # scales and zero points: KW x 16 bytes a copy, in 128-byte slots (KW <= 8)
        sa_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 8, 8], sd.layout)
        sb_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 8, 8], sd.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        bufs = (wa_s, wb_s, sa_s, sb_s)
        bars = (ready, empty)
        gl.warp_specialize([
            (_consumer, (X, Y, Z, sd, bufs, bars, ra0, rb0, N, g_begin, steps, KW, GATED, PDL)),
            (_producer, (wd, sd, bufs, bars, ra0, rb0, g_begin, steps, KW)),
        ], [1], [PRODUCER_REGS])

    def shared_layouts():
        """The descriptors' shared layouts: no swizzle (the consumers read 16-byte runs of 64-byte rows)."""
        return (gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=3),
                gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2))

    def w4a16_ws_gemv(x, words, scales, zeros, n, k, kw=4, stages=4, gated=False, pdl=0, maxnreg=None, producer_regs=24):
        """y [1, n] (gated: [1, n / 2]) = x [1, k] W^T for chunk-major int4 codes (uint8 [n, k / 128, 64] over
        [k / 128, n, 64] storage, `quant_matmul.chunk_major`), scales and zero points [k / 128, n]."""
        import torch
        wl, sl = shared_layouts()
        by_group = words.transpose(0, 1).view(torch.int32)  # [k / 128, n, 16] words, contiguous
        wd = TensorDescriptor.from_tensor(by_group, [kw, 8, 16], wl)
        sd = TensorDescriptor.from_tensor(scales, [kw, 8], sl)
        y = torch.empty(1, n // 2 if gated else n, dtype=x.dtype, device=x.device)
        grid = (n // 16,)
        opts = dict(num_warps=kw, launch_pdl=pdl > 0)
        if maxnreg:
            opts["maxnreg"] = maxnreg
        _w4a16_ws_gemv_kernel[grid](x, y, zeros, sd, wd, n, k, KW=kw, STAGES=stages, GATED=gated, PDL=pdl,
                                    PRODUCER_REGS=producer_regs, **opts)
        return y
