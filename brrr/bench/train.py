"""`brrr bench train`: training tokens/s, MFU and peak memory of the step `brrr train` runs, on random token batches
already on the device (the data loader is not timed). After --warmup steps (compilation), --steps optimizer steps
are timed between two synchronizations. MFU = model FLOPs per token (brrr.analysis.model.training_flops_per_token:
6N + attention, no recompute) x tokens/s / the GPU's datasheet bf16 peak.

Alone, on one GPU: for each --model, a fresh fp32 model, bf16 autocast, fused AdamW, gradient clipping, optionally
torch.compile and activation checkpointing; one `train_throughput` record per model, which adds the MFU against the
bf16 matmul rate measured in the same run (`of_measured_matmul`).

    brrr bench train --model smollm2-135m:16 llama-3.2-1b:8 --seq-len 2048 --compile

Under torchrun, on N GPUs (or CPU processes, as a check): the pieces `brrr train` runs over one DeviceMesh (FSDP2
with bf16 compute and fp32 master weights and reduction, TP with sequence parallelism, per-layer torch.compile,
activation checkpointing); one process is the trainer's one-process path, the baseline of the scaling efficiency.
Rank 0 prints one `train_distributed` record for the layout: tokens/s (global, per GPU), MFU over N GPUs, the
busiest rank's peak memory and `brrr calc train`'s prediction for the layout; with --pp, the pipeline bubble of the
timed steps (the busiest stage's idle share) beside the formula's.

    torchrun --nproc_per_node 4 -m brrr bench train --model llama-3.1-8b --micro-batch 1 --seq-len 4096 \\
        --compile --checkpointing

--profile DIR runs one more step under torch.profiler after the timed ones: DIR/rank<r>.trace.json and
DIR/rank<r>.kernels.txt (the top 20 kernels by GPU time; rank 0's printed), or DIR/<model>.* alone.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time

from brrr.analysis.hardware import measure
from brrr.analysis.model import param_counts, training_flops_per_token
from brrr.bench.latency import emit, require_at_least
from brrr.bench.train_profile import profile_step
from brrr.config import ModelConfig
from brrr.errors import BrrrError
from brrr.presets import preset_config
from brrr.train.launch_cli import add_layout_flags
from brrr.train.config import ParallelConfig
from brrr.train.loss import CausalLMLoss
from brrr.train.parallel import ParallelStep, Ranks, parallelize, plan_layout, predicted_memory, zero_stage
from brrr.train.parallel.context_parallel import layout_loss
from brrr.train.pretrain import TrainConfig, build_model
from brrr.train.shapes import SHAPES
from brrr.train.trainer import autocast_for, checkpoint_activations, device_gpu, make_optimizer, optimizer_step

# Each mode keeps its own defaults: many small shapes fit one GPU; a layout is measured one model at a time.
ALONE = {"model": ["smollm2-135m:16", "llama-3.2-1b:8"], "micro_batch": 8, "seq_len": 2048}
UNDER_TORCHRUN = {"model": ["llama-3.2-1b"], "micro_batch": 1, "seq_len": 4096}


def register(bench_sub) -> None:
    p = bench_sub.add_parser("train", help="training tokens/s, MFU and peak memory (one GPU, or a layout under "
                             "torchrun)", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", nargs="+", default=None, metavar="NAME[:MICRO_BATCH]",
                   help="a training shape, a preset (brrr calc's names) or a config.json, each with its micro-batch "
                        f"(default: {' '.join(ALONE['model'])} alone; {UNDER_TORCHRUN['model'][0]} under torchrun, "
                        "which takes one)")
    p.add_argument("--micro-batch", type=int, default=None,
                   help="sequences per rank per step of a --model without :MICRO_BATCH "
                        f"(default {ALONE['micro_batch']} alone, {UNDER_TORCHRUN['micro_batch']} under torchrun)")
    p.add_argument("--seq-len", type=int, default=None,
                   help=f"(default {ALONE['seq_len']} alone, {UNDER_TORCHRUN['seq_len']} under torchrun)")
    g = p.add_argument_group("parallel layout, under torchrun (dp-replicate x dp-shard x ep x cp x tp x pp = "
                             "WORLD_SIZE; with --pp the record adds the bubble)")
    add_layout_flags(g)
    g.add_argument("--zero2", action="store_true", help="FSDP keeps gathered weights until backward")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--checkpointing", action="store_true")
    p.add_argument("--out", default=None, help="append the JSON records to this file too")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="profile one more step after the timed ones: a chrome trace and a top-20 kernel table per "
                        "rank (alone: per model) in DIR, the table printed (brrr/bench/train_profile.py)")
    p.set_defaults(func=cmd_train)


def cmd_train(args) -> int:
    import torch

    require_at_least(steps=(args.steps, 1), warmup=(args.warmup, 0), micro_batch=(args.micro_batch, 1),
                     seq_len=(args.seq_len, 1))
    torchrun = "WORLD_SIZE" in os.environ
    defaults = UNDER_TORCHRUN if torchrun else ALONE
    specs = []
    for spec in args.model or defaults["model"]:
        name, _, batch = spec.partition(":")
        if batch and not (batch.isdigit() and int(batch) > 0):
            raise BrrrError(f"--model {spec}: the micro-batch after ':' must be a positive integer")
        specs.append((name, int(batch) if batch else args.micro_batch or defaults["micro_batch"]))
    args.seq_len = args.seq_len or defaults["seq_len"]
    if torchrun:
        if len(specs) != 1:
            raise BrrrError(f"under torchrun --model takes one model (a layout is measured one at a time), got "
                            f"{len(specs)}")
        record = run_layout(*specs[0], args)
        if record is not None:  # rank 0's
            emit(record, args.out)
        return 0

    layout = ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep", "pp_schedule", "microbatches")
    changed = [f"--{k.replace('_', '-')}" for k in layout if getattr(args, k) != getattr(ParallelConfig(), k)]
    changed += ["--zero2"] * args.zero2
    if changed:
        raise BrrrError(f"{', '.join(changed)} set a multi-GPU layout: launch with torchrun "
                        "(torchrun --nproc_per_node N -m brrr bench train ...)")
    if not torch.cuda.is_available():
        raise BrrrError("brrr bench train measures a GPU; torch sees no CUDA device (under torchrun it also runs on "
                        "CPU processes)")
    gpu = measure()
    for name, micro_batch in specs:
        emit(run_one(name, micro_batch, args, gpu), args.out)
        torch._dynamo.reset()  # the next shape compiles afresh; the last one's memory goes back
        torch.cuda.empty_cache()
    return 0


def model_config(name: str):
    """A training shape (brrr.train.shapes; its tokenizer-given vocabulary set to 8192), a config.json or a
    preset."""
    from pathlib import Path

    if name in SHAPES:
        return ModelConfig.from_hf({**SHAPES[name], "vocab_size": SHAPES[name]["vocab_size"] or 8192})
    if name.endswith(".json"):
        return ModelConfig.from_hf(json.loads(Path(name).read_text()))
    return preset_config(name)


def timed_steps(step, args, sync, on_timed=lambda: None) -> tuple[float, float, float]:
    """(warm-up seconds, seconds per timed step, the last step's loss). on_timed: called between the two."""
    t0 = time.perf_counter()
    for i in range(args.warmup):
        step(i)
    sync()
    warmup_s = time.perf_counter() - t0
    on_timed()
    t0 = time.perf_counter()
    for i in range(args.steps):
        last_loss, _ = step(i)
    sync()
    return warmup_s, (time.perf_counter() - t0) / args.steps, float(last_loss)


def random_batches(vocab: int, micro_batch: int, seq_len: int, device, seed: int) -> list:
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    return [torch.randint(0, vocab, (micro_batch, seq_len + 1), device=device, generator=gen) for _ in range(4)]


def run_one(name: str, micro_batch: int, args, gpu) -> dict:
    """One GPU, one process: the trainer's step on one model shape."""
    import torch


    cfg = model_config(name)
    device = torch.device("cuda", torch.cuda.current_device())  # indexed: CausalLMLoss keys its cache by it
    model = build_model(cfg, device)
    train_cfg = TrainConfig(name, "", "", seq_len=args.seq_len, micro_batch=micro_batch)
    optimizer = make_optimizer(model, train_cfg.loop, device)
    params = [p for p in model.parameters()]
    loss = CausalLMLoss(model)
    loss.meta(micro_batch, args.seq_len, device)
    if args.checkpointing:
        checkpoint_activations(model)
    loss_fn = loss
    if args.compile:
        model.model.rotary_emb(torch.zeros(1, dtype=torch.long, device=device), torch.float32)
        loss_fn = torch.compile(loss)
    autocast = autocast_for(device)
    batches = random_batches(cfg.vocab_size, micro_batch, args.seq_len, device, 0)
    step = lambda i: optimizer_step(loss_fn, optimizer, params, [(batches[i % 4][:, :-1], batches[i % 4][:, 1:])],
                                    1.0, autocast)
    torch.cuda.reset_peak_memory_stats()
    warmup_s, seconds, last_loss = timed_steps(step, args, torch.cuda.synchronize)
    peak_memory = torch.cuda.max_memory_allocated()
    if args.profile:
        from pathlib import Path

        print(profile_step(lambda: step(0), args.profile, Path(name).stem, device), flush=True)
    tokens = micro_batch * args.seq_len
    flops = training_flops_per_token(cfg, args.seq_len)
    achieved = tokens / seconds * flops
    return {
        "bench": "train_throughput", "model": name, "params": param_counts(cfg)["total"], "seq_len": args.seq_len,
        "micro_batch": micro_batch, "tokens_per_step": tokens, "compile": args.compile,
        "activation_checkpointing": args.checkpointing, "precision": "bf16 autocast, fp32 master weights",
        "optimizer": "AdamW fused", "step_ms": seconds * 1e3, "tokens_per_s": tokens / seconds,
        "model_flops_per_token": flops, "achieved_tflops": achieved / 1e12,
        "mfu": achieved / gpu.datasheet_peak("bf16"), "of_measured_matmul": achieved / gpu.peak("bf16"),
        "target_mfu": 0.45, "warmup_s": warmup_s, "final_loss": last_loss,
        "peak_memory_gb": peak_memory / 1e9, "gpu": gpu.name,
        "datasheet_bf16_tflops": gpu.datasheet_peak("bf16") / 1e12, "measured_bf16_tflops": gpu.peak("bf16") / 1e12,
        "torch": torch.__version__, "python": platform.python_version(),
    }


def run_layout(name: str, micro_batch: int, args) -> dict | None:
    """This rank's part of a torchrun launch; rank 0 returns the layout's record, the others None."""
    import contextlib

    import torch
    import torch.distributed as dist


    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    model_cfg = model_config(name)
    cfg = TrainConfig(name, "", "", seq_len=args.seq_len, micro_batch=micro_batch, compile=args.compile,
                      activation_checkpointing=args.checkpointing, dp_replicate=args.dp_replicate,
                      dp_shard=args.dp_shard, tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep,
                      pp_schedule=args.pp_schedule, microbatches=args.microbatches,
                      reshard_after_forward=not args.zero2)
    try:
        mesh = plan_layout(cfg.parallel, model_cfg, micro_batch, args.seq_len, device)
        ranks = Ranks.from_env()
        ranks.open_group()
        parallel = ParallelStep(mesh, micro_batch, args.seq_len)
        model, parallel.pipeline = parallelize(build_model(model_cfg, device), mesh, cfg.parallel, device,
                                               grad_accum=1, seq_len=args.seq_len, compile=args.compile,
                                               activation_checkpointing=args.checkpointing)
        optimizer = make_optimizer(model, cfg.loop, device)
        params = [p for p in model.parameters() if p.requires_grad]
        loss = layout_loss(model, mesh)
        loss_fn = loss
        if args.compile and not mesh.distributed:
            loss.meta(micro_batch, args.seq_len, device)
            model.model.rotary_emb(torch.zeros(1, dtype=torch.long, device=device), torch.float32)
            loss_fn = torch.compile(loss)
        autocast = autocast_for(device) if not mesh.fsdp else contextlib.nullcontext()
        # the ranks of one data-parallel replica (its TP ranks) read the same batch
        batches = random_batches(model_cfg.vocab_size, micro_batch, args.seq_len, device, mesh.dp_rank)

        def step(i):
            rows = batches[i % 4]
            return parallel(optimizer_step, loss_fn, optimizer, params, [(rows[:, :-1], rows[:, 1:])], 1.0, autocast)

        if cuda:
            torch.cuda.reset_peak_memory_stats()
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        # on_timed drops the warm-up's bubble
        warmup_s, seconds, last_loss = timed_steps(step, args, sync, on_timed=lambda: parallel.log_fields(ranks))
        bubble = parallel.log_fields(ranks) if parallel.pipeline is not None else {}  # the timed steps'
        memory = ranks.max_over_ranks(torch.cuda.max_memory_allocated(device) if cuda else 0)
        if args.profile:  # after the peak memory is read: the profiler's buffers are not the step's
            table = profile_step(lambda: step(0), args.profile, f"rank{mesh.rank}", device)
            if mesh.rank == 0:
                print(table, flush=True)
        world = mesh.layout.world
        tokens = micro_batch * args.seq_len * mesh.dp_world
        flops = training_flops_per_token(model_cfg, args.seq_len)
        gpu = device_gpu(device)
        peak, gpu_name = (gpu.datasheet_peak("bf16"), gpu.name) if gpu else (None, "cpu")
        # brrr calc train's prediction for this layout on this GPU (none on CPU processes)
        calc = predicted_memory(cfg.parallel, mesh, model_cfg, micro_batch, args.seq_len, args.checkpointing, gpu)
        rank = mesh.rank
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    record = {
        "bench": "train_distributed", "model": name, "params": param_counts(model_cfg)["total"],
        "gpus": world, "layout": mesh.layout.describe(), "dp_replicate": mesh.layout.dp_replicate,
        "dp_shard": mesh.layout.dp_shard, "tp": mesh.layout.tp, "pp": mesh.layout.pp,
        "zero": zero_stage(cfg.parallel, mesh),
        "seq_len": args.seq_len, "micro_batch_per_rank": micro_batch, "tokens_per_step": tokens,
        "compile": args.compile, "activation_checkpointing": args.checkpointing,
        "precision": "bf16 compute, fp32 master weights" + (" and reduction (FSDP2)" if mesh.fsdp else
                                                            " (autocast)"),
        "step_ms": seconds * 1e3, "tokens_per_s": tokens / seconds, "tokens_per_s_per_gpu": tokens / seconds / world,
        "mfu": tokens / seconds * flops / (world * peak) if peak else None, "model_flops_per_token": flops,
        "peak_memory_bytes": memory, "calc_memory_bytes": calc["bytes"] if calc else None,
        "memory_vs_calc": memory / calc["bytes"] - 1 if calc else None, "warmup_s": warmup_s, "final_loss": last_loss,
        "gpu": gpu_name, "torch": torch.__version__, "python": platform.python_version(),
    }
    if bubble:  # the busiest stage's idle share of the timed steps, beside (p - 1) / (v m + p - 1)
        record.update(pp_schedule=args.pp_schedule, microbatches=parallel.pipeline.microbatches, **bubble)
    return record if rank == 0 else None
