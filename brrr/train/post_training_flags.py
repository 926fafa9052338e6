"""The flags `brrr dpo` and `brrr grpo` share: the policy's (TRL's ModelConfig names) and the loop's, spelled as
TRL spells them where it has them (--learning-rate, --per-device-train-batch-size, --gradient-accumulation-steps)
beside brrr's own (--lr, --micro-batch, --grad-accum)."""
from __future__ import annotations

from brrr.train.config import LoopConfig, flat_flags
from brrr.train.policy import PolicyConfig


def add_policy_flags(p, t: PolicyConfig):
    p.add_argument("--use-peft", action="store_true",
                   help="train LoRA adapters over a frozen base (the reference: the base, adapters off); else "
                        "every weight trains and the reference log-probs are computed once before step 1")
    p.add_argument("--lora-r", type=int, default=t.lora_r, help="adapter rank (with --use-peft)")
    p.add_argument("--lora-alpha", type=float, default=t.lora_alpha, help="the update is scaled by alpha / r")
    p.add_argument("--lora-dropout", type=float, default=t.lora_dropout, help="dropout on the adapters' input")
    p.add_argument("--target-modules", default=t.target_modules, help="comma-separated module names (PEFT's rule)")
    p.add_argument("--use-rslora", action="store_true", help="scale by alpha / sqrt(r) (rsLoRA)")
    p.add_argument("--qlora", action="store_true", help="--use-peft over an NF4 base with double quantization")
    p.add_argument("--dtype", default=t.dtype, choices=["auto", "bfloat16", "float32"],
                   help="the weights (auto: bfloat16 for a frozen --use-peft base on CUDA, else float32)")


def add_loop_flags(p, d: LoopConfig, names=("max_steps", "min_lr_ratio", "warmup_steps", "weight_decay", "beta1",
                                            "beta2", "grad_clip", "log_every", "checkpoint_every", "seed")):
    p.add_argument("--learning-rate", "--lr", dest="lr", type=float, default=d.lr, help="peak learning rate")
    p.add_argument("--per-device-train-batch-size", "--micro-batch", dest="micro_batch", type=int,
                   default=d.micro_batch, help="examples per forward/backward")
    p.add_argument("--gradient-accumulation-steps", "--grad-accum", dest="grad_accum", type=int,
                   default=d.grad_accum, help="micro-batches per optimizer step")
    helps = {"max_steps": "optimizer steps", "min_lr_ratio": "final lr as a fraction of the peak (cosine)",
             "warmup_steps": "linear warmup steps", "weight_decay": "AdamW decoupled weight decay",
             "beta1": "AdamW beta1", "beta2": "AdamW beta2", "grad_clip": "max global gradient norm",
             "log_every": "steps between log lines", "checkpoint_every": "steps between checkpoints",
             "seed": "data-order, adapter-initialisation and sampling seed"}
    for name in names:
        default = getattr(d, name)
        p.add_argument("--" + name.replace("_", "-"), type=type(default), default=default, help=helps[name])
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--stop-at", type=int, default=None, help="halt after this step (checkpoint + output)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint/")


def config_from_args(cls, args):
    """A command's config (DPOConfig, GRPOConfig) from its parsed flags."""
    names = set(flat_flags(cls("", "", "")))
    return cls(**{k: v for k, v in vars(args).items() if k in names})
