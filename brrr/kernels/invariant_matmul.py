"""A matmul whose every output row is the same bits whatever else is in the batch: out[i] = x[i] @ w, each element
summed over K in one fixed order for any number of rows M.

A GEMM library picks its kernel from the shape. On CPU (torch 2.13, MKL/oneDNN) an fp32 GEMM of 1 to 3 rows runs
another kernel than one of 7 or more, so a prompt's row differs in its last bits between a decode step of one
sequence and a batch of eight; on CUDA cuBLAS picks tiles and split-K by M. Both forms here fix the shape the
library or kernel sees:
- `mm_invariant_ref` (CPU, the reference): rows in blocks of ROWS, the last block padded with zero rows, one GEMM
  call a block. Every call is [ROWS, K] x [K, N], so a row's sums are that one kernel's; tests check that its place
  inside a block does not change them either.
- `mm_invariant_triton` (CUDA): a persistent kernel, one tile shape for every M, the K loop in order in fp32, no
  split-K; each tile's sums are the same whichever program computes it.
The Triton form carries a backward (plain matmuls), so a trainer's forward runs the same kernel the engine does.
"""
from __future__ import annotations

import torch

from brrr.kernels.dispatch import num_sms, triton_on

ROWS = 16  # rows a GEMM call of the reference form takes: at most 15 padding rows a call


def mm_invariant_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w [K, N] in blocks of ROWS rows (zero-padded): the same GEMM shape for every M."""
    m, k = x.shape
    if m == 0:
        return x.new_zeros(0, w.shape[1])
    pad = -m % ROWS
    if pad:
        x = torch.cat([x, x.new_zeros(pad, k)])
    out = torch.cat([torch.mm(x[i:i + ROWS], w) for i in range(0, x.shape[0], ROWS)])
    return out[:m] if pad else out


try:
    import triton
    import triton.language as tl
except Exception:  # the dispatcher takes the reference when triton is missing
    triton = None

if triton is not None:
    @triton.jit
    def _mm_kernel(A, B, C, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PROGRAMS: tl.constexpr,
                   IEEE: tl.constexpr):
        """Persistent: program p computes tiles p, p + PROGRAMS, ... Each tile accumulates its K steps in order."""
        tiles_n = tl.cdiv(N, BLOCK_N)
        tiles = tl.cdiv(M, BLOCK_M) * tiles_n
        for tile in range(tl.program_id(0), tiles, PROGRAMS):
            rm = (tile // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
            rn = (tile % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
            rk = tl.arange(0, BLOCK_K)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + rk
                a = tl.load(A + rm[:, None].to(tl.int64) * stride_am + kk[None, :] * stride_ak,
                            mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
                b = tl.load(B + kk[:, None] * stride_bk + rn[None, :].to(tl.int64) * stride_bn,
                            mask=(kk[:, None] < K) & (rn[None, :] < N), other=0.0)
                if IEEE:  # fp32 inputs: full-precision products, not TF32
                    acc = tl.dot(a, b, acc, input_precision="ieee")
                else:
                    acc = tl.dot(a, b, acc)
            tl.store(C + rm[:, None].to(tl.int64) * stride_cm + rn[None, :] * stride_cn, acc.to(C.dtype.element_ty),
                     mask=(rm[:, None] < M) & (rn[None, :] < N))


def _tile(dtype: torch.dtype, n: int, sms: int, interpreted: bool) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): one tile for every M (that is the point), chosen from the dtype
    and the weight's N alone. Decode steps have one row-tile, so N / BLOCK_N is all the parallelism there is:
    narrow column tiles where the weight would not give every SM one."""
    if interpreted:
        return 16, 32, 16, 4, 1
    if dtype == torch.float32:
        return 32, 64 if n >= 64 * sms else 32, 32, 4, 2
    return 64, 128 if n >= 128 * sms else 64 if n >= 64 * sms else 32, 64, 4, 3


def mm_invariant_triton(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w [K, N] (any strides) through the fixed-tile persistent kernel."""
    m, k = x.shape
    n = w.shape[1]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    interpreted = not x.is_cuda
    # the program count is the device's SM count (a constant of the GPU): a tile's sums never depend on it anyway
    programs = 4 if interpreted else num_sms(x.device.index if x.device.index is not None else 0)
    bm, bn, bk, warps, stages = _tile(x.dtype, n, programs, interpreted)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    _mm_kernel[(min(tiles, programs),)](x, w, out, m, n, k, x.stride(0), x.stride(1), w.stride(0), w.stride(1),
                                        out.stride(0), out.stride(1), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                                        PROGRAMS=programs, IEEE=x.dtype == torch.float32, num_warps=warps,
                                        num_stages=stages)
    return out


class _TritonMM(torch.autograd.Function):
    """The kernel forward; the backward in plain matmuls (gradients need no batch invariance)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return mm_invariant_triton(x, w)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        gx = torch.mm(grad, w.t()) if ctx.needs_input_grad[0] else None
        gw = torch.mm(x.t(), grad) if ctx.needs_input_grad[1] else None
        return gx, gw


def mm_invariant(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ w [K, N] -> [..., N], each row's result independent of the other rows and of their count."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if triton_on(x2, w) and x2.dtype == w.dtype and x2.dtype in (torch.float16, torch.bfloat16, torch.float32):
        out = _TritonMM.apply(x2, w)
    else:
        out = mm_invariant_ref(x2, w)
    return out.view(*lead, w.shape[1])


def linear_invariant(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear's contract (weight [N, K]) through `mm_invariant`; the bias added after the product's rounding."""
    out = mm_invariant(x, weight.t())
    return out if bias is None else out + bias
