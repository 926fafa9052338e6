"""Batch-1 paged decode attention (Llama-3.1-8B heads: 32 query, 8 KV, dim 128) at several context lengths, for
every split count and key tile, against the default (`decode_splits`): how much of a batch-1 decode step's
attention time is the split policy. Graph bounds 208 (the quant_speed engine's) and 2048 (the engine's short-context
graphs). Caches are small enough to stay in L2, so these are lower bounds on the in-step time.

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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    machine = torch.cuda.get_device_name()
    for bound in (208, 2048):
        blocks = bound // BLOCK
        caches = [[torch.randn(blocks + 1, BLOCK, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16)
                   for _ in range(2)] for _ in range(LAYERS)]
        tables = torch.arange(blocks, dtype=torch.int32, device="cuda")[None]
        cu = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
        q = torch.randn(1, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
        for ctx in [c for c in (16, 105, 205, 1000, 2000) if c <= bound]:
            lens = torch.tensor([ctx], dtype=torch.int32, device="cuda")
            for splits in (None, 1, 2, 4, 8, 16, 32):
                for block_n in (None, 16, 32, 64):
                    def call(i, splits=splits, block_n=block_n):
                        return attention.decode_attention_triton(q, *caches[i], cu, lens, tables, 0.088,
                                                                 max_context_len=bound, num_splits=splits,
                                                                 block_n=block_n)
                    us = graph_time_us([lambda i=i: call(i) for i in range(LAYERS)])
                    emit(dict(machine=machine, bound=bound, context=ctx, splits=splits, block_n=block_n,
                              default_splits=attention.decode_splits(1, KV_HEADS, bound, q.device),
                              us=round(us, 2)), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
