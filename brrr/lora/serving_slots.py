"""Adapter weights on the device for serving: a fixed number of slots, each able to hold one adapter, as stacked
tensors per serving module, and the per-row slot index every LoRA-wrapped module reads in a step.

Fixed tensors, allocated once at start-up: a captured CUDA graph keeps their addresses, so loading an adapter is a
copy into a slot, never a new allocation. Each slot holds, per serving module, A [slices * rank, in] and B [out,
rank] with the adapter's scaling folded into B; an adapter of a smaller rank (or one that leaves a module out) is
zero-padded, which adds nothing. `rank` is max_lora_rank rounded up to a power of two of at least 16 (the kernels'
tile). A packed projection (q/k/v, gate/up) is one serving module of several slices, each with its own part of A
and its own rows of B, so the update is exactly the separate modules' updates side by side.

On a tensor-parallel shard (`shard`) each rank's slots hold its slices of every adapter, cut like the layers they
wrap: a column-parallel projection (q/k/v, gate/up) keeps its output rows, so B is sliced by rows and A is whole; a
row-parallel one (o_proj, down_proj) keeps its input columns, so A is sliced by columns and B is whole, and the
update x_r A_r^T B^T is added to the rank's partial product before the all-reduce, which sums it with the others
(sum_r x_r A_r^T = x A^T): no collective of its own. The slot count and each row's slot are the same on every rank;
rank 0 decides them, and its loads travel to the workers with the step that needs them (`journal`)."""
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
        self.partition = None  # a tensor-parallel shard's Partition: which slice of each adapter tensor it holds
        # rank 0 of a shard: the loads (slot, adapter) not yet copied, which the next step carries to every rank
        self.journal: list | None = None

    def shard(self, partition, journal: bool) -> None:
        """Hold `partition`'s slices of every adapter; journal (rank 0): `write` queues the loads for the next step
        (`take_journal`), which copies them on every rank."""
        self.partition, self.journal = partition, [] if journal else None

    def take_journal(self) -> list:
        """The loads queued since the last step (each rank copies them in before running it)."""
        if not self.journal:
            return []
        out, self.journal = self.journal, []
        return out

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

    def write(self, slot: int, adapter: LoraAdapter) -> None:
        """Put `adapter` in `slot`: now, or with rank 0 of a shard at the next step, on every rank."""
        if self.journal is not None:
            self.journal.append((slot, adapter))
        else:
            self.copy_in(slot, adapter)

    def _slices(self, name: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's A and B of module `name`'s update: the slice its layer holds (the module docstring)."""
        where = None if self.partition is None else self.partition.slice_of(name + ".weight")
        if where is None:
            return a, b
        dim, start, stop = where
        return (a, b[start:stop]) if dim == 0 else (a[:, start:stop], b)

    @torch.no_grad()
    def copy_in(self, slot: int, adapter: LoraAdapter) -> None:
        """Copy `adapter` (this rank's slices) into `slot`, one copy per tensor, on the compute stream (a step still
        reading the slot runs first). Built on the host: padding and scaling cost no device launches."""
        scaling, r = adapter.config.scaling, adapter.rank
        for target in self.targets.values():
            a_host = torch.zeros(target.a.shape[1:], dtype=self.dtype)
            b_host = torch.zeros(target.b.shape[1:], dtype=self.dtype)
            for j, name in enumerate(target.names):
                if name not in adapter.weights:
                    continue
                a, b = self._slices(name, *adapter.weights[name])
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
    """A serving projection (nn.Linear, QuantLinear or a packed one) plus each row's adapter update from the slots.
    A row-parallel shard's projection (one with `partial` and `reduce`: brrr/distributed/sharding.py) gets the
    update on its partial product, before the all-reduce."""

    def __init__(self, base: nn.Module, slots: LoraSlots, target: SlotTarget):
        super().__init__()
        self.base, self.slots, self.target = base, slots, target
        self.in_features, self.out_features = target.a.shape[2], target.offsets[-1]

    def forward(self, x):
        reduce = getattr(self.base, "reduce", None)
        y = self.base(x) if reduce is None else self.base.partial(x)
        rows = self.slots.rows
        if rows is not None:
            if rows.num_rows != x.shape[0]:
                raise RuntimeError(f"LoRA rows were set for {rows.num_rows} rows but the step has {x.shape[0]}")
            t = self.target
            shrunk = self.slots.t[:, t.t_columns[0]:t.t_columns[1]]
            y = lora_apply(y, x, t.a, t.b, rows, t.offsets, t.offsets_t, shrunk)
        return y if reduce is None else reduce(y)
