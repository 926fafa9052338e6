"""What the layout-aware training commands share (brrr train, brrr distill; brrr bench train's layout flags): the
parallel-layout flags and running a command's config under torchrun or alone."""
from __future__ import annotations

import argparse
import json


def add_parallel_flags(p):
    g = p.add_argument_group("parallel layout (under torchrun: dp-replicate x dp-shard x ep x cp x tp x pp = "
                             "WORLD_SIZE)")
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
    g.add_argument("--ep", type=int, default=1,
                   help="expert-parallel ranks: each MoE layer's experts split over them (all-to-all dispatch); "
                        "they are data-parallel ranks too")
    from brrr.analysis.train import SCHEDULES

    g.add_argument("--pp-schedule", default="1f1b", choices=SCHEDULES,
                   help="pipeline schedule (interleaved: 2 stages per rank)")
    g.add_argument("--microbatches", type=int, default=None,
                   help="pipeline microbatches per micro-batch (default: --pp)")


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


def run_trainer(cfg) -> int:
    """Run a layout-aware task's command config under torchrun or alone (brrr train, brrr distill): rank 0 alone
    reports a refused layout, a rank whose step raised takes the job down, the summary is printed once."""
    import os

    import torch.distributed as dist

    from brrr.errors import BrrrError
    from brrr.train.trainer import Trainer

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
