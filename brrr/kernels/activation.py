"""SwiGLU's elementwise half: silu(gate) * up, one pass over both inputs.

gate and up stay two tensors (the model runs HF's separate gate_proj and up_proj GEMMs, docs/models.md says
why), so the kernel reads two inputs instead of one packed [N, 2I] one. It rounds where torch's two ops do
(silu's output, then the product), so bf16 results equal the reference's up to the exp's last bit.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from brrr.kernels.dispatch import use_triton


def silu_and_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


try:
    import triton
    import triton.language as tl
except Exception:
    triton = None

if triton is not None:

    @triton.jit
    def _silu_and_mul_kernel(G, U, O, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(G.dtype.element_ty).to(tl.float32)
        tl.store(O + offs, (s * u).to(O.dtype.element_ty), mask=mask)


def silu_and_mul_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    n = gate.numel()
    block = 2048
    # no FMA contraction: the kernel must round where torch's two ops round
    _silu_and_mul_kernel[(triton.cdiv(n, block),)](gate, up, out, n, BLOCK=block, num_warps=8,
                                                   enable_fp_fusion=False)
    return out


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if gate.shape == up.shape and gate.dtype == up.dtype and gate.numel() > 0 and use_triton(gate, up):
        return silu_and_mul_triton(gate, up)
    return silu_and_mul_ref(gate, up)
