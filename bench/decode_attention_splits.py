"""Batch-1, 4 and 16 paged decode attention (Llama-3.1-8B heads: 32 query, 8 KV, dim 128) at several context
lengths under graph bounds 208 (the quant_speed engine's), 2048 (the engine's short-context graphs), 8192 and 32768:
the default split (`decode_splits` bounds, each sequence's parts from its own length) against one part and
against other part lengths and key tiles. Caches stay in L2 below ~8k keys, so those are lower bounds on the
in-step time.

    PYTHONPATH=$PWD python bench/decode_attention_splits.py --out bench/results/decode_attention_splits_h200.jsonl
"""
import argparse
import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from brrr.bench.latency import emit  # noqa: E402
from brrr.bench.timing import graph_time_us  # noqa: E402

attention = importlib.import_module("brrr.kernels.attention")  # brrr.kernels.attention is also a function's name
HEADS, KV_HEADS, DIM, BLOCK, LAYERS = 32, 8, 128, 16, 8
# (name, decode_attention_triton keywords): the default, no split, and the policy at other key tiles, part lengths
# and pipeline depths
VARIANTS = [("default", {}), ("one part", {"num_splits": 1})] + [
    (f"tile {n} min_part {p} stages {st}", {"block_n": n, "min_part": p, "num_stages": st})
    for n in (64, 128) for p in (64, 128, 256) for st in (2, 3, 4)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    machine = torch.cuda.get_device_name()
    for bound in (208, 2048, 8192, 32768):
        blocks = bound // BLOCK
        caches = [[torch.randn(blocks + 1, BLOCK, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16)
                   for _ in range(2)] for _ in range(LAYERS)]
        for batch in (1, 4, 16):
            tables = torch.arange(blocks, dtype=torch.int32, device="cuda").repeat(batch, 1)
            cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
            q = torch.randn(batch, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
            for ctx in [c for c in (16, 105, 205, 500, 1000, 2000, 4000, 8000, 32000) if c <= bound]:
                lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
                for name, kw in VARIANTS:
                    def call(i, kw=kw):
                        return attention.decode_attention_triton(q, *caches[i], cu, lens, tables, 0.088,
                                                                 max_context_len=bound, **kw)
                    us = graph_time_us([lambda i=i: call(i) for i in range(LAYERS)])
                    emit(dict(machine=machine, bound=bound, batch=batch, context=ctx, variant=name,
                              bounds=attention.decode_splits(batch, KV_HEADS, bound, q.device), us=round(us, 2)),
                         args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
