"""`brrr train`: a Llama-family model (brrr's own models/ code) trained on a `brrr data build` directory.

One optimizer step = grad_accum micro-batches of micro_batch x seq_len tokens, forward under bf16 autocast on
CUDA (fp32 on CPU), loss averaged over the step, gradients clipped, AdamW (fused on CUDA) with weight decay on
matrices only, learning rate from linear warmup + cosine decay. Every eval_every steps the loss on the
validation split is measured per source; every checkpoint_every steps the full state (model, optimizer, data
position, RNGs) is written atomically, so `--resume` continues bit for bit. At the end (or at --stop-at, or when
--time-budget runs out) the output directory is a Hugging Face model directory that brrr and transformers load.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from torch import nn

from brrr.analysis.model import param_counts, training_flops_per_token
from brrr.errors import BrrrError
from brrr.loader import save_model
from brrr.models import model_class
from brrr.pretrained import check_device
from brrr.token_data import TokenData
from brrr.train import checkpoint
from brrr.train.loss import CausalLMLoss
from brrr.train.parallel import Checkpointer, Parallel, decoder_layers, load_model_weights
from brrr.train.parallel import checkpoint_activations as recompute_layers
from brrr.train.sampler import TrainWindows, eval_windows
from brrr.train.shapes import resolve_config
from brrr.train.signals import stop_on_signals
from brrr.train.tokenizer import tokenizer_config

PROBE_STEPS = (5, 15)  # with --time-budget, steps [5, 15) are timed (after compilation) to size the run


class TrainingDiverged(BrrrError):
    """The loss or gradient norm became NaN or infinite."""


@dataclass
class TrainConfig:
    model: str  # shape, preset or config.json (brrr.train.shapes)
    data: str
    out: str
    seq_len: int = 1024
    micro_batch: int = 16
    grad_accum: int = 1
    max_steps: int = 1000
    lr: float = 6e-4
    min_lr_ratio: float = 0.1  # the cosine ends at lr * min_lr_ratio
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    eval_every: int = 250
    eval_windows: int = 64  # per source, during training
    final_eval_windows: int | None = None  # per source, at the end (None: the whole validation split)
    log_every: int = 10
    checkpoint_every: int = 500
    seed: int = 0
    device: str | None = None
    compile: bool = False
    activation_checkpointing: bool = False
    time_budget: float | None = None  # wall-clock seconds for this invocation, final eval and export included
    stop_at: int | None = None  # halt after this step (checkpoint + export), to resume later
    resume: bool = False
    export_dtype: str = "auto"  # auto: bfloat16 when trained under bf16 autocast, else float32
    # parallel layout under torchrun (brrr.train.parallel): dp_replicate x dp_shard x tp x pp = WORLD_SIZE
    dp_replicate: int = 1
    dp_shard: int = -1  # -1: the ranks the other dimensions leave
    tp: int = 1
    pp: int = 1
    pp_schedule: str = "1f1b"
    microbatches: int | None = None  # pipeline microbatches per micro-batch (default: pp)
    reshard_after_forward: bool = True  # FSDP: True frees gathered weights after forward (ZeRO-3), False ZeRO-2
    async_checkpoint: bool = False
    activation_checkpointing_every: int = 1  # with activation_checkpointing: recompute every N-th layer only
    fp16: bool = False  # fp16 compute with dynamic loss scaling (GPUs without bf16), instead of bf16

    def check(self):
        positive = ("seq_len", "micro_batch", "grad_accum", "max_steps", "eval_every", "eval_windows", "log_every",
                    "checkpoint_every", "activation_checkpointing_every")
        for name in positive:
            if getattr(self, name) < 1:
                raise BrrrError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0 or not 0 <= self.min_lr_ratio <= 1 or self.warmup_steps < 0 or self.grad_clip <= 0:
            raise BrrrError("--lr and --grad-clip must be > 0, --min-lr-ratio in [0, 1], --warmup-steps >= 0")
        if self.time_budget is not None and self.time_budget <= 0:
            raise BrrrError(f"--time-budget must be > 0 seconds, got {self.time_budget}")
        if self.export_dtype not in ("auto", "float32", "bfloat16"):
            raise BrrrError(f"--export-dtype must be auto, float32 or bfloat16, got {self.export_dtype!r}")


@dataclass
class Distributed:
    """Where this process sits in a torchrun launch (RANK / WORLD_SIZE / LOCAL_RANK), or a lone process."""
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @classmethod
    def from_env(cls) -> "Distributed":
        env = {k: int(os.environ.get(k, d)) for k, d in (("RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_RANK", 0))}
        return cls(env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"])

    @property
    def main(self) -> bool:
        return self.rank == 0


def lr_at(step: int, cfg: TrainConfig, max_steps: int) -> float:
    """Linear warmup to cfg.lr over warmup_steps, then cosine down to lr * min_lr_ratio at max_steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, max_steps - cfg.warmup_steps))
    low = cfg.lr * cfg.min_lr_ratio
    return low + 0.5 * (1 + math.cos(math.pi * progress)) * (cfg.lr - low)


def build_model(cfg, device, seed: int = 0) -> nn.Module:
    """A freshly initialised fp32 model: N(0, 0.02) matrices, residual-output projections (o_proj, down_proj)
    scaled by 1/sqrt(2 * layers) as in GPT-2, zero biases, unit norm weights."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = model_class(cfg)(cfg)
    residual_std = 0.02 / math.sqrt(2 * cfg.num_layers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.zero_()
            elif p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, residual_std if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02)
    return model


def make_optimizer(model: nn.Module, cfg: TrainConfig, device) -> torch.optim.AdamW:
    """AdamW with decoupled weight decay on matrices (embedding included) and none on norms and biases."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
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


def one_process_layout(micro_batch: int, seq_len: int, model_cfg, device) -> Parallel:
    """The layout of a run that is one process by construction (brrr finetune, brrr train-draft): the trainer's
    loop steps through it as through any other."""
    flags = SimpleNamespace(dp_replicate=1, dp_shard=-1, tp=1, pp=1, pp_schedule="1f1b", microbatches=None,
                            micro_batch=micro_batch, seq_len=seq_len, fp16=False)
    return Parallel(flags, model_cfg, device)


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


def peak_flops(device) -> tuple[float | None, str]:
    """The bf16 peak MFU is quoted against (the GPU's datasheet, via brrr.analysis.hardware), or None on CPU."""
    if torch.device(device).type != "cuda":
        return None, "cpu"
    from brrr.analysis.hardware import measure

    gpu = measure(str(device))
    return gpu.datasheet_peak("bf16"), gpu.name


class Trainer:
    checkpoints: Checkpointer | None = None  # a layout's (sharded, maybe async) checkpoints; None: a state file
    calc_memory: dict | None = None  # brrr calc train's per-GPU bytes for this run, logged beside the peak

    def __init__(self, cfg: TrainConfig):
        cfg.check()
        self.start = time.perf_counter()
        self.cfg, self.dist = cfg, Distributed.from_env()
        self.out = Path(cfg.out)
        self.data = TokenData(cfg.data)
        self.model_cfg = resolve_config(cfg.model, self.data.vocab_size, self.data.special_tokens, cfg.seq_len)
        self.device = training_device(cfg.device, self.dist.local_rank)
        self.parallel = Parallel(cfg, self.model_cfg, self.device)  # torchrun's ranks -> a DeviceMesh
        self.checkpoints = Checkpointer(self.out, self.parallel.distributed, self.dist.main, cfg.async_checkpoint)
        self.ckpt_path = self.checkpoints.path
        # FSDP's mixed-precision policy casts the weights itself; DDP and one process use autocast
        self.autocast = autocast_for(self.device, cfg.fp16) if not self.parallel.fsdp else contextlib.nullcontext()
        self.model = self.parallel.apply(build_model(self.model_cfg, self.device, cfg.seed))
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = make_optimizer(self.model, cfg, self.device)
        self.windows = TrainWindows(self.data.splits["train"], cfg.seq_len, cfg.micro_batch, cfg.seed,
                                    self.parallel.dp_rank, self.parallel.dp_world)
        self.state = {"step": 0, "position": 0, "tokens_seen": 0, "max_steps": cfg.max_steps,
                      "budget_fixed": False, "train_seconds": 0.0, "config": self._resume_key()}
        if cfg.resume:
            self.restore_checkpoint(self.model)
        elif self.out.exists() and self.checkpoints.exists():
            raise BrrrError(f"{self.out} already holds a training run; pass --resume to continue it, "
                            "or choose another --out")
        self.loss = CausalLMLoss(self.model)
        self.loss_fn = self.loss
        # one process compiles the whole loss (distributed runs compile per layer); fill the eager caches first
        # (AttnMeta, RoPE frequencies), so the graph sees no mutation
        if cfg.compile and not self.parallel.compiles_blocks:
            self.loss.meta(cfg.micro_batch, cfg.seq_len, self.device)
            self.model.model.rotary_emb(torch.zeros(1, dtype=torch.long, device=self.device), torch.float32)
            self.loss_fn = torch.compile(self.loss)
        self.tokens_per_step = cfg.micro_batch * cfg.seq_len * cfg.grad_accum * self.parallel.dp_world
        self.flops_per_token = training_flops_per_token(self.model_cfg, cfg.seq_len)
        self.peak, self.gpu_name = peak_flops(self.device)
        # brrr calc train's per-GPU memory for this layout, logged beside the measured peak on CUDA
        self.calc_memory = self.parallel.calc_train_memory(self.model_cfg) if self.device.type == "cuda" else None
        if self.dist.main:
            self._open_run_files()

    def _start_one_process(self, cfg, command: str, run: str) -> None:
        """The common start of a run that is one process by construction (brrr finetune, brrr train-draft): the
        config, the clock, the output paths, the device; refused under torchrun and over another run's output."""
        self.start = time.perf_counter()
        self.cfg, self.dist = cfg, Distributed.from_env()
        if self.dist.world > 1:
            raise BrrrError(f"WORLD_SIZE={self.dist.world}: brrr {command} runs one process")
        self.out = Path(cfg.out)
        self.ckpt_path = self.out / "checkpoint" / "state.pt"
        if self.ckpt_path.exists() and not cfg.resume:
            raise BrrrError(f"{self.out} already holds a {run} run; pass --resume to continue it, "
                            "or choose another --out")
        self.device = training_device(cfg.device)
        self.autocast = autocast_for(self.device)

    def _open_run_files(self) -> None:
        """OUT/train_config.json, and OUT/train_log.jsonl opened for appending (the main rank's)."""
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "train_config.json").write_text(json.dumps(asdict(self.cfg), indent=2) + "\n")
        self.log_file = open(self.out / "train_log.jsonl", "a")

    def restore_checkpoint(self, trained) -> None:
        """--resume: `trained` (what checkpoints hold) and the optimizer, after checking the run's resume key
        against the checkpoint's; a budget-fixed step count is kept, else --max-steps may extend it. A layout's
        sharded checkpoint (`self.checkpoints`), or a one-process run's state file (finetune, train-draft)."""
        saved = (self.checkpoints.load(trained, self.optimizer) if self.checkpoints is not None
                 else checkpoint.load(self.ckpt_path, trained, self.optimizer))
        for key, value in self._resume_key().items():
            if saved["config"].get(key) != value:
                note = " (--micro-batch x data-parallel ranks: keep it when the layout changes)" \
                    if key == "micro_batch" and self.checkpoints is not None else ""
                raise BrrrError(f"--resume: the checkpoint was trained with {key}={saved['config'].get(key)!r}, "
                                f"this run has {value!r}{note}")
        self.state = saved
        self.parallel.restore(saved)
        self.state["max_steps"] = max(self.cfg.max_steps, saved["step"]) if not saved["budget_fixed"] \
            else saved["max_steps"]

    def _resume_key(self) -> dict:
        """What must not change across a resume: the model, the data, and the batch geometry."""
        c = self.cfg
        # the layout may change (the data position counts global micro-batches), the global batch may not:
        # micro_batch is the sequences of one micro-batch over all data-parallel ranks
        return {"model": self.model_cfg.to_hf(), "tokenizer_sha256": self.data.manifest["tokenizer_sha256"],
                "seq_len": c.seq_len, "micro_batch": c.micro_batch * self.parallel.dp_world,
                "grad_accum": c.grad_accum, "seed": c.seed}

    # -- logging ---------------------------------------------------------------------------------------------
    def log(self, record: dict, line: str):
        if not self.dist.main:
            return
        self.log_file.write(json.dumps(record) + "\n")
        self.log_file.flush()
        print(line, flush=True)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    # -- evaluation ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, max_windows: int | None) -> dict[str, float]:
        """Mean next-token loss on the validation split, per source and over all of them (token-weighted)."""
        self.model.eval()
        val = self.data.splits["val"]
        sums, counts = {}, {}
        for name, (start, end) in self.data.source_ranges("val").items():
            starts, length = eval_windows(start, end, self.cfg.seq_len, max_windows)
            total, n = torch.zeros((), device=self.device, dtype=torch.float64), 0
            for i in range(0, len(starts), self.cfg.micro_batch):
                chunk = starts[i: i + self.cfg.micro_batch]
                rows = torch.from_numpy(val[chunk[:, None] + np.arange(length)].astype(np.int64))
                rows = rows.to(self.device)
                total += self.parallel.eval_loss_sum(self.loss, rows[:, :-1], rows[:, 1:], self.autocast).double()
                n += rows[:, 1:].numel()
            if n:
                sums[name], counts[name] = total.item(), n
        self.model.train()
        out = {f"val_loss/{k}": sums[k] / counts[k] for k in sums}
        if counts:
            out["val_loss"] = sum(sums.values()) / sum(counts.values())
        return out

    def describe(self) -> str:
        n, st = param_counts(self.model_cfg)["total"], self.state
        return (f"training {self.cfg.model}: {n / 1e6:.2f}M parameters on {self.device} ({self.gpu_name}); "
                f"{self.data.manifest['splits']['train']['tokens']:,} train tokens, "
                f"{self.tokens_per_step:,} tokens/step; steps {st['step']} -> {st['max_steps']}")

    def before_first_step(self):
        """Called once the run is described, before its first step (of this invocation)."""

    # -- the loop --------------------------------------------------------------------------------------------
    def run(self) -> dict:
        cfg, st = self.cfg, self.state
        self.model.train()
        if self.dist.main:
            print(self.describe(), flush=True)
            if self.parallel.distributed:
                print(f"layout: {self.parallel.layout.describe()} on {self.dist.world} ranks"
                      + (f" (ZeRO-{self.calc_memory['zero']}); brrr calc train predicts "
                         f"{self.calc_memory['bytes'] / 2**30:.2f} GiB per GPU" if self.calc_memory else ""),
                      flush=True)
            if st["max_steps"] < cfg.warmup_steps:
                peak = lr_at(st["max_steps"] - 1, cfg, st["max_steps"])
                print(f"warning: --max-steps {st['max_steps']} ends inside the {cfg.warmup_steps} --warmup-steps: "
                      f"the learning rate peaks at {peak:.2e}, not --lr {cfg.lr:.2e}, and never decays",
                      file=sys.stderr, flush=True)
        self.before_first_step()
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
            batches = [self.windows.batch_at(st["position"] + i, self.device) for i in range(cfg.grad_accum)]
            loss, norm = self.parallel.step(optimizer_step, self.loss_fn, self.optimizer, self.params, batches,
                                            cfg.grad_clip, self.autocast)
            st["step"], st["position"] = step + 1, st["position"] + cfg.grad_accum
            st["tokens_seen"] += self.tokens_per_step
            loss_sum += loss
            bad |= ~torch.isfinite(loss) | ~torch.isfinite(norm)
            window_steps += 1
            step = st["step"]
            self._maybe_fix_budget(step)
            last = step == st["max_steps"]
            halted = (cfg.stop_at is not None and step >= cfg.stop_at) or self.parallel.any(self._out_of_time())
            # Ctrl-C / SIGTERM: checkpoint this step and stop, no evaluation or export (all ranks at one step)
            stopping = self.parallel.any(bool(interrupted))
            if step % cfg.log_every == 0 or last or halted or stopping:
                if bad.item():
                    self._diverged(step, last_good)
                now = time.perf_counter()
                seconds = now - window_start
                st["train_seconds"] += seconds
                tok_s = window_steps * self.tokens_per_step / seconds
                mfu = tok_s * self.flops_per_token / (self.peak * self.dist.world) if self.peak else None
                record = {"step": step, "loss": loss_sum.item() / window_steps, "lr": lr, "grad_norm": norm.item(),
                          "tokens_per_s": tok_s, "tokens_per_s_per_gpu": tok_s / self.dist.world, "mfu": mfu,
                          "tokens_seen": st["tokens_seen"], "epoch": self.windows.epoch(st["position"]),
                          "elapsed_s": self.elapsed()}
                if self.device.type == "cuda":  # the busiest rank's, beside brrr calc train's prediction
                    record["peak_memory_bytes"] = self.parallel.max_over_ranks(
                        torch.cuda.max_memory_allocated(self.device))
                    record["peak_memory_gb"] = record["peak_memory_bytes"] / 1e9
                    if self.calc_memory:
                        record["calc_memory_bytes"] = self.calc_memory["bytes"]
                record.update(self.parallel.log_fields())
                self.log(record, f"step {step:>6}/{st['max_steps']} | loss {record['loss']:.4f} | lr {lr:.2e} | "
                                 f"grad {record['grad_norm']:.3f} | {tok_s / 1e3:,.1f}k tok/s"
                                 + (f" ({tok_s / self.dist.world / 1e3:,.1f}k/GPU)" if self.dist.world > 1 else "")
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
                    if self.dist.main:
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
        val = self.evaluate(windows)
        record = {"step": step, **val, "final": final, "elapsed_s": self.elapsed()}
        parts = " | ".join(f"{k.removeprefix('val_loss/')} {v:.4f}" for k, v in val.items() if "/" in k)
        self.log(record, f"{'final ' if final else ''}eval @ {step}: val loss {val.get('val_loss', float('nan')):.4f}"
                         f" (ppl {math.exp(val.get('val_loss', float('nan'))):.2f}) | {parts}")
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
            sources = len(self.data.source_ranges("val"))
            eval_s = token_eval_s * cfg.eval_windows * sources * cfg.seq_len
            self._reserve_s = 15 + self._final_eval_tokens() * token_eval_s  # final eval, export, slack
            left = cfg.time_budget - self.elapsed() - self._reserve_s
            fits = self.parallel.min_int(int(left / (step_s + eval_s / cfg.eval_every)))  # ranks agree
            st["max_steps"] = max(step + 1, min(st["max_steps"], step + fits))
            st["budget_fixed"] = True
            self.log({"step": step, "step_seconds": step_s, "max_steps": st["max_steps"]},
                     f"time budget {cfg.time_budget:.0f}s: {step_s * 1e3:.1f} ms/step -> max_steps {st['max_steps']}")

    def _final_eval_tokens(self) -> int:
        total = 0
        for start, end in self.data.source_ranges("val").values():
            starts, length = eval_windows(start, end, self.cfg.seq_len, self.cfg.final_eval_windows)
            total += len(starts) * length
        return total

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
        self.state.update(self.parallel.state())
        self.checkpoints.save(self.model, self.optimizer, self.state)

    def wait_for_checkpoint(self):
        """Until an async save in flight has landed (one-process subclasses save synchronously)."""
        if self.checkpoints is not None:
            self.checkpoints.wait()

    def finish(self, halted: bool) -> dict:
        st = self.state
        final = self._eval_and_log(st["step"], self.cfg.final_eval_windows, final=True)
        summary = {"model": self.cfg.model, "params": param_counts(self.model_cfg)["total"], "steps": st["step"],
                   "max_steps": st["max_steps"], "halted": halted, "tokens_seen": st["tokens_seen"],
                   "epochs": self.windows.epoch(st["position"]), "train_seconds": st["train_seconds"],
                   "device": str(self.device), "gpu": self.gpu_name,
                   **final, **{k.replace("val_loss", "val_ppl"): math.exp(v) for k, v in final.items()}}
        self.wait_for_checkpoint()
        if self.dist.main:
            self.export()
            (self.out / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
            self.log_file.close()
        return summary

    def export(self):
        """config.json + model.safetensors (save_model), tokenizer files, generation_config.json."""
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(self.cfg.export_dtype)
        if dtype is None:
            dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        model = self.model
        if self.parallel.distributed:  # rank 0 gathers the final checkpoint's shards into a plain model
            model = build_model(self.model_cfg, "cpu")
            load_model_weights(model, self.ckpt_path)
        save_model(model, self.out, dtype)
        shutil.copyfile(self.data.tokenizer_file, self.out / "tokenizer.json")
        context = self.model_cfg.max_position_embeddings
        (self.out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(context), indent=2) + "\n")
        gen = {"bos_token_id": self.model_cfg.bos_token_id, "eos_token_id": list(self.model_cfg.eos_token_ids),
               "do_sample": True, "temperature": 0.8, "top_p": 0.95, "max_length": context}
        (self.out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def config_fields() -> list[str]:
    return [f.name for f in fields(TrainConfig)]
