"""Batch-small decode attention on tensor cores: the lean decode kernel's plan (`lean._lean_decode_kernel`: a sequence's
whole context read before the PDL wait, no split, the warps' partials merged in one program) with one program a kv
head and mma.sync m16n8k16 for both products. `plan.decode_plan` takes it for bounds above `plan.LEAN_MMA_ABOVE`
keys; shorter ones keep the CUDA-core kernel, which skips the chunks past the context.

A warp holds 16-key blocks as 32-bit words. For the scores, lane 4g + c has 16 bytes (dims 32s + 8c .. + 7) of key
rows g and g + 8 in each of the head's four 32-dim segments s: the MMA's A fragment up to a relabeling of K (the
MMA GEMV's trick, kernels/quant/mma_gemv.py). The kv head's query heads are the 8 columns of B, so the GQA group
shares one read of the cache and S[key, head] comes out of 8 MMAs a block. For the weighted sum the lane loads dims 16g .. 16g
+ 15 of keys 2c and 2c + 1 (and of 2c + 8, 2c + 9), and `prmt` pairs them by key into A = V^T; the weights' C
fragment goes to B = P^T through `movmatrix`. The output O^T[d, head] lands with its rows relabeled (`_sa_index`).
A warp's softmax is its own (shuffles over the 8 rows); the warps' partials and the new key's go through a static
shared-memory array to one merge, as in the lean kernel. RoPE of q and of the new key runs on the words in packed
16-bit PTX with the rotary kernel's roundings, so the cache gets the same bits. Head dim 128, 16-bit activations, at
most 8 query heads a kv head, cache blocks of a multiple of 16 keys. FAST False (the interpreter): the same program
computes the warps' partials with plain tensor ops instead, into a global scratch (SCR).
"""
from __future__ import annotations

import torch

from brrr.kernels.attention.helpers import LOG2E
from brrr.kernels.attention.plan import LEAN_MMA_HEAD_DIM as HEAD_DIM, DecodePlan
from brrr.kernels.dispatch import next_power_of_2
from brrr.kernels.pdl import pdl_on

try:
    import triton
    import triton.language as tl
except Exception:
    triton = None

MAX_WARPS = 8
SCRATCH_BYTES = 4 * (8 * HEAD_DIM * MAX_WARPS + 16 * MAX_WARPS + 8)  # a program's partials: SCR's block at 8 warps


def _mma(d: str, a: tuple, b: tuple, c: str, kind: str) -> str:
    return (f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32 {{{d}}}, {{{', '.join(a)}}}, "
            f"{{{', '.join(b)}}}, {{{c}}};")


def _rope_asm(kind: str) -> str:
    """One word of a rotated row, as `_rope` rounds: x*cos and sign*x'*sin each rounded to 16 bits, then their sum.
    A product of two 16-bit values is exact in fp32, so the packed multiply's single rounding is that rounding; the
    packed fma is the sum's (exact past it). $1 the word, $2 its partner 64 dims away, $3 / $4 the cos and sin of
    its two dims (16-bit, as the model builds them), $5 the sign as two 16-bit values (+-1.0)."""
    return "\n".join(["{", ".reg .b32 pa, pb;", f"mul.rn.{kind}x2 pa, $1, $3;", f"mul.rn.{kind}x2 pb, $2, $4;",
                      f"fma.rn.{kind}x2 $0, pb, $5, pa;", "}"])


def _scores_asm(kind: str) -> str:
    """S[key, head] of one 16-key block: A = the keys' words (rows g: $4-$19, four per segment; rows g + 8:
    $20-$35), B = q's words ($36-$51, the column's head = the lane's g); two accumulator chains."""
    body = [".reg .f32 d0, d1, d2, d3, e0, e1, e2, e3;"] + [f"mov.f32 {r}, 0f00000000;" for r in
                                                           ("d0", "d1", "d2", "d3", "e0", "e1", "e2", "e3")]
    for s in range(4):
        acc = "d0, d1, d2, d3" if s < 2 else "e0, e1, e2, e3"
        for h in range(2):
            ka, kb, q = 4 + 4 * s + 2 * h, 20 + 4 * s + 2 * h, 36 + 4 * s + 2 * h
            body.append(_mma(acc, (f"${ka}", f"${kb}", f"${ka + 1}", f"${kb + 1}"), (f"${q}", f"${q + 1}"), acc, kind))
    body += [f"add.f32 ${i}, d{i}, e{i};" for i in range(4)]
    return "{\n" + "\n".join(body) + "\n}"


def _softmax_asm(n: int) -> str:
    """A warp's softmax over its keys, per head: $0.. the weights, $n.. the max, $2n.. the sum of weights, from the
    base-2 scores $3n.. (element e: head 2c + e % 2; the keys are e // 2 and the warp's 8 rows). An empty warp keeps
    max -inf and weights 0."""
    s = [f"${3 * n + e}" for e in range(n)]
    body = [".reg .f32 m0, m1, l0, l1, u0, u1, t;", ".reg .pred z;"]
    for a in range(2):
        body.append(f"mov.f32 m{a}, {s[a]};")
        body += [f"max.f32 m{a}, m{a}, {s[e]};" for e in range(a + 2, n, 2)]
        for x in (4, 8, 16):
            body += [f"shfl.sync.bfly.b32 t, m{a}, {x}, 0x1f, -1;", f"max.f32 m{a}, m{a}, t;"]
        body += [f"setp.eq.f32 z, m{a}, 0fFF800000;", f"selp.f32 u{a}, 0f00000000, m{a}, z;"]
    for e in range(n):
        body += [f"sub.f32 t, {s[e]}, u{e % 2};", f"ex2.approx.f32 ${e}, t;"]
    for a in range(2):
        body.append(f"mov.f32 l{a}, ${a};")
        body += [f"add.f32 l{a}, l{a}, ${e};" for e in range(a + 2, n, 2)]
        for x in (4, 8, 16):
            body += [f"shfl.sync.bfly.b32 t, l{a}, {x}, 0x1f, -1;", f"add.f32 l{a}, l{a}, t;"]
    body += [f"mov.f32 ${n + e}, m{e % 2};" for e in range(n)] + [f"mov.f32 ${2 * n + e}, l{e % 2};" for e in range(n)]
    return "{\n" + "\n".join(body) + "\n}"


def _weights_asm(kind: str) -> str:
    """A block's weights P[key, head] ($4-$7: keys g and g + 8, heads 2c and 2c + 1) -> P^T as the B fragment of
    the weighted sum: $0 = (keys 2c, 2c + 1 of the first 8; head g), $1 the same of the last 8 ($2, $3 copies)."""
    return "\n".join(["{", ".reg .b32 wa, wb;", f"cvt.rn.{kind}x2.f32 wa, $5, $4;", f"cvt.rn.{kind}x2.f32 wb, $7, $6;",
                      "movmatrix.sync.aligned.m8n8.trans.b16 $0, wa;", "movmatrix.sync.aligned.m8n8.trans.b16 $1, wb;",
                      "mov.b32 $2, $0;", "mov.b32 $3, $1;", "}"])


def _values_asm(kind: str, j0: int) -> str:
    """O^T[d, head] of one block, output tiles T = 2j + x for j = j0, j0 + 1 ($0-$15): A = V^T, each register two
    keys' values of one dim, paired by `prmt` from the words lane (g, c) loaded ($20-$51: keys 2c / 2c + 1 of the
    block's first 8 (A) and last 8 (B), dims 16g .. + 7 and 16g + 8 .. + 15; word j holds dims 2j, 2j + 1 of those);
    B = `_weights_asm`'s ($16, $17). Row g of tile T is dim 16g + T, row g + 8 dim 16g + 8 + T."""
    va0, va1, va2, va3, vb0, vb1, vb2, vb3 = (20 + 4 * n for n in range(8))  # (key 2c + e, dims half): e0h0, e0h1, ...
    body = [".reg .f32 z;", ".reg .b32 a0, a1, a2, a3;", "mov.f32 z, 0f00000000;"]
    for j in (j0, j0 + 1):
        for x, sel in ((0, "0x5410"), (1, "0x7632")):  # the words' low halves (dim 2j), then the high (2j + 1)
            o = 4 * (2 * (j - j0) + x)
            body += [f"prmt.b32 a0, ${va0 + j}, ${va2 + j}, {sel};", f"prmt.b32 a1, ${va1 + j}, ${va3 + j}, {sel};",
                     f"prmt.b32 a2, ${vb0 + j}, ${vb2 + j}, {sel};", f"prmt.b32 a3, ${vb1 + j}, ${vb3 + j}, {sel};",
                     _mma(", ".join(f"${o + i}" for i in range(4)), ("a0", "a1", "a2", "a3"), ("$16", "$17"),
                          "z, z, z, z", kind)]
    return "{\n" + "\n".join(body) + "\n}"


if triton is not None:
    from brrr.kernels.attention.helpers import _decode_row, _rope, _rope_factors, _store_in_place
    from brrr.kernels.pdl import wait_previous

    D128 = tl.constexpr(HEAD_DIM)

    _ROPE_BF16 = tl.constexpr(_rope_asm("bf16"))
    # +-1.0 in both 16-bit halves of a word, as int32 (`_rope_asm`'s sign operand)
    _BF16_ONES, _BF16_MINUS_ONES = tl.constexpr(0x3F803F80), tl.constexpr(0xBF80BF80 - 2**32)
    _F16_ONES, _F16_MINUS_ONES = tl.constexpr(0x3C003C00), tl.constexpr(0xBC00BC00 - 2**32)
    _ROPE_F16 = tl.constexpr(_rope_asm("f16"))
    _SCORES_BF16 = tl.constexpr(_scores_asm("bf16"))
    _SCORES_F16 = tl.constexpr(_scores_asm("f16"))
    _SOFTMAX_4 = tl.constexpr(_softmax_asm(4))
    _SOFTMAX_8 = tl.constexpr(_softmax_asm(8))
    _WEIGHTS_BF16 = tl.constexpr(_weights_asm("bf16"))
    _WEIGHTS_F16 = tl.constexpr(_weights_asm("f16"))
    _VALUES_LO_BF16 = tl.constexpr(_values_asm("bf16", 0))
    _VALUES_HI_BF16 = tl.constexpr(_values_asm("bf16", 2))
    _VALUES_LO_F16 = tl.constexpr(_values_asm("f16", 0))
    _VALUES_HI_F16 = tl.constexpr(_values_asm("f16", 2))
    _SCRATCH_DECL = tl.constexpr(f".shared .align 16 .b8 brrr_mma_scratch[{SCRATCH_BYTES}]; "
                                 "mov.u32 $0, brrr_mma_scratch; // $1")
    _SCORES_IO = tl.constexpr(",".join(["=f"] * 4 + ["r"] * 48))
    _SOFTMAX_8_IO = tl.constexpr(",".join(["=f"] * 24 + ["f"] * 8))
    _SOFTMAX_4_IO = tl.constexpr(",".join(["=f"] * 12 + ["f"] * 4))
    _VALUES_IO = tl.constexpr(",".join(["=f"] * 16 + ["r"] * 36))

    @triton.jit
    def _pinned(x):
        """x (32 bits) computed here: an asm with side effects is not moved past the PDL wait's, so what is known
        before the wait is computed before it, not where it is used."""
        return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x.to(tl.int32, bitcast=True)], dtype=tl.int32,
                                         is_pure=False, pack=1).to(x.dtype, bitcast=True)

    @triton.jit
    def _rope_word(x, partner, cs, sn, SUB: tl.constexpr, BF16: tl.constexpr):
        ONE: tl.constexpr = ((_BF16_MINUS_ONES if SUB else _BF16_ONES) if BF16 else
                             (_F16_MINUS_ONES if SUB else _F16_ONES))
        one = tl.full(x.shape, ONE, tl.int32)
        ROPE: tl.constexpr = _ROPE_BF16 if BF16 else _ROPE_F16
        y = tl.inline_asm_elementwise(ROPE, "=r,r,r,r,r,r", [x, partner, cs, sn, one], dtype=tl.int32, is_pure=True,
                                      pack=1)
        return y

    @triton.jit
    def _rope_words(w0, w1, w2, w3, c0, c1, s0, s1, BF16: tl.constexpr):
        """A row's four segments of words rotated (rotate-half: segment s pairs with s + 2; cos and sin repeat
        every 64 dims, so two segments' pairs serve all four)."""
        return (_rope_word(w0, w2, c0, s0, True, BF16), _rope_word(w1, w3, c1, s1, True, BF16),
                _rope_word(w2, w0, c0, s0, False, BF16), _rope_word(w3, w1, c1, s1, False, BF16))

    @triton.jit
    def _scores(ka0, ka1, ka2, ka3, kb0, kb1, kb2, kb3, q0, q1, q2, q3, BF16: tl.constexpr):
        args = [ka0, ka1, ka2, ka3, kb0, kb1, kb2, kb3, q0, q1, q2, q3]
        SCORES: tl.constexpr = _SCORES_BF16 if BF16 else _SCORES_F16
        s = tl.inline_asm_elementwise(SCORES, _SCORES_IO, args, dtype=tl.float32, is_pure=True, pack=4)
        return s

    @triton.jit
    def _softmax(s, REPS: tl.constexpr):
        SOFTMAX: tl.constexpr = _SOFTMAX_8 if REPS == 2 else _SOFTMAX_4
        IO: tl.constexpr = _SOFTMAX_8_IO if REPS == 2 else _SOFTMAX_4_IO
        p, m, l = tl.inline_asm_elementwise(SOFTMAX, IO, [s], dtype=(tl.float32, tl.float32, tl.float32),
                                            is_pure=True, pack=4 * REPS)
        return p, m, l

    @triton.jit
    def _values(p, v0, v1, v2, v3, v4, v5, v6, v7, BF16: tl.constexpr):
        """The block's O^T partial tiles 0-7 (its own: summed over the blocks after) from `_values_asm`'s eight word
        tiles."""
        WEIGHTS: tl.constexpr = _WEIGHTS_BF16 if BF16 else _WEIGHTS_F16
        VALUES_LO: tl.constexpr = _VALUES_LO_BF16 if BF16 else _VALUES_LO_F16
        VALUES_HI: tl.constexpr = _VALUES_HI_BF16 if BF16 else _VALUES_HI_F16
        pt = tl.inline_asm_elementwise(WEIGHTS, "=r,=r,=r,=r,f,f,f,f", [p], dtype=tl.int32, is_pure=True, pack=4)
        lo = tl.inline_asm_elementwise(VALUES_LO, _VALUES_IO, [pt, v0, v1, v2, v3, v4, v5, v6, v7],
                                       dtype=(tl.float32,) * 4, is_pure=True, pack=4)
        hi = tl.inline_asm_elementwise(VALUES_HI, _VALUES_IO, [pt, v0, v1, v2, v3, v4, v5, v6, v7],
                                       dtype=(tl.float32,) * 4, is_pure=True, pack=4)
        return lo[0], lo[1], lo[2], lo[3], hi[0], hi[1], hi[2], hi[3]

    @triton.jit
    def _sa_index(head, d, w, W: tl.constexpr):
        """Where SA holds warp w's partial sum of (head, d): in the order of `_values_asm`'s outputs, which the fast
        path stores as they sit (tile T of [8W, 16], row 8w + g, column 4c + i): row g (+ 8 if i >= 2) of tile T
        is dim 16g (+ 8) + T, column 4c + i head 2c + i % 2."""
        r = d % 16
        return ((r % 8) * 8 * W + 8 * w + d // 16) * 16 + 4 * (head // 2) + 2 * (r // 8) + head % 2

    @triton.jit
    def _lean_mma_kernel(Q, KC, VC, O, SCR, CU_Q, CTX, BT, K, V, COS, SIN, SLOTS,
                         wq_n, wq_h, so_n, so_h, wc_b, wc_t, wc_h, stride_bt, wk_n, wk_h, wv_n, wv_h, sv_n, sv_h,
                         stride_cos, qk_scale, window, BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr,
                         GP: tl.constexpr, W: tl.constexpr, REPS: tl.constexpr, SLIDING: tl.constexpr,
                         PDL: tl.constexpr, FAST: tl.constexpr):
        """One program: one kv head of a sequence with one new token, its GROUP query heads and its whole context
        (< 16 W REPS keys, block j of 16 keys on warp j % W). w* strides count 32-bit words. Before the PDL wait:
        the keys' and values' words, cos and sin; after it q, the new key and value (rotated on the words, the new
        key into the key tiles at its position), the warps' softmax partials to shared memory (FAST; else to SCR),
        the new key and value written to the cache, a barrier, and the merge (with the new key's own partial)."""
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        q_row, single, ctx, lo, hi = _decode_row(CU_Q, CTX, b, window, SLIDING)
        slot = tl.load(SLOTS + q_row).to(tl.int64)
        scr = SCR + (b * tl.num_programs(1) + kvh) * (8 * D128 * W + 16 * W + 8)
        SA, SM = scr, scr + 8 * D128 * W  # the sums (`_sa_index`); [8, W + 1] maxima (the new key's last)
        SL = SM + 8 * (W + 1)  # [8, W] sums of weights
        BF16: tl.constexpr = Q.dtype.element_ty == tl.bfloat16
        row = tl.arange(0, 8 * W)[:, None, None]  # [8W, 1, 1]: warp row // 8, lane row g = row % 8
        col = tl.arange(0, 16)[None, None, :]  # a row's words of one segment, 4 a lane
        if FAST:
            rep = tl.arange(0, REPS)[None, :, None]
            key_a = 16 * (rep * W + row // 8) + row % 8  # [8W, REPS, 1]; tile B holds key_a + 8
            ok_a = (key_a >= lo) & (key_a < hi)
            ok_b = (key_a + 8 >= lo) & (key_a + 8 < hi)
            kw = KC.to(tl.pointer_type(tl.int32), bitcast=True)
            vw = VC.to(tl.pointer_type(tl.int32), bitcast=True)
            # a 16-key block sits in one cache block (BLOCK_SIZE a multiple of 16): one lookup for its keys and values
            first_key = 16 * (rep * W + row // 8)  # [8W, REPS, 1]
            blk = tl.load(BT + b * stride_bt + first_key // BLOCK_SIZE, mask=(first_key < hi) & (first_key + 16 > lo),
                          other=0).to(tl.int64) * wc_b + kvh * wc_h
            ra = tl.multiple_of(blk + (key_a % BLOCK_SIZE) * wc_t, [1, 1, 4]) + col
            rb = tl.multiple_of(blk + ((key_a + 8) % BLOCK_SIZE) * wc_t, [1, 1, 4]) + col
            ka0, ka1 = tl.load(kw + ra, mask=ok_a, other=0), tl.load(kw + ra + 16, mask=ok_a, other=0)
            ka2, ka3 = tl.load(kw + ra + 32, mask=ok_a, other=0), tl.load(kw + ra + 48, mask=ok_a, other=0)
            kb0, kb1 = tl.load(kw + rb, mask=ok_b, other=0), tl.load(kw + rb + 16, mask=ok_b, other=0)
            kb2, kb3 = tl.load(kw + rb + 32, mask=ok_b, other=0), tl.load(kw + rb + 48, mask=ok_b, other=0)
            # values: lane (g, c) loads dims 16g .. 16g + 15 of keys 2c and 2c + 1 (+ 8 for tile B)
            key_v = first_key + 2 * (col // 4)  # [8W, REPS, 16]
            base_v = blk + (key_v % BLOCK_SIZE) * wc_t + 8 * (row % 8) + col % 4
            ok_v = (key_v >= lo) & (key_v < hi)  # each of the lane's four key rows has its own mask
            ok_v1 = (key_v + 1 >= lo) & (key_v + 1 < hi)
            ok_v8 = (key_v + 8 >= lo) & (key_v + 8 < hi)
            ok_v9 = (key_v + 9 >= lo) & (key_v + 9 < hi)
            v0, v1, v2, v3, v4, v5, v6, v7 = (tl.load(vw + base_v, mask=ok_v, other=0),
                                              tl.load(vw + base_v + 4, mask=ok_v, other=0),
                                              tl.load(vw + base_v + wc_t, mask=ok_v1, other=0),
                                              tl.load(vw + base_v + wc_t + 4, mask=ok_v1, other=0),
                                              tl.load(vw + base_v + 8 * wc_t, mask=ok_v8, other=0),
                                              tl.load(vw + base_v + 8 * wc_t + 4, mask=ok_v8, other=0),
                                              tl.load(vw + base_v + 9 * wc_t, mask=ok_v9, other=0),
                                              tl.load(vw + base_v + 9 * wc_t + 4, mask=ok_v9, other=0))
            cw = COS.to(tl.pointer_type(tl.int32), bitcast=True) + q_row * (stride_cos // 2) + col + row * 0
            sw = SIN.to(tl.pointer_type(tl.int32), bitcast=True) + q_row * (stride_cos // 2) + col + row * 0
            c0, c1, s0, s1 = tl.load(cw), tl.load(cw + 16), tl.load(sw), tl.load(sw + 16)
            key = key_a + 8 * ((col % 4) // 2)  # [8W, REPS, 16]: element (c, i) is key row g (+ 8 if i >= 2)
            head = 2 * (col // 4) + col % 2  # and head 2c + i % 2
            bias = _pinned(tl.where((key >= lo) & (key < hi), 0.0, float("-inf")))  # the cached keys' scores
            is_a = _pinned(tl.where((key_a == hi) & (ctx > 0), 1, 0)) != 0  # the new key's row in a tile
            is_b = _pinned(tl.where((key_a + 8 == hi) & (ctx > 0), 1, 0)) != 0
            is_new = _pinned(tl.where((key == hi) & (ctx > 0) & (head < GROUP), 1, 0)) != 0  # its scores
        wait_previous(PDL)
        if single:  # else a prefill chunk: the prefill kernel's
            has_new = ctx > 0
            if FAST:
                v_n = _new_value(V, q_row, kvh, ctx, sv_n, sv_h, GROUP, GP, FAST)
                g = row % 8  # the B operand's column: query head kvh * GROUP + g
                qp = Q.to(tl.pointer_type(tl.int32), bitcast=True) + q_row * wq_n + (kvh * GROUP + g) * wq_h + col
                qm = (g < GROUP) & (col < 16)
                q0, q1, q2, q3 = _rope_words(tl.load(qp, mask=qm, other=0), tl.load(qp + 16, mask=qm, other=0),
                                             tl.load(qp + 32, mask=qm, other=0), tl.load(qp + 48, mask=qm, other=0),
                                             c0, c1, s0, s1, BF16)
                kp = K.to(tl.pointer_type(tl.int32), bitcast=True) + q_row * wk_n + kvh * wk_h + col + row * 0
                n0, n1, n2, n3 = _rope_words(tl.load(kp), tl.load(kp + 16), tl.load(kp + 32), tl.load(kp + 48),
                                             c0, c1, s0, s1, BF16)
                ka0, ka1 = tl.where(is_a, n0, ka0), tl.where(is_a, n1, ka1)
                ka2, ka3 = tl.where(is_a, n2, ka2), tl.where(is_a, n3, ka3)
                kb0, kb1 = tl.where(is_b, n0, kb0), tl.where(is_b, n1, kb1)
                kb2, kb3 = tl.where(is_b, n2, kb2), tl.where(is_b, n3, kb3)
                s = _scores(ka0, ka1, ka2, ka3, kb0, kb1, kb2, kb3, q0, q1, q2, q3, BF16) * qk_scale
                # the partials go to shared memory (byte addresses; SCR's layout)
                ssa = _shared_scratch(kvh)
                ssm = ssa + 4 * 8 * D128 * W
                ssl = ssm + 4 * 8 * (W + 1)
                _st_shared(ssm + 4 * (head * (W + 1) + W + key * 0), s, is_new)
                p, m, l = _softmax(s + bias, REPS)
                first = (row % 8 == 0) & (rep == 0) & (col % 4 < 2) & (head < GROUP)
                _st_shared(ssm + 4 * (head * (W + 1) + row // 8 + rep * 0), m, first)
                _st_shared(ssl + 4 * (head * W + row // 8 + rep * 0), l, first)
                o0, o1, o2, o3, o4, o5, o6, o7 = _values(p, v0, v1, v2, v3, v4, v5, v6, v7, BF16)
                sa = ssa + 4 * (row * 16 + col)  # [8W, 1, 16]: tile t at sa + 4 * 128 W t (`_sa_index`)
                real = 2 * (col // 4) < GROUP  # the lanes holding heads < GROUP
                _st_shared4(sa, tl.sum(o0, 1, keep_dims=True), real)
                _st_shared4(sa + 512 * W, tl.sum(o1, 1, keep_dims=True), real)
                _st_shared4(sa + 1024 * W, tl.sum(o2, 1, keep_dims=True), real)
                _st_shared4(sa + 1536 * W, tl.sum(o3, 1, keep_dims=True), real)
                _st_shared4(sa + 2048 * W, tl.sum(o4, 1, keep_dims=True), real)
                _st_shared4(sa + 2560 * W, tl.sum(o5, 1, keep_dims=True), real)
                _st_shared4(sa + 3072 * W, tl.sum(o6, 1, keep_dims=True), real)
                _st_shared4(sa + 3584 * W, tl.sum(o7, 1, keep_dims=True), real)
                # the new key and value into the cache: 16 bytes a lane of warp 0's first row
                dst = (slot // BLOCK_SIZE) * wc_b + (slot % BLOCK_SIZE) * wc_t + kvh * wc_h + col + row * 0
                one = (row == 0) & (slot >= 0) & has_new & (col < 16)
                vp = V.to(tl.pointer_type(tl.int32), bitcast=True) + q_row * wv_n + kvh * wv_h + col + row * 0
                tl.store(kw + dst, n0, mask=one)
                tl.store(kw + dst + 16, n1, mask=one)
                tl.store(kw + dst + 32, n2, mask=one)
                tl.store(kw + dst + 48, n3, mask=one)
                tl.store(vw + dst, tl.load(vp, mask=one), mask=one)
                tl.store(vw + dst + 16, tl.load(vp + 16, mask=one), mask=one)
                tl.store(vw + dst + 32, tl.load(vp + 32, mask=one), mask=one)
                tl.store(vw + dst + 48, tl.load(vp + 48, mask=one), mask=one)
                tl.debug_barrier()  # the partials in shared memory visible to every thread
                _merge(O, v_n, ssa, ssm, ssl, q_row, kvh, ctx, so_n, so_h, GROUP, GP, W, FAST)
            else:
                _portable_partials(Q, KC, VC, K, V, COS, SIN, BT, SA, SM, SL, b, kvh, q_row, lo, hi, ctx, slot,
                                   wq_n * 2, wq_h * 2, wc_b * 2, wc_t * 2, wc_h * 2, stride_bt, wk_n * 2, wk_h * 2,
                                   sv_n, sv_h, stride_cos, qk_scale, BLOCK_SIZE, GROUP, GP, W, REPS)
                tl.debug_barrier()  # the CTA's global writes are visible to its threads after it
                v_n = _new_value(V, q_row, kvh, ctx, sv_n, sv_h, GROUP, GP, FAST)
                _merge(O, v_n, SA, SM, SL, q_row, kvh, ctx, so_n, so_h, GROUP, GP, W, FAST)

    @triton.jit
    def _shared_scratch(x):
        """The byte address of the program's shared-memory scratch (SCR's layout at 8 warps). A static array of the
        PTX: Triton's own reductions through shared memory lay the reduced (warp) dim fastest, so a warp's 32 lanes
        hit one bank. Called once a kernel (x: a scalar), since the asm declares it."""
        return tl.inline_asm_elementwise(_SCRATCH_DECL, "=r,r", [x], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _st_shared(addr, v, mask):
        tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.s32 p, $3, 0; @p st.shared.f32 [$1], $2; mov.u32 $0, 0; }",
                                  "=r,r,f,r", [addr, v, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _st_shared4(addr, v, mask):
        """A lane's four consecutive fp32 (its columns 4c .. 4c + 3) as one 16-byte store at the first's address."""
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.s32 p, $12, 0; @p st.shared.v4.f32 [$4], {$8, $9, $10, $11}; mov.u32 $0, 0; "
            "mov.u32 $1, 0; mov.u32 $2, 0; mov.u32 $3, 0; }", "=r,=r,=r,=r,r,r,r,r,f,f,f,f,r,r,r,r",
            [addr, v, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=4)

    @triton.jit
    def _scratch_load(base, off, mask, FAST: tl.constexpr):
        """Element off of a scratch array, 0 where masked: FAST, base is a shared-memory byte address (PTX ld.shared,
        in the layout off is in: the merge's loads need no conversions); else an fp32 pointer (SCR)."""
        if FAST:
            v = tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.s32 p, $2, 0; mov.b32 $0, 0; @p ld.shared.b32 $0, [$1]; }", "=r,r,r",
                [base + 4 * off, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1).to(tl.float32, bitcast=True)
        else:
            v = tl.load(base + off, mask=mask, other=0.0)
        return v

    @triton.jit
    def _load_in_place(ptrs, mask, FAST: tl.constexpr):
        """tl.load(ptrs, mask, other=0) of 16-bit values, in the layout ptrs are in (FAST: PTX ld.global, which
        Triton does not re-lay out for coalescing)."""
        if FAST:
            v = tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.s32 p, $2, 0; mov.b16 $0, 0; @p ld.global.b16 $0, [$1]; }", "=h,l,r",
                [ptrs.to(tl.int64), mask.to(tl.int32)], dtype=tl.int16, is_pure=False, pack=1)
            v = v.to(ptrs.dtype.element_ty, bitcast=True)
        else:
            v = tl.load(ptrs, mask=mask, other=0.0)
        return v

    @triton.jit
    def _merge_index(ctx, GROUP: tl.constexpr, GP: tl.constexpr):
        """The merge's [1, 8 tiles, 8 rows, NC columns] output index: (tile, row, column, dim, head, the head's
        mask, the new key's mask)."""
        NC: tl.constexpr = 4 if GP < 2 else 2 * GP  # columns 4c + i of heads 2c + i % 2 < GP
        t = tl.arange(0, 8)[None, :, None, None]  # tile T of `_values_asm`
        g = tl.arange(0, 8)[None, None, :, None]
        col = tl.arange(0, NC)[None, None, None, :]
        head = 2 * (col // 4) + col % 2
        d = 16 * g + 8 * ((col % 4) // 2) + t  # [1, 8, 8, NC]
        hm = (head < GROUP) & (d < D128)
        return t, g, col, d, head, hm, hm & (d * 0 + ctx > 0)  # (not `ctx > 0` itself: see _portable_partials)

    @triton.jit
    def _new_value(V, q_row, kvh, ctx, sv_n, sv_h, GROUP: tl.constexpr, GP: tl.constexpr, FAST: tl.constexpr):
        """The new token's value in the merge's index, fp32 (loaded right after the PDL wait: its latency then
        overlaps the scores, not the merge)."""
        _, _, _, d, head, hm, new = _merge_index(ctx, GROUP, GP)
        return _load_in_place(V + q_row.to(tl.int64) * sv_n + kvh * sv_h + d + head * 0, new, FAST).to(tl.float32)

    @triton.jit
    def _merge(O, v_n, SA, SM, SL, q_row, kvh, ctx, so_n, so_h, GROUP: tl.constexpr, GP: tl.constexpr,
               W: tl.constexpr, FAST: tl.constexpr):
        """The output of each query head: the W warps' partials and the new key's (max = its score, sum 1, values its
        v) at one max. SA, SM, SL: shared-memory byte addresses (FAST) or SCR pointers. The tile is SA's own
        order (`_sa_index`: [W, 8 tiles, 8 rows, the columns of real heads]), so its loads are contiguous
        runs, all issued before any is used, and W stays in each thread's registers (sums without shuffles).
        (Read by head and dim instead, each warp's load spans up to 32 sectors.)"""
        w = tl.arange(0, W)[:, None, None, None]
        t, g, col, d, head, hm, new = _merge_index(ctx, GROUP, GP)
        ok = hm & (w < W)
        a_w = _scratch_load(SA, (t * 8 * W + 8 * w + g) * 16 + col, ok, FAST)
        m_w = _scratch_load(SM, head * (W + 1) + w + d * 0, ok, FAST)
        l_w = _scratch_load(SL, head * W + w + d * 0, ok, FAST)
        m_n = _scratch_load(SM, head * (W + 1) + W + d * 0, new, FAST)
        m_w = tl.where(ok, m_w, float("-inf"))
        m_n = tl.where(new, m_n, float("-inf"))
        top = tl.maximum(tl.max(m_w, 0, keep_dims=True), m_n)  # [1, 8, 8, NC], as every result below
        top = tl.where(top == float("-inf"), 0.0, top)
        scale = tl.math.exp2(m_w - top)
        p_n = tl.math.exp2(m_n - top)
        total = tl.sum(l_w * scale, 0, keep_dims=True) + p_n
        acc = tl.sum(a_w * scale, 0, keep_dims=True) + p_n * v_n
        out = acc / tl.where(total == 0.0, 1.0, total)
        _store_in_place(O + q_row.to(tl.int64) * so_n + (kvh * GROUP + head) * so_h + d, out.to(O.dtype.element_ty),
                        hm, FAST)

    @triton.jit
    def _portable_partials(Q, KC, VC, K, V, COS, SIN, BT, SA, SM, SL, b, kvh, q_row, lo, hi, ctx, slot,
                           sq_n, sq_h, sc_b, sc_t, sc_h, stride_bt, sk_n, sk_h, sv_n, sv_h, stride_cos, qk_scale,
                           BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GP: tl.constexpr, W: tl.constexpr,
                           REPS: tl.constexpr):
        """The FAST path's SCR contents with plain tensor ops (the interpreter): warp w's keys are the blocks
        j = w, w + W, ..., weights rounded to the activations' dtype before the weighted sum, as the MMAs take
        them; the new key rotated and written to the cache."""
        dt = Q.dtype.element_ty
        KS: tl.constexpr = 16 * REPS
        t = tl.arange(0, KS)[None, :]
        key = 16 * ((t // 16) * W + tl.arange(0, W)[:, None]) + t % 16  # [W, KS]
        ok = (key >= lo) & (key < hi)
        blk = tl.load(BT + b * stride_bt + key // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
        rows = (blk * sc_b + (key % BLOCK_SIZE) * sc_t + kvh * sc_h)[:, :, None]
        d = tl.arange(0, D128)[None, None, :]
        k = tl.load(KC + rows + d, mask=ok[:, :, None], other=0.0).to(tl.float32)  # [W, KS, D]
        v = tl.load(VC + rows + d, mask=ok[:, :, None], other=0.0).to(tl.float32)
        h = tl.arange(0, GP)[:, None]  # [GP, 1]
        dd = tl.arange(0, D128)[None, :]
        dm = dd < D128
        c, sn, swap, sign = _rope_factors(COS, SIN, q_row, stride_cos, dd, dm, D128)
        qm = (h < GROUP) & dm
        q = _rope(Q + q_row.to(tl.int64) * sq_n + (kvh * GROUP + h) * sq_h, dd, qm, c, sn, swap, sign).to(tl.float32)
        k_new = _rope(K + q_row.to(tl.int64) * sk_n + kvh * sk_h, dd, dm, c, sn, swap, sign)  # [1, D]
        s = tl.sum(q[:, None, None, :] * k[None, :, :, :], 3) * qk_scale  # [GP, W, KS]
        s = tl.where(ok[None, :, :], s, float("-inf"))
        m = tl.max(s, 2)  # [GP, W]
        p = tl.math.exp2(s - tl.where(m == float("-inf"), 0.0, m)[:, :, None])
        acc = tl.sum(p.to(dt).to(tl.float32)[:, :, :, None] * v[None, :, :, :], 2)  # [GP, W, D]
        hw = tl.arange(0, GP)[:, None, None]
        tl.store(SA + _sa_index(hw, tl.arange(0, D128)[None, None, :], tl.arange(0, W)[None, :, None], W), acc,
                 mask=hw < GROUP)
        hm = h < GROUP
        wi = tl.arange(0, W)[None, :]
        tl.store(SM + h * (W + 1) + wi, m, mask=hm)
        tl.store(SL + h * W + wi, tl.sum(p, 2), mask=hm)
        h1 = tl.arange(0, GP)  # (a scalar bool in a mask trips the interpreter's store: ctx > 0 as a tensor)
        s_new = tl.sum(q * k_new.to(tl.float32), 1) * qk_scale
        tl.store(SM + h1 * (W + 1) + W, s_new, mask=(h1 < GROUP) & (h1 * 0 + ctx > 0))
        if (slot >= 0) & (ctx > 0):
            dst = (slot // BLOCK_SIZE) * sc_b + (slot % BLOCK_SIZE) * sc_t + kvh * sc_h + dd
            tl.store(KC + dst, k_new)
            tl.store(VC + dst, tl.load(V + q_row.to(tl.int64) * sv_n + kvh * sv_h + dd))


def lean_mma_decode(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale, sliding_window, out, rope,
                    plan: DecodePlan):
    """`decode.decode_attention_triton` with rope through `_lean_mma_kernel` (grid: sequences x kv heads): every
    context at most plan.max_context <= 256 keys."""
    batch, n_heads, n_kv = cu_seqlens_q.shape[0] - 1, q.shape[1], k_cache.shape[2]
    k, v, cos, sin, slots = rope
    warps, reps = plan.num_warps, plan.reps
    group = n_heads // n_kv
    scratch = torch.empty(1 if q.is_cuda else batch * n_kv * (8 * HEAD_DIM * warps + 16 * warps + 8),
                          dtype=torch.float32, device=q.device)  # the portable path's (CUDA: shared memory)
    for t in (q, k, v, k_cache, cos):
        assert t.stride(-1) == 1 and all(s % 2 == 0 for s in t.stride()[:-1]), "16-bit rows in whole words"
    pdl = pdl_on(q)
    _lean_mma_kernel[(batch, n_kv)](
        q, k_cache, v_cache, out, scratch, cu_seqlens_q, context_lens, block_tables, k, v, cos, sin, slots,
        q.stride(0) // 2, q.stride(1) // 2, out.stride(0), out.stride(1), k_cache.stride(0) // 2,
        k_cache.stride(1) // 2, k_cache.stride(2) // 2, block_tables.stride(0), k.stride(0) // 2, k.stride(1) // 2,
        v.stride(0) // 2, v.stride(1) // 2, v.stride(0), v.stride(1), cos.stride(0), scale * LOG2E,
        sliding_window or 0, BLOCK_SIZE=k_cache.shape[1], GROUP=group, GP=next_power_of_2(group), W=warps, REPS=reps,
        SLIDING=sliding_window is not None, PDL=pdl, FAST=q.is_cuda, num_warps=warps, num_stages=1,
        launch_pdl=pdl > 0)
    return out
