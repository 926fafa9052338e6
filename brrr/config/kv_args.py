"""The KV-cache flags every engine front end takes (`brrr serve`, `brrr bench throughput`), declared once: vLLM's
`--kv-cache-dtype` and `--calculate-kv-scales`, and the eviction policy with its per-sequence token budget."""
from __future__ import annotations

from brrr.config import KV_CACHE_DTYPES, KV_EVICTIONS


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


def kv_cache_config(args) -> dict:
    """EngineConfig's keyword arguments from the parsed flags."""
    return dict(kv_cache_dtype=args.kv_cache_dtype, calculate_kv_scales=args.calculate_kv_scales,
                kv_eviction=args.kv_eviction, kv_budget=args.kv_budget, kv_sink_tokens=args.kv_sink_tokens)
