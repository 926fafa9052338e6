"""2:4 sparse bf16 against dense bf16 on one GPU, Llama-3.1-8B shapes, random weights pruned 2:4 by magnitude
(speed does not depend on the values).

Two sections, one JSON record per result (stdout, and appended to --out):
  gemm    per-GEMM device time of `F.linear(x, W)` with W dense and W a semi-structured sparse tensor
          (brrr.prune.semi_structured.SemiSparseLinear: cuSPARSELt, and the CUTLASS backend beside it) for the 8B
          projections (q/o, k/v, packed qkv, gate/up, packed gate_up, down) at M = 1, 16, 64, 256 (decode) and
          2048, 4096, 8192 (prefill) rows (--gemm-m). Decode sizes are timed as CUDA-graph replays over enough
          weight copies to exceed L2 (each call streams its weights from HBM, GB/s = stored bytes / time);
          prefill sizes with triton's do_bench. A backend that refuses a shape or a capture is recorded as an
          error, the run goes on.
  engine  the whole model through the engine (LLMEngine, as `brrr bench latency`): decode tok/s at --batches and
          the time to first token of one --prefill-len prompt, dense against 2:4 (the engine's
          prepare_for_serving swaps the 2:4 projections to SemiSparseLinear), the median of --rounds rounds that
          take the variants in turn; --no-graphs runs the engine eagerly (should graph capture refuse the sparse
          GEMM).

  PYTHONPATH=$PWD python bench/sparse_speed.py --out bench/results/sparse_speed_h200.jsonl
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

from brrr.bench.latency import emit, run_batch  # noqa: E402
from brrr.bench.timing import graph_time_us  # noqa: E402
from brrr.prune.magnitude import magnitude_prune  # noqa: E402
from brrr.prune.mask import parse_pattern  # noqa: E402
from brrr.prune.semi_structured import SemiSparseLinear, swap_semi_structured  # noqa: E402
from brrr.quant.linear import projections  # noqa: E402

GEMM_SHAPES = {"q/o": (4096, 4096), "k/v": (1024, 4096), "qkv": (6144, 4096), "gate/up": (14336, 4096),
               "gate_up": (28672, 4096), "down": (4096, 14336)}
BF16 = torch.bfloat16
TWO_FOUR = parse_pattern(None, "2:4")
DECODE_MAX_M = 256  # up to here a GEMM is timed over weight copies in a graph (weight-bound); beyond, do_bench


def sparse_linear(w: torch.Tensor, cutlass: bool) -> SemiSparseLinear:
    cls = torch.sparse.SparseSemiStructuredTensor
    cls._FORCE_CUTLASS, before = cutlass, cls._FORCE_CUTLASS  # which backend to_sparse_semi_structured builds
    try:
        return SemiSparseLinear(w, None)
    finally:
        cls._FORCE_CUTLASS = before


def timed_us(calls, m: int) -> float:
    if m <= DECODE_MAX_M:
        return graph_time_us(calls)
    import triton

    return triton.testing.do_bench(calls[0], warmup=25, rep=100, return_mode="median") * 1e3


def section_gemm(args, machine):
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (n, k) in GEMM_SHAPES.items():
        copies = max(3, math.ceil(4 * 60e6 / (n * k)))  # the sparse copies (9/16 of the bytes) still span L2
        weights = [magnitude_prune(torch.randn(n, k, device="cuda", generator=gen, dtype=BF16) * 0.02, TWO_FOUR)
                   for _ in range(copies)]
        variants = {"bf16-dense": (weights, n * k * 2)}
        for backend, cutlass in (("2:4-cusparselt", False), ("2:4-cutlass", True)):
            try:
                variants[backend] = ([sparse_linear(w, cutlass) for w in weights], n * k * 2 * 9 // 16)
            except Exception as e:  # a backend this torch build lacks
                emit({"bench": "sparse_gemm", "shape": name, "variant": backend,
                      "error": f"{type(e).__name__}: {e}"[:300]}, args.out)
        for m in args.gemm_m:
            x = torch.randn(m, k, device="cuda", dtype=BF16)
            base = None
            for variant, (mods, nbytes) in variants.items():
                calls = [lambda w=w: F.linear(x, w) for w in mods] if variant == "bf16-dense" else \
                        [lambda q=q: q(x) for q in mods]
                try:
                    us = timed_us(calls, m)
                except Exception as e:  # a shape or a graph capture the backend refuses
                    emit({"bench": "sparse_gemm", "shape": name, "m": m, "variant": variant,
                          "error": f"{type(e).__name__}: {e}"[:300]}, args.out)
                    continue
                base = base or us
                emit({"bench": "sparse_gemm", "machine": machine, "shape": name, "n": n, "k": k, "m": m,
                      "variant": variant, "us": round(us, 2), "weight_bytes": nbytes,
                      "gb_s": round(nbytes / us / 1e3, 1), "tflop_s": round(2 * m * n * k / us / 1e6, 1),
                      "speedup_vs_dense": round(base / us, 2)}, args.out)
        del weights, variants
        torch.cuda.empty_cache()


def pruned_model(cfg, sparse: bool):
    from brrr.models.random_weights import random_model

    model = random_model(cfg, BF16, torch.device("cuda"))
    if sparse:
        with torch.no_grad():
            for _, linear in projections(model):
                linear.weight.copy_(magnitude_prune(linear.weight, TWO_FOUR))
    return model


def section_engine(args, machine):
    from brrr.config import EngineConfig
    from brrr.engine import LLMEngine
    from brrr.models.random_weights import model_config

    cfg = model_config("llama-3.1-8b")
    max_len = max(args.prefill_len, args.prompt_len + args.new_tokens) + 8
    seqs = max(args.batches)
    built = []
    for variant in ("bf16-dense", "bf16-2:4"):
        model = pruned_model(cfg, variant == "bf16-2:4")
        engine = LLMEngine(model, None, EngineConfig(max_model_len=max_len, max_num_seqs=seqs,
                                                     num_blocks=seqs * -(-max_len // 16) + 8,
                                                     cuda_graphs=not args.no_graphs))
        swapped = sum(isinstance(m, SemiSparseLinear) for m in engine.model.modules())
        if variant == "bf16-2:4" and not swapped:  # prepare_for_serving left it dense (no sparse tensor cores?)
            swapped = len(swap_semi_structured(engine.model))
        for i, batch in enumerate(args.batches):  # warm-up: graphs, tuning
            run_batch(engine, batch, args.prompt_len, 8, cfg.vocab_size, seed=90 + i)
        run_batch(engine, 1, args.prefill_len, 2, cfg.vocab_size, seed=99)
        built.append((variant, engine, swapped))
        del model
    rates: dict = {}
    for _ in range(args.rounds):
        for variant, engine, _ in built:
            for batch in args.batches:
                _, decode_s = run_batch(engine, batch, args.prompt_len, args.new_tokens, cfg.vocab_size, seed=batch)
                rates.setdefault((variant, "decode", batch), []).append(batch * (args.new_tokens - 1) / decode_s)
            ttft, _ = run_batch(engine, 1, args.prefill_len, 2, cfg.vocab_size, seed=7)
            rates.setdefault((variant, "prefill", 1), []).append(ttft)
    base = {}
    for variant, _, swapped in built:
        for (v, kind, batch), values in rates.items():
            if v != variant:
                continue
            median = sorted(values)[len(values) // 2]
            base.setdefault((kind, batch), median)
            rec = {"bench": "sparse_engine", "machine": machine, "model": "llama-3.1-8b (random weights)",
                   "variant": variant, "sparse_modules": swapped, "cuda_graphs": not args.no_graphs,
                   "kind": kind, "batch": batch}
            if kind == "decode":
                rec.update(new_tokens=args.new_tokens, decode_tok_s=round(median, 1),
                           speedup_vs_dense=round(median / base[kind, batch], 3),
                           rounds=[round(r, 1) for r in values])
            else:
                rec.update(prompt_len=args.prefill_len, ttft_s=round(median, 4),
                           speedup_vs_dense=round(base[kind, batch] / median, 3), rounds=[round(r, 4) for r in values])
            emit(rec, args.out)
    del built
    gc.collect()
    torch.cuda.empty_cache()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="append the JSON records to this file")
    p.add_argument("--sections", nargs="+", default=["gemm", "engine"], choices=["gemm", "engine"])
    p.add_argument("--gemm-m", nargs="+", type=int, default=[1, 16, 64, 256, 2048, 4096, 8192])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 16], help="engine decode batch sizes")
    p.add_argument("--prompt-len", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=200)
    p.add_argument("--prefill-len", type=int, default=2048, help="engine: the prompt whose first token is timed")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-graphs", action="store_true", help="engine: no CUDA graphs")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/sparse_speed.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from brrr.analysis.hardware import measure

    gpu = measure()
    machine = f"{gpu.name}, torch {torch.__version__}"
    emit({"bench": "sparse_machine", "machine": machine, "copy_bandwidth_gb_s": round(gpu.bandwidth / 1e9),
          "bf16_matmul_tflop_s": round(gpu.flops["bf16"] / 1e12)}, args.out)
    for section in args.sections:
        t0 = time.perf_counter()
        try:
            (section_gemm if section == "gemm" else section_engine)(args, machine)
        except Exception as e:  # keep the other section's records
            import traceback

            traceback.print_exc()
            emit({"bench": f"sparse_{section}", "error": f"{type(e).__name__}: {e}"[:500]}, args.out)
        print(f"# section {section}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
