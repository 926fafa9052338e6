"""Wanda (Sun et al. 2023, "A Simple and Effective Pruning Approach for Large Language Models"): a weight's score is
|W_ij| * ||X_j||_2, its magnitude times the L2 norm of input feature j over the calibration tokens, compared within
each output row. Large-magnitude activation features (which LLMs have a few of) protect the weights that read
them; no weight update."""
from __future__ import annotations

import torch

from brrr.prune.mask import Pattern, keep_mask


class InputNorms:
    """Running sum over calibration tokens of x_j^2 per input feature (float64 on the CPU, float32 on a GPU, as
    brrr.quant.gptq.Hessian accumulates)."""

    def __init__(self, dim: int, device="cpu"):
        dtype = torch.float64 if torch.device(device).type == "cpu" else torch.float32
        self.sq = torch.zeros(dim, dtype=dtype, device=device)

    def add(self, x: torch.Tensor):
        x = x.reshape(-1, x.shape[-1]).to(self.sq)
        self.sq += (x * x).sum(0)

    def norms(self) -> torch.Tensor:
        return self.sq.sqrt()


def wanda_scores(w: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
    return w.abs().float() * norms.to(w.device).float().unsqueeze(0)


def wanda_prune(w: torch.Tensor, norms: torch.Tensor, pattern: Pattern) -> torch.Tensor:
    """w with its pruned weights zeroed (a new tensor, w's dtype); norms [in]: ||X_j||_2 (InputNorms.norms())."""
    return w * keep_mask(wanda_scores(w, norms), pattern).to(w.dtype)
