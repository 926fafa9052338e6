"""`brrr bench engine-stats`: one engine run on a shared-prefix workload (half the requests open with the same
96-token "system prompt"): block utilization, prefix-cache hit rate, preemptions and how many steps mix prefill
with decode, for the KV-cache and batching settings given. Prints one JSON record.

    brrr bench engine-stats [--model DIR] [--requests 64] [--num-blocks 96]
"""
from __future__ import annotations

import random
import time

from brrr.bench.latency import emit, require_at_least
from brrr.engine import LLM
from brrr.sampling_params import SamplingParams


def register(bench_sub) -> None:
    p = bench_sub.add_parser("engine-stats", help="block utilization, prefix hit rate, preemptions on a shared-prefix "
                             "workload", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a model directory (default: the shipped default model)")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--num-blocks", type=int, default=96)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--out", default=None, help="append the JSON record to this file too")
    p.set_defaults(func=cmd_engine_stats)


def cmd_engine_stats(args) -> int:
    import platform

    import torch

    require_at_least(requests=(args.requests, 1))
    llm = LLM(args.model, num_blocks=args.num_blocks, block_size=args.block_size,
              max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs)
    engine, rng = llm.engine, random.Random(0)
    vocab = llm.pretrained.config.vocab_size
    system = [rng.randrange(vocab) for _ in range(96)]  # a shared "system prompt": 6 full blocks
    for i in range(args.requests):
        own = [rng.randrange(vocab) for _ in range(rng.randint(16, 200))]
        prompt = (system if i % 2 == 0 else []) + own
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=rng.randint(16, 128), temperature=0.8,
                                                          seed=i, ignore_eos=True))
    usage, mixed, start = [], 0, time.perf_counter()
    while engine.has_unfinished_requests():
        batch = engine.scheduler.schedule()  # the step engine.step() would take, inspected first
        mixed += any(n > 1 for _, n in batch.items) and any(n == 1 for _, n in batch.items)
        engine.step(batch)
        usage.append(engine.block_manager.usage)
    stats = engine.stats()
    seconds = time.perf_counter() - start
    emit({
        "bench": "engine_stats", "machine": platform.machine() + " " + (torch.cuda.get_device_name()
                                                                      if torch.cuda.is_available() else "cpu"),
        "model": str(llm.pretrained.path.name), "requests": args.requests, "num_blocks": args.num_blocks,
        "block_size": args.block_size, "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_num_seqs": args.max_num_seqs, "steps": stats["num_steps"], "steps_mixing_prefill_and_decode": mixed,
        "mean_block_utilization": round(sum(usage) / len(usage), 3), "peak_block_utilization": round(max(usage), 3),
        "prefix_cache_queries": stats["prefix_cache_queries"], "prefix_cache_hits": stats["prefix_cache_hits"],
        "prefix_hit_rate": round(stats["prefix_cache_hits"] / max(1, stats["prefix_cache_queries"]), 3),
        "preemptions": stats["num_preemptions"], "prompt_tokens_computed": stats["prompt_tokens"],
        "generation_tokens": stats["generation_tokens"], "seconds": round(seconds, 2),
        "output_tok_s": round(stats["generation_tokens"] / seconds, 1),
    }, args.out)
    return 0
