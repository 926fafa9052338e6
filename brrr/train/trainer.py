"""The training loop, written once for every task (brrr/train/task.py: pretraining, LoRA SFT, the EAGLE draft
head; `brrr train`, `brrr finetune`, `brrr train-draft`).

One optimizer step = grad_accum micro-batches (the task's batches, each of micro_batch x seq_len tokens), forward
under bf16 autocast on CUDA (fp32 on CPU; fp16 with dynamic loss scaling on request), the task's loss averaged over
the step, gradients clipped, AdamW (fused on CUDA) with weight decay on matrices only, learning rate from linear
warmup + cosine decay. Every eval_every steps the task evaluates; every checkpoint_every steps the full state (what
the task trains, optimizer, data position, RNGs) is written atomically, so `--resume` continues bit for bit. At the
end (or at --stop-at, or when --time-budget runs out) the task exports its output directory. Under torchrun the
steps run over the layout (brrr.train.parallel) for a task that takes one.
"""
from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from pathlib import Path

import torch
from torch import nn

from brrr.analysis.hardware import GPU, measure
from brrr.errors import BrrrError
from brrr.pretrained import check_device
from brrr.train.config import LoopConfig, ParallelConfig, flat_flags
from brrr.train.parallel import (Checkpointer, ParallelStep, Ranks, decoder_layers, parallelize, plan_layout)
from brrr.train.parallel import checkpoint_activations as recompute_layers
from brrr.train.parallel.dcp import has_checkpoint
from brrr.train.signals import stop_on_signals
from brrr.train.task import TrainTask, trainable

PROBE_STEPS = (5, 15)  # with --time-budget, steps [5, 15) are timed (after compilation) to size the run


class TrainingDiverged(BrrrError):
    """The loss or gradient norm became NaN or infinite."""


def lr_at(step: int, cfg: LoopConfig, max_steps: int) -> float:
    """Linear warmup to cfg.lr over warmup_steps, then cosine down to lr * min_lr_ratio at max_steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, max_steps - cfg.warmup_steps))
    low = cfg.lr * cfg.min_lr_ratio
    return low + 0.5 * (1 + math.cos(math.pi * progress)) * (cfg.lr - low)


def make_optimizer(model: nn.Module, cfg: LoopConfig, device) -> torch.optim.AdamW:
    """AdamW with decoupled weight decay on matrices (embedding included) and none on norms and biases."""
    params = trainable(model)
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    meshes = list(dict.fromkeys(getattr(p, "device_mesh", None) for p in params))
    if len(meshes) > 1:  # --ep's experts sit on a mesh of their own, and the fused step's DTensor ops take one
        groups = [{**g, "params": [p for p in g["params"] if getattr(p, "device_mesh", None) == m]}
                  for g in groups for m in meshes]
    # no empty group (adapters alone are all matrices): DCP's flattened optimizer state cannot load one back
    groups = [g for g in groups if g["params"]]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8,
                             fused=torch.device(device).type == "cuda")


def training_device(spec: str | None, local_rank: int = 0) -> torch.device:
    """The device a training process runs on, made current: --device (a bare "cuda" is this rank's GPU), else
    this rank's GPU when there is one, else the CPU. Indexed, since the loss and the memory readings key by it."""
    if spec:
        device = check_device(spec)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def checkpoint_activations(model: nn.Module, selective: bool = False):
    """Recompute each decoder layer in backward instead of keeping its activations (the parameters' names,
    and so the state dict, are unchanged: only the layers' forward is wrapped). selective: keep the outputs of
    the matmuls that contract a wide dimension and of attention, recompute only the cheap rest (norms, RoPE,
    activations, dropout, rank-r LoRA expansions): backward then re-runs almost no FLOPs, for more memory."""
    recompute_layers(decoder_layers(model), selective)


def autocast_for(device, fp16: bool = False) -> contextlib.AbstractContextManager:
    if fp16:
        return torch.autocast(torch.device(device).type, dtype=torch.float16)
    if torch.device(device).type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def optimizer_step(loss_fn, optimizer, params, batches, grad_clip: float, autocast,
                   clip=torch.nn.utils.clip_grad_norm_) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step over micro-batches [(inputs, targets), ...] (or whatever tuples loss_fn takes):
    (mean loss, pre-clip grad norm), both left on the device (reading them would wait for the GPU). clip: the
    layout's gradient clipping."""
    total = None
    for batch in batches:
        with autocast:
            loss = loss_fn(*batch)
        (loss / len(batches)).backward()
        total = loss.detach() if total is None else total + loss.detach()
    norm = clip(params, grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total / len(batches), norm


def device_gpu(device) -> GPU | None:
    """This CUDA device, measured (brrr.analysis.hardware: its datasheet entry beside), or None on CPU."""
    if torch.device(device).type != "cuda":
        return None
    return measure(str(device))


def peak_flops(device) -> tuple[float | None, str]:
    """The bf16 peak MFU is quoted against (the GPU's datasheet, via brrr.analysis.hardware), or None on CPU."""
    gpu = device_gpu(device)
    return (gpu.datasheet_peak("bf16"), gpu.name) if gpu is not None else (None, "cpu")


class Trainer:
    """The loop over one task. cfg: a command's config (TrainConfig, FinetuneConfig, DraftConfig: its .loop,
    .parallel and make_task()), or a RunConfig with the task given."""

    def __init__(self, cfg, task: TrainTask | None = None):
        self.start = time.perf_counter()
        self.cfg: LoopConfig = cfg.loop
        self.parallel_cfg: ParallelConfig = cfg.parallel
        self.config = cfg  # all its parts, for train_config.json
        self.task = task if task is not None else cfg.make_task()
        self.cfg.check()
        self.ranks = Ranks.from_env()
        if self.ranks.world > 1 and not self.task.parallel:
            raise BrrrError(f"WORLD_SIZE={self.ranks.world}: brrr {self.task.command} runs one process")
        self.out = Path(self.cfg.out)
        if not self.cfg.resume and has_checkpoint(self.out):
            raise BrrrError(f"{self.out} already holds a {self.task.run_name} run; pass --resume to continue it, "
                            "or choose another --out")
        self.device = training_device(self.cfg.device, self.ranks.local_rank)
        self.model_cfg = self.task.configure(self)
        cfg = self.cfg
        if cfg.seq_len is None:
            raise BrrrError(f"--seq-len must be set: the {self.task.run_name} task took none from its model")
        # torchrun's ranks -> a DeviceMesh, the layout checked on every rank before any collective
        self.mesh = plan_layout(self.parallel_cfg, self.model_cfg, cfg.micro_batch, cfg.seq_len, self.device)
        self.ranks.open_group()
        self.checkpoints = Checkpointer(self.out, self.mesh.distributed, self.ranks.main,
                                        self.parallel_cfg.async_checkpoint)
        self.ckpt_path = self.checkpoints.path
        # FSDP's mixed-precision policy casts the weights itself; DDP and one process use autocast
        self.autocast = autocast_for(self.device, self.parallel_cfg.fp16) if not self.mesh.fsdp \
            else contextlib.nullcontext()
        self.train_step = ParallelStep(self.mesh, cfg.micro_batch, cfg.seq_len, self.parallel_cfg.fp16)
        self.model = self.task.build(self)
        self.params = trainable(self.model)
        self.optimizer = make_optimizer(self.model, cfg, self.device)
        self.state = {"step": 0, "position": 0, "tokens_seen": 0, "max_steps": cfg.max_steps,
                      "budget_fixed": False, "train_seconds": 0.0, "config": self.task.resume_key(self)}
        if cfg.resume:
            self.restore_checkpoint()
        self.loss_fn = self.task.loss_fn
        self.tokens_per_step = cfg.micro_batch * cfg.seq_len * cfg.grad_accum * self.mesh.dp_world
        self.gpu = device_gpu(self.device)
        self.peak, self.gpu_name = (self.gpu.datasheet_peak("bf16"), self.gpu.name) if self.gpu else (None, "cpu")
        # brrr calc's per-GPU memory for this run on this device, logged beside the measured peak on CUDA
        self.calc_memory = self.task.predicted_memory(self) if self.gpu else None
        if self.ranks.main:
            self._open_run_files()

    def parallelize(self, model: nn.Module, **options) -> nn.Module:
        """A task's plain model laid out over this run's mesh (brrr.train.parallel.parallelize; options: compile,
        activation_checkpointing, checkpoint_every); the step then runs the layout's pipeline if it made one."""
        model, self.train_step.pipeline = parallelize(model, self.mesh, self.parallel_cfg, self.device,
                                                      grad_accum=self.cfg.grad_accum, seq_len=self.cfg.seq_len,
                                                      **options)
        return model

    def _open_run_files(self) -> None:
        """OUT/train_config.json, and OUT/train_log.jsonl opened for appending (the main rank's)."""
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "train_config.json").write_text(json.dumps(flat_flags(self.config), indent=2) + "\n")
        self.log_file = open(self.out / "train_log.jsonl", "a")

    def restore_checkpoint(self) -> None:
        """--resume: what the task trains and the optimizer, after checking the run's resume key against the
        checkpoint's; a budget-fixed step count is kept, else --max-steps may extend it. A layout's sharded
        checkpoint, or a one-process run's state file."""
        saved = self.checkpoints.load(self.task.checkpointed, self.optimizer)
        for key, value in self.task.resume_key(self).items():
            if saved["config"].get(key) != value:
                note = " (--micro-batch x data-parallel ranks: keep it when the layout changes)" \
                    if key == "micro_batch" and self.task.parallel else ""
                raise BrrrError(f"--resume: the checkpoint was trained with {key}={saved['config'].get(key)!r}, "
                                f"this run has {value!r}{note}")
        self.state = saved
        self.train_step.restore(saved)
        self.state["max_steps"] = max(self.cfg.max_steps, saved["step"]) if not saved["budget_fixed"] \
            else saved["max_steps"]

    # -- logging ---------------------------------------------------------------------------------------------
    def log(self, record: dict, line: str):
        if not self.ranks.main:
            return
        self.log_file.write(json.dumps(record) + "\n")
        self.log_file.flush()
        print(line, flush=True)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def evaluate(self, max_windows: int | None) -> dict[str, float]:
        return self.task.evaluate(self, max_windows)

    # -- the loop --------------------------------------------------------------------------------------------
    def run(self) -> dict:
        cfg, st = self.cfg, self.state
        self.model.train()
        if self.ranks.main:
            print(self.task.describe(self), flush=True)
            if self.mesh.distributed:
                print(f"layout: {self.mesh.layout.describe()} on {self.ranks.world} ranks"
                      + (f" (ZeRO-{self.calc_memory['zero']}); brrr calc train predicts "
                         f"{self.calc_memory['bytes'] / 2**30:.2f} GiB per GPU" if self.calc_memory else ""),
                      flush=True)
            if self.calc_memory and not self.calc_memory.get("fits", True):
                print(f"warning: brrr calc train predicts {self.calc_memory['bytes'] / 2**30:.1f} GiB per GPU, more "
                      f"than the {self.calc_memory['gpu_memory'] / 2**30:.0f} GiB of this {self.gpu_name}",
                      file=sys.stderr, flush=True)
            if st["max_steps"] < cfg.warmup_steps:
                peak = lr_at(st["max_steps"] - 1, cfg, st["max_steps"])
                print(f"warning: --max-steps {st['max_steps']} ends inside the {cfg.warmup_steps} --warmup-steps: "
                      f"the learning rate peaks at {peak:.2e}, not --lr {cfg.lr:.2e}, and never decays",
                      file=sys.stderr, flush=True)
        if st["step"] == 0 and self.task.eval_at_start:
            self._eval_and_log(0, cfg.eval_windows)
        with stop_on_signals() as interrupted:
            halted = self._loop(interrupted)
        return self.finish(halted)

    def _loop(self, interrupted: list) -> bool:
        """Steps until max_steps, --stop-at or the time budget (then True: halted), or Ctrl-C (KeyboardInterrupt
        once the checkpoint is written)."""
        cfg, st = self.cfg, self.state
        loss_sum = torch.zeros((), device=self.device)
        bad = torch.zeros((), dtype=torch.bool, device=self.device)
        window_start, window_steps, last_good = time.perf_counter(), 0, st["step"]
        halted = False
        while st["step"] < st["max_steps"]:
            step = st["step"]
            lr = lr_at(step, cfg, st["max_steps"])
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            batches = [self.task.batches.batch_at(st["position"] + i, self.device) for i in range(cfg.grad_accum)]
            loss, norm = self.train_step(optimizer_step, self.loss_fn, self.optimizer, self.params, batches,
                                            cfg.grad_clip, self.autocast)
            if hasattr(self.task, "after_step"):  # an optional member (task.py)
                self.task.after_step(self)
            st["step"], st["position"] = step + 1, st["position"] + cfg.grad_accum
            st["tokens_seen"] += self.tokens_per_step
            loss_sum += loss
            bad |= ~torch.isfinite(loss) | ~torch.isfinite(norm)
            window_steps += 1
            step = st["step"]
            self._maybe_fix_budget(step)
            last = step == st["max_steps"]
            halted = (cfg.stop_at is not None and step >= cfg.stop_at) or self.ranks.any(self._out_of_time())
            # Ctrl-C / SIGTERM: checkpoint this step and stop, no evaluation or export (all ranks at one step)
            stopping = self.ranks.any(bool(interrupted))
            if step % cfg.log_every == 0 or last or halted or stopping:
                if bad.item():
                    self._diverged(step, last_good)
                now = time.perf_counter()
                seconds = now - window_start
                st["train_seconds"] += seconds
                tok_s = window_steps * self.tokens_per_step / seconds
                per_rank = "GPU" if self.device.type == "cuda" else "rank"  # gloo ranks on a CPU are processes
                mfu = tok_s * self.task.flops_per_token / (self.peak * self.ranks.world) if self.peak else None
                record = {"step": step, "loss": loss_sum.item() / window_steps, "lr": lr, "grad_norm": norm.item(),
                          "tokens_per_s": tok_s, "tokens_per_s_per_gpu": tok_s / self.ranks.world, "mfu": mfu,
                          "tokens_seen": st["tokens_seen"], "epoch": self.task.batches.epoch(st["position"]),
                          "elapsed_s": self.elapsed()}
                if self.device.type == "cuda":  # the busiest rank's, beside brrr calc train's prediction
                    record["peak_memory_bytes"] = self.ranks.max_over_ranks(
                        torch.cuda.max_memory_allocated(self.device))
                    record["peak_memory_gb"] = record["peak_memory_bytes"] / 1e9
                    if self.calc_memory:
                        record["calc_memory_bytes"] = self.calc_memory["bytes"]
                record.update(self.train_step.log_fields(self.ranks))
                record.update(self.task.log_fields())
                self.log(record, f"step {step:>6}/{st['max_steps']} | loss {record['loss']:.4f} | lr {lr:.2e} | "
                                 f"grad {record['grad_norm']:.3f} | {rate(tok_s)} tok/s"
                                 + (f" ({rate(tok_s / self.ranks.world)}/{per_rank})" if self.ranks.world > 1 else "")
                                 + (f" | MFU {mfu:.1%}" if mfu is not None else "")
                                 + (f" | mem {record['peak_memory_bytes'] / 2**30:.1f} GiB" if "peak_memory_bytes"
                                    in record else "")
                                 + (f" (calc {record['calc_memory_bytes'] / 2**30:.1f})" if "calc_memory_bytes"
                                    in record else "")
                                 + (f" | bubble {record['pp_bubble']:.0%} (formula {record['pp_bubble_formula']:.0%}),"
                                    f" busiest stage {record['pp_stage_imbalance']:.2f}x the mean"
                                    if record.get("pp_bubble") is not None else "")
                                 + (f" | loss scale {record['loss_scale']:g} ({record['overflow_steps']} skipped)"
                                    if "loss_scale" in record else "") + f" | {self.elapsed():.0f}s"
                                 + (f" | ETA {_duration((st['max_steps'] - step) * seconds / window_steps)}"
                                    if not last else ""))
                loss_sum.zero_()
                window_steps = 0
                if stopping:
                    self.save_checkpoint()
                    self.wait_for_checkpoint()  # an async save must land before the process exits
                    if self.ranks.main:
                        print(f"interrupted: checkpoint of step {step} written to {self.ckpt_path}; continue with "
                              "the same command and --resume", file=sys.stderr, flush=True)
                    raise KeyboardInterrupt
                if step % cfg.eval_every == 0 or last or halted:
                    self._eval_and_log(step, cfg.eval_windows)
                if step % cfg.checkpoint_every == 0 or last or halted:
                    self.save_checkpoint()
                    last_good = step
                window_start = time.perf_counter()
            if halted:
                break
        return halted

    def _eval_and_log(self, step: int, windows: int | None, final: bool = False) -> dict:
        val = self.task.evaluate(self, windows)
        self.log({"step": step, **val, "final": final, "elapsed_s": self.elapsed()},
                 f"{'final ' if final else ''}eval @ {step}: {self.task.eval_line(val)}")
        return val

    def _diverged(self, step: int, last_good: int):
        self.wait_for_checkpoint()  # an async save of the last good step still lands
        where = f"{self.ckpt_path} (step {last_good})" if self.ckpt_path.exists() else "none written yet"
        self.log({"step": step, "error": "non-finite loss or gradient norm"}, f"step {step}: loss is not finite")
        raise TrainingDiverged(f"the loss or gradient norm became NaN/inf between steps {last_good} and {step}; "
                               f"stopped. Last good checkpoint: {where}. Resume it with --resume, perhaps with a "
                               f"lower --lr or --grad-clip")

    def _maybe_fix_budget(self, step: int):
        """With --time-budget: once steps PROBE_STEPS have been timed, cap max_steps to what fits (evaluations,
        the final evaluation and the export included), and keep that number for the rest of the run."""
        cfg, st = self.cfg, self.state
        if cfg.time_budget is None or st["budget_fixed"]:
            return
        if step == PROBE_STEPS[0]:
            self._sync()
            self._probe_start = time.perf_counter()
        elif step == PROBE_STEPS[1] and hasattr(self, "_probe_start"):
            self._sync()
            step_s = (time.perf_counter() - self._probe_start) / (PROBE_STEPS[1] - PROBE_STEPS[0])
            token_eval_s = step_s / self.tokens_per_step / 3  # a forward is about a third of a training step
            eval_s = token_eval_s * self.task.eval_tokens(cfg.eval_windows)
            self._reserve_s = 15 + self.task.eval_tokens(cfg.final_eval_windows) * token_eval_s  # final eval, export
            left = cfg.time_budget - self.elapsed() - self._reserve_s
            fits = self.ranks.min_int(int(left / (step_s + eval_s / cfg.eval_every)))  # ranks agree
            st["max_steps"] = max(step + 1, min(st["max_steps"], step + fits))
            st["budget_fixed"] = True
            self.log({"step": step, "step_seconds": step_s, "max_steps": st["max_steps"]},
                     f"time budget {cfg.time_budget:.0f}s: {step_s * 1e3:.1f} ms/step -> max_steps {st['max_steps']}")

    def _out_of_time(self) -> bool:
        """A safety net behind the budget's sizing: stop when only the final evaluation's reserve is left."""
        if self.cfg.time_budget is None:
            return False
        return self.elapsed() > self.cfg.time_budget - getattr(self, "_reserve_s", 15)

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- outputs ---------------------------------------------------------------------------------------------
    def save_checkpoint(self):
        self.state.update(self.train_step.state())
        self.checkpoints.save(self.task.checkpointed, self.optimizer, self.state)

    def wait_for_checkpoint(self):
        """Until an async save in flight has landed."""
        self.checkpoints.wait()

    def finish(self, halted: bool) -> dict:
        st = self.state
        final = self._eval_and_log(st["step"], self.cfg.final_eval_windows, final=True)
        summary = {"steps": st["step"], "max_steps": st["max_steps"], "halted": halted,
                   "tokens_seen": st["tokens_seen"], "epochs": self.task.batches.epoch(st["position"]),
                   "train_seconds": st["train_seconds"], "device": str(self.device), "gpu": self.gpu_name,
                   **final, **self.task.summary(self, final)}
        self.wait_for_checkpoint()
        if self.ranks.main:
            summary.update(self.task.export(self))
            (self.out / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
            self.log_file.close()
        return summary


def rate(per_second: float) -> str:
    """A rate for the log line: thousands with a k (12.3k), smaller ones plainly (42, 0.4), never 0.0k."""
    if per_second >= 1e3:
        return f"{per_second / 1e3:,.1f}k"
    return f"{per_second:.0f}" if per_second >= 10 else f"{per_second:.1f}"


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


# brrr train's config, where its callers have always imported it from (defined beside its task)
from brrr.train.pretrain import TrainConfig  # noqa: E402,F401
