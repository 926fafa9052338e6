"""Programmatic dependent launch (brrr/kernels/pdl.py) and the decode fusions on the captured step, A/B in one process.

Per variant (bf16, W8A16, W4A16 g128; Llama-3.1-8B shapes, random weights) one engine is built and its kernels
tuned once; then for each setting (`pdl.MODE`, as `BRRR_PDL`) the decode graphs are captured again and timed, so every setting
runs the same kernel configs (separate runs of bench/quant_speed.py may tune different ones): off; on (the
default); waits without early launches; PDL without the loads before the wait (`pdl.EARLY_LOADS`); without
the gate/up GEMV's SiLU-and-mul epilogue (`quant_matmul.GATED_GEMV`); without RoPE and the KV write in the decode
kernel (`attention.DECODE_ROPE`); the MMA GEMVs releasing the next kernel only from their epilogue, not
from their last K step (`quant_matmul.LAST_STEP_RELEASE`, tuned again); without the MMA GEMV candidates whose warps
split K (`quant_matmul.K_SLICE_WARPS`, tuned again); the RMSNorm weight read after the wait
(`rms_norm.EARLY_WEIGHT`); without either fusion; off again (drift check); and two ablations that skip the
RMSNorms or attention (wrong outputs: the most fusing or shortening them could save), and the same kernels replaced
by copy kernels (the floor of a kernel in their place); decode attention variants (the split kernel in place of
the lean one, part sizes, warps, register caps) and the q/k/v GEMV releasing attention where tuned instead of at its
last K step; the RMSNorms as kernels of their own instead of inside the int4 GEMVs (`LlamaModel.norms_in_gemvs`);
the GEMV configs tuned again, in a chain (`quant_matmul.CHAIN_TUNING`) or each candidate alone; the final RMSNorm,
the logits' fp32 cast and the embedding's gather as kernels of their own (`llama.FINAL_NORM_IN_LM_HEAD`,
`quant.linear.LOGITS_FROM_GEMV`, `rms_norm.EMBED_NORM`).
Records: device time of one graph replay per batch, and the engine's decode tok/s at batch 1.

    PYTHONPATH=$PWD python bench/pdl_decode.py --out bench/results/pdl_decode_h200.jsonl
"""
from __future__ import annotations

import argparse
import gc
import importlib
import sys

import torch
import triton
import triton.language as tl

from brrr.bench.latency import emit, run_batch
from brrr.bench.timing import replay_time_us, step_kernels
from brrr.kernels import pdl
from brrr.kernels.pdl import wait_previous
from brrr.kernels import quant_matmul as qm
from brrr.models import llama
from brrr.quant import linear as qlinear

attention = importlib.import_module("brrr.kernels.attention")  # the package exports a function of that name
norm = importlib.import_module("brrr.kernels.rms_norm")
rotary = importlib.import_module("brrr.kernels.rotary")  # and one of this name
ORIGINAL = {name: getattr(llama, name) for name in ("rms_norm", "add_rms_norm", "attention")}

# name -> (description, changes from the defaults: PDL on, early loads, the gated GEMV, RoPE in the decode kernel in
# parts of 64 keys)
SETTINGS = {"off": ("off", {"MODE": 0}), "pdl": ("pdl", {}), "wait": ("pdl, wait only (no early launch)", {"MODE": 1}),
            "late": ("pdl, no loads before the wait", {"EARLY_LOADS": False}),
            "no-gated": ("pdl, silu_and_mul kernel", {"GATED_GEMV": False}),
            "no-rope": ("pdl, rotary kernel", {"DECODE_ROPE": False}),
            "norm-late": ("pdl, RMSNorm weight read after the wait", {"EARLY_WEIGHT": False}),
            "no-kw": ("pdl, MMA GEMVs without warps splitting K (tuned again)",
                      {"K_SLICE_WARPS": False, "RETUNE": True}),
            "epilogue-release": ("pdl, MMA GEMVs release the next kernel from their epilogue (tuned again)",
                                 {"LAST_STEP_RELEASE": False, "RETUNE": True}),
            "unfused": ("pdl, silu_and_mul and rotary kernels", {"GATED_GEMV": False, "DECODE_ROPE": False}),
            "off-no-rope": ("off, rotary kernel", {"MODE": 0, "DECODE_ROPE": False}),
            "part32": ("pdl, RoPE decode parts of 32 keys", {"ROPE_PART": 32}),
            "part128": ("pdl, RoPE decode parts of 128 keys", {"ROPE_PART": 128}),
            "off2": ("off (again)", {"MODE": 0}), "pdl2": ("pdl (again)", {}),
            # the GEMV configs tuned again: each candidate timed alone (do_bench), or in a chain again
            "tune-alone": ("pdl, configs tuned alone", {"CHAIN_TUNING": False, "RETUNE": True}),
            "retune": ("pdl, configs tuned again in a chain", {"RETUNE": True}),
            # ablations, wrong outputs, timing only: what the step would save at most if these kernels cost nothing
            "skip-norm": ("pdl, RMSNorms skipped (ablation)", {"ABLATE": "norm"}),
            "skip-attn": ("pdl, attention skipped (ablation)", {"ABLATE": "attn"}),
            # floors: each replaced by the least kernel in its place (PDL wait, then one L2 read and write of its
            # output's size), so "floor" minus "skip" is the dependency and "pdl" minus "floor" the kernel's own work
            "floor-attn": ("pdl, attention as a copy kernel (floor)", {"ABLATE": "floor-attn"}),
            "floor-norm": ("pdl, RMSNorms as copy kernels (floor)", {"ABLATE": "floor-norm"}),
            "floor-attn-lean": ("pdl, attention as a copy kernel holding a lean decode program's K/V tiles (floor)",
                                {"ABLATE": "floor-attn-lean"}),
            "qkv-as-tuned": ("pdl, the q/k/v GEMV releasing attention where tuned (no last-step hint)",
                             {"EARLY_RELEASE_HINT": False}),
            "part128-w8": ("pdl, RoPE decode parts of 128 keys, 8 warps", {"ROPE_PART": 128, "ROPE_TILE_WARPS": 8}),
            "part256-w8": ("pdl, RoPE decode parts of 256 keys, 8 warps", {"ROPE_PART": 256, "ROPE_TILE_WARPS": 8}),
            "part256-w16": ("pdl, RoPE decode parts of 256 keys, 16 warps",
                            {"ROPE_PART": 256, "ROPE_TILE_WARPS": 16}),
            "part32-w4": ("pdl, RoPE decode parts of 32 keys, 4 warps", {"ROPE_PART": 32, "SPLIT_ROPE_WARPS": 4}),
            "part16-w4": ("pdl, RoPE decode parts of 16 keys, 4 warps", {"ROPE_PART": 16, "SPLIT_ROPE_WARPS": 4}),
            "part32-w8": ("pdl, RoPE decode parts of 32 keys", {"ROPE_PART": 32}),
            "split-attn": ("pdl, the split decode kernel at short contexts (no lean kernel)", {"LEAN_DECODE": False}),
            "norm-kernels": ("pdl, RMSNorms as kernels of their own (not in the GEMVs)", {"NORMS_IN_GEMVS": False}),
            "weights-normal": ("pdl, GEMV weights loaded with L2's normal eviction (not evict-first)",
                               {"WEIGHT_EVICT": ""}),
            "cos-sin-torch": ("pdl, rotary cos/sin tables by torch ops (not one kernel)", {"COS_SIN_KERNEL": False}),
            # the o_proj GEMV (N x K 4096 x 4096) in a config other than the tuned one: the tuner times it in a chain
            # of its own, not beside attention's programs, which hold an SM's registers while o_proj's launch
            "o-kw8": ("pdl, o_proj's MMA GEMV in 8 warps, K in 8 slices",
                      {"PICK": {(4096, 4096): dict(num_warps=8, KW=8)}}),
            "o-kw4": ("pdl, o_proj's MMA GEMV in 4 warps, K in 4 slices",
                      {"PICK": {(4096, 4096): dict(num_warps=4, KW=4)}}),
            "o-32-kw4": ("pdl, o_proj's MMA GEMV of 32 rows in 8 warps, K in 4 slices",
                         {"PICK": {(4096, 4096): dict(BLOCK_N=32, num_warps=8, KW=4)}}),
            "lean-one-chunk": ("pdl, lean decode kernel computing its whole tile (no chunks skipped)",
                               {"LEAN_CHUNKS": 1}),
            "lean-two-chunks": ("pdl, lean decode kernel in chunks of 128 keys (not 64)", {"LEAN_CHUNKS": 2}),
            "lean-no-fma": ("pdl, lean decode kernel without FMA contraction", {"LEAN_FMA": False}),
            "lean-tl-stores": ("pdl, lean decode kernel storing through tl.store (layout conversions)",
                               {"LEAN_ASM_STORES": False}),
            "lean-cuda-cores": ("pdl, lean decode kernel on CUDA cores at every context (not attention_mma.py's above "
                                "128 keys)", {"LEAN_MMA": False}),
            "lean-w8": ("pdl, lean decode kernel on CUDA cores in 8 warps at every bound", {"LEAN_WARPS": 8}),
            "mma-above-64": ("pdl, lean decode kernel on tensor cores above 64 keys (not 128)", {"LEAN_MMA_ABOVE": 64}),
            "mma-above-96": ("pdl, lean decode kernel on tensor cores above 96 keys (not 128)", {"LEAN_MMA_ABOVE": 96}),
            "mma-above-160": ("pdl, lean decode kernel on tensor cores above 160 keys (not 128)",
                              {"LEAN_MMA_ABOVE": 160}),
            "mma-everywhere": ("pdl, lean decode kernel on tensor cores at every context (the 128-key graph's too)",
                               {"LEAN_MMA_ABOVE": 0}),
            "mma-graph-64": ("pdl, lean decode kernel on tensor cores at every context, the extra lean graph at 64 "
                             "keys",
                             {"LEAN_MMA_ABOVE": 0, "LEAN_MMA_GRAPH": 64}),
            "lean-w4": ("pdl, lean decode kernel in 4 warps", {"LEAN_WARPS": 4}),
            "lean-w16": ("pdl, lean decode kernel in 16 warps", {"LEAN_WARPS": 16}),
            "final-norm-kernel": ("pdl, the final RMSNorm a kernel of its own (not in lm_head's GEMV)",
                                  {"FINAL_NORM_IN_LM_HEAD": False}),
            "logits-cast": ("pdl, lm_head's logits cast to fp32 by a kernel of their own", {"LOGITS_FROM_GEMV": False}),
            "embed-gather": ("pdl, the embedding gathered by a kernel of its own (not in the first norm)",
                             {"EMBED_NORM": False}),
            "three-kernels": ("pdl, the final norm, the logits' cast and the embedding's gather as kernels",
                              {"FINAL_NORM_IN_LM_HEAD": False, "LOGITS_FROM_GEMV": False, "EMBED_NORM": False}),
            "r96": ("pdl, decode kernel capped at 96 registers", {"DECODE_MAXNREG": 96}),
            "r64": ("pdl, decode kernel capped at 64 registers", {"DECODE_MAXNREG": 64}),
            "w4-r128": ("pdl, decode kernel 4 warps capped at 128 registers",
                        {"DECODE_MAXNREG": 128, "SPLIT_ROPE_WARPS": 4})}
# each flag's module and its value at import (the default every setting starts from)
FLAGS = {flag: (module, getattr(module, flag)) for module, flag in
         ((pdl, "MODE"), (pdl, "EARLY_LOADS"), (qm, "GATED_GEMV"), (attention, "DECODE_ROPE"), (attention, "ROPE_PART"),
          (attention, "SPLIT_ROPE_WARPS"), (attention, "DECODE_MAXNREG"), (attention, "ROPE_TILE_WARPS"),
          (attention, "LEAN_DECODE"), (attention, "LEAN_WARPS"), (attention, "LEAN_CHUNKS"),
          (attention, "LEAN_FMA"), (attention, "LEAN_ASM_STORES"), (attention, "LEAN_MMA"),
          (attention, "LEAN_MMA_ABOVE"), (attention, "LEAN_MMA_GRAPH"),
          (qm, "CHAIN_TUNING"), (qm, "LAST_STEP_RELEASE"), (qm, "K_SLICE_WARPS"), (qm, "EARLY_RELEASE_HINT"),
          (qm, "WEIGHT_EVICT"), (norm, "EARLY_WEIGHT"), (rotary, "COS_SIN_KERNEL"), (llama, "FINAL_NORM_IN_LM_HEAD"),
          (qlinear, "LOGITS_FROM_GEMV"), (norm, "EMBED_NORM"))}


@triton.jit
def _copy_kernel(X, Y, R, RES_OUT, KV, n, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
                 KV_ROWS: tl.constexpr):
    """The floor of a kernel in the decode chain: wait for the previous one, let the next launch, copy n values (and
    n of the residual: the fused norm's reads and writes, without the sum, so the stream stays bounded). KV_ROWS:
    also a lean decode program's footprint, a [KV_ROWS, 128] K and V tile read before the wait and held past it."""
    if KV_ROWS:
        r = tl.arange(0, KV_ROWS)[:, None] * 128 + tl.arange(0, 128)[None, :]
        k = tl.load(KV + r).to(tl.int16, bitcast=True)
        v = tl.load(KV + KV_ROWS * 128 + r).to(tl.int16, bitcast=True)
    wait_previous(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < n)
    if KV_ROWS:  # both tiles reach the output through xor-reductions with a value read after the wait
        s = tl.load(X).to(tl.int16, bitcast=True)
        xs = tl.xor_sum(tl.ravel(k ^ s), 0) ^ tl.xor_sum(tl.ravel(v ^ s), 0)
        x = tl.where(xs == 12345, x * 2, x)
    tl.store(Y + offs, x, mask=offs < n)
    if HAS_RESIDUAL:
        tl.store(RES_OUT + offs, tl.load(R + offs, mask=offs < n), mask=offs < n)


def _copy(x, residual=None, programs=1, kv=None, warps=4):
    x = x.contiguous()
    out, res = torch.empty_like(x), torch.empty_like(x) if residual is not None else None
    block = triton.next_power_of_2(-(-x.numel() // programs))
    mode = pdl.pdl_on(x)
    _copy_kernel[(programs,)](x, out, residual if residual is not None else x, res if res is not None else out,
                              kv if kv is not None else x, x.numel(), HAS_RESIDUAL=residual is not None, BLOCK=block,
                              PDL=mode, KV_ROWS=256 if kv is not None else 0, num_warps=warps, launch_pdl=mode > 0)
    return out, res


def _ablate(what: str | None):
    """Swap the model's norms or attention for no-ops or copy kernels (None: put them back)."""
    for name, fn in ORIGINAL.items():
        setattr(llama, name, fn)
    if what == "norm":
        llama.rms_norm = lambda x, weight, eps: x
        llama.add_rms_norm = lambda x, residual, weight, eps: (x, residual)
    elif what == "attn":
        llama.attention = lambda q, *args, **kwargs: q.reshape(q.shape[0], -1)
    elif what == "floor-norm":  # one program, as the batch-1 norm
        llama.rms_norm = lambda x, weight, eps: _copy(x)[0]
        llama.add_rms_norm = lambda x, residual, weight, eps: _copy(x, residual)
    elif what == "floor-attn":  # one program a kv head, as the decode kernel at short contexts
        llama.attention = lambda q, k, *args, **kwargs: _copy(q, programs=k.shape[1])[0].reshape(q.shape[0], -1)
    elif what == "floor-attn-lean":  # as the lean decode kernel: a program a query head, its K/V tiles held
        llama.attention = lambda q, k, v, meta, layer, *args, **kwargs: _copy(
            q, programs=q.shape[1], kv=meta.kv_caches[layer][0], warps=8)[0].reshape(q.shape[0], -1)


def _brief(cfg: dict) -> str:
    """A tuned config in a few characters: family, rows a program, split K, warps."""
    family = "mma-gemv" if cfg.get("MMA_GEMV") else "mma" if cfg.get("MMA") else "gemv" if "CHUNKS" in cfg else "tc"
    return f"{family} {cfg.get('BLOCK_N')} {cfg.get('SPLIT_K')} w{cfg.get('num_warps')}" + (
        f" kw{cfg['KW']}" if cfg.get("KW", 1) > 1 else "") + (
        " ahead" if cfg.get("AHEAD") else "") + (" last-step-release" if cfg.get("LAST_STEP_RELEASE") else "")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    p.add_argument("--variants", nargs="+", default=["bf16", "w8a16", "w4a16-g128"],
                   choices=["bf16", "w8a16", "w4a16-g128"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    p.add_argument("--new-tokens", type=int, default=200)
    p.add_argument("--lm-head", action="store_true", help="quantize lm_head too (`brrr quantize --lm-head`)")
    p.add_argument("--kernels", nargs="*", default=[], choices=list(SETTINGS),
                   help="also each kernel's device time in the batch-1 step under these settings")
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
        norms_in_gemvs = model.model.norms_in_gemvs
        engine = LLMEngine(model, None, EngineConfig(max_model_len=max_len, max_num_seqs=seqs,
                                                     num_blocks=seqs * -(-max_len // 16) + 8, cuda_graphs=True))
        runner = engine.runner
        for batch in args.batches:  # warm-up: prefill shapes and the kernel tuning
            run_batch(engine, batch, prompt_len, 8, cfg.vocab_size, seed=batch)
        tuned = None
        for key in args.settings:
            name, changes = SETTINGS[key]
            tuned = tuned or dict(qm._TUNED)  # the picks every setting starts from
            qm._TUNED.clear()
            qm._TUNED.update(tuned)
            for k, pick in list(qm._TUNED.items()):
                if k[1] == 1 and pick.get("MMA_GEMV") and (k[2], k[3]) in changes.get("PICK", {}):
                    qm._TUNED[k] = {**pick, **changes["PICK"][(k[2], k[3])]}
            for flag, (module, default) in FLAGS.items():
                setattr(module, flag, changes.get(flag, default))
            _ablate(changes.get("ABLATE"))
            model.model.norms_in_gemvs = changes.get("NORMS_IN_GEMVS", norms_in_gemvs)
            if changes.get("RETUNE"):
                qm._TUNED.clear()
                for batch in args.batches:
                    run_batch(engine, batch, prompt_len, 8, cfg.vocab_size, seed=batch)
            [table.clear() for table in runner.graph_tables]
            gc.collect(), torch.cuda.empty_cache()
            runner.capture_cuda_graphs(seqs, -(-max_len // runner.block_size))
            _, decode_s = run_batch(engine, 1, prompt_len, args.new_tokens, cfg.vocab_size, seed=7)
            label = variant + ("-lmhead" if args.lm_head and variant != "bf16" else "")
            rec = {"bench": "pdl_decode", "machine": machine, "variant": label, "setting": name,
                   "decode_tok_s_batch1": round((args.new_tokens - 1) / decode_s, 1)}
            for batch in args.batches:  # the graphs after the run: contexts of 1 + new_tokens - 1 tokens
                rec[f"graph_step_us_batch{batch}"] = round(replay_time_us(runner.graphs[batch][0]), 1)
            rec["picks_m1"] = {f"{k[0]} {k[2]}x{k[3]}{' gated' if k[9 if k[0] == 'w4' else 7] else ''}"
                               f"{' fused' if k[-1] == 'fused' else ''}": _brief(c)
                               for k, c in qm._TUNED.items() if k[1] == 1}
            if key in args.kernels:
                rec["kernels_batch1"] = [[k[:60], round(t, 2), round(c, 1)] for k, t, c in
                                         step_kernels(runner.graphs[1][0])]
            emit(rec, args.out)
        del engine, model, runner
        gc.collect()
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
