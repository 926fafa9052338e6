"""The flags of a training run, composed of parts: the loop's (LoopConfig: batch geometry, optimizer, schedule,
cadences, budget, resume), the layout's (ParallelConfig, for a task that runs under torchrun) and the task's own
(PretrainConfig, FinetuneTaskConfig, DraftTaskConfig, beside their tasks). A command's config (TrainConfig,
FinetuneConfig, DraftConfig) holds one of each part and is built from flat keyword flags, as the CLI passes them:
`split_flags` hands each part its own fields, so one flag name means one thing in every command.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace

from brrr.errors import BrrrError


@dataclass
class LoopConfig:
    """What the training loop (brrr/train/trainer.py) reads, whatever the task. Defaults are `brrr train`'s; the
    other commands start from their own (FINETUNE_LOOP, DRAFT_LOOP)."""
    out: str
    seq_len: int | None = 1024  # None: the task sets it from the model (brrr finetune: its context, capped)
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
    eval_windows: int = 64  # per source (or held-out rows), during training
    final_eval_windows: int | None = None  # at the end (None: the whole validation split)
    log_every: int = 10
    checkpoint_every: int = 500
    seed: int = 0
    device: str | None = None
    time_budget: float | None = None  # wall-clock seconds for this invocation, final eval and export included
    stop_at: int | None = None  # halt after this step (checkpoint + export), to resume later
    resume: bool = False

    def check(self):
        positive = ("micro_batch", "grad_accum", "max_steps", "eval_every", "eval_windows", "log_every",
                    "checkpoint_every") + (("seq_len",) if self.seq_len is not None else ())
        for name in positive:
            if getattr(self, name) < 1:
                raise BrrrError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0 or not 0 <= self.min_lr_ratio <= 1 or self.warmup_steps < 0 or self.grad_clip <= 0:
            raise BrrrError("--lr and --grad-clip must be > 0, --min-lr-ratio in [0, 1], --warmup-steps >= 0")
        if self.time_budget is not None and self.time_budget <= 0:
            raise BrrrError(f"--time-budget must be > 0 seconds, got {self.time_budget}")


@dataclass
class ParallelConfig:
    """The layout under torchrun (brrr.train.parallel): dp_replicate x dp_shard x ep x cp x tp x pp = WORLD_SIZE, and
    how the layout computes and checkpoints. The defaults are one process."""
    dp_replicate: int = 1
    dp_shard: int = -1  # -1: the ranks the other dimensions leave
    tp: int = 1
    pp: int = 1
    cp: int = 1  # context parallel: each sequence over cp ranks, ring attention
    ep: int = 1  # expert parallel: each MoE layer's experts over ep ranks, all-to-all dispatch
    pp_schedule: str = "1f1b"
    microbatches: int | None = None  # pipeline microbatches per micro-batch (default: pp)
    reshard_after_forward: bool = True  # FSDP: True frees gathered weights after forward (ZeRO-3), False ZeRO-2
    async_checkpoint: bool = False
    fp16: bool = False  # fp16 compute with dynamic loss scaling (GPUs without bf16), instead of bf16


# the loop defaults of the commands other than `brrr train`
FINETUNE_LOOP = dict(seq_len=None, micro_batch=1, grad_accum=4, max_steps=500, lr=2e-4, warmup_steps=10,
                     weight_decay=0.0, beta2=0.999, eval_every=50, eval_windows=64, checkpoint_every=100)
DRAFT_LOOP = dict(seq_len=512, micro_batch=8, max_steps=2000, lr=3e-4, warmup_steps=50, weight_decay=0.0,
                  eval_every=200, eval_windows=32, final_eval_windows=128)


def split_flags(flags: dict, *parts) -> list:
    """Each part (a dataclass instance holding its defaults) with the flags that are its fields replaced; a flag
    no part has is refused by name (a TypeError, as a dataclass's constructor would raise)."""
    left, out = dict(flags), []
    for part in parts:
        names = {f.name for f in fields(part)}
        out.append(replace(part, **{k: left.pop(k) for k in list(left) if k in names}))
    if left:
        owners = ", ".join(type(p).__name__ for p in parts)
        raise TypeError(f"unknown flag(s) {', '.join(sorted(left))}: none of {owners} has them")
    return out


def flat_flags(cfg) -> dict:
    """A command's config as the flat flags it was built from (train_config.json): the task's (if it has a part of
    its own), the loop's, and the layout's."""
    parts = [getattr(cfg, "task", None), cfg.loop, cfg.parallel]
    return {k: v for part in parts if part is not None for k, v in asdict(part).items()}


@dataclass
class RunConfig:
    """The loop's and the layout's parts alone, for a task built by hand: `Trainer(RunConfig(LoopConfig(out)),
    task)` (a task that runs under torchrun reads the layout as run.parallel_cfg)."""
    loop: LoopConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
