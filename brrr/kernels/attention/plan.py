"""Every selection rule and threshold of the attention kernels: which decode kernel a step runs and how it is
launched, which graphs a CUDA-graph capture needs, and the prefill kernel's tiles.

A step of decodes (one new token a sequence) runs one of three kernels, chosen from host-known sizes only (batch,
context bound, heads, dtype, cache block size, device), so a graph captured for a bound replays the same launch:
- "lean_mma" (lean_mma.py): one program a kv head, the whole context read before the PDL wait, both products on
  tensor cores. Batch-small steps whose bound is above LEAN_MMA_ABOVE keys (up to LEAN_CONTEXT), head dim 128 in
  16 bits; at shorter bounds it loses to the CUDA-core kernel, which skips the chunks past the context.
- "lean" (lean.py): one program a query head, the whole context (<= LEAN_CONTEXT keys) in one tile on CUDA cores, no
  split to combine. Steps whose batch x query heads fit one wave of the GPU.
- "split" (decode.py): split-KV FlashDecoding, everything else: a sequence is cut into parts by its own length, up to
  `splits` parts (a grid bound fixed on the host), the last part to arrive combining them.
The lean kernels take only steps whose RoPE and cache write they do themselves (`rope`); the plain path (q and k
rotated and the cache written before attention) takes the split kernel.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from brrr.kernels.dispatch import next_power_of_2, num_sms

MAX_HEAD_DIM = 256
MAX_SPLITS = 64
# Keys a part of a split context holds at least: up to one wave of programs DECODE_MIN_PART (one 128-key tile), past
# it DECODE_LONG_PART.
DECODE_MIN_PART, DECODE_LONG_PART = 128, 512
# With RoPE in the split kernel, every part's first tile is read before the PDL wait: short contexts are cut into
# one-tile parts of ROPE_PART keys (more programs, each with its keys in flight during the previous kernel).
ROPE_PART = 64
SPLIT_ROPE_WARPS = 8  # warps of a split kernel program on the RoPE path when a sequence is split; 4 otherwise
# Full batches (not split) whose contexts are all this short take 128-key tiles; longer contexts 64-key ones.
SHORT_CONTEXT = 2048
LEAN_CONTEXT = 256  # the longest context of the lean kernels
LEAN_CHUNKS = 4  # chunks of the lean kernel's tile: those past a step's context are skipped
LEAN_MMA_ABOVE = 128  # the lean kernel runs on tensor cores above this bound
LEAN_MMA_GRAPH = 128  # so graphs are also captured at this bound, whose steps keep the CUDA-core kernel
LEAN_MMA_HEAD_DIM = 128
AUTOTUNE_MIN_TOKENS = 1024  # shorter prefill steps take a fixed tile: tuning each shape would cost more than it saves
# Autotuned prefill tiles (BLOCK_M, BLOCK_N, warps, stages) by padded head dim; K and V tiles are pipelined `stages`
# deep in shared memory, so hd256 takes shallower pipelines and narrower key tiles.
PREFILL_TILES = {
    64: [(128, 64, 4, 3), (128, 128, 8, 3), (64, 64, 4, 3), (128, 64, 8, 3)],
    128: [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (128, 32, 4, 3)],
    256: [(64, 64, 4, 2), (64, 32, 4, 2), (128, 64, 8, 2), (128, 32, 8, 2)],
}
# Kernels defined under Triton's interpreter (set before triton is imported) take small fixed prefill tiles.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class DecodePlan:
    """One decode launch: the kernel and every launch parameter that is not a tensor's shape. Hashable: CUDA graphs
    are keyed by (batch size, plan). The split kernel's: grid parts a sequence (splits), the parts that fill one
    wave, the keys a part holds at least (min_part), the parts' worth of keys one program reads whole, and whether
    inputs and the first tile are read before the PDL wait; the lean kernels': the tile's chunks, a warp's 16-key
    blocks (reps)."""
    kernel: str  # "split", "lean" or "lean_mma"
    max_context: int  # the context bound it serves (every context of the step is at most this)
    block_n: int  # keys a tile (lean kernels: the whole context's tile)
    num_warps: int
    num_stages: int = 1
    rope: bool = True  # the kernel rotates q and the new key and writes the new K/V to the cache
    splits: int = 1
    wave: int = 1
    min_part: int = DECODE_MIN_PART
    whole: int = 2
    early_loads: bool = True
    chunks: int = 1
    reps: int = 1


def _sms(device) -> int:
    return num_sms(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 132


def lean_decode_ok(batch: int, n_heads: int, head_dim: int, max_context: int, device) -> bool:
    """Whether a decode step of `batch` sequences fits the lean kernels (see LEAN_CONTEXT)."""
    return max_context <= LEAN_CONTEXT and head_dim <= 128 and batch * n_heads <= _sms(device)


def lean_mma_ok(head_dim: int, dtype: torch.dtype, group: int, block_size: int) -> bool:
    """Whether the tensor-core lean kernel takes these heads: dim 128, bf16/fp16, <= 8 query heads a kv head, cache
    blocks of a multiple of 16 keys."""
    return (head_dim == LEAN_MMA_HEAD_DIM and dtype in (torch.bfloat16, torch.float16) and group <= 8
            and block_size % 16 == 0)


def decode_splits(batch: int, n_kv: int, max_context: int, device, min_part: int = DECODE_MIN_PART,
                  whole: int = 2) -> tuple[int, int]:
    """(grid parts a sequence, parts that fill one wave) for the split kernel. When batch x kv_heads programs
    already fill a wave of the GPU, no split (splitting a full batch only adds the reduction). Otherwise at most one
    wave under a short bound (a grid's idle parts still cost), up to ~4 programs an SM under a long one; never more
    than the bound has min_part-key parts, at most MAX_SPLITS. The kernel picks each sequence's own count from its
    length (`_decode_parts`); these bounds depend only on host-known sizes, so a captured graph keeps them."""
    programs = batch * n_kv
    sms = _sms(device)
    if programs >= sms or max_context <= whole * min_part:  # the kernel reads `whole` parts' worth in one
        return 1, 1
    wave = sms // programs
    most = wave if max_context <= SHORT_CONTEXT else -(-4 * sms // programs)
    return max(1, min(most, -(-max_context // min_part), MAX_SPLITS)), wave


def decode_tile(splits: int, block_d: int, max_context: int, kv_fp8: bool = False) -> tuple[int, int]:
    """(keys a tile, pipeline stages) of the split kernel: split grids and short full batches 128 x 3, long full
    batches 64 x 2, head dim 256 32 x 2 (what fits in shared memory). An fp8 cache 64 x 6 at any split, with 2 warps
    (`split_plan`): a tile is half the bytes, so more of them stay in flight, and smaller programs fit more a
    multiprocessor (an H200 sweep, 32/8 heads hd128, b1-128 x 2k-32k: 1.3-1.5x the time of the bf16 rule's tile)."""
    if block_d >= 256:
        return 32, 2
    if kv_fp8:
        return 64, 6
    return (128, 3) if splits > 1 or max_context <= SHORT_CONTEXT else (64, 2)


@functools.lru_cache(maxsize=256)
def _part_tiles(bound: int, splits: int, wave: int, min_part: int, block_n: int, whole: int) -> int:
    """The most key tiles one program of the split kernel reads for any context up to `bound` (what
    `_decode_parts` gives). Two at most: no software pipeline (one stage), whose shared memory would keep the
    programs from being placed beside the kernel before them."""
    most = 0
    for span in range(block_n, bound + block_n, block_n):
        span = min(span, bound)
        parts = max(min(wave, -(-span // min_part)), -(-span // DECODE_LONG_PART))
        parts = 1 if span <= whole * min_part or splits == 1 else min(parts, splits)
        most = max(most, -(-span // parts))
    return -(-most // block_n)


def split_plan(batch: int, n_kv: int, head_dim: int, max_context: int, device, rope: bool,
               num_splits: int | None = None, block_n: int | None = None, num_warps: int | None = None,
               num_stages: int | None = None, min_part: int = DECODE_MIN_PART, kv_fp8: bool = False) -> DecodePlan:
    """The split kernel's launch (kv_fp8: over an fp8 cache); the keyword arguments override the rules (tests,
    kernel benchmarks)."""
    block_d = next_power_of_2(head_dim)
    rope_parts = rope and block_d <= 128  # one-tile parts, each part's first tile read before the PDL wait
    if rope_parts:
        min_part = block_n = block_n or ROPE_PART
    whole = 1 if rope_parts else 2
    splits, wave = (num_splits, num_splits) if num_splits else decode_splits(
        batch, n_kv, max_context, device, min_part=min_part if rope_parts else DECODE_MIN_PART, whole=whole)
    splits = min(splits, MAX_SPLITS)
    tile, stages = decode_tile(splits, block_d, max_context, kv_fp8)
    block_n = block_n or tile
    min_part = max(min_part, 1)  # as the kernel gets it
    if _part_tiles(max_context, splits, wave, min_part, block_n, whole) <= 2:
        stages = 1
    warps = 2 if kv_fp8 and block_d <= 128 else SPLIT_ROPE_WARPS if rope_parts and splits > 1 else 4
    return DecodePlan("split", max_context, block_n, num_warps or warps,
                      num_stages or stages, rope, splits, wave, min_part, whole, early_loads=rope_parts or not rope)


def lean_plan(max_context: int) -> DecodePlan:
    """The CUDA-core lean kernel for contexts up to max_context: 8 warps past 128 keys, else 4."""
    block_n = max(16, next_power_of_2(max_context))
    return DecodePlan("lean", max_context, block_n, 8 if block_n > 128 else 4,
                      chunks=min(LEAN_CHUNKS, max(1, block_n // 32)))


def lean_mma_plan(max_context: int) -> DecodePlan:
    """The tensor-core lean kernel for contexts up to max_context (<= 256): a lane holds 128 registers of keys and
    values at 16 x warps x reps keys."""
    block_n = max(16, next_power_of_2(max_context))
    assert block_n <= 256, "the lean MMA kernel holds at most 256 keys"
    warps = max(1, block_n // 32)
    return DecodePlan("lean_mma", max_context, block_n, warps, reps=block_n // (16 * warps))


@functools.lru_cache(maxsize=1024)
def decode_plan(batch: int, max_context: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                block_size: int, device: torch.device, rope: bool = True, kv_fp8: bool = False) -> DecodePlan:
    """The launch of a step of `batch` decodes whose contexts are all at most max_context keys. rope: the kernel
    rotates q and the new key and writes the new K/V (a step of decodes only); else they come rotated and cached.
    kv_fp8: over an fp8 cache, which only the split kernel reads (and never with rope: the write quantizes first)."""
    if rope and lean_decode_ok(batch, num_heads, head_dim, max_context, device):
        if max_context > LEAN_MMA_ABOVE and lean_mma_ok(head_dim, dtype, num_heads // num_kv_heads, block_size):
            return lean_mma_plan(max_context)
        return lean_plan(max_context)
    return split_plan(batch, num_kv_heads, head_dim, max_context, device, rope, kv_fp8=kv_fp8)


def decode_graph_plans(batch: int, max_context: int, num_heads: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype, block_size: int, device: torch.device) -> tuple[DecodePlan, ...]:
    """The decode graphs a capture of batch size `batch` needs for contexts up to max_context, loosest first: one
    for any context, and, below it, one whose split kernel is tiled for SHORT_CONTEXT, one at LEAN_CONTEXT taking
    the lean kernel (batches whose query heads fit a wave) and, when longer lean bounds take tensor cores, one at
    LEAN_MMA_GRAPH keeping the CUDA-core kernel. A step replays `graph_plan_for`'s. Plans of the RoPE path, the
    engine's decode step; a model on the plain path runs the split kernel at the same bounds."""
    lean = lean_decode_ok(batch, num_heads, head_dim, LEAN_CONTEXT, device)
    mma = lean and lean_mma_ok(head_dim, dtype, num_heads // num_kv_heads, block_size)
    bounds = [max_context] + [c for c, ok in ((SHORT_CONTEXT, True), (LEAN_CONTEXT, lean), (LEAN_MMA_GRAPH, mma))
                              if ok and max_context > c]
    return tuple(decode_plan(batch, c, num_heads, num_kv_heads, head_dim, dtype, block_size, device)
                 for c in bounds)


def graph_plan_for(plans: tuple[DecodePlan, ...], longest: int) -> DecodePlan:
    """Of a capture's plans, the one a step whose longest context is `longest` replays: the tightest bound it fits
    (the loosest when none does)."""
    ordered = sorted(plans, key=lambda p: p.max_context)
    return next((p for p in ordered if longest <= p.max_context), ordered[-1])


def prefill_config(dim: int, dtype: torch.dtype) -> dict:
    """The fixed prefill tile for fp32 and for short steps: a safe fit for the head dim, not the fastest."""
    if dtype == torch.float32:
        return dict(BLOCK_M=32, BLOCK_N=16 if dim > 128 else 32, num_warps=4, num_stages=2)
    if dim > 128:
        return dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2)
    return dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)


def prefill_plan(dim: int, dtype: torch.dtype, max_seqlen_q: int) -> dict | None:
    """The prefill kernel's tile {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"}, or None: autotuned (16-bit steps
    of >= AUTOTUNE_MIN_TOKENS new tokens, per head dim, GQA group and length bucket)."""
    if _INTERPRETED:
        return {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    if dtype == torch.float32 or max_seqlen_q < AUTOTUNE_MIN_TOKENS:
        return prefill_config(dim, dtype)
    return None


def prefill_tile_bucket(block_d: int) -> int:
    """PREFILL_TILES' key for a padded head dim."""
    return 64 if block_d <= 64 else 128 if block_d <= 128 else 256
