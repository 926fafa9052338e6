"""`brrr bench rl`: the GRPO step `brrr grpo` runs (brrr/train/grpo.py), timed phase by phase, one record a step.

A step: the weight sync and wake of the colocated engine (from the second step on), the rollout (--num-prompts
prompts, --num-generations samples each, up to --max-completion-length tokens, through brrr's engine in this
process), the rewards (the built-in python_syntax: no model), the reference log-probs (with --beta), then the
train step (one micro-batch a group: --num-generations completions forward and backward, then AdamW). The phases
are the ones the GRPO task logs (rollout_s, reference_logps_s, train_s, weight_sync_s, wake_s); step_s is the
step's wall time around all of them, so what it has beyond their sum is the rewards, the advantages and the
engine's sleep. rollout_tok_s: the completion tokens sampled / rollout_s. The first step also pays warm-up.

--model: a model directory or hub id (its weights), or a preset (brrr calc's names: random weights of that shape,
with the default model's tokenizer, written to a temporary directory: speed does not depend on the values); default
brrr's shipped default model. Full-parameter, fp32 master weights, as `brrr grpo` runs by default.

    brrr bench rl --model qwen3-0.6b --num-prompts 16 --num-generations 8 --max-completion-length 256 --steps 4
    brrr bench rl ... --batch-invariant       # the engine and the trainer in the batch-invariant mode
    brrr bench rl ... --use-peft [--batch-invariant]   # a LoRA policy: the rollout in the base's bf16 on CUDA
"""
from __future__ import annotations

import argparse
import json
import platform
import shutil
import tempfile
import time
from pathlib import Path

import torch

from brrr.bench.latency import emit, require_at_least
from brrr.default_model import default_model_dir
from brrr.loader import save_model
from brrr.models.random_weights import random_model
from brrr.presets import PRESETS, preset_config
from brrr.train.grpo import GRPOConfig
from brrr.train.trainer import Trainer, lr_at, optimizer_step

# code heads for the python_syntax reward to score completions of (a numbered comment keeps repeats distinct)
HEADS = ["def add(a, b):", "def is_even(n):", "class Point:", "def read_lines(path):", "for i in range(10):",
         "def fib(n):", "import os", "def main():"]
PHASES = ("weight_sync_s", "wake_s", "rollout_s", "reference_logps_s", "train_s")
WORKLOAD = ("model", "num_prompts", "num_generations", "max_completion_length", "steps", "device")  # add_workload_args


def add_workload_args(p) -> None:
    """The model and step shape, shared with the TRL peer harness (bench/trl_grpo.py) so both run the same work."""
    p.add_argument("--model", default=None,
                   help="model directory or hub id, or a preset (random weights); default: brrr's default model")
    p.add_argument("--num-prompts", type=int, default=4, help="prompts a step, each a group")
    p.add_argument("--num-generations", type=int, default=8, help="completions per prompt")
    p.add_argument("--max-completion-length", type=int, default=64, help="tokens a completion may have")
    p.add_argument("--steps", type=int, default=3, help="GRPO steps, one record each")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")


def register(bench_sub) -> None:
    p = bench_sub.add_parser("rl", help="GRPO steps: rollout / reference log-probs / train / weight-sync seconds "
                             "and rollout tok/s", description=__doc__,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(p)
    p.add_argument("--beta", type=float, default=0.0,
                   help="KL weight: nonzero computes the reference log-probs each step (a frozen copy)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="engine and trainer in the batch-invariant mode (as brrr grpo --batch-invariant)")
    p.add_argument("--use-peft", action="store_true",
                   help="a LoRA policy (r 16, dropout 0) over the base in bf16 on CUDA, as brrr grpo --use-peft: "
                        "the engine runs the base's own bf16 tensors, in the mode too")
    p.add_argument("--out", "--json", dest="out", default=None, metavar="PATH",
                   help="append the JSON records to this file too")
    p.set_defaults(func=cmd_rl)


def command_line(args, prog: str, flags: tuple[str, ...] = WORKLOAD) -> str:
    """The flags of this run, as a command that repeats it (the peer harness passes its own prog)."""
    parts = [prog]
    for name in flags:
        if getattr(args, name) is not None:
            parts += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    switches = [f"--{name.replace('_', '-')}" for name in ("batch_invariant", "use_peft") if getattr(args, name, False)]
    return " ".join(parts + switches)


def model_dir(spec: str | None, tmp: Path) -> tuple[str, str]:
    """(what GRPO loads, "loaded" or "random"): a preset becomes a directory of random weights of its shape (bf16)
    with the default model's tokenizer (its ids are a subset of any preset's vocabulary)."""
    if spec is None:
        return str(default_model_dir()), "loaded"
    if spec not in PRESETS:
        return spec, "loaded"
    out = tmp / spec
    device = "cuda" if torch.cuda.is_available() else "cpu"  # random values are drawn faster there
    save_model(random_model(preset_config(spec), torch.bfloat16, device), out)
    # the tokenizer only (not checkpoint.TOKENIZER_FILES: its generation_config would give the preset the default
    # model's stop ids)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(default_model_dir() / name, out / name)
    return str(out), "random"


def write_prompts(path: Path, n: int) -> Path:
    rows = [{"prompt": (f"# task {i}\n" if i >= len(HEADS) else "") + HEADS[i % len(HEADS)] + "\n"} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_steps(trainer: Trainer, steps: int):
    """One dict a step: its wall time, the task's phase times and metrics (the loop of Trainer._loop, without its
    log line, evaluation and checkpoints)."""
    task, cfg = trainer.task, trainer.cfg
    trainer.model.train()
    for step in range(steps):
        lr = lr_at(step, cfg, steps)
        for group in trainer.optimizer.param_groups:
            group["lr"] = lr
        start = time.perf_counter()
        batches = [task.batches.batch_at(step * cfg.grad_accum + i, trainer.device) for i in range(cfg.grad_accum)]
        loss, _ = trainer.train_step(optimizer_step, trainer.loss_fn, trainer.optimizer, trainer.params, batches,
                                     cfg.grad_clip, trainer.autocast)
        fields = task.log_fields()  # synchronizes the device and ends the train phase
        yield {"step": step + 1, "step_s": time.perf_counter() - start, "loss": loss.item(), **fields}


def cmd_rl(args) -> int:
    require_at_least(num_prompts=(args.num_prompts, 1), num_generations=(args.num_generations, 2),
                     max_completion_length=(args.max_completion_length, 1), steps=(args.steps, 1),
                     beta=(args.beta, 0))
    with tempfile.TemporaryDirectory(prefix="brrr-bench-rl-") as tmp:
        tmp = Path(tmp)
        model, weights = model_dir(args.model, tmp)
        cfg = GRPOConfig(model, str(write_prompts(tmp / "prompts.jsonl", args.num_prompts)), str(tmp / "run"),
                         reward=["python_syntax"], num_generations=args.num_generations,
                         max_completion_length=args.max_completion_length, beta=args.beta,
                         batch_invariant=args.batch_invariant, use_peft=args.use_peft, lora_dropout=0.0,
                         micro_batch=args.num_generations, grad_accum=args.num_prompts, max_steps=args.steps,
                         device=args.device)
        trainer = Trainer(cfg)
        try:
            completions = args.num_prompts * args.num_generations
            config = {"num_prompts": args.num_prompts, "num_generations": args.num_generations,
                      "max_completion_length": args.max_completion_length, "steps": args.steps, "beta": args.beta,
                      "batch_invariant": args.batch_invariant, "use_peft": args.use_peft,
                      "dtype": str(next(trainer.task.model.parameters()).dtype).removeprefix("torch."),
                      "micro_batch": args.num_generations,
                      "grad_accum": args.num_prompts, "policy": trainer.task.policy.describe(),
                      "rollout_weights": "shared" if trainer.task.engine.shared else "bf16 copy",
                      "reward": "python_syntax", "lr": cfg.loop.lr}
            for fields in run_steps(trainer, args.steps):
                tokens = round(fields["completions/mean_length"] * completions)
                phases = {k: fields.get(k, 0.0) for k in PHASES}  # the first step has no sync or wake
                emit({"bench": "rl", "model": args.model or "default", "weights": weights,
                      "machine": trainer.gpu_name, "device": str(trainer.device), "command": command_line(args, "brrr bench rl", WORKLOAD + ("beta",)),
                      "config": config, "step": fields["step"], "step_s": fields["step_s"], **phases,
                      "phases_s": sum(phases.values()), "rollout_tokens": tokens,
                      "rollout_tok_s": tokens / phases["rollout_s"], "reward": fields["reward"],
                      "logprob_mismatch_max": fields["logprob_mismatch/max"],
                      "logprob_mismatch_mean": fields["logprob_mismatch/mean"],
                      "kv_cache_bytes": trainer.task.kv_bytes, "torch": torch.__version__,
                      "python": platform.python_version()}, args.out)
        finally:
            trainer.log_file.close()
    return 0
