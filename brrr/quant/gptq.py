"""GPTQ (Frantar et al. 2022): quantize a weight column by column, pushing each column's rounding error onto the
columns not yet quantized through the inverse Hessian of the layer's inputs, H = (2/n) X^T X.

Follows the reference algorithm: dead inputs zeroed, 1% dampening, the upper Cholesky factor of H^-1, lazy blocks
of 128 columns (error applied inside the block per column, to the rest once per block), act-order (columns by
descending diag H) with static groups (each group's scale/zero computed on the unpermuted weight first)."""
from __future__ import annotations

import torch

from brrr.kernels.quant.gptq_block import gptq_block
from brrr.quant.formats import check_group, from_codes, int4_params


class Hessian:
    """Running (2/n) sum x x^T over calibration tokens, where the activations are: float64 on the CPU, float32 on a
    GPU (as the reference GPTQ accumulates; a GPU's float64 matmul is far slower)."""

    def __init__(self, dim: int, device="cpu"):
        dtype = torch.float64 if torch.device(device).type == "cpu" else torch.float32
        self.H, self.n = torch.zeros(dim, dim, dtype=dtype, device=device), 0

    def add(self, x: torch.Tensor):
        x = x.reshape(-1, x.shape[-1]).to(self.H)
        total = self.n + len(x)
        self.H *= self.n / total
        self.H += (2 / total) * x.T @ x
        self.n = total


def without_dead_inputs(w: torch.Tensor, H: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 copies of w and H (on w's device) with the inputs calibration never saw (zero diagonal) zeroed in w and
    given a unit diagonal in H, so H is invertible and their columns cost nothing."""
    W, H = w.float().clone(), H.to(w.device).float().clone()
    dead = H.diagonal() == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    return W, H


def upper_inverse_factor(H: torch.Tensor, damp: float = 0.01) -> torch.Tensor:
    """The upper Cholesky factor of (H + damp * mean(diag H) * I)^-1, in place on H: row i from the diagonal on is
    what the column sweeps of GPTQ and SparseGPT (brrr/prune/sparsegpt.py) spread column i's error with."""
    H.diagonal().add_(damp * H.diagonal().mean())
    return torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)


def gptq_quantize(w: torch.Tensor, H: torch.Tensor, group_size: int = 128, symmetric: bool = False,
                  act_order: bool = True, block: int = 128, damp: float = 0.01) -> dict:
    """On w's device (H is moved there): the column sweep runs `gptq_block` per block of columns, a Triton kernel
    on CUDA."""
    out, n = w.shape
    check_group(n, group_size)
    W, H = without_dead_inputs(w, H)
    static = act_order  # without act-order groups are computed lazily from the updated columns, as the reference
    groups = n // group_size
    scale, zero = int4_params(W.view(out, groups, group_size), symmetric)  # [out, groups]
    scale, zero = scale.contiguous(), zero.contiguous()
    perm = torch.argsort(H.diagonal(), descending=True) if act_order else torch.arange(n, device=W.device)
    W, H = W[:, perm], H[perm][:, perm]
    Hinv = upper_inverse_factor(H, damp)
    codes = torch.zeros_like(W)
    group_of = (perm // group_size).to(torch.int32)
    for i1 in range(0, n, block):
        i2 = min(i1 + block, n)
        q, err1 = gptq_block(W[:, i1:i2].contiguous(), Hinv[i1:i2, i1:i2], scale, zero, group_of[i1:i2],
                             group_size, not static, symmetric)
        codes[:, i1:i2] = q
        W[:, i2:] -= err1 @ Hinv[i1:i2, i2:]
    return from_codes(codes[:, torch.argsort(perm)], scale, zero)
