"""Which rows of a step belong to which adapter slot, in the form the grouped LoRA kernels read.

Per token row a slot index (-1: the base model alone). The kernels group rows by slot (Punica's SGMV): each program
takes a block of up to BLOCK_M rows of one slot, so that slot's A and B are read once per block, not once per row.
The blocks are listed once a step: every slot's rows cut into blocks, at most cdiv(N, BLOCK_M) + slots of them, so a
launch has that many row programs (not cdiv(N, BLOCK_M) per slot, most of them empty). It is all computed on the
device with static shapes (compares against every slot, a stable sort, a sorted search), so it runs inside a
captured CUDA graph whose input is the per-row slot index."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

# Triton's interpreter (CPU tests) multiplies 16-bit inputs of a dot as integer bit patterns: it takes fp32 dots.
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
BLOCK_M = 16  # rows of one slot per kernel program: the smallest tile a tensor-core dot takes


def ieee_dot(t: torch.Tensor) -> bool:
    """Whether the kernels' dots run in exact fp32: fp32 models (tf32 would round their inputs) and the
    interpreter."""
    return _INTERPRETED or t.dtype == torch.float32


@dataclass
class LoraRows:
    slots: torch.Tensor  # [N] int32, the slot of each row (-1: no adapter)
    order: torch.Tensor  # [N] int32, row indices sorted by slot (the -1 rows first)
    counts: torch.Tensor  # [S] int32, rows per slot
    starts: torch.Tensor  # [S] int32, where each slot's rows begin in `order`
    block_slot: torch.Tensor  # [B] int32, the slot of each block of rows
    block_start: torch.Tensor  # [B] int32, where the block's rows begin in `order`
    block_count: torch.Tensor  # [B] int32, rows in the block (0: an unused block)
    num_slots: int

    @property
    def num_rows(self) -> int:
        return self.slots.shape[0]

    @property
    def num_blocks(self) -> int:
        return self.block_slot.shape[0]


def lora_rows(slots: torch.Tensor, num_slots: int) -> LoraRows:
    """Group the rows of `slots` ([N] int, -1 or a slot in [0, num_slots)) by slot, in blocks of BLOCK_M."""
    ids = torch.arange(num_slots, device=slots.device, dtype=slots.dtype)
    counts = (slots[:, None] == ids[None, :]).sum(0, dtype=torch.int64)
    starts = (slots[:, None] < ids[None, :]).sum(0, dtype=torch.int64)  # the -1 rows sort first
    order = torch.sort(slots, stable=True).indices.to(torch.int32)
    per_slot = (counts + BLOCK_M - 1) // BLOCK_M
    ends = per_slot.cumsum(0)  # block b belongs to the first slot whose blocks end after it
    n_blocks = -(-slots.shape[0] // BLOCK_M) + num_slots
    b = torch.arange(n_blocks, device=slots.device, dtype=torch.int64)
    slot = torch.searchsorted(ends, b, right=True)
    used = slot < num_slots
    slot = slot.clamp(max=num_slots - 1)
    first_row = (b - (ends[slot] - per_slot[slot])) * BLOCK_M
    count = torch.where(used, (counts[slot] - first_row).clamp(0, BLOCK_M), 0)
    return LoraRows(slots, order, counts.to(torch.int32), starts.to(torch.int32), slot.to(torch.int32),
                    (starts[slot] + first_row).to(torch.int32), count.to(torch.int32), num_slots)
