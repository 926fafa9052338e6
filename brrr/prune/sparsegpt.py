"""SparseGPT (Frantar & Alistarh 2023): prune a layer column by column, and after each column push the error of the
weights just zeroed onto the columns not yet visited, the Optimal Brain Surgeon update under the layer's Hessian
H = (2/n) X^T X (brrr.quant.gptq.Hessian, the one GPTQ accumulates).

For weight w_q of a row, OBS's cost of zeroing it is w_q^2 / [H^-1]_qq, and the best correction of the remaining
weights is -w_q / [H^-1]_qq * H^-1_{:,q}. Visiting columns left to right and taking the rows of the upper Cholesky
factor of H^-1 (brrr.quant.gptq.upper_inverse_factor, as GPTQ does) applies that update for every row at once,
with the inverse of the shrinking set of unvisited columns read off one factorisation. The mask is chosen as the
sweep reaches it, from the updated weights: per block of 128 columns for unstructured sparsity (each row prunes its
share of the block, so every row ends at exactly the requested sparsity), per group of M columns for N:M."""
from __future__ import annotations

import torch

from brrr.prune.mask import Pattern, keep_mask
from brrr.quant.gptq import upper_inverse_factor, without_dead_inputs

BLOCK = 128  # columns whose updates are applied inside the block one by one, to the rest once per block


def sparsegpt_prune(w: torch.Tensor, H: torch.Tensor, pattern: Pattern, damp: float = 0.01) -> torch.Tensor:
    """w pruned and updated (a new tensor, w's dtype), on w's device; H [in, in] from the layer's inputs."""
    out, n = w.shape
    W, H = without_dead_inputs(w, H)
    Hinv = upper_inverse_factor(H, damp)
    block = BLOCK // pattern.m * pattern.m if pattern.structured else BLOCK
    for i1 in range(0, n, block):
        i2 = min(i1 + block, n)
        W1, Hinv1 = W[:, i1:i2].clone(), Hinv[i1:i2, i1:i2]
        d = Hinv1.diagonal()
        err = torch.zeros_like(W1)
        if pattern.structured:
            keep = torch.zeros_like(W1, dtype=torch.bool)
        else:  # each row's share of the block: round(s * i2) - round(s * i1) zeros
            pruned = round(pattern.sparsity * i2) - round(pattern.sparsity * i1)
            keep = _keep_count(W1 ** 2 / d ** 2, i2 - i1 - pruned)
        for i in range(i2 - i1):
            if pattern.structured and i % pattern.m == 0:
                group = slice(i, i + pattern.m)
                keep[:, group] = keep_mask(W1[:, group] ** 2 / d[group] ** 2, pattern)
            col = W1[:, i]
            q = col * keep[:, i]
            e = (col - q) / d[i]
            W1[:, i:] -= e.unsqueeze(1) * Hinv1[i, i:].unsqueeze(0)
            W1[:, i] = q  # exactly zero where pruned (the update above leaves rounding there)
            err[:, i] = e
        W[:, i1:i2] = W1
        W[:, i2:] -= err @ Hinv[i1:i2, i2:]
    return W.to(w.dtype)


def _keep_count(score: torch.Tensor, kept: int) -> torch.Tensor:
    """[out, cols] bool: the `kept` highest scores of each row."""
    keep = torch.zeros_like(score, dtype=torch.bool)
    if kept:
        keep.scatter_(1, score.topk(kept, dim=1).indices, True)
    return keep
