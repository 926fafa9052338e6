"""`brrr bench finetune`: LoRA / QLoRA SFT speed and memory on one GPU: brrr (the step `brrr finetune` runs)
beside PEFT + transformers on the same shape, batch and sequence length, and beside `brrr calc train --lora-r`'s
predicted peak.

Every variant runs in its own process (so each peak is its own): random weights of a preset shape (nothing is
downloaded), one packed row of --seq-len tokens per micro-batch (micro-batch 1: one document, all tokens trained),
activation checkpointing, bf16 autocast, fused AdamW on the adapters only, r/alpha/dropout/targets alike.
  brrr-lora     bf16 base (brrr.models.random_weights), LoraLinear on the targets
  brrr-lora-selective   the same with selective checkpointing (`--activation-checkpointing selective`): matmul and
                attention outputs kept, only norms, RoPE, SwiGLU, dropout and rank-r expansions recomputed
  brrr-qlora    NF4 + double-quant base built one tensor at a time (brrr.lora.qlora.random_nf4_model)
  peft-lora     transformers' LlamaForCausalLM (sdpa attention, bf16) from the same config, peft.get_peft_model,
                gradient_checkpointing_enable(use_reentrant=False)
  peft-qlora    the same with bitsandbytes' Linear4bit (nf4, double quant) in place of the projections; skipped,
                with the reason in its record, where bitsandbytes is not installed
PEFT, transformers and bitsandbytes are imported only by the peft-* variants.
Tokens/s is timed over --steps optimizer steps after --warmup; peak memory is torch.cuda.max_memory_allocated from
the end of model building to the end of the timed steps (the build's own peak is reported apart).

  brrr bench finetune --model llama-3.1-8b --seq-len 2048 --out bench/results/finetune_speed_h100.jsonl
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from brrr.analysis.finetune import DEFAULT_TARGETS, finetune_memory
from brrr.bench.latency import emit, require_at_least
from brrr.kernels import AttnMeta
from brrr.lora import LoraConfig
from brrr.lora.layers import apply_lora
from brrr.models.random_weights import model_config, random_model
from brrr.train.finetune import SFTLoss
from brrr.train.trainer import autocast_for, checkpoint_activations, optimizer_step

VARIANTS = ("brrr-lora", "brrr-lora-selective", "brrr-qlora", "peft-lora", "peft-qlora")


def brrr_setup(args, qlora: bool, selective: bool = False):
    import torch

    from brrr.lora.qlora import random_nf4_model  # the QLoRA kernels load for NF4 runs only

    cfg = model_config(args.model)
    device = _device()
    model = random_nf4_model(cfg, device, torch.bfloat16) if qlora else random_model(cfg, torch.bfloat16, device)
    torch.manual_seed(0)
    apply_lora(model, LoraConfig(r=args.r, lora_alpha=args.alpha, target_modules=DEFAULT_TARGETS, lora_dropout=args.dropout))
    model.train()
    checkpoint_activations(model, selective=selective)
    loss = SFTLoss(model, recompute_logits=not selective)  # as brrr finetune pairs them
    n = args.seq_len
    positions = torch.arange(n, device=device)
    meta = AttnMeta.causal([n], device)

    def batch(ids):
        return ids[:-1], ids[1:], positions, meta

    return cfg, model, loss, batch


def peft_setup(args, qlora: bool):
    import torch

    import peft
    import transformers

    cfg = model_config(args.model)
    hf_config = transformers.LlamaConfig(**{k: v for k, v in cfg.to_hf().items()
                                            if k not in ("architectures", "torch_dtype", "dtype")})
    hf_config._attn_implementation = "sdpa"
    device = _device()
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = transformers.LlamaForCausalLM(hf_config)
    finally:
        torch.set_default_dtype(default)
    model.requires_grad_(False)
    if qlora:
        _to_bnb_nf4(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = peft.get_peft_model(model, peft.LoraConfig(r=args.r, lora_alpha=args.alpha, lora_dropout=args.dropout,
                                                       target_modules=list(DEFAULT_TARGETS), task_type="CAUSAL_LM"))
    model.train()

    def loss(ids):  # transformers shifts the labels itself
        return model(input_ids=ids, labels=ids).loss

    def batch(ids):
        return (ids[None, :-1],)

    return cfg, model, loss, batch


def _to_bnb_nf4(model):
    """Each decoder projection -> bitsandbytes' Linear4bit (nf4, double quantization, bf16 compute), freeing the
    bf16 weight as it goes."""
    import bitsandbytes as bnb
    import torch

    for name, module in list(model.named_modules()):
        if name.rsplit(".", 1)[-1] not in DEFAULT_TARGETS or not isinstance(module, torch.nn.Linear):
            continue
        q = bnb.nn.Linear4bit(module.in_features, module.out_features, bias=module.bias is not None,
                              compute_dtype=torch.bfloat16, compress_statistics=True, quant_type="nf4",
                              device="meta")
        q.weight = bnb.nn.Params4bit(module.weight.data.cpu(), requires_grad=False, compress_statistics=True,
                                     quant_type="nf4").to(module.weight.device)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, q)
        del module
    torch.cuda.empty_cache()


def run_variant(variant: str, args) -> dict:
    import torch

    qlora = variant.endswith("qlora")
    device = _device()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    if variant.startswith("brrr"):
        cfg, model, loss_fn, batch = brrr_setup(args, qlora, selective=variant.endswith("selective"))
    else:
        cfg, model, loss_fn, batch = peft_setup(args, qlora)
    _sync(device)
    build_s, build_peak = time.perf_counter() - t0, torch.cuda.max_memory_allocated() if cuda else 0
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0, fused=cuda)
    gen = torch.Generator(device=device).manual_seed(0)
    rows = [torch.randint(0, cfg.vocab_size, (args.seq_len + 1,), device=device, generator=gen) for _ in range(2)]
    autocast = autocast_for(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for i in range(args.warmup):
        optimizer_step(loss_fn, optimizer, params, [batch(rows[i % 2])], 1.0, autocast)
    _sync(device)
    t0 = time.perf_counter()
    for i in range(args.steps):
        loss, _ = optimizer_step(loss_fn, optimizer, params, [batch(rows[i % 2])], 1.0, autocast)
    _sync(device)
    step_s = (time.perf_counter() - t0) / args.steps
    checkpointing = "selective" if variant.endswith("selective") else "full"
    predicted = finetune_memory(cfg, r=args.r, targets=DEFAULT_TARGETS, qlora=qlora, dropout=args.dropout > 0,
                                micro_batch=1, seq_len=args.seq_len, checkpointing=checkpointing)
    return {"bench": "finetune_speed", "variant": variant, "model": args.model, "seq_len": args.seq_len,
            "micro_batch": 1, "r": args.r, "alpha": args.alpha, "dropout": args.dropout, "targets": list(DEFAULT_TARGETS),
            "activation_checkpointing": checkpointing, "trainable_params": sum(p.numel() for p in params),
            "step_ms": step_s * 1e3, "tokens_per_s": args.seq_len / step_s, "final_loss": float(loss),
            "peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9 if cuda else None,
            "build_peak_memory_gb": build_peak / 1e9,
            "build_s": build_s, "predicted_peak_gb": predicted["total"] / 1e9, "predicted": predicted,
            "gpu": torch.cuda.get_device_name() if cuda else "cpu",
            "torch": torch.__version__, "python": platform.python_version(), **_versions(variant)}


def _device():
    """The GPU (a CPU run only checks that a variant runs: its numbers mean nothing)."""
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _sync(device):
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def _versions(variant: str) -> dict:
    if not variant.startswith("peft"):
        return {}
    import peft
    import transformers

    return {"peft": peft.__version__, "transformers": transformers.__version__}


def register(bench_sub) -> None:
    p = bench_sub.add_parser("finetune", help="LoRA / QLoRA SFT tokens/s and peak memory, brrr beside PEFT",
                             description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3.1-8b", help="a preset (brrr.presets) or a model directory")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--r", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--dropout", type=float, default=0.05)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--timeout", type=float, default=60, help="seconds per variant")
    p.add_argument("--variant", default=None, help=argparse.SUPPRESS)  # the child process's one variant
    p.add_argument("--out", default=None, help="append the JSON records to this file too")
    p.set_defaults(func=cmd_finetune)


def cmd_finetune(args) -> int:
    require_at_least(steps=(args.steps, 1), warmup=(args.warmup, 0), seq_len=(args.seq_len, 1), r=(args.r, 1),
                     timeout=(args.timeout, 1))
    if args.variant:
        print(json.dumps(run_variant(args.variant, args)), flush=True)
        return 0
    records = []
    for variant in args.variants:
        if variant == "peft-qlora" and not _has_bitsandbytes():
            record = {"bench": "finetune_speed", "variant": variant, "model": args.model,
                      "skipped": "bitsandbytes is not installed: PEFT's QLoRA needs it; peft-lora (bf16) is the "
                                 "PEFT baseline"}
        else:
            record = _child(variant, args)
        records.append(record)
        emit(record, args.out)
    by = {r["variant"]: r for r in records if "tokens_per_s" in r}
    for mine in ("brrr-lora", "brrr-lora-selective"):
        if mine in by and "peft-lora" in by:
            print(f"LoRA tokens/s {mine} / peft-lora: {by[mine]['tokens_per_s'] / by['peft-lora']['tokens_per_s']:.2f}x"
                  f" (target >= 1.5x)")
    if "brrr-qlora" in by and by["brrr-qlora"]["peak_memory_gb"] is not None:
        print(f"QLoRA peak memory: {by['brrr-qlora']['peak_memory_gb']:.2f} GB (target <= 10 GB; predicted "
              f"{by['brrr-qlora']['predicted_peak_gb']:.2f} GB)")
    return 0 if all("error" not in r for r in records) else 1


def _has_bitsandbytes() -> bool:
    try:
        import bitsandbytes  # noqa: F401
    except Exception:
        return False
    return True


def _child(variant: str, args) -> dict:
    cmd = [sys.executable, "-m", "brrr", "bench", "finetune", "--variant", variant, "--model", args.model,
           "--seq-len", str(args.seq_len), "--r", str(args.r), "--alpha", str(args.alpha), "--dropout",
           str(args.dropout), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    # the child imports this brrr, wherever the parent found it (a checkout on PYTHONPATH or an install)
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"bench": "finetune_speed", "variant": variant, "model": args.model,
                "error": f"did not finish in {args.timeout:.0f} s"}
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"bench": "finetune_speed", "variant": variant, "model": args.model,
                "error": (done.stderr or done.stdout)[-2000:]}
    return json.loads(lines[-1])

