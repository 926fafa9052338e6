"""`brrr train-draft`: an EAGLE draft head for a target model (brrr/train/draft.py), registered by
brrr/train/cli.py."""
from __future__ import annotations

import json

from brrr.cli import HelpFormatter


def register(sub):
    from brrr.train.draft import DraftConfig

    d = DraftConfig("", "", "").loop
    p = sub.add_parser("train-draft", help="train an EAGLE draft head for speculative decoding on a data directory",
                       formatter_class=HelpFormatter)
    p.add_argument("--target", required=True, dest="model", metavar="DIR", help="the target model's HF directory (frozen)")
    p.add_argument("--data", required=True, help="directory made by `brrr data build` with the target's tokenizer")
    p.add_argument("--out", required=True, help="output: the head's directory, plus checkpoint/ and train_log.jsonl")
    for name, help_text in (
            ("seq_len", "tokens per window"), ("micro_batch", "windows per forward/backward"),
            ("grad_accum", "micro-batches per optimizer step"), ("max_steps", "optimizer steps"),
            ("lr", "peak learning rate"), ("min_lr_ratio", "final lr as a fraction of --lr (cosine)"),
            ("warmup_steps", "linear warmup steps"), ("weight_decay", "AdamW decoupled weight decay (matrices)"),
            ("grad_clip", "max global gradient norm"), ("eval_every", "steps between validation evaluations"),
            ("eval_windows", "validation windows per source in each evaluation"),
            ("log_every", "steps between log lines"), ("checkpoint_every", "steps between checkpoints"),
            ("seed", "initialisation and data-order seed")):
        default = getattr(d, name)
        p.add_argument("--" + name.replace("_", "-"), type=type(default), default=default, help=help_text)
    p.add_argument("--final-eval-windows", type=int, default=d.final_eval_windows,
                   help="validation windows per source in the final evaluation")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds this run may take: steps are capped to fit after timing a few")
    p.add_argument("--stop-at", type=int, default=None, help="halt after this step (checkpoint + export)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint/state.pt")
    p.set_defaults(func=cmd_train_draft)


def cmd_train_draft(args) -> int:
    from brrr.train.config import flat_flags
    from brrr.train.draft import DraftConfig
    from brrr.train.trainer import Trainer

    names = set(flat_flags(DraftConfig("", "", "")))
    cfg = DraftConfig(**{k: v for k, v in vars(args).items() if k in names})
    summary = Trainer(cfg).run()
    print(json.dumps(summary, indent=2))
    return 0
