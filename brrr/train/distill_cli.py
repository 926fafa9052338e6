"""`brrr distill`: token-level knowledge distillation from a teacher into a student (brrr/train/distill.py),
registered by brrr/train/cli.py."""
from __future__ import annotations

from brrr.cli import HelpFormatter
from brrr.train.launch_cli import add_parallel_flags, run_trainer


def register(sub):
    from brrr.train.distill import DistillConfig  # the defaults: its dataclasses (brrr --help imports this module)

    d, t = DistillConfig("", "", "", ""), DistillConfig("", "", "", "").task
    p = sub.add_parser("distill", help="distil a teacher model into a student (forward or reverse KL, mixed with "
                       "the hard-label loss) on a data directory", formatter_class=HelpFormatter)
    p.add_argument("--teacher", required=True, metavar="DIR", help="the teacher's HF model directory (frozen)")
    p.add_argument("--student", required=True, metavar="DIR|CONFIG",
                   help="an HF model directory (a smaller or a pruned model: its zeros are kept), or a training "
                        "shape, preset or config.json for a fresh student")
    p.add_argument("--data", required=True, help="directory made by `brrr data build` with the teacher's tokenizer, or a text file (tokenized "
                   "with it; its last tenth held out)")
    p.add_argument("--out", required=True, help="output: the student's HF directory, plus checkpoint/ and "
                   "train_log.jsonl")
    p.add_argument("--kind", default=t.kind, choices=["forward", "reverse"],
                   help="forward KL(teacher || student) (mode-covering) or reverse KL(student || teacher) "
                        "(mode-seeking, MiniLLM's direction)")
    p.add_argument("--temperature", type=float, default=t.temperature,
                   help="softens both distributions; the KL is scaled by T^2")
    p.add_argument("--alpha", type=float, default=t.alpha,
                   help="weight of the hard-label cross-entropy (1 - alpha on the KL; 1: hard labels only)")
    p.add_argument("--teacher-top-k", type=int, default=t.teacher_top_k,
                   help="only the teacher's k most likely tokens per position count (0: the whole vocabulary)")
    for name, help_text in (
            ("seq_len", "tokens per window"), ("micro_batch", "windows per forward/backward"),
            ("grad_accum", "micro-batches per optimizer step"), ("max_steps", "optimizer steps"),
            ("lr", "peak learning rate"), ("min_lr_ratio", "final lr as a fraction of --lr (cosine)"),
            ("warmup_steps", "linear warmup steps"), ("weight_decay", "AdamW decoupled weight decay (matrices)"),
            ("grad_clip", "max global gradient norm"), ("eval_every", "steps between validation evaluations"),
            ("eval_windows", "validation windows in each evaluation"),
            ("log_every", "steps between log lines"), ("checkpoint_every", "steps between checkpoints"),
            ("seed", "initialisation and data-order seed")):
        default = getattr(d.loop, name)
        p.add_argument("--" + name.replace("_", "-"), type=type(default), default=default, help=help_text)
    p.add_argument("--final-eval-windows", type=int, default=None,
                   help="validation windows in the final evaluation (default: all)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds this run may take: steps are capped to fit after timing a few")
    p.add_argument("--stop-at", type=int, default=None, help="halt after this step (checkpoint + export)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint/")
    p.add_argument("--export-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="auto: the student checkpoint's dtype (a fresh student: bfloat16 on CUDA, else float32)")
    add_parallel_flags(p)
    p.set_defaults(func=cmd_distill)


def cmd_distill(args) -> int:
    # the task loads with the command: brrr.cli imports this module
    from brrr.train.config import flat_flags
    from brrr.train.distill import DistillConfig

    names = set(flat_flags(DistillConfig("", "", "", "")))
    cfg = DistillConfig(**{k: v for k, v in vars(args).items() if k in names})
    return run_trainer(cfg)
