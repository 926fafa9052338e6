"""`brrr data build` and `brrr train` (registered by brrr/cli.py through register(subparsers))."""
from __future__ import annotations

import argparse
import json

from brrr.cli import HelpFormatter


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
    p.add_argument("--export-dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    add_parallel_flags(p)
    p.set_defaults(func=cmd_train)

    from brrr.train.finetune_cli import register as register_finetune

    register_finetune(sub)

    from brrr.train.draft_cli import register as register_draft

    register_draft(sub)


def add_parallel_flags(p):
    g = p.add_argument_group("parallel layout (under torchrun: dp-replicate x dp-shard x cp x tp x pp = WORLD_SIZE)")
    add_layout_flags(g)
    g.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction, default=True,
                   help="FSDP: free gathered weights after forward (ZeRO-3); --no-...: keep them (ZeRO-2)")
    g.add_argument("--fp16", action="store_true",
                   help="fp16 compute with dynamic loss scaling (overflowing steps are skipped), instead of bf16")
    g.add_argument("--async-checkpoint", action="store_true",
                   help="write distributed checkpoints in the background while training continues")


def add_layout_flags(g):
    """The mesh's dimensions and the pipeline's schedule: `brrr train`'s and `brrr bench train`'s."""
    g.add_argument("--dp-replicate", type=int, default=1, help="data-parallel replicas (DDP; with --dp-shard: HSDP)")
    g.add_argument("--dp-shard", type=int, default=-1, help="FSDP2 shard group size (-1: the ranks left over)")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (with sequence parallelism)")
    g.add_argument("--pp", type=int, default=1, help="pipeline stages")
    g.add_argument("--cp", type=int, default=1,
                   help="context-parallel ranks: each sequence split over them (head-tail chunks, ring attention)")
    from brrr.analysis.train import SCHEDULES

    g.add_argument("--pp-schedule", default="1f1b", choices=SCHEDULES,
                   help="pipeline schedule (interleaved: 2 stages per rank)")
    g.add_argument("--microbatches", type=int, default=None,
                   help="pipeline microbatches per micro-batch (default: --pp)")


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


def exit_failed_rank() -> None:
    """A rank whose step raised: print the error and leave at once. destroy_process_group would wait on the NCCL
    sends and receives its peers posted for the step this rank abandoned, hanging it and them; once this process
    exits torchrun stops the other ranks."""
    import os
    import sys
    import traceback

    traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def cmd_train(args) -> int:
    import os

    import torch.distributed as dist

    from brrr.errors import BrrrError
    from brrr.train.config import flat_flags
    from brrr.train.pretrain import TrainConfig
    from brrr.train.trainer import Trainer

    cfg = TrainConfig(**{k: getattr(args, k) for k in flat_flags(TrainConfig("", "", ""))})
    try:
        summary = Trainer(cfg).run()
    except BrrrError:
        if int(os.environ.get("RANK", 0)) == 0:
            raise
        return 2  # every rank refuses the same layout; rank 0 alone says why
    except Exception:
        if dist.is_initialized() and dist.get_world_size() > 1:
            exit_failed_rank()
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if int(os.environ.get("RANK", 0)) == 0:
        print(json.dumps(summary, indent=2))
    return 0
