"""Programmatic dependent launch (brrr/kernels/pdl.py) and the decode fusions on the captured step, A/B in one process.

Per variant (bf16, W8A16, W4A16 g128; Llama-3.1-8B shapes, random weights) one engine is built and its kernels
tuned once; then for each setting (`pdl.MODE`, as `BRRR_PDL`) the decode graphs are captured again and timed, so every setting
runs the same kernel configs (separate runs of bench/quant_speed.py may tune different ones): off; on (the
default); waits without early launches; PDL without the loads before the wait (`pdl.EARLY_LOADS`); without
the gate/up GEMV's SiLU-and-mul epilogue (`quant_matmul.GATED_GEMV`); without RoPE and the KV write in the decode
kernel (`attention.DECODE_ROPE`); without either fusion; off again (drift check). Records: device time of one graph replay per
batch, and the engine's decode tok/s at batch 1.

    PYTHONPATH=$PWD python bench/pdl_decode.py --out bench/results/pdl_decode_h200.jsonl
"""
from __future__ import annotations

import argparse
import gc
import sys

import torch

from brrr.bench.latency import emit, run_batch
from brrr.bench.timing import replay_time_us
from brrr.kernels import attention, pdl
from brrr.kernels import quant_matmul as qm

# name -> (description, pdl.MODE, pdl.EARLY_LOADS, quant_matmul.GATED_GEMV, attention.DECODE_ROPE)
SETTINGS = {"off": ("off", 0, True, True, True), "pdl": ("pdl", 2, True, True, True),
            "wait": ("pdl, wait only (no early launch)", 1, True, True, True),
            "late": ("pdl, no loads before the wait", 2, False, True, True),
            "no-gated": ("pdl, silu_and_mul kernel", 2, True, False, True),
            "no-rope": ("pdl, rotary kernel", 2, True, True, False),
            "unfused": ("pdl, silu_and_mul and rotary kernels", 2, True, False, False),
            "off2": ("off (again)", 0, True, True, True), "pdl2": ("pdl (again)", 2, True, True, True)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    p.add_argument("--variants", nargs="+", default=["bf16", "w8a16", "w4a16-g128"],
                   choices=["bf16", "w8a16", "w4a16-g128"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    p.add_argument("--new-tokens", type=int, default=200)
    p.add_argument("--lm-head", action="store_true", help="quantize lm_head too (`brrr quantize --lm-head`)")
    p.add_argument("--settings", nargs="+", default=["off", "pdl", "wait", "off2"], choices=list(SETTINGS))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/pdl_decode.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from brrr.bench.random_model import model_config, random_model
    from brrr.config import EngineConfig
    from brrr.engine import LLMEngine
    from brrr.quant.linear import pack_quantized_projections
    from brrr.quant.methods import quantize_model

    cfg = model_config("llama-3.1-8b")
    machine = f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    prompt_len, max_len, seqs = 5, 5 + args.new_tokens, max(args.batches)
    for variant in args.variants:
        model = random_model(cfg, torch.bfloat16, torch.device("cuda"))
        if variant != "bf16":
            quantize_model(model, "rtn-int8" if variant == "w8a16" else "rtn-int4", group_size=128,
                           lm_head=args.lm_head)
            pack_quantized_projections(model)
        engine = LLMEngine(model, None, EngineConfig(max_model_len=max_len, max_num_seqs=seqs,
                                                     num_blocks=seqs * -(-max_len // 16) + 8, cuda_graphs=True))
        runner = engine.runner
        for batch in args.batches:  # warm-up: prefill shapes and the kernel tuning
            run_batch(engine, batch, prompt_len, 8, cfg.vocab_size, seed=batch)
        for name, mode, early, gated, rope in (SETTINGS[key] for key in args.settings):
            pdl.MODE, pdl.EARLY_LOADS, qm.GATED_GEMV, attention.DECODE_ROPE = mode, early, gated, rope
            runner.graphs.clear(), runner.short_graphs.clear()
            gc.collect(), torch.cuda.empty_cache()
            runner.capture_cuda_graphs(seqs, -(-max_len // runner.block_size))
            _, decode_s = run_batch(engine, 1, prompt_len, args.new_tokens, cfg.vocab_size, seed=7)
            rec = {"bench": "pdl_decode", "machine": machine, "variant": variant + ("-lmhead" if args.lm_head and variant != "bf16" else ""),
                   "setting": name,
                   "decode_tok_s_batch1": round((args.new_tokens - 1) / decode_s, 1)}
            for batch in args.batches:  # the graphs after the run: contexts of 1 + new_tokens - 1 tokens
                rec[f"graph_step_us_batch{batch}"] = round(replay_time_us(runner.graphs[batch][0]), 1)
            emit(rec, args.out)
        del engine, model, runner
        gc.collect()
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
