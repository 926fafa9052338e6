"""The decode kernel's KV-read bandwidth by cache layout and tile, at the shapes the engine meets:
  token-major  cache [blocks, block_size, kv_heads, D]: a head's 16 tokens of a block are 256 B pieces 2 KB apart
  head-major   cache [blocks, kv_heads, block_size, D] (passed as a transposed view): each (block, head) one 4 KB run
    python bench/decode_layout.py --out FILE
"""
import argparse
import json
import random

import torch
import triton

from brrr.kernels.attention import decode_attention_triton

SHAPES = {  # name: (batch, contexts, heads, kv_heads)
    "throughput-0.6b": (256, "uniform 100..2000", 16, 8),
    "batch64-4k": (64, "4096", 32, 8),
    "batch1-32k": (1, "32768", 32, 8),
    "throughput-8b": (256, "uniform 100..2000", 32, 8),
    "batch128-1k": (128, "1024", 32, 8),
    "batch256-512": (256, "512", 16, 8),
}


def contexts(spec, batch, rng):
    if spec.startswith("uniform"):
        lo, hi = map(int, spec.split()[1].split(".."))
        return [rng.randint(lo, hi) for _ in range(batch)]
    return [int(spec)] * batch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--layouts", default="token-major,head-major")
    args = ap.parse_args()
    rng, bs, d = random.Random(0), 16, 128
    with open(args.out, "w") as f:
        for name in args.shapes.split(","):
            batch, spec, heads, kv = SHAPES[name]
            ctx = contexts(spec, batch, rng)
            per_seq = [-(-c // bs) for c in ctx]
            width, blocks = max(per_seq), sum(per_seq)
            perm = torch.randperm(blocks, device="cuda").to(torch.int32)
            tables = torch.zeros(batch, width, dtype=torch.int32, device="cuda")
            at = 0
            for i, n in enumerate(per_seq):
                tables[i, :n] = perm[at:at + n]
                at += n
            q = torch.randn(batch, heads, d, device="cuda", dtype=torch.bfloat16)
            cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
            ctx_t = torch.tensor(ctx, dtype=torch.int32, device="cuda")
            nbytes = 2 * sum(ctx) * kv * d * 2
            layouts = {
                "token-major": lambda: torch.randn(blocks, bs, kv, d, device="cuda", dtype=torch.bfloat16),
                "head-major": lambda: torch.randn(blocks, kv, bs, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2),
            }
            for layout in args.layouts.split(","):
                make = layouts[layout]
                k_cache, v_cache = make(), make()
                out = torch.empty_like(q)
                for block_n in (32, 64, 128):
                    for warps in (4, 8):
                        for stages in (2, 3, 4):
                            try:
                                ms = triton.testing.do_bench(lambda: decode_attention_triton(
                                    q, k_cache, v_cache, cu, ctx_t, tables, d**-0.5, max_context_len=max(ctx),
                                    out=out, block_n=block_n, num_warps=warps, num_stages=stages),
                                    warmup=10, rep=40, return_mode="median")
                            except Exception as e:  # a tile that does not fit: recorded, not fatal
                                rec = {"shape": name, "layout": layout, "block_n": block_n, "warps": warps,
                                       "stages": stages, "error": type(e).__name__}
                            else:
                                rec = {"shape": name, "layout": layout, "block_n": block_n, "warps": warps,
                                       "stages": stages, "us": round(ms * 1e3, 1), "gb_s": round(nbytes / ms / 1e6)}
                            print(json.dumps(rec), flush=True)
                            f.write(json.dumps(rec) + "\n")
                del k_cache, v_cache


if __name__ == "__main__":
    main()
