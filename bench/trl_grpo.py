"""TRL's GRPOTrainer on `brrr bench rl`'s setup, one JSON record a step: the peer of brrr's rollout (issue 56).

Maintained in the repo, never imported by brrr's runtime (like bench/torchtitan/). The same setup as
`brrr bench rl` (brrr/bench/rl.py), through its own functions: the model directory (`model_dir`: a preset becomes
random weights of its shape with the default model's tokenizer, written to a temp dir; a directory or hub id is
read as is; default brrr's shipped default model), the prompts (`write_prompts`: brrr's code HEADS, one group
each), the reward (brrr's built-in python_syntax, passed to TRL as is: brrr's reward functions take TRL's
reward_funcs signature, `f(prompts, completions, completion_ids, **fields)`), and brrr grpo's defaults for what TRL
also has (temperature 1.0, top_p 1, top_k 0, epsilon 0.2, loss_type dapo, scale_rewards group, lr 1e-6 cosine to 0
with no warmup, AdamW betas (0.9, 0.999), no weight decay, grad clip 1.0). Full-parameter, fp32 weights (loaded
here and handed to TRL), bf16 autocast on CUDA (TRL's bf16=True), beta 0 (no reference model), transformers
generation (use_vllm False, no continuous batching), no gradient checkpointing (TRL defaults to it; brrr bench rl
does not checkpoint). One step = --num-prompts groups of --num-generations completions: TRL generates them in one
`generate` call (generation_batch_size = per_device_train_batch_size x gradient_accumulation_steps), then trains
one micro-batch a group (per_device_train_batch_size = --num-generations, gradient_accumulation_steps =
--num-prompts), as brrr bench rl does.

What a record times (CUDA synchronized at each edge):
  step_s          TrainerCallback on_step_begin -> on_step_end: the optimizer step's wall time
  generation_s    the model's `generate` (wrapped on the model object TRL is given): transformers' generation alone,
                  what the ">= 5x TRL's generation" target compares with brrr's rollout_s. TRL times the same call
                  (profiling_context "transformers.generate"), but only reports it to wandb / mlflow / trackio, not
                  to its logs or callbacks, so the wrapper times it here
  generation_tokens / generation_tok_s
                  completion tokens (each row up to and including its first EOS, TRL's completion mask) / generation_s:
                  brrr bench rl's rollout_tok_s definition; generated_positions is batch x decoded length, what
                  transformers ran (finished rows keep decoding until the last one stops)
  score_s         GRPOTrainer._generate_and_score_completions less generation_s: tokenizing, decoding, rewards,
                  advantages
  train_s         step_s less _generate_and_score_completions: forward + backward of each micro-batch, clip, AdamW

One device call, both sides (`bash bench/trl_grpo.sh run $OUT/rl_peer.jsonl` with .whl carried is this: the wheels
below installed, then brrr's records, then TRL's, into one file):
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/trl_site \
        .whl/trl-*.whl .whl/datasets-*.whl .whl/multiprocess-*.whl .whl/dill-*.whl
    export PYTHONPATH=/tmp/trl_site:$PWD
    python3 -m brrr bench rl --model qwen3-0.6b --num-prompts 16 --num-generations 8 --max-completion-length 256 \
        --steps 2 --out $OUT/rl_peer.jsonl
    python3 bench/trl_grpo.py --model qwen3-0.6b --num-prompts 16 --num-generations 8 --max-completion-length 256 \
        --steps 2 --out $OUT/rl_peer.jsonl
A preset's random weights are drawn with seed 0 on the same device by both sides (brrr.bench.rl.model_dir), so both
read the same values.

Wheels TRL needs on a device image that has torch, transformers, accelerate, peft and the rest of KINDS.md's list
but no trl or datasets: the closure of trl 1.16.0's and datasets 5.2.0's Requires-Dist (their installed metadata,
the same in the wheels), less the image's packages (accelerate, transformers, huggingface-hub, jinja2, numpy,
packaging, pandas, psutil, pyarrow, pyyaml, filelock, tqdm, xxhash, fsspec): trl 1.16.0, datasets 5.2.0,
multiprocess 0.70.19, dill 0.4.1 (1.8 MB; the torchtitan bundle carried the same datasets / multiprocess / dill).
`--no-deps` does not check the image's versions against what these ask: pyarrow >= 24, huggingface-hub >= 1.31 and
< 3, fsspec <= 2026.9.0 (datasets), transformers >= 4.56.2, accelerate >= 1.10.1 (trl); the record carries the
versions it ran with. Fetched here (`bash bench/trl_grpo.sh fetch`), for python 3.12 manylinux x86_64:
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform any -d .whl trl==1.16.0 datasets==5.2.0 multiprocess==0.70.19 dill==0.4.1

Here or there:
    PYTHONPATH=$PWD python bench/trl_grpo.py --model qwen3-0.6b --num-prompts 16 --num-generations 8 \
        --max-completion-length 256 --steps 2 --out X
    PYTHONPATH=$PWD python bench/trl_grpo.py --model DIR ...
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import accelerate
import datasets
import torch
import transformers
import trl
from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback

from brrr.bench.latency import emit, require_at_least
from brrr.bench.rl import add_workload_args, command_line, model_dir, write_prompts
from brrr.train.grpo import GRPO_LOOP, GRPOTaskConfig
from brrr.train.rewards import python_syntax

class Clock:
    """Seconds and completion tokens of the wrapped calls, the device synchronized at each edge."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.generation_s = self.prepare_s = 0.0
        self.tokens = self.positions = 0

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


def time_generate(model, clock: Clock, eos_ids: list[int]):
    """Replace model.generate (on this object) with a timed call that also counts the completion tokens."""
    inner = model.generate
    eos = torch.tensor(eos_ids)

    def generate(*args, **kwargs):
        start = clock.now()
        out = inner(*args, **kwargs)
        clock.generation_s += clock.now() - start
        completion = out[:, kwargs["input_ids"].shape[1]:]
        is_eos = torch.isin(completion, eos.to(completion.device))
        first = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, completion.shape[1])  # EOS counted
        clock.tokens += int(first.sum())
        clock.positions += completion.numel()
        return out

    model.generate = generate


class StepRecords(TrainerCallback):
    """One record a step: times from on_step_begin / on_step_end, TRL's metrics from the step's on_log."""

    def __init__(self, clock: Clock, out: str | None):
        self.clock, self.out, self.base = clock, out, {}
        self.times: dict[int, dict] = {}

    def on_step_begin(self, args, state, control, **kwargs):
        c = self.clock
        c.generation_s = c.prepare_s = 0.0
        c.tokens = c.positions = 0
        self.start = c.now()

    def on_step_end(self, args, state, control, **kwargs):
        c = self.clock
        step_s = c.now() - self.start
        self.times[state.global_step] = {
            "step_s": step_s, "generation_s": c.generation_s, "generation_tokens": c.tokens,
            "generation_tok_s": c.tokens / c.generation_s if c.generation_s else None,
            "generated_positions": c.positions, "score_s": c.prepare_s - c.generation_s,
            "train_s": step_s - c.prepare_s}

    def on_log(self, args, state, control, logs=None, **kwargs):
        times = self.times.pop(state.global_step, None)
        if times is None or "train_runtime" in (logs or {}):  # the run's summary line, or a step already written
            return
        emit({**self.base, "step": state.global_step, **times, "reward": logs.get("reward"),
              "completions_mean_length": logs.get("completions/mean_length"), "loss": logs.get("loss"),
              "trl_step_time": logs.get("step_time")}, self.out)


def timed_trainer(clock: Clock):
    class TimedGRPOTrainer(trl.GRPOTrainer):
        """GRPOTrainer with its generate-and-score phase timed (the rest of a step is the train step)."""

        def _generate_and_score_completions(self, inputs):
            start = clock.now()
            out = super()._generate_and_score_completions(inputs)
            clock.prepare_s += clock.now() - start
            return out

    return TimedGRPOTrainer


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(p)
    p.add_argument("--out", "--json", dest="out", default=None, metavar="PATH",
                   help="append the JSON records to this file too")
    args = p.parse_args(argv)
    require_at_least(num_prompts=(args.num_prompts, 1), num_generations=(args.num_generations, 2),
                     max_completion_length=(args.max_completion_length, 1), steps=(args.steps, 1))
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    brrr_task = GRPOTaskConfig()  # brrr grpo's sampling and loss defaults, which brrr bench rl runs with
    with tempfile.TemporaryDirectory(prefix="brrr-trl-grpo-") as tmp:
        tmp = Path(tmp)
        model_path, weights = model_dir(args.model, tmp)
        rows = [json.loads(line) for line in write_prompts(tmp / "prompts.jsonl", args.num_prompts).open()]
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        config = trl.GRPOConfig(
            output_dir=str(tmp / "trl"), per_device_train_batch_size=args.num_generations,
            gradient_accumulation_steps=args.num_prompts, num_generations=args.num_generations,
            max_completion_length=args.max_completion_length, max_steps=args.steps,
            temperature=brrr_task.temperature, top_p=brrr_task.top_p, top_k=brrr_task.top_k, beta=0.0,
            epsilon=brrr_task.epsilon, loss_type=brrr_task.loss_type, scale_rewards=brrr_task.scale_rewards,
            learning_rate=GRPO_LOOP["lr"], lr_scheduler_type="cosine", warmup_steps=GRPO_LOOP["warmup_steps"],
            weight_decay=GRPO_LOOP["weight_decay"], adam_beta2=GRPO_LOOP["beta2"], max_grad_norm=1.0,
            gradient_checkpointing=False, bf16=device.type == "cuda", use_cpu=device.type == "cpu",
            use_vllm=False, logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, seed=0)
        clock = Clock(device)
        records = StepRecords(clock, args.out)
        trainer = timed_trainer(clock)(model=model, reward_funcs=[python_syntax], args=config,
                                       train_dataset=datasets.Dataset.from_list(rows), processing_class=tokenizer,
                                       callbacks=[records])
        trainer.remove_callback(PrinterCallback)  # its dict lines would interleave with the records on stdout
        time_generate(trainer.model, clock, trainer.eos_token_ids)
        records.base = {
            "bench": "rl-peer-trl", "model": args.model or "default", "weights": weights,
            "machine": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "device": str(device),
            "command": command_line(args, "python bench/trl_grpo.py"), "trl": trl.__version__, "config": {
                "num_prompts": args.num_prompts, "num_generations": args.num_generations,
                "max_completion_length": args.max_completion_length, "steps": args.steps, "beta": config.beta,
                "micro_batch": config.per_device_train_batch_size, "grad_accum": config.gradient_accumulation_steps,
                "generation_batch_size": config.generation_batch_size,
                "policy": "full-parameter, fp32 weights" + (", bf16 autocast" if config.bf16 else ""),
                "generation": "transformers generate (use_vllm False)", "reward": "python_syntax",
                "lr": config.learning_rate, "temperature": config.temperature, "top_p": config.top_p,
                "top_k": config.top_k, "loss_type": config.loss_type, "eos_token_ids": list(trainer.eos_token_ids),
                "gradient_checkpointing": config.gradient_checkpointing},
            "transformers": transformers.__version__, "accelerate": accelerate.__version__,
            "torch": torch.__version__, "python": platform.python_version()}
        trainer.train()
    return 0


if __name__ == "__main__":
    sys.exit(main())
