"""Quantized inference speed on one GPU, Llama-3.1-8B shapes, random weights (speed does not depend on values).

Three sections, one JSON record per result (stdout, and appended to --out):
  gemm     per-GEMM device time of W8A16 / W4A16 g128 (tuned: Triton kernels, or dequantize + F.linear at larger M)
           vs bf16 F.linear at M = 1, 16, 64, 256 (--gemm-m) for the 8B projections (q/o 4096x4096, k/v
           1024x4096, packed qkv 6144x4096, gate/up 14336x4096, packed gate_up 28672x4096, down 4096x14336) and
           lm_head (128256x4096). Timed as CUDA-graph replays over enough weight copies to exceed L2, so
           every call streams its weights from HBM and no host launch cost is counted; GB/s = stored bytes / time.
  prefill  FP8 W8A8 `torch._scaled_mm` (row-wise scales) vs bf16 at M = 2048, 4096: the GEMM alone, with fast
           accumulation, and the whole linear (per-token activation quantization included); SmoothQuant's
           `torch._int_mm` and the tuned W4A16 / W8A16 paths beside them.
  decode   batch-1, 16 and 64 (--batches) decode tok/s through the engine (LLMEngine, CUDA graphs, as `brrr bench
           latency`) for bf16, W8A16 and W4A16 g128 (RTN; q/k/v and gate/up packed for every variant: the engine
           packs every model (brrr.serving_form.prepare_for_serving); -lmhead: lm_head quantized too),
           the median of --rounds rounds that take the variants in turn, plus the device time of one captured
           decode step (graph replay alone), which separates kernel speed from the engine's host work per step;
           with --kernels, each kernel's device time in that step. The gguf-* variants hold the projections
           as GGUF blocks repacked at load (brrr/gguf/repack.py: q8_0, q6_k, and q4_k_m: Q4_K with Q6_K for
           attn_v and ffn_down in the layers llama.cpp's Q4_K_M gives more bits), random block bytes with finite
           fp16 scales, lm_head bf16 (as the GGUF loader keeps it). TTFT at 2k: --prompt-len 2048 (ttft_s of the batch-1 record).

  PYTHONPATH=$PWD python bench/quant_speed.py --out bench/results/quant_speed_h200.jsonl
"""
from __future__ import annotations

import argparse
import gc
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from brrr.bench.latency import emit  # noqa: E402
from brrr.bench.timing import graph_time_us, replay_time_us, step_kernels  # noqa: E402
from brrr.kernels import quant as qm  # noqa: E402
from brrr.quant import formats  # noqa: E402
from brrr.quant.linear import QuantLinear  # noqa: E402

GEMM_SHAPES = {"q/o": (4096, 4096), "k/v": (1024, 4096), "qkv": (6144, 4096), "gate/up": (14336, 4096),
               "gate_up": (28672, 4096), "down": (4096, 14336), "lm_head": (128256, 4096)}
PREFILL_SHAPES = {"q/o": (4096, 4096), "gate/up": (14336, 4096), "down": (4096, 14336), "gate_up": (28672, 4096)}
BF16 = torch.bfloat16


def bench_us(fn) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def quant_linear(fmt: str, w: torch.Tensor) -> QuantLinear:
    quantize = {"int4": lambda: formats.quantize_int4(w, 128), "int8": lambda: formats.quantize_int8(w),
                "fp8": lambda: formats.quantize_fp8(w)}
    return QuantLinear(fmt, quantize[fmt](), w.shape[1], w.shape[0], None, dtype=BF16)


def stored_bytes(module) -> int:
    return sum(t.numel() * t.element_size() for t in module.tensors().values() if t is not None)


def section_gemm(args, machine, reports):
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (n, k) in GEMM_SHAPES.items():
        copies = max(3, math.ceil(4 * 60e6 / (n * k / 2)))  # even the int4 copies span ~4x the 60 MB L2
        weights = [torch.randn(n, k, device="cuda", generator=gen, dtype=BF16) * 0.02 for _ in range(copies)]
        variants = {"bf16": weights}
        variants["w8a16"] = [quant_linear("int8", w) for w in weights]
        variants["w4a16-g128"] = [quant_linear("int4", w) for w in weights]
        if args.gemm_fp8:
            variants["fp8-w8a16"] = [quant_linear("fp8", w) for w in weights]
        for m in args.gemm_m:
            x = torch.randn(m, k, device="cuda", dtype=BF16)
            base = None
            for variant, mods in variants.items():
                if variant == "bf16":
                    calls, nbytes = [lambda w=w: F.linear(x, w) for w in mods], n * k * 2
                else:
                    calls, nbytes = [lambda q=q: q(x) for q in mods], stored_bytes(mods[0])
                with qm.quant_tuning() as report:  # graph_time_us's warm-up calls tune the shape
                    us = graph_time_us(calls)
                reports.append(report)
                base = base or us
                emit({"bench": "quant_gemm", "machine": machine, "shape": name, "n": n, "k": k, "m": m,
                      "variant": variant, "us": round(us, 2), "weight_bytes": nbytes,
                      "gb_s": round(nbytes / us / 1e3, 1), "speedup_vs_bf16": round(base / us, 2)}, args.out)
        del weights, variants
        torch.cuda.empty_cache()


def section_prefill(args, machine, reports):
    from brrr.quant.w8a8 import fp8_w8a8_linear, int8_w8a8_linear

    gen = torch.Generator(device="cuda").manual_seed(1)
    for name, (n, k) in PREFILL_SHAPES.items():
        w = torch.randn(n, k, device="cuda", generator=gen, dtype=BF16) * 0.02
        f8 = formats.quantize_fp8(w.float())
        sw = f8["scales"].reshape(1, n).contiguous()
        i8 = formats.quantize_int8(w.float())
        w4, w8 = quant_linear("int4", w), quant_linear("int8", w)
        for m in (2048, 4096):
            x = torch.randn(m, k, device="cuda", generator=gen, dtype=BF16)
            xq, sx = qm.quantize_per_token(x, torch.float8_e4m3fn)
            xi, _ = qm.quantize_per_token(x, torch.int8)
            flops = 2 * m * n * k
            runs = {
                "bf16": lambda: F.linear(x, w),
                "fp8-scaled_mm": lambda: torch._scaled_mm(xq, f8["qweight"].t(), scale_a=sx, scale_b=sw,
                                                          out_dtype=BF16),
                "fp8-scaled_mm-fast-accum": lambda: torch._scaled_mm(xq, f8["qweight"].t(), scale_a=sx,
                                                                     scale_b=sw, out_dtype=BF16,
                                                                     use_fast_accum=True),
                "fp8-w8a8-linear (with activation quant)": lambda: fp8_w8a8_linear(x, f8["qweight"], f8["scales"]),
                "int8-int_mm": lambda: torch._int_mm(xi, i8["qweight"].t()),
                "int8-w8a8-linear (with activation quant)": lambda: int8_w8a8_linear(x, i8["qweight"],
                                                                                     i8["scales"]),
                "w8a16": lambda: w8(x),  # tuned: tiled kernel or dequantize + F.linear
                "w4a16-g128": lambda: w4(x),
            }
            base = None
            for variant, fn in runs.items():
                try:
                    with qm.quant_tuning() as report:  # do_bench's warm-up calls tune the shape
                        us = bench_us(fn)
                    reports.append(report)
                except Exception as e:  # record what failed instead of losing the section
                    emit({"bench": "quant_prefill", "shape": name, "m": m, "variant": variant,
                          "error": f"{type(e).__name__}: {e}"[:300]}, args.out)
                    continue
                base = base or us
                emit({"bench": "quant_prefill", "machine": machine, "shape": name, "n": n, "k": k, "m": m,
                      "variant": variant, "us": round(us, 1), "tflop_s": round(flops / us / 1e6, 1),
                      "speedup_vs_bf16": round(base / us, 2)}, args.out)
        torch.cuda.empty_cache()


def q4_k_m_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's Q4_K_M rule (use_more_bits): attn_v and ffn_down of these layers are Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def gguf_blocks_model(model, variant: str) -> None:
    """Swap every decoder projection for a QuantLinear holding random GGUF blocks of the variant's type(s),
    repacked as brrr/gguf/load.py repacks a file's (the block bytes are random, d / dmin finite fp16)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

    from brrr.gguf.repack import repack_groupwise

    fp16_at = {T.Q8_0: [0], T.Q6_K: [208], T.Q5_K: [0, 2], T.Q4_K: [0, 2]}
    layers = model.model.layers
    dev = next(model.parameters()).device
    gen = torch.Generator(device=dev).manual_seed(2)
    for i, layer in enumerate(layers):
        for parent, names in ((layer.self_attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                              (layer.mlp, ("gate_proj", "up_proj", "down_proj"))):
            for name in names:
                linear = getattr(parent, name)
                qtype = {"gguf-q8_0": T.Q8_0, "gguf-q6_k": T.Q6_K}.get(variant, T.Q4_K)
                if variant == "gguf-q4_k_m" and name in ("v_proj", "down_proj") and q4_k_m_more_bits(i, len(layers)):
                    qtype = T.Q6_K
                rows, cols = linear.out_features, linear.in_features
                block, size = GGML_QUANT_SIZES[qtype]
                b = torch.randint(0, 256, (rows, cols // block, size), device=dev, dtype=torch.uint8,
                                  generator=gen)
                for off in fp16_at[qtype]:
                    b[..., off:off + 2] = torch.full((rows, cols // block, 1), 0.01, device=dev,
                                                     dtype=torch.float16).view(torch.uint8)
                fmt, tensors = repack_groupwise(b.reshape(rows, -1), qtype, rows, cols)
                setattr(parent, name, QuantLinear(fmt, tensors, cols, rows, linear.bias, dtype=BF16))


def model_bytes(model) -> int:
    """Bytes a decode step reads for weights: every parameter and buffer except the embedding table."""
    total = 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if "embed_tokens" not in name and t is not None:
            total += t.numel() * t.element_size()
    return total


def section_decode(args, machine, bandwidth, reports):
    """Every variant's engine is built first and kept; then --rounds rounds each decode every variant once in turn,
    so a drift of the GPU over the run (one bf16 run was 3% slower than another in the same session) reaches every
    variant alike; each variant's rate is its median round."""
    from brrr.bench.latency import run_batch
    from brrr.models.random_weights import model_config, random_model
    from brrr.config import EngineConfig
    from brrr.engine import LLMEngine
    from brrr.quant.methods import quantize_model

    cfg = model_config("llama-3.1-8b")
    max_len = args.prompt_len + args.new_tokens
    built = []
    for variant in args.variants:
        t0 = time.perf_counter()
        model = random_model(cfg, BF16, torch.device("cuda"))
        if variant.startswith("gguf-"):
            gguf_blocks_model(model, variant)
        elif variant != "bf16":
            method = next(m for prefix, m in (("fp8-w8a8", "fp8-w8a8"), ("fp8", "fp8"), ("w8a16", "rtn-int8"),
                                               ("w4a16", "rtn-int4")) if variant.startswith(prefix))
            quantize_model(model, method, group_size=128, lm_head=variant.endswith("-lmhead"))
        seqs = max(args.batches)
        with qm.quant_tuning() as report:  # as the engine process's warm-up: the decode and prefill shapes
            engine = LLMEngine(model, None, EngineConfig(max_model_len=max_len, max_num_seqs=seqs,
                                                         num_blocks=seqs * -(-max_len // 16) + 8, cuda_graphs=True))
            for i, batch in enumerate(args.batches):
                run_batch(engine, batch, args.prompt_len, 8, cfg.vocab_size, seed=90 + i)
        reports.append(report)
        batches = (1,) if variant.endswith("-unpacked") else args.batches
        built.append((variant, engine, batches, model_bytes(model), time.perf_counter() - t0))
        del model
    rates = {}  # (variant, batch) -> tok/s of each round
    for _ in range(args.rounds):
        for variant, engine, batches, _, _ in built:
            for batch in batches:
                ttft, decode_s = run_batch(engine, batch, args.prompt_len, args.new_tokens, cfg.vocab_size, seed=batch)
                rates.setdefault((variant, batch), []).append((batch * (args.new_tokens - 1) / decode_s, ttft))
    base = {}
    for variant, engine, batches, nbytes, setup_s in built:
        for batch in batches:
            tok_s, ttft = sorted(rates[variant, batch])[len(rates[variant, batch]) // 2]
            graphs = getattr(engine.runner, "graphs", {})
            # the size's graph for any context (its loosest plan), as a step beyond the short-context bounds replays
            general = max(graphs[batch].items(), key=lambda kv: kv[0].max_context)[1][0] if batch in graphs else None
            step_us = replay_time_us(general) if general is not None else None
            base.setdefault(batch, (tok_s, step_us))
            kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2 * batch * (args.prompt_len +
                                                                                    args.new_tokens // 2)
            rec = {"bench": "quant_decode", "machine": machine, "model": "llama-3.1-8b (random weights)",
                   "variant": variant, "batch": batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                   "decode_tok_s": round(tok_s, 1), "speedup_vs_bf16": round(tok_s / base[batch][0], 2),
                   "decode_tok_s_rounds": [round(r, 1) for r, _ in rates[variant, batch]],
                   "ttft_s": round(ttft, 4), "bytes_per_step": nbytes + kv,
                   "roofline_tok_s": round(batch * bandwidth / (nbytes + kv), 1),
                   "fraction_of_roofline": round(tok_s * (nbytes + kv) / (batch * bandwidth), 3),
                   "setup_s": round(setup_s, 1)}
            if step_us:
                rec.update(graph_step_us=round(step_us, 1), graph_tok_s=round(batch * 1e6 / step_us, 1),
                           graph_speedup_vs_bf16=round(base[batch][1] / step_us, 2) if base[batch][1] else None)
            emit(rec, args.out)
            if args.kernels and step_us:
                kernels = step_kernels(general)
                emit({"bench": "quant_step_kernels", "machine": machine, "variant": variant, "batch": batch,
                      "kernel_us": round(sum(t for _, t, _ in kernels), 1),
                      "kernels": [[k[:90], round(t, 2), round(c, 1)] for k, t, c in kernels]}, args.out)
    del built
    gc.collect()
    torch.cuda.empty_cache()


def emit_tuning(args, machine, section, reports):
    """The config each tuned kernel shape chose, with every candidate's time (brrr.kernels.quant.tune)."""
    for tuned in (shape for report in reports for shape in report.shapes):
        if not tuned.timings:  # one candidate: nothing was timed
            continue
        best = min(tuned.timings, key=lambda ct: ct[1])
        emit({"bench": "quant_tuning", "section": section, "machine": machine,
              "key": [str(k) for k in tuned.shape] + [f"bucket {tuned.bucket}"], "best": best[0],
              "best_us": round(best[1] * 1e3, 2), "candidates_us": [round(t * 1e3, 2) for _, t in tuned.timings]},
             args.out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="append the JSON records to this file")
    p.add_argument("--sections", nargs="+", default=["gemm", "prefill", "decode"],
                   choices=["gemm", "prefill", "decode"])
    p.add_argument("--variants", nargs="+", default=["bf16", "w8a16", "w4a16-g128", "w4a16-g128-unpacked"],
                   choices=["bf16", "w8a16", "w4a16-g128", "w4a16-g128-unpacked", "w8a16-lmhead",
                            "gguf-q8_0", "gguf-q4_k_m", "gguf-q6_k",
                            "w4a16-g128-lmhead", "fp8", "fp8-lmhead", "fp8-w8a8"],
                   help="decode variants (-unpacked: q/k/v and gate/up left as separate GEMMs, batch 1 only; "
                        "-lmhead: lm_head quantized too, `brrr quantize --lm-head`; fp8: E4M3 weights with a "
                        "scale a row, weight-only; fp8-w8a8: and E4M3 activations a token, `torch._scaled_mm`)")
    p.add_argument("--gemm-fp8", action="store_true", help="gemm section: weight-only FP8 too")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64], help="decode batch sizes")
    p.add_argument("--gemm-m", nargs="+", type=int, default=[1, 16, 64, 256], help="rows of x in the gemm section")
    p.add_argument("--prompt-len", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3, help="decode: rounds of every variant in turn (median)")
    p.add_argument("--kernels", action="store_true", help="decode: also each kernel's device time in one captured "
                   "step (torch.profiler over graph replays)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/quant_speed.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from brrr.analysis.hardware import measure

    gpu = measure()
    machine = f"{gpu.name}, torch {torch.__version__}"
    emit({"bench": "quant_machine", "machine": machine, "copy_bandwidth_gb_s": round(gpu.bandwidth / 1e9),
          "bf16_matmul_tflop_s": round(gpu.flops["bf16"] / 1e12)}, args.out)
    for section in args.sections:
        t0 = time.perf_counter()
        reports = []
        try:
            if section == "gemm":
                section_gemm(args, machine, reports)
            elif section == "prefill":
                section_prefill(args, machine, reports)
            else:
                section_decode(args, machine, gpu.bandwidth, reports)
            emit_tuning(args, machine, section, reports)
        except Exception as e:  # keep the other sections' records
            import traceback

            traceback.print_exc()
            emit({"bench": f"quant_{section}", "error": f"{type(e).__name__}: {e}"[:500]}, args.out)
        print(f"# section {section}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
