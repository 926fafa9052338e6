"""Magnitude pruning: the smallest |w| of each row go (the baseline Wanda and SparseGPT are measured against; no
calibration data)."""
from __future__ import annotations

import torch

from brrr.prune.mask import Pattern, keep_mask


def magnitude_prune(w: torch.Tensor, pattern: Pattern) -> torch.Tensor:
    """w with its pruned weights zeroed (a new tensor, w's dtype)."""
    return w * keep_mask(w.abs().float(), pattern).to(w.dtype)
