"""Swap preemption's host side (rank 0): the host block pool's free list, the rule that says whether a preempted
sequence's blocks go to it, and the copies' runs of consecutive host blocks.

A preempted sequence either loses its blocks and is recomputed later, or, when the pool has room and it holds at
least `SwapPolicy.min_tokens` computed tokens (the cost rule's crossover, brrr/analysis/offload.py; 0 when
preemption_mode='swap' forces it), has them copied to host blocks and resumes from where it was: new device blocks,
the same bytes copied back (fp8 caches included: their scales are per layer and stay on the device). The runner
holds the host tensors and does the copies (`ModelRunner.swap_blocks`).
"""
from __future__ import annotations

import heapq
import logging
from dataclasses import dataclass

import torch

from brrr.analysis.hardware import _known_spec
from brrr.analysis.offload import swap_threshold
from brrr.engine.host_prefix import HostPrefixTier
from brrr.errors import BrrrError

log = logging.getLogger("brrr.engine")
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}  # brrr.analysis's names


class HostBlockPool:
    """Ids of the host blocks; the lowest free ones first, so a sequence's blocks tend to be consecutive (one copy
    per run of them)."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks ({num_blocks}) must be >= 1")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks))  # a heap

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise BrrrError(f"{n} host blocks asked for, {len(self._free)} free")
        return [heapq.heappop(self._free) for _ in range(n)]

    def free(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            heapq.heappush(self._free, block_id)

    def check_invariants(self, seqs) -> None:
        """Every host block is free or held by exactly one of `seqs`, once."""
        held = [b for seq in seqs for b in seq.host_table]
        every = held + self._free
        assert len(every) == len(set(every)) == self.num_blocks, "a host block is lost or held twice"


@dataclass
class SwapPolicy:
    pool: HostBlockPool
    min_tokens: int  # computed tokens from which a preempted sequence swaps instead of recomputing

    def swaps(self, computed_tokens: int, blocks: int) -> bool:
        return 0 < blocks <= self.pool.num_free and computed_tokens >= self.min_tokens


def block_runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(src, dst) block pairs as (src, dst, count) runs where both sides are consecutive: one slice copy each."""
    runs: list[list[int]] = []
    for src, dst in pairs:
        if runs and runs[-1][0] + runs[-1][2] == src and runs[-1][1] + runs[-1][2] == dst:
            runs[-1][2] += 1
        else:
            runs.append([src, dst, 1])
    return [tuple(r) for r in runs]


def host_runs(host_blocks: list[int]) -> list[tuple[int, int, int]]:
    """Host block ids, in the order of the staging rows that hold them, as (first host block, first row, count)
    runs of consecutive ids: one copy across the host link each."""
    return [(host, row, n) for row, host, n in block_runs(list(enumerate(host_blocks)))]


def swap_policy(ec, cfg, device: torch.device, dtype: torch.dtype, bytes_per_block: int, max_model_len: int
                ) -> SwapPolicy | None:
    """The policy EngineConfig asks for, None when preemption always recomputes: no swap_space, the mode forced to
    recompute, or a device where the cost rule finds swapping never cheaper within max_model_len. On a device
    without datasheet figures (CPU, an unlisted GPU) every preemption the pool has room for swaps."""
    if not ec.swap_space or ec.preemption_mode == "recompute":
        return None
    num_blocks = int(ec.swap_space * 2**30) // bytes_per_block
    if num_blocks < 1:
        raise BrrrError(f"EngineConfig.swap_space ({ec.swap_space} GiB, --swap-space) holds no KV block of "
                        f"{bytes_per_block} bytes: raise it, or 0 to turn swapping off")
    min_tokens = 0
    gpu = _known_spec(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    if ec.preemption_mode is None and gpu is not None and dtype in DTYPE_NAMES:
        kv = DTYPE_NAMES[dtype] if ec.kv_cache_dtype == "auto" else ec.kv_cache_dtype
        min_tokens = swap_threshold(cfg, gpu, max_model_len, kv, DTYPE_NAMES[dtype])
        if min_tokens is None:
            log.info("swap_space: recomputing is cheaper than swapping at every length up to %d on %s; preemption "
                     "recomputes", max_model_len, gpu.name)
            return None
    log.info("swap_space: %d host blocks; preempted sequences of >= %d computed tokens swap", num_blocks, min_tokens)
    return SwapPolicy(HostBlockPool(num_blocks), min_tokens)


def host_prefix_tier(ec, bytes_per_block: int, first: int) -> HostPrefixTier | None:
    """The prefix cache's host tier EngineConfig.kv_offloading_size asks for (host block ids from `first`), or
    None: no size, or prefix caching off."""
    if not ec.kv_offloading_size or not ec.enable_prefix_caching:
        return None
    num_blocks = int(ec.kv_offloading_size * 2**30) // bytes_per_block
    if num_blocks < 1:
        raise BrrrError(f"EngineConfig.kv_offloading_size ({ec.kv_offloading_size} GiB, --kv-offloading-size) holds "
                        f"no KV block of {bytes_per_block} bytes: raise it, or 0 to turn the host tier off")
    log.info("kv_offloading_size: %d host blocks for prefix-cache blocks the device pool evicts", num_blocks)
    return HostPrefixTier(first, num_blocks)
