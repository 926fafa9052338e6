"""Where this process sits in a torchrun launch, and how the ranks agree at a step's boundary: a signal that
reached one rank stops them all, the time budget is the slowest rank's, the logged peak memory the busiest
rank's, and the pipeline's timings are every rank's. The agreements run over a CPU (gloo) group of their own, so
deciding costs no device synchronization and never interleaves with the step's collectives.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Ranks:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    group: object | None = None  # the agreements' gloo group (open_group), None for one process

    @classmethod
    def from_env(cls) -> "Ranks":
        """RANK / WORLD_SIZE / LOCAL_RANK as torchrun sets them; a lone process is rank 0 of 1."""
        env = {k: int(os.environ.get(k, d)) for k, d in (("RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_RANK", 0))}
        return cls(env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"])

    @property
    def main(self) -> bool:
        return self.rank == 0

    def open_group(self) -> None:
        """The agreements' group, once the process group is up (brrr.train.parallel.layout.build_mesh): every rank
        calls this at the same point, as any new group requires."""
        if self.world > 1 and dist.is_initialized() and self.group is None:
            self.group = dist.new_group(backend="gloo")

    def _reduce(self, value, dtype, op):
        t = torch.tensor([value], dtype=dtype)
        dist.all_reduce(t, op=op, group=self.group)
        return t.item()

    def any(self, flag: bool) -> bool:
        """True on every rank if it is on any (a signal that reached one rank stops them all at one step)."""
        if self.group is None:
            return flag
        return bool(self._reduce(int(flag), torch.int64, dist.ReduceOp.MAX))

    def min_int(self, value: int) -> int:
        if self.group is None:
            return value
        return int(self._reduce(value, torch.int64, dist.ReduceOp.MIN))

    def max_over_ranks(self, value: float) -> float:
        if self.group is None:
            return value
        return float(self._reduce(float(value), torch.float64, dist.ReduceOp.MAX))

    def gather(self, values: tuple[float, ...]) -> list[tuple[float, ...]]:
        """Every rank's `values`, in rank order."""
        if self.group is None:
            return [tuple(values)]
        mine = torch.tensor(values, dtype=torch.float64)
        gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, mine, group=self.group)
        return [tuple(t.tolist()) for t in gathered]
