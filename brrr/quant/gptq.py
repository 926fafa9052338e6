"""GPTQ (Frantar et al. 2022): quantize a weight column by column, pushing each column's rounding error onto the
columns not yet quantized through the inverse Hessian of the layer's inputs, H = (2/n) X^T X.

Follows the reference algorithm: dead inputs zeroed, 1% dampening, the upper Cholesky factor of H^-1, lazy blocks
of 128 columns (error applied inside the block per column, to the rest once per block), act-order (columns by
descending diag H) with static groups (each group's scale/zero computed on the unpermuted weight first)."""
from __future__ import annotations

import torch

from brrr.quant.formats import check_group, from_codes, int4_params, int4_round


class Hessian:
    """Running (2/n) sum x x^T over calibration tokens."""

    def __init__(self, dim: int):
        self.H, self.n = torch.zeros(dim, dim, dtype=torch.float64), 0

    def add(self, x: torch.Tensor):
        x = x.reshape(-1, x.shape[-1]).double()
        total = self.n + len(x)
        self.H *= self.n / total
        self.H += (2 / total) * x.T @ x
        self.n = total


def gptq_quantize(w: torch.Tensor, H: torch.Tensor, group_size: int = 128, symmetric: bool = False,
                  act_order: bool = True, block: int = 128, damp: float = 0.01) -> dict:
    out, n = w.shape
    check_group(n, group_size)
    W, H = w.float().clone(), H.float().clone()
    dead = H.diagonal() == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    static = act_order  # without act-order groups are computed lazily from the updated columns, as the reference
    groups = n // group_size
    scale, zero = int4_params(W.view(out, groups, group_size), symmetric)  # [out, groups]
    perm = torch.argsort(H.diagonal(), descending=True) if act_order else torch.arange(n)
    W, H = W[:, perm], H[perm][:, perm]
    H.diagonal().add_(damp * H.diagonal().mean())
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    codes = torch.zeros_like(W)
    group_of = perm // group_size
    for i1 in range(0, n, block):
        i2 = min(i1 + block, n)
        W1, Hinv1, Err1 = W[:, i1:i2].clone(), Hinv[i1:i2, i1:i2], torch.zeros(out, i2 - i1)
        for i in range(i2 - i1):
            col = i1 + i
            g = int(group_of[col])
            if not static and col % group_size == 0:
                scale[:, g], zero[:, g] = int4_params(W1[:, i:i + group_size], symmetric)
            q = int4_round(W1[:, i], scale[:, g], zero[:, g])
            codes[:, col] = q
            err = (W1[:, i] - (q - zero[:, g]) * scale[:, g]) / Hinv1[i, i]
            W1[:, i:] -= err[:, None] * Hinv1[i, i:][None, :]
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    return from_codes(codes[:, torch.argsort(perm)], scale, zero)
