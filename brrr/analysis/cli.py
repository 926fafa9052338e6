"""`brrr calc`: model / serve / train / spec / roofline arithmetic as rich tables, or JSON with --json.

brrr/cli.py wires it: `from brrr.analysis.cli import register; register(subparsers)`. Each leaf parser sets
func(args) -> exit code; BrrrError propagates to the main CLI, which prints it and exits 2.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from brrr.analysis import model as arith
from brrr.analysis.finetune import finetune_memory, lora_training_flops_per_token
from brrr.analysis.formats import KV_BYTES, WEIGHT_FORMATS, weight_format
from brrr.analysis.hardware import GPU, GPUS, get_gpu, measure
from brrr.analysis.roofline import plot, roofline, transformer_ops
from brrr.analysis.serve import serve_plan
from brrr.analysis.spec_decode import MAX_K, cost_ratio, spec_plan
from brrr.analysis.train import SCHEDULES, TYPICAL_EFFICIENCY, train_plan
from brrr.config import ModelConfig
from brrr.errors import BrrrError
from brrr.lora import LoraConfig
from brrr.presets import PRESETS, preset_config

DEFAULT_GPU = "h200"
DEFAULT_BATCHES = (1, 8, 16, 32, 64, 128, 256)


def load_model(spec: str) -> ModelConfig:
    """A preset name (brrr.presets) or a Hugging Face model directory / config.json path."""
    if spec in PRESETS:
        return preset_config(spec)
    path = Path(spec).expanduser()
    if path.is_dir() or path.is_file():
        return ModelConfig.from_dir(path)
    raise BrrrError(f"MODEL {spec!r} is neither a preset ({', '.join(PRESETS)}) nor a model directory or "
                    "config.json path")


def _gpu(args) -> GPU:
    return measure() if args.measure else get_gpu(args.gpu)


def _batches(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be >= 1, got {text!r}")
    return values


def _num(x: float, unit: str = "") -> str:
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:,.2f} {prefix}{unit}"
    return f"{x:,.4g} {unit}".rstrip()


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.3f} ms"


def _table(title: str, columns: list[str], rows: list[list]):
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*[str(v) for v in row])
    return table


def _print(items):
    from rich.console import Console
    from rich.measure import Measurement

    console = Console()
    if not console.is_terminal:  # piped: no terminal to fit, so no wrapping at rich's 80 columns either
        wide = console.options.update(max_width=10**6)
        console = Console(width=max([80] + [Measurement.get(console, wide, item).maximum for item in items]))
    for item in items:
        console.print(item)


def _emit_json(obj) -> int:
    json.dump(obj, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")
    return 0


def attention_kind(cfg: ModelConfig) -> str:
    if arith.is_mla(cfg):
        return "MLA"
    if cfg.num_kv_heads == cfg.num_heads:
        return "MHA"
    return "MQA" if cfg.num_kv_heads == 1 else f"GQA ({cfg.num_heads} q / {cfg.num_kv_heads} kv heads)"


def model_summary(cfg: ModelConfig, gpu: GPU, context: int, batches, weight_dtype: str, kv_dtype: str) -> dict:
    counts = arith.param_counts(cfg)
    return {
        "architecture": cfg.architecture, "tied_embeddings": cfg.tie_word_embeddings,
        "experts": {"total": cfg.num_experts, "per_token": cfg.num_experts_per_tok} if cfg.num_experts else None,
        "params": counts, "matmul_params": arith.matmul_params(cfg),
        "weight_bytes": {f: arith.weight_bytes(cfg, f) for f in ("fp32", "bf16", "fp8", "int8", "int4")},
        "context": context,
        "flops_per_token": {"prefill": arith.prefill_flops_per_token(cfg, context),
                            "decode": arith.flops_per_token(cfg, context), "two_n": 2 * arith.matmul_params(cfg),
                            "training": arith.training_flops_per_token(cfg, context)},
        "kv": {"attention": attention_kind(cfg), "sliding_window": cfg.sliding_window,
               "bytes_per_token": {d: arith.kv_bytes_per_token(cfg, d) for d in ("bf16", "fp8")},
               "bytes_per_sequence": {d: arith.kv_bytes_per_sequence(cfg, context, d) for d in ("bf16", "fp8")}},
        "gpu": gpu.name, "weight_dtype": weight_format(weight_dtype).name, "kv_dtype": kv_dtype,
        "ridge": gpu.ridge(weight_format(weight_dtype).compute_dtype),
        "decode": [{"batch": b, "flops": arith.decode_flops_per_step(cfg, b, context),
                    "bytes": arith.decode_bytes_per_step(cfg, b, context, weight_dtype, kv_dtype),
                    "intensity": arith.decode_intensity(cfg, b, context, weight_dtype, kv_dtype)} for b in batches],
        "compute_bound_batch": arith.compute_bound_batch(cfg, gpu, context, weight_dtype, kv_dtype),
    }


def cmd_model(args) -> int:
    cfg, gpu = load_model(args.model), _gpu(args)
    s = model_summary(cfg, gpu, args.context, args.batch, args.weights, args.kv)
    if args.json:
        return _emit_json({"model": args.model, **s})
    p = s["params"]
    parts = ("embedding", "attention", "mlp", "norms", "head")
    part_rows = [[k, _num(p[k]), f"{p[k] / p['total']:.1%}"] for k in parts]
    part_rows.append(["total", _num(p["total"]), "tied head" if cfg.tie_word_embeddings else ""])
    if cfg.num_experts:
        part_rows.append([f"active per token ({cfg.num_experts_per_tok} of {cfg.num_experts} experts)",
                          _num(p["active"]), f"{p['active'] / p['total']:.1%}"])
    f = s["flops_per_token"]
    kv = s["kv"]
    cb = s["compute_bound_batch"]
    _print([
        f"{args.model}: {cfg.architecture}",
        _table("parameters", ["part", "params", "share"], part_rows),
        "linear weights in the format; embeddings, norms, biases, routers 16-bit; int4 = groups of 128 "
        "with a bf16 scale and zero each",
        _table("weights in memory", ["format", "bytes"], [[k, _num(v, "B")] for k, v in s["weight_bytes"].items()]),
        _table(f"FLOPs per token, S={args.context}", ["", "FLOPs"],
               [["2N (N = matmul params, head in, embedding out)", _num(f["two_n"])],
                ["prefill (causal average)", _num(f["prefill"])], ["decode", _num(f["decode"])],
                ["training (fwd + bwd)", _num(f["training"])]]),
        f"KV cache: {kv['attention']}" + (f", sliding window {cfg.sliding_window}" if cfg.sliding_window else ""),
        _table("KV cache", ["dtype", "per token", f"per sequence of {args.context}"],
               [[d, _num(kv["bytes_per_token"][d], "B"), _num(kv["bytes_per_sequence"][d], "B")]
                for d in ("bf16", "fp8")]),
        f"decode step at context {args.context} on {gpu.name}: weights {s['weight_dtype']}, KV {args.kv}, "
        f"ridge {s['ridge']:.0f} FLOP/B",
        _table("decode step", ["batch", "FLOPs", "bytes", "FLOP/B", "bound"],
               [[d["batch"], _num(d["flops"]), _num(d["bytes"], "B"), f"{d['intensity']:.1f}",
                 "compute" if d["intensity"] >= s["ridge"] else "memory"] for d in s["decode"]]),
        f"decode turns compute-bound at batch {cb}" if cb else
        "decode stays memory-bound at every batch at this context (the KV reads alone are below the ridge)",
    ])
    return 0


def cmd_serve(args) -> int:
    cfg, gpu = load_model(args.model), _gpu(args)
    r = serve_plan(cfg, gpu, tp=args.tp, weight_dtype=args.weights, kv_dtype=args.kv, util=args.util,
                   context=args.context, prompt=args.prompt, batches=args.batch)
    if args.json:
        return _emit_json({"model": args.model, **r})
    mem = [["GPU memory", _num(r["memory_per_gpu"], "B")],
           [f"budget (util {args.util})", _num(r["budget_per_gpu"], "B")],
           [f"weights ({r['weight_dtype']}, /tp)", _num(r["weights_per_gpu"], "B")],
           ["activation reserve (8k-token prefill chunk)", _num(r["activation_reserve_per_gpu"], "B")],
           ["left for KV cache", _num(r["kv_memory_per_gpu"], "B")],
           [f"KV per token ({args.kv})", _num(r["kv_bytes_per_token_per_gpu"], "B")],
           ["KV tokens that fit", f"{r['kv_tokens']:,}"],
           [f"sequences of {args.context} tokens that fit", f"{r['max_sequences']:,}"]]
    dec = [[d["batch"], _ms(d["step_s"]), f"{d['tok_s_per_seq']:,.1f}", f"{d['tok_s_total']:,.0f}", d["bound"],
            _ms(d["comm_s"]), "yes" if d["fits"] else "no"] for d in r["decode"]]
    t = r["ttft"]
    items = [
        f"{args.model} on {args.tp} x {gpu.name}",
        _table("memory per GPU", ["", ""], mem),
        f"decode at context {args.context}, roofline bound: max(bytes / bandwidth, FLOPs / peak) + TP all-reduces",
        _table("decode", ["batch", "step", "tok/s per seq", "tok/s total", "bound", "comm", "KV fits"], dec),
        f"TTFT for a {args.prompt}-token prompt: {_ms(t['ttft_s'])} ({t['bound']}-bound; "
        f"compute {_ms(t['compute_s'])}, memory {_ms(t['memory_s'])}, comm {_ms(t['comm_s'])})",
    ]
    if not r["fits"]:
        items.insert(1, f"[red]does not fit: weights {_num(r['weights_per_gpu'], 'B')} + reserve leave no room for "
                        f"one {args.context}-token sequence in {_num(r['budget_per_gpu'], 'B')}[/red]")
    _print(items)
    return 0


def cmd_train(args) -> int:
    cfg, gpu = load_model(args.model), _gpu(args)
    if args.lora_r is not None:
        return _cmd_finetune(args, cfg, gpu)
    r = train_plan(cfg, gpu, gpus=args.gpus, zero=args.zero, tp=args.tp, pp=args.pp, micro_batch=args.micro_batch,
                   seq_len=args.seq_len, microbatches=args.microbatches, checkpointing=args.checkpointing,
                   schedule=args.schedule, chunks=args.chunks, gpus_per_node=args.gpus_per_node,
                   efficiency=args.efficiency, ep=args.ep)
    if args.json:
        return _emit_json({"model": args.model, **r})
    m, c, t, b = r["memory"], r["communication_bytes"], r["time"], r["bubble"]
    ep = f" (ep {r['ep']} of them)" if r["ep"] > 1 else ""
    layout = (f"{args.model} ({_num(r['params'])} params) on {r['gpus']} x {gpu.name}: dp {r['dp']}{ep} x tp {r['tp']} "
              f"x pp {r['pp']}, ZeRO-{r['zero']}, micro-batch {r['micro_batch']} x {r['seq_len']} tokens, "
              f"{r['microbatches']} microbatches, {'checkpointing' if r['checkpointing'] else 'no recompute'}")
    _print([
        layout,
        "mixed-precision AdamW as PyTorch holds it: fp32 master weights 4 + fp32 grads 4 + Adam m, v 8 bytes per "
        "parameter, bf16 working copies while a step uses them",
        _table("memory per GPU", ["", "bytes"],
               [[k.replace("_", " "), _num(m[k], "B")] for k in
                ("params", "grads", "optimizer", "working_weights", "ddp_buckets", "activations", "loss",
                 "reduce_scatter", "end_of_forward", "end_of_backward") if m[k]]
               + [[f"peak ({m['peak']})", _num(m["total"], "B")],
                  ["fits in " + _num(m["gpu_memory"], "B"), "yes" if m["fits"] else "NO"]]
               + ([["pipeline rank", m["rank"]]] if "rank" in m else [])),
        _table("bytes sent per GPU per step", ["", "bytes"],
               [[k.replace("_", " "), _num(v, "B")] for k, v in c.items() if v or k != "expert_parallel"]
               + ([["all-to-all per forward (dispatch + combine)", _num(r["all_to_all_bytes_per_forward"], "B")]]
                  if r["ep"] > 1 else [])),
        _table("step", ["", ""],
               [[f"pipeline bubble ({r['schedule']})",
                 f"{b['fraction']:.1%} of the step ({b['overhead']:.1%} overhead)"],
                ["layers per stage (the last runs the head)",
                 f"{'/'.join(map(str, r['stage_layers']))}: busiest rank {r['stage_imbalance']:.2f}x the mean"],
                ["FLOPs per token (6N + attention)", _num(r["flops"]["per_token"])],
                ["assumed matmul efficiency (--efficiency)", f"{r['efficiency']:.0%} of the bf16 peak"],
                ["compute", _ms(t["compute_s"])], ["with bubble and stage imbalance", _ms(t["pipeline_s"])],
                ["tensor-parallel collectives", _ms(t["tensor_parallel_s"])],
                *([["expert-parallel all-to-alls", _ms(t["expert_parallel_s"])]] if r["ep"] > 1 else []),
                ["data-parallel traffic (exposed)",
                 f"{_ms(t['data_parallel_s'])} ({_ms(t['data_parallel_exposed_s'])})"],
                ["step", _ms(t["step_s"])], ["tokens/s", f"{r['tokens_per_s']:,.0f}"], ["MFU", f"{r['mfu']:.1%}"]]),
    ])
    return 0


def _cmd_finetune(args, cfg, gpu) -> int:
    """`brrr calc train --lora-r R [--qlora]`: one GPU fine-tuning adapters over a frozen base."""
    targets = tuple(t.strip() for t in args.target_modules.split(",") if t.strip())
    checkpointing = "selective" if args.selective_checkpointing else "full" if args.checkpointing else "none"
    m = finetune_memory(cfg, r=args.lora_r, targets=targets, qlora=args.qlora, dora=args.use_dora,
                        dropout=args.lora_dropout > 0, micro_batch=args.micro_batch, seq_len=args.seq_len,
                        checkpointing=checkpointing)
    lora = LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, target_modules=targets, use_dora=args.use_dora)
    flops = lora_training_flops_per_token(cfg, args.seq_len, lora, recompute=checkpointing == "full")
    tokens_per_s = gpu.peak("bf16") * args.efficiency / flops
    r = {"model": args.model, "gpu": gpu.name, "method": "qlora" if args.qlora else "lora", "r": args.lora_r,
         "targets": list(targets), "dora": args.use_dora, "micro_batch": args.micro_batch, "seq_len": args.seq_len,
         "checkpointing": checkpointing, "memory": {**m, "gpu_memory": gpu.memory, "fits": m["total"] <= gpu.memory},
         "flops_per_token": flops, "efficiency": args.efficiency, "tokens_per_s": tokens_per_s}
    if args.json:
        return _emit_json(r)
    base = "NF4 + double quant (0.516 B/param) projections, bf16 embeddings and norms" if args.qlora else "bf16"
    _print([
        f"{args.model} {r['method']} r={args.lora_r} on one {gpu.name}: micro-batch {args.micro_batch} x "
        f"{args.seq_len} tokens, {checkpointing} activation checkpointing; frozen base {base}",
        f"adapters: {_num(m['adapter_params'])} params, 16 bytes each (fp32 weight, grad, Adam m and v)",
        _table("memory", ["", "bytes"],
               [[k.replace("_", " "), _num(m[k], "B")] for k in ("base_weights", "adapter_weights", "adapter_grads",
                                                               "optimizer", "activations", "logits",
                                                               "dequantized_weight", "total")]
               + [["fits in " + _num(gpu.memory, "B"), "yes" if m["total"] <= gpu.memory else "NO"]]),
        _table("step", ["", ""], [["FLOPs per token (frozen base: ~4N + attention)", _num(flops)],
                                  ["assumed matmul efficiency (--efficiency)", f"{args.efficiency:.0%}"],
                                  ["tokens/s", f"{tokens_per_s:,.0f}"]]),
    ])
    return 0


def cmd_roofline(args) -> int:
    gpu = _gpu(args)
    cfg = load_model(args.model)
    ops = transformer_ops(cfg, context=args.context, batch=args.batch_size)
    r = roofline(gpu, ops)
    if args.plot:
        r["plot"] = plot(gpu, ops, args.plot)
    if args.json:
        return _emit_json(r)
    _print([
        f"{gpu.name}: {r['peak_flops'] / 1e12:,.0f} TFLOP/s bf16, {r['bandwidth'] / 1e12:.2f} TB/s, "
        f"ridge {r['ridge']:.0f} FLOP/B  ({gpu.source}); op shapes from {args.model}",
        _table("ops on the roofline", ["op", "FLOPs", "bytes", "FLOP/B", "bound", "attainable", "min time"],
               [[p["name"], _num(p["flops"]), _num(p["bytes"], "B"), f"{p['intensity']:,.1f}", p["bound"],
                 _num(p["attainable_flops"], "FLOP/s"), f"{p['min_time_s'] * 1e6:,.1f} us"] for p in r["ops"]]),
        *([f"plot written to {r['plot']}"] if args.plot else []),
    ])
    return 0


def _rates(text: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a rate or comma-separated per-position rates, got {text!r}") \
            from None


def _is_eagle_head(path: str) -> bool:
    """A directory `brrr train-draft` wrote: its cost is the target's head shape, whatever its config says."""
    file = Path(path) / "config.json"
    try:
        return json.loads(file.read_text()).get("architectures") == ["EagleHead"]
    except (OSError, ValueError, AttributeError):
        return False


def cmd_spec(args) -> int:
    if args.k is not None and not 1 <= args.k <= MAX_K:
        raise BrrrError(f"-k {args.k} must be in [1, {MAX_K}]")
    costs = None
    if args.cost_ratio is not None:
        if args.target or args.draft:
            raise BrrrError("give --cost-ratio, or --target and --draft to derive it, not both")
        c = args.cost_ratio
    elif args.target and args.draft:
        if args.batch_size < 1 or args.context < 1:
            raise BrrrError(f"--batch-size ({args.batch_size}) and --context ({args.context}) must be >= 1")
        draft = None if args.draft == "eagle" or _is_eagle_head(args.draft) else load_model(args.draft)
        costs = cost_ratio(load_model(args.target), draft, _gpu(args), args.batch_size, args.context, args.weights)
        c = costs["cost_ratio"]
    else:
        raise BrrrError("give the draft/target cost ratio: --cost-ratio C, or --target MODEL --draft MODEL|eagle")
    rates = args.acceptance
    one = len(rates) == 1
    r = spec_plan(acceptance=rates[0] if one else None, rates=None if one else rates, cost=c,
                  ks=range(1, max(8, args.k or 0) + 1))
    if costs:
        r.update(costs, target=args.target, draft=args.draft, gpu=_gpu(args).name, batch=args.batch_size,
                 context=args.context)
    if args.k is not None:
        r["k"] = args.k
    if args.json:
        return _emit_json(r)
    items = []
    if costs:
        items.append(f"c = draft step / target step on {r['gpu']} (roofline, batch {args.batch_size}, context "
                     f"{args.context}, {args.weights}): {costs['draft_step_s'] * 1e6:,.2f} us / "
                     f"{costs['target_step_s'] * 1e6:,.2f} us"
                     f" = {c:.4f}" + (" (EAGLE head: 1 target layer + fc + LM head)" if draft is None else ""))
    source = f"a = {rates[0]}" if one else "per-position acceptance " + ", ".join(f"{x:g}" for x in rates)
    items.append(f"{source}, c = {c:.4f}: E = 1 + r_1 + ... + r_k tokens per verify, S = E / (1 + k c)")
    items.append(_table("speculative decoding", ["k", "E (tokens / verify)", "speedup S", ""],
                        [[row["k"], f"{row['expected_tokens']:.3f}", f"{row['speedup']:.3f}x",
                          " ".join(m for m, on in (("best", row["k"] == r["best_k"]), ("-k", row["k"] == args.k))
                                   if on)] for row in r["rows"]]))
    items.append(f"best k = {r['best_k']}: {r['best_speedup']:.3f}x")
    _print(items)
    return 0


def _common(p: argparse.ArgumentParser, model: bool = True):
    if model:
        p.add_argument("model", metavar="MODEL", help=f"HF model directory or preset: {', '.join(PRESETS)}")
    p.add_argument("--gpu", default=DEFAULT_GPU, help=f"one of {', '.join(GPUS)} (default {DEFAULT_GPU})")
    p.add_argument("--measure", action="store_true", help="measure this machine's GPU instead of a datasheet")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")


def register(subparsers) -> argparse.ArgumentParser:
    calc = subparsers.add_parser("calc", help="performance arithmetic: params, FLOPs, KV, serving, training, speculative decoding, roofline",
                                 description="Performance arithmetic (formulas: docs/arithmetic.md).")
    sub = calc.add_subparsers(dest="calc_command", required=True)

    p = sub.add_parser("model", help="parameters, bytes, FLOPs per token, KV cache, decode intensity")
    _common(p)
    p.add_argument("--context", type=int, default=4096, help="context length S (default 4096)")
    p.add_argument("--batch", type=_batches, default=DEFAULT_BATCHES, help="decode batch sizes, e.g. 1,8,64")
    p.add_argument("--weights", default="bf16", help=f"weight format: {', '.join(WEIGHT_FORMATS)}")
    p.add_argument("--kv", default="bf16", help=f"KV-cache dtype: {', '.join(KV_BYTES)}")
    p.set_defaults(func=cmd_model)

    p = sub.add_parser("serve", help="KV capacity, decode tok/s per batch size, TTFT")
    _common(p)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel GPUs")
    p.add_argument("--weights", default="bf16", help=f"weight format: {', '.join(WEIGHT_FORMATS)}")
    p.add_argument("--kv", default="bf16", help=f"KV-cache dtype: {', '.join(KV_BYTES)}")
    p.add_argument("--util", type=float, default=0.9, help="fraction of GPU memory brrr may use (default 0.9)")
    p.add_argument("--context", type=int, default=4096, help="tokens per sequence, prompt + output (default 4096)")
    p.add_argument("--prompt", type=int, default=1024, help="prompt length for TTFT (default 1024)")
    p.add_argument("--batch", type=_batches, default=DEFAULT_BATCHES, help="decode batch sizes, e.g. 1,64")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("train", help="per-GPU memory, communication, pipeline bubble, step time and MFU")
    _common(p)
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3))
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1,
                   help="expert parallel: an MoE model's experts split over this many of the data-parallel ranks")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per microbatch per data-parallel rank")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--microbatches", type=int, default=None, help="per step (default 1, or 4 x pp with pp > 1)")
    p.add_argument("--checkpointing", action="store_true", help="recompute each layer in backward")
    p.add_argument("--schedule", default="1f1b", choices=SCHEDULES)
    p.add_argument("--chunks", type=int, default=1, help="model chunks per GPU for --schedule interleaved")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--efficiency", type=float, default=TYPICAL_EFFICIENCY,
                   help="fraction of the bf16 peak the matmuls reach (default: typical of large bf16 runs; 1 = the "
                        "roofline, what the layout alone costs)")
    lora = p.add_argument_group("fine-tuning adapters on one GPU (brrr finetune)")
    lora.add_argument("--lora-r", type=int, default=None, help="LoRA rank: plan LoRA fine-tuning instead")
    lora.add_argument("--qlora", action="store_true", help="with --lora-r: the frozen base in NF4 + double quant")
    lora.add_argument("--use-dora", action="store_true", help="with --lora-r: DoRA magnitudes too")
    lora.add_argument("--lora-dropout", type=float, default=0.05, help="with --lora-r: > 0 keeps dropped inputs")
    lora.add_argument("--target-modules", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")
    lora.add_argument("--selective-checkpointing", action="store_true",
                      help="with --lora-r: keep matmul outputs, recompute the rest")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("spec", help="speculative decoding: tokens per verify and speedup by k, and the best k",
                       description="E = 1 + r_1 + ... + r_k (r_i = a^i for one rate a), S = E / (1 + k c); "
                                   "docs/speculative.md derives both.")
    _common(p, model=False)
    p.add_argument("--acceptance", type=_rates, required=True, metavar="A[,A2,...]",
                   help="acceptance rate a of each draft token, or per-position rates r_1,r_2,... (accepted at "
                        "position i / drafts, as `brrr bench` and vLLM report them)")
    p.add_argument("-k", "--num-speculative-tokens", dest="k", type=int, default=None,
                   help="mark this k in the table (the table covers k = 1..8, or up to k)")
    p.add_argument("--cost-ratio", type=float, default=None, help="c: one draft step's time / one target step's")
    p.add_argument("--target", default=None, help="target model (preset or HF dir): derive c on the roofline")
    p.add_argument("--draft", default=None,
                   help="draft model (preset or HF dir), or 'eagle' (or an EAGLE head's dir) for the target's head")
    p.add_argument("--batch-size", type=int, default=1, help="decode batch for the roofline step times")
    p.add_argument("--context", type=int, default=4096, help="context for the roofline step times")
    p.add_argument("--weights", default="bf16", help=f"weight format: {', '.join(WEIGHT_FORMATS)}")
    p.set_defaults(func=cmd_spec)

    p = sub.add_parser("roofline", help="the GPU's roofline with named ops placed on it (--plot PNG)")
    _common(p, model=False)
    p.add_argument("--model", default="llama-3.1-8b", help="shapes for the ops (preset or HF dir)")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--batch-size", type=int, default=64, help="batch for the decode GEMM / attention ops")
    p.add_argument("--plot", default=None, metavar="PNG", help="write the roofline plot here (needs brrr[plot])")
    p.set_defaults(func=cmd_roofline)
    return calc
