"""The KV-cache flags every engine front end takes (`brrr serve`, `brrr bench throughput`), declared once: vLLM's
`--kv-cache-dtype` and `--calculate-kv-scales`, the eviction policy with its per-sequence token budget, and where a
preempted sequence's KV goes (vLLM's `--swap-space` and `--preemption-mode`)."""
from __future__ import annotations

import argparse

from brrr.config import KV_CACHE_DTYPES, KV_EVICTIONS, PREEMPTION_MODES


def gib(text: str) -> float:
    """A size in GiB, >= 0 (argparse names the flag in its error)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of GiB, got {text!r}") from None
    if not value >= 0:  # (NaN too)
        raise argparse.ArgumentTypeError(f"must be >= 0 GiB, got {text}")
    return value


def add_kv_cache_args(parser) -> None:
    """The flags, on a parser or an argument group."""
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                        help="KV-cache element type: auto (the model's), fp8 / fp8_e4m3 or fp8_e5m2 (half of bf16's "
                             "bytes: twice the tokens; docs/long-context.md)")
    parser.add_argument("--calculate-kv-scales", action="store_true",
                        help="fp8 KV: each layer's K and V scale from the first prefill's amax (default: 1.0)")
    parser.add_argument("--kv-eviction", default=None, choices=KV_EVICTIONS,
                        help="evict KV as sequences grow: streaming keeps the first --kv-sink-tokens and the most "
                             "recent tokens, --kv-budget in all (StreamingLLM); snapkv compacts each prompt to "
                             "--kv-budget tokens per KV head by its last 32 queries' attention (SnapKV); h2o keeps "
                             "the rows of most accumulated attention and the most recent (H2O); both need "
                             "--no-prefix-caching")
    parser.add_argument("--kv-budget", type=int, default=None, metavar="TOKENS",
                        help="with --kv-eviction: cached tokens a sequence keeps at most (a multiple of the block size)")
    parser.add_argument("--kv-sink-tokens", type=int, default=4,
                        help="with --kv-eviction streaming: leading tokens always kept, rounded up to whole blocks")
    parser.add_argument("--swap-space", type=gib, default=0.0, metavar="GIB",
                        help="pinned host memory for preempted sequences' KV blocks, swapped out and back instead of "
                             "recomputed when that is cheaper (default 0: off; docs/engine.md)")
    parser.add_argument("--kv-offloading-size", type=gib, default=0.0, metavar="GIB",
                        help="pinned host memory for prefix-cache blocks the GPU pool evicts: a later prompt with "
                             "that prefix copies them back instead of recomputing (default 0: off; docs/engine.md)")
    parser.add_argument("--preemption-mode", default=None, choices=PREEMPTION_MODES,
                        help="force recompute or swap (swap needs --swap-space) instead of the cost rule's choice")


def kv_cache_config(args) -> dict:
    """EngineConfig's keyword arguments from the parsed flags."""
    return dict(kv_cache_dtype=args.kv_cache_dtype, calculate_kv_scales=args.calculate_kv_scales,
                kv_eviction=args.kv_eviction, kv_budget=args.kv_budget, kv_sink_tokens=args.kv_sink_tokens,
                swap_space=args.swap_space, preemption_mode=args.preemption_mode,
                kv_offloading_size=args.kv_offloading_size)
