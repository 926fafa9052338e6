"""Which rows of a step belong to which adapter slot, in the form the grouped LoRA kernels read.

Per token row a slot index (-1: the base model alone). The kernels group rows by slot (Punica's SGMV): each program
takes a block of one slot's rows, so that slot's A and B are read once per block, not once per row. The grouping is
computed on the device with static shapes (a compare against every slot, a stable sort), so it runs inside a
captured CUDA graph whose input is the per-row slot index."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

# Triton's interpreter (CPU tests) multiplies 16-bit inputs of a dot as integer bit patterns: it takes fp32 dots.
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


def ieee_dot(t: torch.Tensor) -> bool:
    """Whether the kernels' dots run in exact fp32: fp32 models (tf32 would round their inputs) and the
    interpreter."""
    return _INTERPRETED or t.dtype == torch.float32


@dataclass
class LoraRows:
    slots: torch.Tensor  # [N] int32, the slot of each row (-1: no adapter)
    order: torch.Tensor  # [N] row indices sorted by slot (the -1 rows first)
    counts: torch.Tensor  # [S] int32, rows per slot
    starts: torch.Tensor  # [S] int32, where each slot's rows begin in `order`
    num_slots: int

    @property
    def num_rows(self) -> int:
        return self.slots.shape[0]


def lora_rows(slots: torch.Tensor, num_slots: int) -> LoraRows:
    """Group the rows of `slots` ([N] int, -1 or a slot in [0, num_slots)) by slot."""
    ids = torch.arange(num_slots, device=slots.device, dtype=slots.dtype)
    counts = (slots[:, None] == ids[None, :]).sum(0, dtype=torch.int32)
    starts = (slots[:, None] < ids[None, :]).sum(0, dtype=torch.int32)  # the -1 rows sort first
    order = torch.sort(slots, stable=True).indices.to(torch.int32)
    return LoraRows(slots, order, counts, starts, num_slots)
