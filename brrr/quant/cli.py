"""`brrr quantize` and `brrr eval ppl|compare|needle` (ppl --context and needle: brrr.evals, long context)."""
from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from gguf import GGML_QUANT_SIZES

import brrr
from brrr.config import COMPACTING_EVICTIONS, EngineConfig
from brrr.config.kv_args import add_kv_cache_args, kv_cache_config
from brrr.errors import BrrrError
from brrr.gguf import is_gguf, open_gguf
from brrr.hub import resolve_model
from brrr.prune.semi_structured import swap_semi_structured
from brrr.quant.checkpoint import quantization_config, save_quantized
from brrr.quant.linear import QuantLinear, projections

GGUF_PROJECTIONS = tuple(f"{n}.weight" for n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                                                 "ffn_down"))
METHODS = ("rtn-int8", "rtn-int4", "gptq", "awq", "nf4", "fp8", "smoothquant", "fp8-w8a8")


def register(sub) -> None:
    p = sub.add_parser("quantize", help="quantize a model's linear layers and write a checkpoint brrr loads and serves")
    p.add_argument("--model", default=None, help="HF model directory (default: brrr's shipped model)")
    p.add_argument("--method", required=True, choices=METHODS,
                   help="rtn-int8 (per channel), rtn-int4/gptq/awq (int4 group-wise), nf4 (double-quantized), "
                        "fp8 (E4M3 weights, per-row scales), smoothquant (W8A8 int8: smoothed int8 weights, int8 "
                        "per-token activations), fp8-w8a8 (E4M3 weights and per-token E4M3 activations)")
    p.add_argument("--group-size", type=int, default=128, help="int4 group size: 32, 64 or 128")
    p.add_argument("--symmetric", action="store_true", help="int4 without zero points")
    p.add_argument("--no-act-order", action="store_true", help="gptq: quantize columns in order")
    p.add_argument("--lm-head", action="store_true",
                   help="also quantize lm_head (round to nearest, the method's format; weight-only methods)")
    p.add_argument("--calib", default=None,
                   help="calibration data (gptq, awq, smoothquant): brrr data dir or text file")
    p.add_argument("--calib-samples", type=int, default=128)
    p.add_argument("--calib-seq-len", type=int, default=256)
    p.add_argument("--device", default="cpu",
                   help="where the model is loaded and quantized (cuda: the calibration forward passes, GPTQ's "
                        "Hessians and column sweeps and AWQ's searches run on the GPU)")
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_quantize)

    ev = sub.add_parser("eval", help="evaluate models: ppl (sliding-window or per-context perplexity), compare "
                                     "(table), needle (passkey retrieval by context length and depth)")
    ev_sub = ev.add_subparsers(dest="eval_command", metavar="EVAL")
    for name, func, helptext in (("ppl", cmd_ppl, "sliding-window perplexity of one model"),
                                 ("compare", cmd_compare, "perplexity, bits/weight, sparsity and size of several models")):
        e = ev_sub.add_parser(name, help=helptext)
        if name == "ppl":
            e.add_argument("--model", default=None)
        else:
            e.add_argument("--models", nargs="+", required=True, help="model dirs; the first is the baseline")
        e.add_argument("--data", required=True,
                       help="brrr data dir (its val split), a text file, or 'stdlib' (the Python standard library's "
                            "*.py files: the shipped default model's kind of text)")
        e.add_argument("--split", default="val")
        e.add_argument("--window", type=int, default=512)
        e.add_argument("--stride", type=int, default=256)
        e.add_argument("--max-tokens", type=int, default=None, help="score only the first N tokens")
        e.add_argument("--device", default="cpu")
        e.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                       help="compute dtype (bfloat16: what the GPU kernels serve; float32 isolates the quantization)")
        if name == "compare":
            e.add_argument("--json", default=None, help="also write the settings and rows to this JSON file")
        else:
            e.add_argument("--context", default=None,
                           help="perplexity per context length instead of sliding windows: comma-separated lengths "
                                "(4k,8k,16k,32k; k = 1024), each over non-overlapping windows of exactly that many "
                                "tokens")
            e.add_argument("--max-windows", type=int, default=None, help="with --context: at most N windows a length")
            e.add_argument("--rope-scaling", default=None,
                           help="with --context: replace the config's RoPE scaling, a JSON object as config.json's "
                                "rope_scaling ('{\"rope_type\": \"yarn\", \"factor\": 4, "
                                "\"original_max_position_embeddings\": 1024}'), or 'none'")
            add_kv_cache_args(e.add_argument_group(
                "KV cache (with --context: any of these scores the windows through the serving engine, whose cache "
                "they set)"))
        e.set_defaults(func=func)
    n = ev_sub.add_parser("needle", help="passkey retrieval: a random number hidden at each depth of a filler "
                                         "context of each length, greedy generation, the rate per cell (JSON)")
    n.add_argument("--model", default=None)
    n.add_argument("--context", default="1k,2k,4k,8k",
                   help="comma-separated context lengths (k = 1024), each at most the model's context")
    n.add_argument("--depths", default="0,25,50,75,100", help="needle depths, percent of the filler before it")
    n.add_argument("--trials", type=int, default=3, help="random passkeys per (length, depth)")
    n.add_argument("--seed", type=int, default=0)
    n.add_argument("--device", default=None)
    n.add_argument("--dtype", default="auto")
    n.add_argument("--json", default=None, help="also write the result to this JSON file")
    n.add_argument("--rope-scaling", default=None,
                   help="replace the config's RoPE scaling (JSON as config.json's rope_scaling, or 'none'); YaRN and "
                        "llama3 raise the model's context to factor x original_max_position_embeddings")
    add_kv_cache_args(n.add_argument_group("KV cache (the engine's, as brrr serve takes them)"))
    n.set_defaults(func=cmd_needle)
    ev.set_defaults(func=lambda args: (ev.print_help(), 2)[1])


def cmd_quantize(args) -> int:
    import torch

    # the quantizers (GPTQ, AWQ, SmoothQuant, calibration) load for this command only: brrr.cli imports this module
    from brrr.quant.calib import calibration_tokens
    from brrr.quant.methods import NEEDS_CALIBRATION, quantize_model

    if args.method in NEEDS_CALIBRATION and not args.calib:
        raise BrrrError(f"--method {args.method} needs calibration data: pass --calib DIR|FILE")
    pre = brrr.load(args.model, dtype="float32", device=args.device)
    calib = None
    if args.calib:
        calib = calibration_tokens(args.calib, pre.tokenizer, args.calib_samples, args.calib_seq_len)
    t0 = time.perf_counter()
    config = quantize_model(pre.model, args.method, args.group_size, args.symmetric, calib,
                            act_order=not args.no_act_order, lm_head=args.lm_head, show_progress=True)
    save_quantized(pre.model, config, args.out, pre.path, dtype=torch.bfloat16)
    print(json.dumps({"method": args.method, "out": args.out, "seconds": round(time.perf_counter() - t0, 2),
                      **config}))
    return 0


def _eval_tokens(args, tokenizer, wanted: int | None = None):
    from brrr.quant.calib import load_tokens  # for `brrr eval` only: brrr.cli imports this module

    if args.data == "stdlib":
        from brrr.evals.context_ppl import stdlib_tokens  # for `brrr eval` only: brrr.cli imports this module

        return stdlib_tokens(tokenizer, args.max_tokens or wanted or 65536)
    tokens = load_tokens(args.data, tokenizer, args.split)
    return tokens[: args.max_tokens] if args.max_tokens else tokens


def cmd_ppl(args) -> int:
    from brrr.quant.evaluate import perplexity  # for `brrr eval` only: brrr.cli imports this module

    pre = brrr.load(args.model, dtype=args.dtype, device=args.device)
    swap_semi_structured(pre.model)  # a 2:4-pruned model runs its sparse GEMM on CUDA (a no-op elsewhere)
    if args.context is not None:
        return _context_ppl(args, pre)
    if args.rope_scaling is not None or args.max_windows is not None or _engine_kv(args):
        raise BrrrError("--rope-scaling, --max-windows and the --kv-* flags go with --context")
    result = perplexity(pre.model, _eval_tokens(args, pre.tokenizer), args.window, args.stride,
                        progress_label=f"ppl {pre.path.name}")
    print(json.dumps({"model": str(pre.path), **result}))
    return 0


def _engine_kv(args) -> dict:
    """The KV flags given (those not at their defaults) as EngineConfig arguments, empty when none is; the policies
    that rewrite blocks in place turn prefix caching off (as `brrr bench throughput` does)."""
    defaults = EngineConfig()
    kv = {k: v for k, v in kv_cache_config(args).items() if v != getattr(defaults, k)}
    if kv.get("kv_eviction") in COMPACTING_EVICTIONS:
        kv["enable_prefix_caching"] = False
    return kv


def _context_ppl(args, pre) -> int:
    # for `brrr eval ppl --context` only: brrr.cli imports this module
    from brrr.evals.context_ppl import (context_perplexity, engine_context_perplexity, model_dir_with_rope,
                                        parse_contexts, scaled_context, with_rope_scaling)
    from brrr.progress import progress  # (as above: for this command only)

    contexts = parse_contexts(args.context)
    cfg = with_rope_scaling(pre.model, args.rope_scaling)
    wanted = max(contexts) * (args.max_windows or 4)
    tokens = _eval_tokens(args, pre.tokenizer, wanted)
    steps = sum(min(len(tokens) // c, args.max_windows or len(tokens)) for c in contexts)
    kv = _engine_kv(args)
    with progress(f"ppl {pre.path.name}", steps, True) as advance, tempfile.TemporaryDirectory() as tmp:
        if kv:  # the engine reads its RoPE from the model directory's config.json
            model = pre.path if args.rope_scaling is None else model_dir_with_rope(pre.path, args.rope_scaling,
                                                                                   Path(tmp) / "model")
            llm = brrr.LLM(model, dtype=args.dtype, device=args.device, **kv)
            rows = engine_context_perplexity(llm, tokens, contexts, args.max_windows, advance)
        else:
            rows = context_perplexity(pre.model, tokens, contexts, args.max_windows, advance)
    rope = {"rope_type": cfg.rope.type, **cfg.rope.params}
    print(json.dumps({"model": str(pre.path), "data": args.data, "rope": rope, "max_context": scaled_context(cfg),
                      **({"kv_cache": kv} if kv else {}), "contexts": rows}))
    return 0


def cmd_needle(args) -> int:
    # for `brrr eval needle` only: the engine and the evals load here, brrr.cli imports this module
    from brrr.evals.context_ppl import model_dir_with_rope, parse_contexts
    from brrr.evals.needle import needle_eval, parse_depths

    contexts, depths = parse_contexts(args.context), parse_depths(args.depths)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if args.rope_scaling is not None:  # the engine reads its RoPE from the model directory's config.json
            model = model_dir_with_rope(resolve_model(args.model), args.rope_scaling, Path(tmp) / "model")
        kv = _engine_kv(args)
        llm = brrr.LLM(model, dtype=args.dtype, device=args.device, **kv)
        cfg = llm.pretrained.model.config
        rope = {"rope_type": cfg.rope.type, **cfg.rope.params}
        result = {"model": str(resolve_model(args.model)), "rope": rope, "trials": args.trials, "seed": args.seed,
                  **({"kv_cache": kv} if kv else {}), **needle_eval(llm, contexts, depths, args.trials, args.seed)}
    text = json.dumps(result)
    print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def gguf_summary(path: Path) -> dict:
    """A GGUF file's projection bits per weight from its block types (docs/gguf.md), its file size."""
    f = open_gguf(path)
    bits = numel = 0
    types: dict[str, int] = {}
    for name, t in f.tensors.items():
        if name.endswith(GGUF_PROJECTIONS):
            block, size = GGML_QUANT_SIZES[t.type]
            bits += t.numel * size * 8 // block
            numel += t.numel
            types[t.type.name] = types.get(t.type.name, 0) + t.numel
    method = "gguf-" + max(types, key=types.get).lower() if types else "gguf"
    return {"method": method, "bits_per_weight": bits / max(numel, 1), "bytes": path.stat().st_size}


def model_summary(path: Path, model) -> dict:
    """method (quantization's, and pruning's from config.json's sparsity_config), stored bits per projection weight,
    the fraction of projection weights that are zero (as the model computes with them: dequantized), bytes of
    *.safetensors (or of the GGUF file)."""
    gguf = is_gguf(path)
    qc = {} if gguf else quantization_config(path) or {}
    pruned = {} if gguf else json.loads((path / "config.json").read_text()).get("sparsity_config") or {}
    bits = numel = zeros = 0
    for _, m in projections(model):
        n = m.in_features * m.out_features
        if isinstance(m, QuantLinear):
            bits += m.stored_bits
            zeros += (m.dequantize() == 0).sum().item()
        else:
            bits += n * {"float32": 32}.get(model.config.torch_dtype, 16)  # as stored, not as loaded
            zeros += (m.weight == 0).sum().item()
        numel += n
    if gguf:  # the file's block types say what is stored; the zeros are the model's as it computes
        return {**gguf_summary(path), "sparsity": zeros / numel}
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    method = qc.get("method", "none")
    if isinstance(pruned, dict) and pruned.get("method"):
        method = f"{pruned['method']} {pruned.get('sparsity_structure', '')}".strip() + \
            (f" + {method}" if qc else "")
    return {"method": method, "bits_per_weight": bits / numel, "sparsity": zeros / numel, "bytes": size}


def cmd_compare(args) -> int:
    from brrr.quant.evaluate import perplexity  # for `brrr eval` only: brrr.cli imports this module

    rows, base = [], None
    tokens = None
    for spec in args.models:
        pre = brrr.load(spec, dtype=args.dtype, device=args.device)
        if tokens is None:
            tokens = _eval_tokens(args, pre.tokenizer)
        row = {"model": spec, **model_summary(pre.path, pre.model)}
        swap_semi_structured(pre.model)  # after counting the zeros: a 2:4 model's sparse GEMM on CUDA
        row = {**row,
               **perplexity(pre.model, tokens, args.window, args.stride,
                            progress_label=f"ppl {len(rows) + 1}/{len(args.models)} {pre.path.name}")}
        base = base or row["ppl"]
        row["delta_pct"] = 100 * (row["ppl"] / base - 1)
        rows.append(row)
    width = max(12, *(len(r["method"]) for r in rows))
    print(f"{'method':<{width}} {'bits/w':>7} {'sparsity':>8} {'MB':>8} {'ppl':>9} {'delta':>8}  model")
    for r in rows:
        print(f"{r['method']:<{width}} {r['bits_per_weight']:>7.2f} {100 * r['sparsity']:>7.1f}% "
              f"{r['bytes'] / 1e6:>8.2f} {r['ppl']:>9.4f} {r['delta_pct']:>+7.2f}%  {r['model']}")
    if args.json:
        settings = {k: getattr(args, k) for k in ("data", "split", "window", "stride", "max_tokens", "device",
                                                  "dtype")}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({**settings, "rows": rows}, indent=2) + "\n")
    return 0
