"""What a training task is: the part of a run that differs between pretraining (brrr/train/pretrain.py), LoRA SFT
(brrr/train/finetune.py) and the EAGLE draft head (brrr/train/draft.py). The loop (brrr/train/trainer.py: AdamW,
the warmup + cosine schedule, gradient accumulation, clipping, autocast and fp16 loss scaling, the evaluation and
checkpoint cadences, --resume, --time-budget, the step log with tokens/s, MFU and peak memory, divergence
detection, Ctrl-C / SIGTERM) is written once and calls only these members.

Adding a task (DPO, GRPO, ...) is one class with the members below, a dataclass of its own flags, and a command
config composing them with the loop's (`FinetuneConfig` in finetune.py is the pattern: `__init__` splits flat flags
with brrr.train.config.split_flags, `make_task()` builds the task); or, without a command, `Trainer(RunConfig(
LoopConfig(out, ...)), task)`: `tests/train/test_task.py` trains a linear fit written that way.

The order the loop calls them in: configure -> (the layout is planned and checked) -> build -> (the optimizer over
the model's trainable parameters) -> resume_key (--resume checks it and restores `checkpointed`) -> describe ->
eval_at_start's evaluation -> per step:
`batches.batch_at` and `loss_fn`, `after_step` (optional) after the optimizer step, `log_fields` at each log line -> evaluate / eval_line on the eval cadence ->
at the end summary, and export on the main rank.
"""
from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from brrr.config import ModelConfig


class Batches(Protocol):
    """The training data in a fixed, seeded order: micro-batch number `position` (counted over the whole run,
    all data-parallel ranks together) and the epoch it falls in. brrr.train.sampler.TrainWindows and
    brrr.train.sft.SFTBatches are two."""

    def batch_at(self, position: int, device) -> tuple: ...

    def epoch(self, position: int) -> float: ...


class TrainTask(Protocol):
    """run: the Trainer running the task; a task reads its cfg (LoopConfig), parallel_cfg, device, mesh,
    train_step (the layout's step and evaluation), autocast, ranks, checkpoints and gpu, and calls run.parallelize
    and run.log. Attributes are set by `build` at the latest."""

    command: str  # the CLI command ("train", "finetune", "train-draft"), as messages name it
    run_name: str  # what a run of it is called ("training", "fine-tuning", "train-draft")
    parallel: bool  # True: it runs under torchrun over run.parallel_cfg's layout; False: one process only
    eval_at_start: bool  # evaluate before the first step (the untrained figures: the bar to beat)
    model: nn.Module  # what trains: its requires_grad parameters are the optimizer's
    checkpointed: object  # what a checkpoint holds of it (state_dict / load_state_dict): the model, or its trained part
    batches: Batches
    loss_fn: object  # (*batch) -> the scalar mean loss of one micro-batch, what backward runs on
    flops_per_token: float  # model FLOPs of one trained token, forward and backward (MFU)

    def configure(self, run) -> ModelConfig | None:
        """Check the task's flags and inputs and return the model's config, before any weights load and before any
        collective (the layout is checked against it; None for a one-process task whose model is no transformer).
        May fill a loop default that depends on the model (brrr finetune's --seq-len)."""

    def build(self, run) -> nn.Module:
        """Make the model on run.device (a layout-aware task hands its plain model to run.parallelize), freeze
        what does not train, set the attributes above; returns the model."""

    def resume_key(self, run) -> dict:
        """What must not change across --resume (the model, the data, the batch geometry), JSON-serializable."""

    def describe(self, run) -> str:
        """The run's first line: what trains on what."""

    def evaluate(self, run, max_windows: int | None) -> dict[str, float]:
        """Held-out figures ({"val_loss": ...} and any others); max_windows: at most that many windows per source
        (None: all). Leaves the model in train mode."""

    def eval_line(self, val: dict) -> str:
        """The printed line of an evaluation (after "eval @ STEP: ")."""

    def eval_tokens(self, max_windows: int | None) -> int:
        """Tokens one evaluation reads (--time-budget sizes the run with it)."""

    def predicted_memory(self, run) -> dict | None:
        """brrr calc's per-GPU bytes for this run on run.gpu ({"bytes", "zero"}), logged beside the measured peak;
        None when it has none."""

    def log_fields(self) -> dict:
        """Extra fields for the step log since the last call (a DPO task's reward margins, ...)."""

    # optional: after_step(self, run) -> None, called after each optimizer step (pretraining's MoE bias balancing)

    def summary(self, run, final: dict) -> dict:
        """The task's fields of train_summary.json, beside the loop's counters and the final evaluation."""

    def export(self, run) -> dict:
        """Write the output directory (an HF model, a PEFT adapter, a draft head), on the main rank, after the
        final checkpoint landed; returns more summary fields (measured after the export, say)."""


def trainable(model: nn.Module) -> list[torch.nn.Parameter]:
    """The parameters a task trains: those that require gradients, in the model's order."""
    return [p for p in model.parameters() if p.requires_grad]


class NoHeldOut:
    """The TrainTask methods of a task with no held-out evaluation and no memory model (the RL and preference
    tasks: their figures are the per-step logs)."""

    def evaluate(self, run, max_windows: int | None) -> dict[str, float]:
        return {}

    def eval_tokens(self, max_windows: int | None) -> int:
        return 0

    def predicted_memory(self, run) -> dict | None:
        return None
