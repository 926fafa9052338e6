"""The batch-1 lean decode kernels alone: attention_mma.py's (tensor cores, bound 256) and the CUDA-core lean kernel
(bound 256, chunks past the context skipped) on the 8B's heads (32 query, 8 kv, dim 128, bf16, RoPE in the kernel),
each launched 200 times in one CUDA graph without PDL (`graph_time_us`), so a launch's time includes its cache reads
(in the engine they run before the PDL wait). Writes JSON lines: us a launch at each context. (The committed results
up to a46a3cf timed the median of 5 replays with a loop of its own.)

    python bench/lean_kernels_alone.py --contexts 8 100 205 --out bench/results/lean_kernels_alone_h200.jsonl
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "kernels"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", nargs="+", type=int, default=[8, 100, 205])
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/lean_kernels_alone.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from test_attention import make_step

    from brrr.bench.timing import graph_time_us
    from brrr.config import RopeConfig
    from brrr.kernels import pdl
    from brrr.kernels.rotary import rope_inv_freq, rotary_cos_sin

    attention = importlib.import_module("brrr.kernels.attention")
    pdl.MODE = 0
    dev = torch.device("cuda")
    records = []
    for context in args.contexts:
        q, k, v, meta = make_step([1], [context], 32, 8, 128, 16, torch.bfloat16, dev, seed=context)
        inv_freq, scale = rope_inv_freq(RopeConfig(), 128, 512)
        cos, sin = (t.to(dev) for t in rotary_cos_sin(torch.tensor([context - 1]), inv_freq, scale, torch.bfloat16))
        ctx = torch.tensor([context], dtype=torch.int32, device=dev)
        k_cache, v_cache = meta.kv_caches[0]

        def step():  # writes the same key and value to the same slot each launch
            return attention.decode_attention_triton(q, k_cache, v_cache, meta.cu_seqlens_q, ctx, meta.block_tables,
                                                     0.1, None, max_context_len=256,
                                                     rope=(k, v, cos, sin, meta.slot_mapping))
        outs = {}
        for kernel, mma in (("tensor-cores", True), ("cuda-cores", False)):
            attention.LEAN_MMA, attention.LEAN_MMA_ABOVE = mma, 0
            outs[kernel] = step().float()
            machine = f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
            rec = {"bench": "lean_kernels_alone", "machine": machine, "context": context, "kernel": kernel,
                   "us_per_launch": round(graph_time_us([step] * 200), 2)}
            records.append(rec)
            print(json.dumps(rec))
        attention.LEAN_MMA, attention.LEAN_MMA_ABOVE = True, 128
        diff = (outs["tensor-cores"] - outs["cuda-cores"]).abs().max().item()
        assert diff < 0.05, f"the two kernels disagree at {context} keys: {diff}"
    if args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
