"""Many LoRA adapters in one batch: y += scaling * (x @ A[slot].T) @ B[slot].T per row, shrink then expand, rows
grouped by adapter slot (Punica's SGMV; vLLM's LoRA kernels). rows.py groups the rows, shrink.py and expand.py are
the two ops, each with its plain-torch reference."""
from __future__ import annotations

import torch

from brrr.kernels.lora.expand import lora_expand, lora_expand_ref
from brrr.kernels.lora.rows import LoraRows, lora_rows
from brrr.kernels.lora.shrink import lora_shrink, lora_shrink_ref


def lora_apply(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rows: LoraRows,
               offsets: tuple[int, ...], offsets_t: torch.Tensor, t: torch.Tensor | None = None) -> torch.Tensor:
    """y [N, out_total] += each row's adapter update of x [N, in] (in place; returns y). a: [slots, slices * rank,
    in]; b: [slots, out_total, rank] with the scaling folded in; offsets: the slices' bounds along out; t: a zeroed
    fp32 [N, slices * rank] for the shrink's output (lora_shrink)."""
    return lora_expand(y, lora_shrink(x, a, rows, t), b, rows, offsets, offsets_t)


def lora_apply_ref(y, x, a, b, rows: LoraRows, offsets: tuple[int, ...]) -> torch.Tensor:
    return lora_expand_ref(y, lora_shrink_ref(x, a, rows), b, rows, offsets)


__all__ = ["LoraRows", "lora_apply", "lora_apply_ref", "lora_expand", "lora_rows", "lora_shrink"]
