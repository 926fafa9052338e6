"""The fused MoE layer with weight-only quantized experts: `fused_moe.py`'s two grouped GEMMs, the expert weights
read as int8 or int4 codes and dequantized in registers (brrr's W8A16 / W4A16 conventions, brrr/kernels/quant/).

Stacked layouts (`QuantExperts`), one expert per leading index, the same codes and scales QuantLinear holds:
  int8  qweight int8 [E, N, K], scales fp32 [E, N]: w[e, n, k] = q * scales[e, n]. The scale is per output
        channel, so the kernels multiply the fp32 accumulator by it in the epilogue (as `_w8a16_kernel` does).
  int4  qweight uint8 [E, N, K/2] in the int4 kernel layout (within each group of g input columns, byte j holds
        column j low and column j + g/2 high: `pack_int4_kernel`), scales [E, K/g, N] (bf16 for bf16 models),
        zeros uint8 [E, K/g, N] or None (symmetric, zero 8): w = (q - z) * s, rounded once to the activations'
        dtype in registers (`group_weights`), so the values are the reference's exactly.
gate/up is one stack (N = 2I: each expert's gate rows, then its up rows), down another (N = H, K = I).
The reference (`fused_moe_quant_ref`) dequantizes the stacks to the activations' dtype and runs the per-expert
loop; `fused_moe_quant` dispatches (the kernel on CUDA).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from brrr.kernels.dispatch import use_triton
from brrr.kernels.fused_moe import align_by_expert, fused_moe_plan, sum_in_expert_order
from brrr.kernels.moe_experts import moe_experts_ref
from brrr.kernels.quant.launch import INTERPRETED, fast_dequant


class QuantExperts(NamedTuple):
    """One stack of quantized expert weights (module docstring's layouts); group_size 0 for int8."""
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    group_size: int

    @property
    def fmt(self) -> str:
        return "int4" if self.group_size else "int8"

    @property
    def out_features(self) -> int:
        return self.qweight.shape[1]

    @property
    def in_features(self) -> int:
        return self.qweight.shape[2] * (2 if self.group_size else 1)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[E, N, K] in dtype: the fp32 values (q - z) * s, rounded once."""
        if self.fmt == "int8":
            return (self.qweight.float() * self.scales.float()[..., None]).to(dtype)
        e, n, half = self.qweight.shape
        g = self.group_size
        p = self.qweight.view(e, n, 2 * half // g, g // 2)
        codes = torch.cat([p & 0xF, p >> 4], dim=3).float()  # [E, N, K/g, g]
        z = 8.0 if self.zeros is None else self.zeros.transpose(1, 2).float()[..., None]
        w = (codes - z) * self.scales.transpose(1, 2).float()[..., None]
        return w.reshape(e, n, 2 * half).to(dtype)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.zeros) if t is not None)


def fused_moe_quant_ref(x, weights, ids, gate_up: QuantExperts, down: QuantExperts) -> torch.Tensor:
    """The plain-torch form: dequantized weights (in x's dtype) through the per-expert loop, `moe_experts_ref`."""
    w13, w2 = gate_up.dequantize(x.dtype), down.dequantize(x.dtype)
    inter = w13.shape[1] // 2
    return moe_experts_ref(x, weights, ids, [(w[:inter], w[inter:], d) for w, d in zip(w13, w2)])


def fused_moe_quant(x, weights, ids, gate_up: QuantExperts, down: QuantExperts) -> torch.Tensor:
    """The routed experts with quantized stacks: the Triton kernel on CUDA, else the reference."""
    if triton is not None and use_triton(x, gate_up.qweight, down.qweight) and x.dim() == 2 and x.shape[0] > 0:
        return fused_moe_quant_triton(x, weights, ids, gate_up, down)
    return fused_moe_quant_ref(x, weights, ids, gate_up, down)


try:
    import triton
    import triton.language as tl
except Exception:
    triton = None

if triton is not None:
    from brrr.kernels.quant.dequant import group_weights, int8_to
    from brrr.kernels.quant.epilogue import dot_bt

    @triton.jit
    def _int8_tile(W, S, e, rows, kk, k_ok, n_ok, K, N, stride_we, stride_se, DT: tl.constexpr,
                   FAST: tl.constexpr):
        """Rows `rows` x columns kk of expert e's int8 codes as DT (exact), and nothing else: the scale waits for
        the epilogue."""
        q = tl.load(W + e * stride_we + rows[:, None].to(tl.int64) * K + kk[None, :],
                    mask=n_ok[:, None] & k_ok[None, :], other=0)
        return int8_to(q, DT, FAST)

    @triton.jit
    def _int4_group(W, S, Z, e, rows, n_ok, g, K, N, stride_se, HALF: tl.constexpr, BLOCK_N: tl.constexpr,
                    HAS_ZEROS: tl.constexpr, DT: tl.constexpr, FAST: tl.constexpr):
        """Group g of rows `rows` of expert e: the weights of its low and high halves [BLOCK_N, HALF] in DT."""
        h = tl.arange(0, HALF)
        p = tl.load(W + e * N * (K // 2) + rows[:, None].to(tl.int64) * (K // 2) + g * HALF + h[None, :],
                    mask=n_ok[:, None], other=0)
        return group_weights(p, Z + e * stride_se, S + e * stride_se, g, N, rows, n_ok, BLOCK_N, HAS_ZEROS, DT,
                             FAST)

    @triton.jit
    def _gate_up_q_kernel(X, W, S, Z, OUT, PAIRS, BLOCK_EXPERT, n_pairs, top_k, hidden, inter, stride_x,
                          stride_we, stride_se, stride_o, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr,
                          FAST: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr):
        """GROUP 0: int8 codes, BLOCK_K columns a step; else int4, one group (two halves) a step."""
        block, col = tl.program_id(0), tl.program_id(1)
        e = tl.load(BLOCK_EXPERT + block).to(tl.int64)
        if e >= 0:
            dt = OUT.dtype.element_ty
            pair = tl.load(PAIRS + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
            valid = pair < n_pairs
            token = pair // top_k
            n = col * BLOCK_N + tl.arange(0, BLOCK_N)
            n_ok = n < inter
            acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            x_rows = X + token[:, None] * stride_x
            if GROUP == 0:
                for k0 in range(0, hidden, BLOCK_K):
                    kk = k0 + tl.arange(0, BLOCK_K)
                    k_ok = kk < hidden
                    a = tl.load(x_rows + kk[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
                    wg = _int8_tile(W, S, e, n, kk, k_ok, n_ok, hidden, 2 * inter, stride_we, stride_se, dt, FAST)
                    wu = _int8_tile(W, S, e, n + inter, kk, k_ok, n_ok, hidden, 2 * inter, stride_we, stride_se,
                                    dt, FAST)
                    acc_g = dot_bt(a, wg, acc_g, IEEE)
                    acc_u = dot_bt(a, wu, acc_u, IEEE)
                acc_g = acc_g * tl.load(S + e * stride_se + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
                acc_u = acc_u * tl.load(S + e * stride_se + n + inter, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            else:
                HALF: tl.constexpr = GROUP // 2
                h = tl.arange(0, HALF)
                for g in range(0, hidden // GROUP):
                    a_lo = tl.load(x_rows + g * GROUP + h[None, :], mask=valid[:, None], other=0.0)
                    a_hi = tl.load(x_rows + g * GROUP + HALF + h[None, :], mask=valid[:, None], other=0.0)
                    g_lo, g_hi = _int4_group(W, S, Z, e, n, n_ok, g, hidden, 2 * inter, stride_se, HALF, BLOCK_N,
                                             HAS_ZEROS, dt, FAST)
                    u_lo, u_hi = _int4_group(W, S, Z, e, n + inter, n_ok, g, hidden, 2 * inter, stride_se, HALF,
                                             BLOCK_N, HAS_ZEROS, dt, FAST)
                    acc_g = dot_bt(a_hi, g_hi, dot_bt(a_lo, g_lo, acc_g, IEEE), IEEE)
                    acc_u = dot_bt(a_hi, u_hi, dot_bt(a_lo, u_lo, acc_u, IEEE), IEEE)
            # rounded where the reference rounds: the GEMM outputs, silu's output, the product
            gv = acc_g.to(dt).to(tl.float32)
            uv = acc_u.to(dt).to(tl.float32)
            s = (gv * tl.sigmoid(gv)).to(dt).to(tl.float32)
            tl.store(OUT + pair[:, None] * stride_o + n[None, :], (s * uv).to(dt), mask=valid[:, None] & n_ok[None, :])

    @triton.jit
    def _down_q_kernel(A, W, S, Z, WEIGHTS, OUT, PAIRS, BLOCK_EXPERT, n_pairs, hidden, inter, stride_a, stride_we,
                       stride_se, stride_o, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, FAST: tl.constexpr,
                       IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        block, col = tl.program_id(0), tl.program_id(1)
        e = tl.load(BLOCK_EXPERT + block).to(tl.int64)
        if e >= 0:
            dt = OUT.dtype.element_ty
            pair = tl.load(PAIRS + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
            valid = pair < n_pairs
            n = col * BLOCK_N + tl.arange(0, BLOCK_N)
            n_ok = n < hidden
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            a_rows = A + pair[:, None] * stride_a
            if GROUP == 0:
                for k0 in range(0, inter, BLOCK_K):
                    kk = k0 + tl.arange(0, BLOCK_K)
                    k_ok = kk < inter
                    a = tl.load(a_rows + kk[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
                    w = _int8_tile(W, S, e, n, kk, k_ok, n_ok, inter, hidden, stride_we, stride_se, dt, FAST)
                    acc = dot_bt(a, w, acc, IEEE)
                acc = acc * tl.load(S + e * stride_se + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            else:
                HALF: tl.constexpr = GROUP // 2
                h = tl.arange(0, HALF)
                for g in range(0, inter // GROUP):
                    a_lo = tl.load(a_rows + g * GROUP + h[None, :], mask=valid[:, None], other=0.0)
                    a_hi = tl.load(a_rows + g * GROUP + HALF + h[None, :], mask=valid[:, None], other=0.0)
                    w_lo, w_hi = _int4_group(W, S, Z, e, n, n_ok, g, inter, hidden, stride_se, HALF, BLOCK_N,
                                             HAS_ZEROS, dt, FAST)
                    acc = dot_bt(a_hi, w_hi, dot_bt(a_lo, w_lo, acc, IEEE), IEEE)
            r = tl.load(WEIGHTS + pair, mask=valid, other=0.0).to(tl.float32)
            y = acc.to(dt).to(tl.float32) * r[:, None]
            tl.store(OUT + pair[:, None] * stride_o + n[None, :], y.to(dt), mask=valid[:, None] & n_ok[None, :])


def _stack_args(w: QuantExperts):
    """(W, S, Z, expert stride of W, expert stride of S and Z, GROUP, HAS_ZEROS) for a launch."""
    zeros = w.scales if w.zeros is None else w.zeros  # a placeholder pointer when symmetric (never read)
    return w.qweight, w.scales, zeros, w.qweight.stride(0), w.scales.stride(0), w.group_size, w.zeros is not None


def fused_moe_quant_triton(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: QuantExperts,
                           down: QuantExperts, plan: dict | None = None) -> torch.Tensor:
    """x [T, H] (16-bit or fp32); weights [T, k], ids [T, k]; gate_up [E, 2I, H], down [E, H, I] as `QuantExperts`
    (contiguous) -> [T, H], as `fused_moe_quant_ref` up to the GEMMs' summation order."""
    tokens, hidden = x.shape
    num_experts, inter = gate_up.qweight.shape[0], down.in_features
    top_k = ids.shape[1]
    plan = plan or fused_moe_plan(tokens, top_k, num_experts, hidden, inter)
    bm, bn, bk = plan["BLOCK_M"], plan["BLOCK_N"], plan["BLOCK_K"]
    pairs, block_expert = align_by_expert(ids, num_experts, bm)
    n_pairs = tokens * top_k
    fast = fast_dequant(x.dtype)
    ieee = x.dtype == torch.float32 or INTERPRETED  # the interpreter's tl.dot multiplies bf16 bit patterns
    consts = dict(FAST=fast, IEEE=ieee, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=plan["num_warps"])
    act = torch.empty(n_pairs, inter, dtype=x.dtype, device=x.device)
    w, s, z, swe, sse, group, has_z = _stack_args(gate_up)
    _gate_up_q_kernel[(block_expert.shape[0], triton.cdiv(inter, bn))](
        x, w, s, z, act, pairs, block_expert, n_pairs, top_k, hidden, inter, x.stride(0), swe, sse, act.stride(0),
        GROUP=group, HAS_ZEROS=has_z, **consts)
    per_pair = torch.empty(n_pairs, hidden, dtype=x.dtype, device=x.device)
    w, s, z, swe, sse, group, has_z = _stack_args(down)
    _down_q_kernel[(block_expert.shape[0], triton.cdiv(hidden, bn))](
        act, w, s, z, weights.float().contiguous(), per_pair, pairs, block_expert, n_pairs, hidden, inter,
        act.stride(0), swe, sse, per_pair.stride(0), GROUP=group, HAS_ZEROS=has_z, **consts)
    return sum_in_expert_order(per_pair, ids, x)
