"""Training throughput, MFU and peak memory of `brrr train`'s step on N GPUs under torchrun, per layout.

The same pieces `brrr train` runs (brrr.train.parallel over one DeviceMesh: FSDP2 with bf16 compute and fp32
master weights and reduction, TP with sequence parallelism, per-layer torch.compile, activation checkpointing;
AdamW, gradient clipping), on random token batches already on the GPU (the data loader is not timed). One GPU is
the trainer's one-process path (bf16 autocast, whole-model compile): the baseline of the scaling efficiency.
After --warmup steps, --steps optimizer steps are timed between two synchronizations. Rank 0 prints and appends
one JSON record: tokens/s (global, per GPU), MFU (model FLOPs per token, brrr.analysis.model, x tokens/s / (GPUs
x the datasheet bf16 peak)), the busiest rank's peak memory and `brrr calc train`'s prediction for the layout.

  torchrun --nproc_per_node 4 bench/train_distributed.py --model llama-3.1-8b --micro-batch 1 --seq-len 4096 \\
      --compile --checkpointing --out bench/results/train_distributed_h100.jsonl
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from brrr.config import ModelConfig  # noqa: E402
from brrr.analysis.model import param_counts, training_flops_per_token  # noqa: E402
from brrr.presets import preset_config  # noqa: E402
from brrr.train.parallel import Parallel  # noqa: E402
from brrr.train.trainer import (CausalLMLoss, TrainConfig, autocast_for, build_model, make_optimizer,  # noqa: E402
                                optimizer_step, peak_flops)


def run(args) -> dict | None:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    model_cfg = preset_config(args.model) if not args.model.endswith(".json") else \
        ModelConfig.from_hf(json.loads(Path(args.model).read_text()))
    cfg = TrainConfig(args.model, "", "", seq_len=args.seq_len, micro_batch=args.micro_batch, compile=args.compile,
                      activation_checkpointing=args.checkpointing, dp_replicate=args.dp_replicate,
                      dp_shard=args.dp_shard, tp=args.tp, reshard_after_forward=not args.zero2)
    parallel = Parallel(cfg, model_cfg, device)
    model = parallel.apply(build_model(model_cfg, device))
    optimizer = make_optimizer(model, cfg, device)
    params = [p for p in model.parameters() if p.requires_grad]
    loss = CausalLMLoss(model)
    loss_fn = loss
    if args.compile and not parallel.compiles_blocks:
        loss.meta(args.micro_batch, args.seq_len, device)
        model.model.rotary_emb(torch.zeros(1, dtype=torch.long, device=device), torch.float32)
        loss_fn = torch.compile(loss)
    autocast = autocast_for(device) if not parallel.fsdp else contextlib.nullcontext()
    # the ranks of one data-parallel replica (its TP ranks) read the same batch
    gen = torch.Generator(device=device).manual_seed(parallel.dp_rank)
    batches = [torch.randint(0, model_cfg.vocab_size, (args.micro_batch, args.seq_len + 1), device=device,
                             generator=gen) for _ in range(4)]

    def step(i):
        rows = batches[i % 4]
        return parallel.step(optimizer_step, loss_fn, optimizer, params, [(rows[:, :-1], rows[:, 1:])], 1.0,
                             autocast)

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for i in range(args.warmup):
        step(i)
    sync()
    warmup_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(args.steps):
        last_loss, _ = step(i)
    sync()
    seconds = (time.perf_counter() - t0) / args.steps
    world = parallel.layout.world
    tokens = args.micro_batch * args.seq_len * parallel.dp_world
    flops = training_flops_per_token(model_cfg, args.seq_len)
    peak, gpu_name = peak_flops(device)
    memory = parallel.max_over_ranks(torch.cuda.max_memory_allocated(device) if cuda else 0)
    calc = parallel.calc_train_memory(model_cfg)
    record = {
        "bench": "train_distributed", "model": args.model, "params": param_counts(model_cfg)["total"],
        "gpus": world, "layout": parallel.layout.describe(), "dp_replicate": parallel.layout.dp_replicate,
        "dp_shard": parallel.layout.dp_shard, "tp": parallel.layout.tp, "zero": calc["zero"],
        "seq_len": args.seq_len, "micro_batch_per_rank": args.micro_batch, "tokens_per_step": tokens,
        "compile": args.compile, "activation_checkpointing": args.checkpointing,
        "precision": "bf16 compute, fp32 master weights" + (" and reduction (FSDP2)" if parallel.fsdp else
                                                            " (autocast)"),
        "step_ms": seconds * 1e3, "tokens_per_s": tokens / seconds, "tokens_per_s_per_gpu": tokens / seconds / world,
        "mfu": tokens / seconds * flops / (world * peak) if peak else None, "model_flops_per_token": flops,
        "peak_memory_bytes": memory, "calc_memory_bytes": calc["bytes"],
        "memory_vs_calc": memory / calc["bytes"] - 1, "warmup_s": warmup_s, "final_loss": float(last_loss),
        "gpu": gpu_name, "torch": torch.__version__, "python": platform.python_version(),
    }
    return record if parallel.mesh.rank == 0 else None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3.2-1b", help="a preset (brrr calc's names) or a config.json")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--dp-replicate", type=int, default=1)
    p.add_argument("--dp-shard", type=int, default=-1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--zero2", action="store_true", help="FSDP keeps gathered weights until backward")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--checkpointing", action="store_true")
    p.add_argument("--out", default=None, help="append the JSON record to this file too")
    args = p.parse_args(argv)
    try:
        record = run(args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if record is not None:
        line = json.dumps(record)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()
