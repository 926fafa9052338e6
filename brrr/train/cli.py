"""`brrr data build` and `brrr train` (registered by brrr/cli.py through register(subparsers))."""
from __future__ import annotations

import json

from brrr.cli import HelpFormatter
from brrr.train.distill_cli import register as register_distill
from brrr.train.launch_cli import add_parallel_flags, run_trainer


def register(sub):
    data = sub.add_parser("data", help="build training data from Python source on this machine")
    data_sub = data.add_subparsers(dest="data_command", metavar="SUBCOMMAND")
    p = data_sub.add_parser("build", help="collect .py files, train a BPE tokenizer, write token files per split",
                            formatter_class=HelpFormatter)
    p.add_argument("--out", required=True, help="directory to write (tokenizer, train/val token files, manifest)")
    p.add_argument("--source", nargs="+", default=["stdlib"],
                   help="'stdlib' (this interpreter's standard library), 'site-packages', or directories")
    p.add_argument("--vocab", type=int, default=8192, help="BPE vocabulary size, special tokens included")
    p.add_argument("--val-fraction", type=float, default=0.05, help="share of files (by path hash) held out")
    p.add_argument("--max-file-kb", type=int, default=1024, help="skip larger files (generated tables)")
    p.add_argument("--tokenizer-sample-mb", type=float, default=256,
                   help="train the tokenizer on at most this much train-split text (a fixed hash-ordered subset)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_data_build)
    data.set_defaults(func=lambda args: _needs_subcommand(data))

    from brrr.train.pretrain import TrainConfig

    d = TrainConfig("", "", "").loop
    p = sub.add_parser("train", help="train a Llama-family model on a `brrr data build` directory",
                       formatter_class=HelpFormatter)
    p.add_argument("--config", required=True, dest="model",
                   help="a training shape (brrr-default), a preset (brrr calc's names) or a config.json")
    p.add_argument("--data", required=True, help="directory made by `brrr data build`")
    p.add_argument("--out", required=True, help="output: an HF model directory, plus checkpoint/ and train_log.jsonl")
    for name, help_text in (
            ("seq_len", "tokens per sequence"), ("micro_batch", "sequences per forward/backward"),
            ("grad_accum", "micro-batches per optimizer step"), ("max_steps", "optimizer steps"),
            ("lr", "peak learning rate"), ("min_lr_ratio", "final lr as a fraction of --lr (cosine)"),
            ("warmup_steps", "linear warmup steps"), ("weight_decay", "AdamW decoupled weight decay (matrices)"),
            ("beta1", "AdamW beta1"), ("beta2", "AdamW beta2"), ("grad_clip", "max global gradient norm"),
            ("eval_every", "steps between validation evaluations"),
            ("eval_windows", "validation windows per source in each evaluation"),
            ("log_every", "steps between log lines"), ("checkpoint_every", "steps between checkpoints"),
            ("seed", "initialisation and data-order seed")):
        default = getattr(d, name)
        p.add_argument("--" + name.replace("_", "-"), type=type(default), default=default, help=help_text)
    p.add_argument("--final-eval-windows", type=int, default=None,
                   help="validation windows per source in the final evaluation (default: all)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model and loss")
    p.add_argument("--activation-checkpointing", action="store_true", help="recompute layers in backward")
    p.add_argument("--activation-checkpointing-every", type=int, default=1,
                   help="with --activation-checkpointing: recompute every N-th layer only (selective)")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds this run may take: steps are capped to fit after timing a few")
    p.add_argument("--stop-at", type=int, default=None, help="halt after this step (checkpoint + export)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint/ (state.pt, or dcp/ from a torchrun launch)")
    p.add_argument("--router-aux-loss-coef", type=float, default=None,
                   help="MoE models: weight of the load-balancing loss (default: the config's router_aux_loss_coef)")
    p.add_argument("--router-z-loss-coef", type=float, default=0.0, help="MoE models: weight of the router z-loss")
    p.add_argument("--moe-bias-update-speed", type=float, default=0.0,
                   help="DeepSeek-V3 models: auxiliary-loss-free balancing, each step e_score_correction_bias += "
                        "GAMMA * sign(mean load - expert load) (0: off; DeepSeek-V3 used 0.001)")
    p.add_argument("--export-dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    add_parallel_flags(p)
    p.set_defaults(func=cmd_train)

    from brrr.train.finetune_cli import register as register_finetune

    register_finetune(sub)

    from brrr.train.draft_cli import register as register_draft

    register_draft(sub)

    from brrr.train.dpo_cli import register as register_dpo  # the command's own module holds its flags

    register_dpo(sub)

    from brrr.train.grpo_cli import register as register_grpo  # the command's own module holds its flags

    register_grpo(sub)
    register_distill(sub)


def _needs_subcommand(parser) -> int:
    parser.print_help()
    return 2


def cmd_data_build(args) -> int:
    from brrr.train.data import build

    m = build(args.out, args.source, vocab=args.vocab, val_fraction=args.val_fraction, max_file_kb=args.max_file_kb,
              tokenizer_sample_mb=args.tokenizer_sample_mb, show_progress=not args.quiet)
    for s in m["sources"]:
        print(f"{s['name']}: {s['files']} files, {s['bytes'] / 1e6:.1f} MB -> train {s['train']['tokens']:,} "
              f"tokens, val {s['val']['tokens']:,} tokens")
    print(f"vocab {m['vocab_size']}, {m['dtype']}; skipped {json.dumps(m['skipped_files'])}; wrote {args.out}")
    return 0


def cmd_train(args) -> int:
    from brrr.train.config import flat_flags
    from brrr.train.pretrain import TrainConfig

    return run_trainer(TrainConfig(**{k: getattr(args, k) for k in flat_flags(TrainConfig("", "", ""))}))
