"""`brrr dpo`: Direct Preference Optimization of a model on preference pairs, a task of the one training loop.

Data: brrr/train/preference_data.py (TRL's preference format and tokenization). Objective: brrr/train/dpo_loss.py
(sigmoid, ipo, hinge with TRL's names). Per micro-batch of B pairs, one forward over the 2B sequences gives each
completion's summed token log-probs (brrr/train/logprobs.py); the reference's come from a table computed once
before the first step (full-parameter training, and --precompute-ref-log-probs), or from the same model with its
LoRA adapters disabled in the step (brrr/train/policy.py). Each log line carries TRL's metrics: rewards/chosen,
rewards/rejected, rewards/margins, rewards/accuracies, logps/chosen, logps/rejected (means since the last line).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from brrr.analysis.model import param_counts
from brrr.config import ModelConfig
from brrr.errors import BrrrError
from brrr.hub import resolve_model
from brrr.tokenizer import Tokenizer
from brrr.train.config import LoopConfig, ParallelConfig, split_flags
from brrr.train.dpo_loss import LOSS_TYPES, dpo_loss
from brrr.train.logprobs import sequence_sums, token_logprobs
from brrr.train.policy import Policy, PolicyConfig
from brrr.train.preference_data import PreferenceBatches, load_preferences, pair_batch
from brrr.train.task import NoHeldOut

# TRL's DPOConfig defaults where the loop has the knob (learning_rate 1e-6, max_length 1024, batch 8, no decay)
DPO_LOOP = dict(seq_len=1024, micro_batch=8, grad_accum=1, max_steps=500, lr=1e-6, min_lr_ratio=0.0,
                warmup_steps=0, weight_decay=0.0, beta2=0.999, eval_every=100, log_every=10, checkpoint_every=100)


@dataclass
class DPOTaskConfig(PolicyConfig):
    """DPO's own flags (TRL's DPOConfig names) and the policy's; the loop's are LoopConfig's (seq_len is TRL's
    max_length)."""
    model: str | None = None
    data: str = ""
    beta: float = 0.1
    loss_type: str = "sigmoid"
    precompute_ref_log_probs: bool = False  # with adapters: the table instead of the adapters-off forward

    def check(self):
        if self.loss_type not in LOSS_TYPES:
            raise BrrrError(f"--loss-type must be one of {', '.join(LOSS_TYPES)}; got {self.loss_type!r}")
        if not self.beta > 0:
            raise BrrrError(f"--beta must be > 0, got {self.beta}")


@dataclass(init=False)
class DPOConfig:
    """`brrr dpo`'s flags, composed: the loop's (DPO_LOOP's defaults) and the task's; one process."""
    loop: LoopConfig
    parallel: ParallelConfig
    task: DPOTaskConfig

    def __init__(self, model: str | None, data: str, out: str, **flags):
        self.task, self.loop = split_flags(flags, DPOTaskConfig(model=model, data=data), LoopConfig(out, **DPO_LOOP))
        self.parallel = ParallelConfig()

    def make_task(self) -> "DPOTask":
        return DPOTask(self.task)


class WithReference:
    """What a checkpoint holds: the trained tensors and the precomputed reference log-probs (after the first step
    a full-parameter policy can no longer recompute them)."""

    def __init__(self, inner, task: "DPOTask"):
        self.inner, self.task = inner, task

    def state_dict(self) -> dict:
        state = dict(self.inner.state_dict())
        if self.task.ref_table is not None:
            state["reference_logps"] = self.task.ref_table
        return state

    def load_state_dict(self, state: dict):
        state = dict(state)
        table = state.pop("reference_logps", None)
        if table is not None:
            self.task.ref_table = table.to(self.task.device)
        self.inner.load_state_dict(state)


class DPOLoss(nn.Module):
    """The mean DPO loss of a micro-batch of pairs (PreferenceBatches.batch_at's tuple); keeps the metrics."""

    def __init__(self, task: "DPOTask"):
        super().__init__()
        self.task = task
        self.metrics: dict[str, list[torch.Tensor]] = {}

    def forward(self, index, ids, targets, positions, meta, lengths, counts):
        t = self.task
        logps, rows = token_logprobs(t.policy.model, ids, targets, positions, meta)
        chosen, rejected = sequence_sums(logps, rows, lengths).chunk(2)
        if t.ref_table is not None:
            ref = t.ref_table.index_select(0, index.to(t.ref_table.device))
            ref_chosen, ref_rejected = ref[:, 0], ref[:, 1]
        else:
            ref_chosen, ref_rejected = t.reference_logps(ids, targets, positions, meta, lengths)
        chosen_tokens, rejected_tokens = counts.chunk(2)
        loss, metrics = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, t.cfg.beta, t.cfg.loss_type,
                                 chosen_tokens, rejected_tokens)
        for k, v in metrics.items():
            self.metrics.setdefault(k, []).append(v)
        return loss


def _sha256(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


class DPOTask(NoHeldOut):
    """brrr dpo (brrr/train/task.py's interface)."""
    command, run_name, parallel, eval_at_start = "dpo", "DPO", False, False
    flops_per_token = 0.0  # set in build

    def __init__(self, cfg: DPOTaskConfig):
        self.cfg = cfg
        self.ref_table: torch.Tensor | None = None

    def configure(self, run) -> ModelConfig:
        cfg = self.cfg
        cfg.check()
        self.device = run.device
        self.model_path = resolve_model(cfg.model)
        self.base_name = cfg.model if cfg.model and not Path(cfg.model).is_dir() else str(self.model_path.resolve())
        model_cfg = ModelConfig.from_dir(self.model_path)
        if run.cfg.seq_len > model_cfg.max_context:
            raise BrrrError(f"--max-length {run.cfg.seq_len} exceeds the model's context ({model_cfg.max_context})")
        cfg.torch_dtype(run.device)  # a bad --dtype fails before the load
        self.tokenizer = Tokenizer.from_dir(self.model_path)
        self.max_length = run.cfg.seq_len
        self.pairs, self.data_stats = load_preferences(cfg.data, self.tokenizer, self.max_length)
        # the loop counts micro_batch x seq_len tokens a micro-batch (tokens/s): a pair is two sequences, at most
        # this long
        run.cfg.seq_len = 2 * max(len(p.prompt) + max(len(p.chosen), len(p.rejected)) for p in self.pairs)
        return model_cfg

    def build(self, run) -> nn.Module:
        torch.manual_seed(run.cfg.seed)
        self.policy = Policy(self.cfg, self.model_path, self.base_name, run.device)
        self.model = self.policy.model
        self.model_cfg = self.model.config
        self.batches = PreferenceBatches(self.pairs, run.cfg.micro_batch, run.cfg.seed)
        self.loss = self.loss_fn = DPOLoss(self)
        self.checkpointed = WithReference(self.policy.checkpointed, self)
        n = param_counts(self.model_cfg)["total"]
        self.flops_per_token = (6 if not self.policy.lora else 4) * n  # forward + backward (+ the reference's)
        if not self.policy.reference_is_live or self.cfg.precompute_ref_log_probs:
            if not run.cfg.resume:  # a resumed run restores the table from its checkpoint
                self.ref_table = self.precompute_reference(run)
        return self.model

    def reference_logps(self, ids, targets, positions, meta, lengths) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference's (chosen, rejected) sequence log-probs of one pair batch, without gradients."""
        was_training = self.model.training
        self.model.eval()
        with torch.no_grad(), self.policy.reference():
            logps, rows = token_logprobs(self.model, ids, targets, positions, meta)
        self.model.train(was_training)
        return sequence_sums(logps, rows, lengths).chunk(2)

    def precompute_reference(self, run) -> torch.Tensor:
        """[pairs, 2] (chosen, rejected) reference log-probs, micro_batch pairs per forward, in fp32."""
        table = torch.zeros(len(self.pairs), 2, device=run.device)
        mb = run.cfg.micro_batch
        for start in range(0, len(self.pairs), mb):
            ids, targets, positions, meta, lengths, _ = pair_batch(self.pairs[start:start + mb], run.device)
            with run.autocast:
                chosen, rejected = self.reference_logps(ids, targets, positions, meta, lengths)
            table[start:start + len(chosen), 0], table[start:start + len(chosen), 1] = chosen, rejected
        return table

    def resume_key(self, run) -> dict:
        c, loop = self.cfg, run.cfg
        return {"model": self.base_name, "data_sha256": _sha256(c.data), "beta": c.beta, "loss_type": c.loss_type,
                "peft": c.peft, "lora_r": c.lora_r if c.peft else None, "qlora": c.qlora,
                "max_length": self.max_length, "micro_batch": loop.micro_batch, "grad_accum": loop.grad_accum,
                "seed": loop.seed}

    def describe(self, run) -> str:
        st, d = run.state, self.data_stats
        ref = "precomputed once" if self.ref_table is not None else "the base with the adapters off"
        return (f"DPO ({self.cfg.loss_type}, beta {self.cfg.beta}) of {self.policy.describe()} on {run.device}: "
                f"{d['pairs']} pairs ({d['dropped_long_prompts']} left out: prompt >= --max-length; "
                f"{d['truncated_pairs']} cut), reference log-probs {ref}; steps {st['step']} -> {st['max_steps']}")

    def eval_line(self, val: dict) -> str:
        return "no held-out pairs"

    def log_fields(self) -> dict:
        out = {k: torch.cat(v).mean().item() for k, v in self.loss.metrics.items()}
        self.loss.metrics.clear()
        return out

    def summary(self, run, final: dict) -> dict:
        return {"model": self.base_name, "beta": self.cfg.beta, "loss_type": self.cfg.loss_type, **self.data_stats}

    def export(self, run) -> dict:
        self.policy.export(run.out)
        return {}
