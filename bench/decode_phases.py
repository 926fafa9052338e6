"""Where the batch-1 decode attention kernel spends its time inside the captured W4A16 step: each program stamps the
global ns clock when its PDL wait returns and when it ends, and its SM's cycle counter at the phases between
(`attention.DECODE_TRACE`, `_phase`): after the wait, q/k/v loaded, the first (preloaded) tile folded in, all keys
folded in, the end. Stamps come from the last layer of the last replay.

    PYTHONPATH=$PWD python bench/decode_phases.py --contexts 8 40 100 204 --out bench/results/decode_phases_h200.jsonl
"""
from __future__ import annotations

import argparse
import importlib
import statistics
import sys

import torch

from brrr.bench.latency import emit, run_batch

ATTN = importlib.import_module("brrr.kernels.attention")  # the package exports a function of that name


def med(values):
    return round(statistics.median(values), 1) if values else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    p.add_argument("--variant", default="w4a16-g128-lmhead", choices=["bf16", "w8a16-lmhead", "w4a16-g128-lmhead"])
    p.add_argument("--contexts", nargs="+", type=int, default=[8, 40, 100, 204])
    p.add_argument("--rope-part", type=int, default=None, help="attention.ROPE_PART (keys a RoPE-path part)")
    p.add_argument("--tile-warps", type=int, default=None, help="attention.ROPE_TILE_WARPS")
    p.add_argument("--kernel", default="split", choices=["split", "lean", "lean-mma"],
                   help="the decode kernel stamped (lean-mma: attention_mma.py's)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/decode_phases.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from brrr.bench.random_model import model_config, random_model
    from brrr.config import EngineConfig
    from brrr.engine import LLMEngine
    from brrr.quant.linear import pack_quantized_projections
    from brrr.quant.methods import quantize_model

    cfg = model_config("llama-3.1-8b")
    model = random_model(cfg, torch.bfloat16, torch.device("cuda"))
    if args.variant != "bf16":
        quantize_model(model, "rtn-int8" if args.variant.startswith("w8") else "rtn-int4", group_size=128,
                       lm_head=True)
        pack_quantized_projections(model)
    max_len = 5 + max(args.contexts)
    engine = LLMEngine(model, None, EngineConfig(max_model_len=max_len, max_num_seqs=1,
                                                 num_blocks=-(-max_len // 16) + 8, cuda_graphs=True))
    run_batch(engine, 1, 5, max(args.contexts), cfg.vocab_size, seed=1)  # tuning, and the blocks of a long run
    runner = engine.runner
    table = runner.g_tables[0].clone()
    ATTN.ROPE_PART = args.rope_part or ATTN.ROPE_PART
    ATTN.ROPE_TILE_WARPS = args.tile_warps
    ATTN.LEAN_DECODE = args.kernel.startswith("lean")
    ATTN.LEAN_MMA = args.kernel == "lean-mma"
    ATTN.LEAN_MMA_ABOVE = 0 if args.kernel == "lean-mma" else ATTN.LEAN_MMA_ABOVE  # every context on tensor cores
    ATTN.DECODE_TRACE = trace = torch.zeros(4096 * 8, dtype=torch.int64, device="cuda")
    [table.clear() for table in runner.graph_tables]
    runner.capture_cuda_graphs(1, -(-max_len // runner.block_size))
    ATTN.DECODE_TRACE = None
    machine = f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    bs = runner.block_size
    with torch.inference_mode():
        runner.g_tables[0].copy_(table)
        for context in args.contexts:
            runner.g_ctx[0], runner.g_pos[0] = context, context - 1
            runner.g_slots[0] = runner.g_tables[0, (context - 1) // bs].long() * bs + (context - 1) % bs
            graph = runner.graphs[1][0]
            trace.zero_()
            for _ in range(5):
                graph.replay()
            torch.cuda.synchronize()
            rows = trace.view(-1, 8).cpu()
            rows = rows[rows[:, 0] > 0]  # programs that went past the wait
            worked = rows[rows[:, 5] > 0]  # ... and did a part's work
            t0 = int(rows[:, 0].min())

            rec = {"bench": "decode_phases", "machine": machine, "variant": args.variant, "context": context,
                   "kernel": args.kernel, "rope_part": ATTN.ROPE_PART, "tile_warps": args.tile_warps,
                   "programs_past_wait": len(rows), "programs_working": len(worked),
                   # ns from the first program's wait return
                   "waits_spread_ns": int(rows[:, 0].max()) - t0,
                   "starts_before_wait_ns": med([t0 - int(r[7]) for r in rows]),
                   "end_ns_median": med([int(r[6]) - t0 for r in worked]),
                   "end_ns_max": max(int(r[6]) - t0 for r in worked) if len(worked) else None,
                   # cycles between the phases, medians over the working programs
                   "cycles_qkv_load": med([int(r[2] - r[1]) for r in worked]),
                   "cycles_first_tile": med([int(r[3] - r[2]) for r in worked if r[3] > 0]),
                   "cycles_rest_and_new_key": med([int(r[4] - r[3]) if r[3] > 0 else int(r[4] - r[2])
                                                   for r in worked]),
                   "cycles_store_and_combine": med([int(r[5] - r[4]) for r in worked]),
                   "cycles_total": med([int(r[5] - r[1]) for r in worked])}
            emit(rec, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
