"""Adapter weights on the device for serving: a fixed number of slots, each able to hold one adapter, as stacked
tensors per serving module, and the per-row slot index every LoRA-wrapped module reads in a step.

Fixed tensors, allocated once at start-up: a captured CUDA graph keeps their addresses, so loading an adapter is a
copy into a slot, never a new allocation. Each slot holds, per serving module, A [slices * rank, in] and B [out,
rank] with the adapter's scaling folded into B; an adapter of a smaller rank (or one that leaves a module out) is
zero-padded, which adds nothing. `rank` is max_lora_rank rounded up to a power of two of at least 16 (the kernels'
tile). A packed projection (q/k/v, gate/up) is one serving module of several slices, each with its own part of A
and its own rows of B, so the update is exactly the separate modules' updates side by side."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from brrr.kernels.dispatch import next_power_of_2
from brrr.kernels.lora import LoraRows, lora_apply, lora_rows
from brrr.lora.peft_format import LoraAdapter


@dataclass
class SlotTarget:
    """One serving module's slots: `names` are the Hugging Face modules it computes, in output order."""
    names: tuple[str, ...]
    offsets: tuple[int, ...]  # the slices' bounds along the output
    t_columns: tuple[int, int]  # its shrink output's columns in the step's buffer (LoraSlots.t)
    offsets_t: torch.Tensor
    a: torch.Tensor  # [slots, slices * rank, in]
    b: torch.Tensor  # [slots, out, rank]


class LoraSlots:
    def __init__(self, num_slots: int, max_lora_rank: int, max_rows: int, device, dtype: torch.dtype):
        self.num_slots, self.rank, self.device, self.dtype = num_slots, max(16, next_power_of_2(max_lora_rank)), \
            torch.device(device), dtype
        # the slot of every row of the step (-1: base only); a graph input, written before each step
        self.row_slots = torch.full((max_rows,), -1, dtype=torch.int32, device=self.device)
        self.targets: dict[str, SlotTarget] = {}
        self.rows: LoraRows | None = None  # this step's grouping; None: no adapter is applied (profiling runs)
        self.t: torch.Tensor | None = None  # this step's shrink outputs, every module's: zeroed once a step
        self.t_width = 0

    def target(self, key: str, names: tuple[str, ...], in_features: int, outs: tuple[int, ...]) -> SlotTarget:
        offsets = tuple(int(v) for v in torch.tensor([0, *outs]).cumsum(0))
        width = len(names) * self.rank
        # 16-byte aligned column blocks, as separate allocations would be (Triton specializes pointers on it)
        start = self.t_width
        self.t_width += -(-width // 4) * 4
        target = SlotTarget(names, offsets, (start, start + width),
                            torch.tensor(offsets, dtype=torch.int32, device=self.device),
                            torch.zeros(self.num_slots, len(names) * self.rank, in_features, dtype=self.dtype,
                                        device=self.device),
                            torch.zeros(self.num_slots, offsets[-1], self.rank, dtype=self.dtype, device=self.device))
        self.targets[key] = target
        return target

    @property
    def nbytes(self) -> int:
        return sum(t.a.nbytes + t.b.nbytes for t in self.targets.values())

    @torch.no_grad()
    def write(self, slot: int, adapter: LoraAdapter) -> None:
        """Copy `adapter` into `slot`, one copy per tensor, on the compute stream (a step still reading the slot
        runs first). Built on the host: padding and scaling cost no device launches."""
        scaling, r = adapter.config.scaling, adapter.rank
        for target in self.targets.values():
            a_host = torch.zeros(target.a.shape[1:], dtype=self.dtype)
            b_host = torch.zeros(target.b.shape[1:], dtype=self.dtype)
            for j, name in enumerate(target.names):
                if name not in adapter.weights:
                    continue
                a, b = adapter.weights[name]
                a_host[j * self.rank:j * self.rank + r] = a
                b_host[target.offsets[j]:target.offsets[j + 1], :r] = b.float() * scaling
            target.a[slot].copy_(a_host)
            target.b[slot].copy_(b_host)

    def begin(self, num_rows: int) -> None:
        """The step's rows are row_slots[:num_rows]: group them (on the device) for every wrapped module."""
        self.rows = lora_rows(self.row_slots[:num_rows], self.num_slots)
        self.t = torch.zeros(num_rows, self.t_width, dtype=torch.float32, device=self.device)

    def end(self) -> None:
        """The step is issued: a forward outside a step (profiling) adds no update, never a stale step's."""
        self.rows = self.t = None


class LoraLinear(nn.Module):
    """A serving projection (nn.Linear, QuantLinear or a packed one) plus each row's adapter update from the slots."""

    def __init__(self, base: nn.Module, slots: LoraSlots, target: SlotTarget):
        super().__init__()
        self.base, self.slots, self.target = base, slots, target
        self.in_features, self.out_features = target.a.shape[2], target.offsets[-1]

    def forward(self, x):
        y = self.base(x)
        rows = self.slots.rows
        if rows is None:
            return y
        if rows.num_rows != x.shape[0]:
            raise RuntimeError(f"LoRA rows were set for {rows.num_rows} rows but the step has {x.shape[0]}")
        t = self.target
        shrunk = self.slots.t[:, t.t_columns[0]:t.t_columns[1]]
        return lora_apply(y, x, t.a, t.b, rows, t.offsets, t.offsets_t, shrunk)
