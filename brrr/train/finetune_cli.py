"""`brrr finetune` (LoRA / QLoRA SFT into a PEFT adapter) and `brrr merge` (an adapter folded into its base),
registered by brrr/train/cli.py."""
from __future__ import annotations

import json

from brrr.cli import HelpFormatter


def register(sub):
    from brrr.train.finetune import FinetuneConfig

    defaults = FinetuneConfig("", "", "")
    d, t = defaults.loop, defaults.task
    p = sub.add_parser("finetune", help="LoRA / QLoRA supervised fine-tuning on chat JSONL -> a PEFT adapter",
                       formatter_class=HelpFormatter)
    p.add_argument("--model", default=None, help="base: an HF model directory or hub id (default: brrr's model)")
    p.add_argument("--data", required=True,
                   help='JSONL, one example a line: {"messages": [...]} (OpenAI chat) or {"prompt", "completion"}')
    p.add_argument("--out", required=True,
                   help="output: a PEFT adapter directory, plus checkpoint/ and train_log.jsonl")
    p.add_argument("--eval-data", default=None, help="held-out JSONL (default: --val-fraction of --data)")
    p.add_argument("--val-fraction", type=float, default=t.val_fraction,
                   help="share of --data held out for the eval loss when --eval-data is not given")
    p.add_argument("--lora-r", type=int, default=t.lora_r, help="adapter rank")
    p.add_argument("--lora-alpha", type=float, default=t.lora_alpha, help="the update is scaled by alpha / r")
    p.add_argument("--lora-dropout", type=float, default=t.lora_dropout, help="dropout on the adapters' input")
    p.add_argument("--target-modules", default=t.target_modules, help="comma-separated module names (PEFT's rule)")
    p.add_argument("--use-dora", action="store_true", help="DoRA: train a magnitude per output row too")
    p.add_argument("--use-rslora", action="store_true", help="scale by alpha / sqrt(r) (rsLoRA)")
    p.add_argument("--qlora", action="store_true", help="keep the frozen base in NF4 with double quantization")
    p.add_argument("--adapter", default=None, help="start from this adapter directory (its r, alpha and targets)")
    for name, help_text in (
            ("micro_batch", "packed rows per forward/backward"),
            ("grad_accum", "micro-batches per optimizer step"), ("max_steps", "optimizer steps"),
            ("lr", "peak learning rate"), ("min_lr_ratio", "final lr as a fraction of --lr (cosine)"),
            ("warmup_steps", "linear warmup steps"), ("weight_decay", "AdamW decoupled weight decay"),
            ("beta1", "AdamW beta1"), ("beta2", "AdamW beta2"), ("grad_clip", "max global gradient norm"),
            ("eval_every", "steps between held-out evaluations"),
            ("eval_windows", "held-out packed rows per evaluation during training (the final one reads all)"),
            ("log_every", "steps between log lines"), ("checkpoint_every", "steps between checkpoints"),
            ("seed", "adapter initialisation, held-out split and data-order seed")):
        default = getattr(d, name)
        p.add_argument("--" + name.replace("_", "-"), type=type(default), default=default, help=help_text)
    p.add_argument("--seq-len", type=int, default=None,
                   help="tokens per packed row (default: the model's context, at most 2048)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="the frozen base's dtype (auto: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--activation-checkpointing", default=t.activation_checkpointing,
                   choices=["full", "selective", "none"],
                   help="recompute each layer in backward (full), only its cheap non-matmul ops (selective: fewer "
                        "FLOPs, more memory), or keep everything (none)")
    p.add_argument("--stop-at", type=int, default=None, help="halt after this step (checkpoint + adapter)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint/state.pt")
    p.set_defaults(func=cmd_finetune)

    p = sub.add_parser("merge", help="fold a LoRA adapter into its base: a plain HF model directory")
    p.add_argument("--model", required=True, help="the base model directory")
    p.add_argument("--adapter", required=True, help="a PEFT LoRA adapter directory")
    p.add_argument("--out", required=True, help="the merged model directory to write")
    p.set_defaults(func=cmd_merge)


def cmd_finetune(args) -> int:
    from brrr.train.config import flat_flags
    from brrr.train.finetune import FinetuneConfig
    from brrr.train.trainer import Trainer

    names = set(flat_flags(FinetuneConfig("", "", "")))
    cfg = FinetuneConfig(**{k: v for k, v in vars(args).items() if k in names})
    summary = Trainer(cfg).run()
    print(json.dumps(summary, indent=2))
    return 0


def cmd_merge(args) -> int:
    from brrr.lora.merge import merge_adapter

    out = merge_adapter(args.model, args.adapter, args.out)
    print(f"wrote {out}")
    return 0
