"""Training throughput and MFU of brrr's trainer step (the one `brrr train` runs) on one GPU.

For each model shape: a fresh fp32 model, bf16 autocast, AdamW (fused), gradient clipping, optionally
torch.compile and activation checkpointing; random token batches already on the GPU (the data loader is not
timed). After warm-up steps (compilation), `--steps` optimizer steps are timed between two synchronizations.
MFU = model FLOPs per token (brrr.analysis.model.training_flops_per_token: 6N + attention, no recompute) x
tokens/s / the GPU's datasheet bf16 peak; `of_measured_matmul` uses the bf16 matmul rate measured in the same run
(brrr.analysis.hardware.measure). Prints one JSON record per configuration.

  python bench/train_throughput.py --model smollm2-135m:16 llama-3.2-1b:8 --seq-len 2048 --compile
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from brrr.analysis.hardware import measure  # noqa: E402
from brrr.analysis.model import param_counts, training_flops_per_token  # noqa: E402
from brrr.presets import preset_config  # noqa: E402
from brrr.train.shapes import SHAPES  # noqa: E402
from brrr.train.trainer import (CausalLMLoss, TrainConfig, autocast_for, build_model,  # noqa: E402
                                checkpoint_activations, make_optimizer, optimizer_step)


def model_config(name: str):
    if name in SHAPES:
        from brrr.config import ModelConfig

        return ModelConfig.from_hf({**SHAPES[name], "vocab_size": SHAPES[name]["vocab_size"] or 8192})
    return preset_config(name)


def run_one(name: str, micro_batch: int, args, gpu) -> dict:
    cfg = model_config(name)
    device = torch.device("cuda", torch.cuda.current_device())  # indexed: CausalLMLoss keys its cache by it
    model = build_model(cfg, device)
    train_cfg = TrainConfig(name, "", "", seq_len=args.seq_len, micro_batch=micro_batch)
    optimizer = make_optimizer(model, train_cfg, device)
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
    gen = torch.Generator(device=device).manual_seed(0)
    batches = [torch.randint(0, cfg.vocab_size, (micro_batch, args.seq_len + 1), device=device, generator=gen)
               for _ in range(4)]
    step = lambda i: optimizer_step(loss_fn, optimizer, params, [(batches[i % 4][:, :-1], batches[i % 4][:, 1:])],
                                    1.0, autocast)
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for i in range(args.warmup):
        step(i)
    torch.cuda.synchronize()
    warmup_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(args.steps):
        last_loss, _ = step(i)
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - t0) / args.steps
    tokens = micro_batch * args.seq_len
    flops = training_flops_per_token(cfg, args.seq_len)
    achieved = tokens / seconds * flops
    record = {
        "bench": "train_throughput", "model": name, "params": param_counts(cfg)["total"], "seq_len": args.seq_len,
        "micro_batch": micro_batch, "tokens_per_step": tokens, "compile": args.compile,
        "activation_checkpointing": args.checkpointing, "precision": "bf16 autocast, fp32 master weights",
        "optimizer": "AdamW fused", "step_ms": seconds * 1e3, "tokens_per_s": tokens / seconds,
        "model_flops_per_token": flops, "achieved_tflops": achieved / 1e12,
        "mfu": achieved / gpu.datasheet_peak("bf16"), "of_measured_matmul": achieved / gpu.peak("bf16"),
        "target_mfu": 0.45, "warmup_s": warmup_s, "final_loss": float(last_loss),
        "peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9, "gpu": gpu.name,
        "datasheet_bf16_tflops": gpu.datasheet_peak("bf16") / 1e12, "measured_bf16_tflops": gpu.peak("bf16") / 1e12,
        "torch": torch.__version__, "python": platform.python_version(),
    }
    return record


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", nargs="+", default=["smollm2-135m:16", "llama-3.2-1b:8"],
                   help="NAME:MICRO_BATCH (a preset or training shape)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--checkpointing", action="store_true")
    p.add_argument("--out", default=None, help="append the JSON records to this file too")
    args = p.parse_args(argv)
    gpu = measure()
    for spec in args.model:
        name, _, batch = spec.partition(":")
        record = run_one(name, int(batch or 8), args, gpu)
        torch._dynamo.reset()  # the next shape compiles afresh; the last one's memory goes back
        torch.cuda.empty_cache()
        line = json.dumps(record)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()
