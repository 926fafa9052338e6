"""SwiGLU's elementwise half: silu(gate) * up, one pass over both inputs.

gate and up are two [N, I] tensors: HF's separate gate_proj and up_proj outputs, or the two halves of the packed
gate_up GEMM's [N, 2I] output (rows strided, read in place). It rounds where torch's two ops do (silu's output,
then the product), so bf16 results equal the reference's up to the exp's last bit.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from brrr.kernels.dispatch import batch_invariant_on, next_power_of_2, use_triton
from brrr.kernels.pdl import pdl_on


def silu_and_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def silu_and_mul_invariant(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in ops whose every element is the same bits wherever it sits in the tensor. torch's CPU
    silu (and sigmoid) computes the elements of a vectorized block and those of the scalar tail (the end of the
    tensor, or of a thread's share of it) differently, so an fp32 row's values moved with the batch's size; exp and
    a division do not."""
    g = gate.float()
    return (g / (1.0 + torch.exp(-g))).to(gate.dtype) * up


try:
    import triton
    import triton.language as tl
except Exception:
    triton = None

if triton is not None:
    from brrr.kernels.pdl import wait_previous

    @triton.jit
    def _silu_and_mul_kernel(G, U, O, stride_g, stride_u, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
        wait_previous(PDL)
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(G + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(U + row * stride_u + offs, mask=mask, other=0.0).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(G.dtype.element_ty).to(tl.float32)
        tl.store(O + row * n + offs, (s * u).to(O.dtype.element_ty), mask=mask)


def silu_and_mul_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [..., I] with unit-stride rows (any row stride)."""
    n = gate.shape[-1]
    g2, u2 = gate.reshape(-1, n), up.reshape(-1, n)
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    block = min(2048, next_power_of_2(n))
    pdl = pdl_on(gate)
    # no FMA contraction: the kernel must round where torch's two ops round
    _silu_and_mul_kernel[(g2.shape[0], triton.cdiv(n, block))](g2, u2, out, g2.stride(0), u2.stride(0), n,
                                                              BLOCK=block, num_warps=8 if block >= 1024 else 4,
                                                              enable_fp_fusion=False, PDL=pdl, launch_pdl=pdl > 0)
    return out


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if batch_invariant_on():
        return silu_and_mul_invariant(gate, up)
    if (gate.shape == up.shape and gate.dtype == up.dtype and gate.numel() > 0 and gate.stride(-1) == up.stride(-1) == 1
            and use_triton(gate, up)):
        return silu_and_mul_triton(gate, up)
    return silu_and_mul_ref(gate, up)
