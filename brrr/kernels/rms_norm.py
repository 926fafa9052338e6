"""RMSNorm, and the residual add fused into it.

`rms_norm_ref` is the oracle. The Triton kernel keeps its rounding steps: normalise in fp32, cast back to the
input dtype, then multiply by the weight (a product rounded once to the promoted dtype, as torch's `weight * x`
is). The residual add is rounded to the input dtype before the norm reads it, as `h = h + attn_out` is in the
unfused model, so the fused layer gives the reference's numbers up to the fp32 sum's order.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from brrr.kernels.dispatch import batch_invariant_on, next_power_of_2, triton_on, use_triton
from brrr.kernels.pdl import pdl_on

MAX_TRITON_HIDDEN = 65536  # one row is held in registers; wider rows take the reference


class PendingNorm(NamedTuple):
    """rms_norm(h, weight, eps) left for the GEMV that reads it (the NORM epilogue, kernels/quant/mma_gemv.py):
    xw = weight * h rounded to h's dtype and sq, h's row sums of squares in partials [rows, parts], both written by the GEMV that
    wrote h (its RESIDUAL epilogue). The reader multiplies its row sums by 1 / rms(h): one multiply an output where
    the norm was a kernel of its own. It rounds w * h once where rms_norm rounds h / rms, then the product."""
    xw: torch.Tensor
    sq: torch.Tensor
    eps: float

    def rstd(self) -> torch.Tensor:
        """1 / rms(h) per row, [rows, 1], fp32."""
        return torch.rsqrt(self.sq.sum(-1, keepdim=True) / self.xw.shape[-1] + self.eps)

    def apply(self) -> torch.Tensor:
        """The normalized rows, for a GEMM that cannot take the norm."""
        return (self.xw.float() * self.rstd()).to(self.xw.dtype)

    @staticmethod
    def of(h: torch.Tensor, weight: torch.Tensor, eps: float) -> "PendingNorm":
        """What a GEMV's RESIDUAL epilogue writes, in torch (h [rows, hidden]: the new stream)."""
        return PendingNorm((weight * h).to(h.dtype), h.float().pow(2).sum(-1, keepdim=True), eps)

    @staticmethod
    def rows(x) -> torch.Tensor:
        """The rows a GEMM reads for x: x itself, or a PendingNorm's w * h."""
        return x.xw if isinstance(x, PendingNorm) else x


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in fp32, cast back, then scale: the order transformers uses, so bf16 results match bit for bit.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(rms_norm(x + residual), x + residual): the pre-norm transformer's residual step."""
    new_residual = x + residual
    return rms_norm_ref(new_residual, weight, eps), new_residual


try:
    import triton
    import triton.language as tl
except Exception:  # the dispatcher takes the reference when triton is missing
    triton = None

if triton is not None:
    from brrr.kernels.pdl import wait_previous

    @triton.jit
    def _rms_norm_kernel(X, R, W, Y, RES_OUT, IDS, n_rows, n_cols, n_inner, stride_xo, stride_x, stride_r, stride_y,
                         stride_ro, eps, HAS_RESIDUAL: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
                         PDL: tl.constexpr, EARLY: tl.constexpr, GATHER: tl.constexpr = False):
        """Row r of X sits at (r // n_inner) * stride_xo + (r % n_inner) * stride_x: a [N, heads, D] view (q or k
        cut from the packed q/k/v output) is read in place, without a copy to make it 2-D. EARLY: the weight (a
        constant, by decode time out of L2) is read before the PDL wait, so the rows' L2 round trip is all that
        follows it. GATHER: row r is X's row IDS[r] (an embedding table), copied to RES_OUT as the stream."""
        cols = tl.arange(0, BLOCK_H)
        if EARLY:
            w = tl.load(W + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        wait_previous(PDL)
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
        rows = rows.to(tl.int64)
        if GATHER:
            x_rows = tl.load(IDS + rows, mask=rows < n_rows, other=0).to(tl.int64) * stride_xo
        else:
            x_rows = (rows // n_inner) * stride_xo + (rows % n_inner) * stride_x
        x = tl.load(X + x_rows[:, None] + cols[None, :], mask=mask, other=0.0)
        if GATHER:
            tl.store(RES_OUT + rows[:, None] * stride_ro + cols[None, :], x, mask=mask)
        if HAS_RESIDUAL:
            r = tl.load(R + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)  # rounded, as `x + residual` is
            tl.store(RES_OUT + rows[:, None] * stride_ro + cols[None, :], x, mask=mask)
        x32 = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x32 * x32, axis=1) / n_cols + eps)
        normed = (x32 * rstd[:, None]).to(X.dtype.element_ty).to(tl.float32)
        if not EARLY:
            w = tl.load(W + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        tl.store(Y + rows[:, None] * stride_y + cols[None, :], (w[None, :] * normed).to(Y.dtype.element_ty),
                 mask=mask)


def _launch_shape(x, hidden: int):
    """(rows a program, its padded width, warps, PDL mode, weight read before the wait: under PDL)."""
    block_h = next_power_of_2(hidden)
    block_r = max(1, 2048 // block_h)  # narrow rows (per-head q/k norm): several per program
    pdl = pdl_on(x)
    warps = min(16, max(1, block_r * block_h // 512))
    return block_r, block_h, warps, pdl, pdl > 0


def _launch(x, residual, weight, eps):
    hidden = x.shape[-1]
    if residual is None and x.dim() == 3 and x.stride(1) >= hidden:  # [N, heads, D], rows of heads maybe apart
        x2, n_inner, stride_xo, stride_x = x, x.shape[1], x.stride(0), x.stride(1)
        rows = x.shape[0] * x.shape[1]
    else:
        x2 = x.reshape(-1, hidden)
        n_inner, stride_xo, stride_x, rows = 1, x2.stride(0), 0, x2.shape[0]
    out = torch.empty((rows, hidden), dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    block_r, block_h, warps, pdl, early = _launch_shape(x, hidden)
    # enable_fp_fusion=False: no FMA contraction, so each step rounds where the reference's torch ops round
    grid = (triton.cdiv(rows, block_r),)
    if residual is None:
        _rms_norm_kernel[grid](x2, x2, weight, out, x2, x2, rows, hidden, n_inner, stride_xo, stride_x, 0,
                               out.stride(0), 0, eps, HAS_RESIDUAL=False, BLOCK_R=block_r, BLOCK_H=block_h,
                               num_warps=warps, enable_fp_fusion=False, PDL=pdl, EARLY=early, launch_pdl=pdl > 0)
        return out.view(*x.shape[:-1], hidden), None
    r2 = residual.reshape(-1, hidden)
    new_residual = torch.empty_like(x2)
    _rms_norm_kernel[grid](x2, r2, weight, out, new_residual, x2, rows, hidden, 1, x2.stride(0), 0, r2.stride(0),
                           out.stride(0), new_residual.stride(0), eps,
                           HAS_RESIDUAL=True, BLOCK_R=block_r, BLOCK_H=block_h, num_warps=warps,
                           enable_fp_fusion=False, PDL=pdl, EARLY=early, launch_pdl=pdl > 0)
    return out.view(*x.shape[:-1], hidden), new_residual.view(x.shape)


def embed_rms_norm_triton(ids: torch.Tensor, table: torch.Tensor, weight: torch.Tensor, eps: float):
    rows, hidden = ids.numel(), table.shape[1]
    out = torch.empty((rows, hidden), dtype=torch.promote_types(table.dtype, weight.dtype), device=table.device)
    h = torch.empty((rows, hidden), dtype=table.dtype, device=table.device)
    block_r, block_h, warps, pdl, early = _launch_shape(table, hidden)
    _rms_norm_kernel[(triton.cdiv(rows, block_r),)](
        table, table, weight, out, h, ids, rows, hidden, 1, table.stride(0), 0, 0, out.stride(0), h.stride(0), eps,
        HAS_RESIDUAL=False, GATHER=True, BLOCK_R=block_r, BLOCK_H=block_h, num_warps=warps, enable_fp_fusion=False,
        PDL=pdl, EARLY=early, launch_pdl=pdl > 0)
    return out, h


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., hidden] with a unit-stride last dim; weight [hidden]."""
    return _launch(x, None, weight, eps)[0]


def add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    return _launch(x, residual, weight, eps)


def _triton_ok(x, weight, *more) -> bool:
    return (x.shape[-1] <= MAX_TRITON_HIDDEN and x.stride(-1) == 1 and weight.is_contiguous() and x.numel() > 0
            and all(t.shape == x.shape and t.dtype == x.dtype and t.stride(-1) == 1 for t in more)
            and use_triton(x, weight, *more))


def rms_norm_invariant_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm_ref with each row's sum of squares in one order whatever the batch: torch's CPU reductions split the
    reduction of a lone output across threads once it has 32k+ elements (a two-pass sum) and never split one of two
    or more outputs, so a single row is reduced beside a zero row."""
    if x.numel() != x.shape[-1]:
        return rms_norm_ref(x, weight, eps)
    pair = torch.cat([x.reshape(1, -1), torch.zeros_like(x.reshape(1, -1))])
    return rms_norm_ref(pair, weight, eps)[:1].view(*x.shape[:-1], x.shape[-1])


class _TritonRMSNorm(torch.autograd.Function):
    """The Triton kernel (a row a program, its sum in registers in one order, its launch set by the hidden size
    alone: batch-invariant as it is) as the forward, the reference's autograd as the backward: a trainer's forward
    under the mode runs the kernel the engine runs."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return rms_norm_triton(x, weight, eps)

    @staticmethod
    def backward(ctx, grad):
        x, weight = (t.detach().requires_grad_() for t in ctx.saved_tensors)
        with torch.enable_grad():
            out = rms_norm_ref(x, weight, ctx.eps)
        gx, gw = torch.autograd.grad(out, (x, weight), grad)
        return gx, gw, None


def rms_norm_invariant(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm in the batch-invariant mode: the Triton kernel (with a backward) on CUDA, else the reference form."""
    if (x.shape[-1] <= MAX_TRITON_HIDDEN and x.stride(-1) == 1 and weight.is_contiguous() and x.numel() > 0
            and triton_on(x, weight)):
        return _TritonRMSNorm.apply(x, weight, eps)
    return rms_norm_invariant_ref(x, weight, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if batch_invariant_on():
        return rms_norm_invariant(x, weight, eps)
    if _triton_ok(x, weight):
        return rms_norm_triton(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def embed_rms_norm(ids: torch.Tensor, table: torch.Tensor, weight: torch.Tensor, eps: float):
    """(rms_norm(table[ids]), table[ids]): the first layer's normed input and the stream, the gather inside the norm
    kernel (one launch where nn.Embedding and the norm took two)."""
    ids = ids.reshape(-1)
    if _triton_ok(table, weight) and use_triton(ids):
        return embed_rms_norm_triton(ids, table, weight, eps)
    h = F.embedding(ids, table)
    return rms_norm(h, weight, eps), h


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """-> (rms_norm(x + residual), x + residual); new tensors, the inputs are left as they were."""
    if batch_invariant_on():
        new_residual = x + residual
        return rms_norm_invariant(new_residual, weight, eps), new_residual
    if _triton_ok(x, weight, residual):
        return add_rms_norm_triton(x, residual, weight, eps)
    return add_rms_norm_ref(x, residual, weight, eps)
