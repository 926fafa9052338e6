"""`brrr finetune`: LoRA / QLoRA supervised fine-tuning of a Hugging Face model directory on chat JSONL.

The model is loaded frozen (bf16 on CUDA, fp32 on CPU; with --qlora its projections go straight into NF4 with double
quantization, one tensor at a time), the target projections are wrapped in LoraLinear (brrr/lora/layers.py), and
`FinetuneTask` is a task of the training loop (brrr/train/trainer.py: schedule, AdamW, clipping, bf16 autocast,
logging of loss, tokens/s and peak memory, atomic checkpoints and exact --resume) over packed SFT rows
(brrr/train/sft.py).
Checkpoints hold only the trainable tensors. The output directory is a PEFT adapter (adapter_config.json +
adapter_model.safetensors, base_model_name_or_path set) that PEFT, transformers and `brrr serve --lora-modules`
load, next to train_log.jsonl and train_summary.json.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint as recompute

from brrr.analysis.finetune import finetune_memory, lora_training_flops_per_token
from brrr.analysis.model import param_counts
from brrr.config import ModelConfig
from brrr.errors import BrrrError
from brrr.hub import resolve_model
from brrr.lora import LoraConfig, load_adapter, save_adapter
from brrr.lora.layers import apply_lora, load_lora_state, lora_modules, lora_state, trainable_parameters
from brrr.tokenizer import Tokenizer
from brrr.train.config import FINETUNE_LOOP, LoopConfig, ParallelConfig, split_flags
from brrr.train.loss import head_weight, linear_cross_entropy
from brrr.train.parallel import checkpoint_activations, decoder_layers
from brrr.train.sft import IGNORE, SFTBatches, load_sft

DEFAULT_SEQ_LEN = 2048
DEFAULT_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


@dataclass
class FinetuneTaskConfig:
    """Fine-tuning's own flags (model: an HF model directory or hub id; data: a JSONL file); the loop's are
    LoopConfig's, with FINETUNE_LOOP's defaults."""
    model: str | None
    data: str
    activation_checkpointing: str = "full"  # full | selective (keep matmul outputs, recompute the rest) | none
    lora_r: int = 16
    lora_alpha: float = 32.0
    lora_dropout: float = 0.05
    target_modules: str = DEFAULT_TARGETS
    use_dora: bool = False
    use_rslora: bool = False
    qlora: bool = False
    adapter: str | None = None  # start from this adapter (PEFT's or brrr's); its r, alpha and targets win
    eval_data: str | None = None
    val_fraction: float = 0.1
    dtype: str = "auto"  # the frozen base: auto = bfloat16 on CUDA, float32 on CPU

    def check(self):
        if not 0 <= self.val_fraction < 1:
            raise BrrrError(f"--val-fraction must be in [0, 1), got {self.val_fraction}")
        if self.activation_checkpointing not in ("full", "selective", "none"):
            raise BrrrError(f"--activation-checkpointing must be full, selective or none; got "
                            f"{self.activation_checkpointing!r}")

    def lora_config(self, base: str) -> LoraConfig:
        targets = tuple(t.strip() for t in self.target_modules.split(",") if t.strip())
        return LoraConfig(r=self.lora_r, lora_alpha=self.lora_alpha, target_modules=targets,
                          lora_dropout=self.lora_dropout, use_rslora=self.use_rslora, use_dora=self.use_dora,
                          base_model_name_or_path=base)


@dataclass(init=False)
class FinetuneConfig:
    """`brrr finetune`'s flags, composed: the loop's (fine-tuning's defaults) and the task's; one process (no
    layout flags yet). Built from flat flags: FinetuneConfig(model, data, out, lora_r=..., micro_batch=...)."""
    loop: LoopConfig
    parallel: ParallelConfig
    task: FinetuneTaskConfig

    def __init__(self, model: str | None, data: str, out: str, **flags):
        self.task, self.loop = split_flags(flags, FinetuneTaskConfig(model, data), LoopConfig(out, **FINETUNE_LOOP))
        self.parallel = ParallelConfig()

    def make_task(self) -> "FinetuneTask":
        return FinetuneTask(self.task)


class SFTLoss(nn.Module):
    """Mean cross-entropy over the trained target tokens of a packed varlen batch, only for rows with a target.
    A plain LM head takes brrr.train.loss's chunked linear cross-entropy (gradients computed with the loss, no
    logits kept); an adapted or quantized head computes logits `chunk` tokens at a time, with recompute_logits
    recomputing each chunk in backward, so only one chunk's fp32 logits ever exist (else each chunk keeps its fp32
    log-softmax: 4 bytes x vocabulary per token, for one LM-head matmul less)."""
    chunk = 256  # tokens per logits chunk of a head the chunked loss cannot take

    def __init__(self, model: nn.Module, recompute_logits: bool = True):
        super().__init__()
        self.model, self.recompute_logits = model, recompute_logits

    def _chunk_loss(self, hidden, targets):
        return F.cross_entropy(self.model.compute_logits(hidden), targets, reduction="sum")

    def forward(self, ids, targets, positions, meta, reduction: str = "mean"):
        hidden = self.model(ids, positions, meta)
        keep = (targets != IGNORE).nonzero().squeeze(1)
        hidden, targets = hidden.index_select(0, keep), targets.index_select(0, keep)
        total = hidden.sum() * 0.0  # a zero with a graph, for a batch without targets
        weight = head_weight(self.model.lm_head, hidden)
        if weight is not None:  # the LM head's chunked loss: no logits kept, none recomputed
            if len(keep):
                total = total + linear_cross_entropy(hidden, weight, targets, "sum")
        else:
            for h, t in zip(hidden.split(self.chunk), targets.split(self.chunk)):
                if self.recompute_logits and torch.is_grad_enabled():
                    total = total + recompute(self._chunk_loss, h, t, use_reentrant=False)
                else:
                    total = total + self._chunk_loss(h, t)
        if reduction == "sum":
            return total, len(keep)
        return total / max(1, len(keep))


class TrainableState:
    """The trainable tensors as a state dict (what a fine-tuning checkpoint holds: not the frozen base). module: the
    model they are of, which a distributed checkpoint saves with its frozen parameters left out
    (brrr.train.parallel.dcp)."""

    def __init__(self, model: nn.Module):
        self.params = trainable_parameters(model)
        self.module = model

    def state_dict(self) -> dict:
        return {n: p.detach() for n, p in self.params.items()}

    def load_state_dict(self, state: dict):
        if set(state) != set(self.params):
            raise BrrrError("--resume: the checkpoint's adapter tensors differ from this run's (another --lora-r, "
                            "--target-modules or --use-dora?)")
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(state[n])


def _sha256(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest() if path else ""


def load_base(path: Path, device: torch.device, dtype: torch.dtype, qlora: bool) -> nn.Module:
    """The frozen base: as stored, or with --qlora quantized to NF4 while loading. A checkpoint `brrr quantize
    --method nf4` wrote is already QLoRA's base and loads as stored; other quantized formats cannot host LoRA."""
    from brrr.loader import load_model
    from brrr.quant.checkpoint import quantization_config

    stored = quantization_config(path)
    if stored is not None and stored.get("format") != "nf4":
        raise BrrrError(f"{path} holds {stored.get('format')} weights: brrr fine-tunes LoRA over a bf16/fp32 base "
                        f"(or NF4 with --qlora); point --model at the unquantized model")
    if qlora and stored is None:
        from brrr.lora.qlora import load_nf4_model

        return load_nf4_model(path, device, dtype)
    return load_model(path, dtype=dtype, device=device)


class FinetuneTask:
    """brrr finetune (brrr/train/task.py's interface): a frozen base with LoRA adapters over packed SFT rows;
    checkpoints hold only the trainable tensors, the output is a PEFT adapter."""
    command, run_name, parallel = "finetune", "fine-tuning", False

    def __init__(self, cfg: FinetuneTaskConfig):
        self.cfg = cfg

    def configure(self, run) -> ModelConfig:
        """Flags, adapter and data are checked before the (possibly minutes-long) model load."""
        cfg, loop = self.cfg, run.cfg
        self.model_path = resolve_model(cfg.model)
        context = ModelConfig.from_dir(self.model_path).max_context
        if loop.seq_len is None:
            loop.seq_len = min(DEFAULT_SEQ_LEN, context)
        self.seq_len = loop.seq_len
        cfg.check()
        self.base_name = cfg.model if cfg.model and not Path(cfg.model).is_dir() else str(self.model_path.resolve())
        self.dtype = {"auto": torch.bfloat16 if run.device.type == "cuda" else torch.float32,
                      "bfloat16": torch.bfloat16, "float32": torch.float32}.get(cfg.dtype)
        if self.dtype is None:
            raise BrrrError(f"--dtype must be auto, bfloat16 or float32, got {cfg.dtype!r}")
        if loop.seq_len > context:
            raise BrrrError(f"--seq-len {loop.seq_len} exceeds the model's context ({context} tokens); pass "
                            f"--seq-len {context} or less")
        self.adapter = load_adapter(cfg.adapter, device=run.device) if cfg.adapter else None
        self.lora = self.adapter.config if self.adapter else cfg.lora_config(self.base_name)
        self.tokenizer = Tokenizer.from_dir(self.model_path)
        self.train_rows, self.val_rows, self.data_stats = load_sft(cfg.data, self.tokenizer, loop.seq_len,
                                                                   cfg.val_fraction, loop.seed, cfg.eval_data)
        self.eval_at_start = self.val_rows is not None  # the base model's held-out loss: the bar to beat
        return ModelConfig.from_dir(self.model_path)

    def build(self, run) -> nn.Module:
        cfg, loop = self.cfg, run.cfg
        self.model = load_base(self.model_path, run.device, self.dtype, cfg.qlora)
        self.model_cfg = self.model.config
        torch.manual_seed(loop.seed)
        if self.adapter:
            load_lora_state(self.model, self.adapter)
        else:
            apply_lora(self.model, self.lora)
        self.batches = SFTBatches(self.train_rows, loop.micro_batch, loop.seed)
        self.checkpointed = TrainableState(self.model)
        # full checkpointing is chosen to save memory: the logits too; the other modes spend it for speed
        self.loss = self.loss_fn = SFTLoss(self.model, recompute_logits=cfg.activation_checkpointing == "full")
        if cfg.activation_checkpointing != "none":
            checkpoint_activations(decoder_layers(self.model), selective=cfg.activation_checkpointing == "selective")
        self.flops_per_token = lora_training_flops_per_token(self.model_cfg, loop.seq_len, self.lora)
        return self.model

    def resume_key(self, run) -> dict:
        c, loop = self.cfg, run.cfg
        return {"model": self.base_name, "model_config": self.model_cfg.to_hf(), "qlora": c.qlora,
                "lora": self.lora.to_peft_json(), "data_sha256": _sha256(c.data),
                "eval_data_sha256": _sha256(c.eval_data), "val_fraction": c.val_fraction, "seq_len": loop.seq_len,
                "micro_batch": loop.micro_batch, "grad_accum": loop.grad_accum, "seed": loop.seed}

    def describe(self, run) -> str:
        n = sum(p.numel() for p in run.params)
        st, d = run.state, self.data_stats
        kind = "QLoRA (NF4 base)" if self.cfg.qlora else "LoRA"
        return (f"fine-tuning {self.base_name} with {kind} r={self.lora.r}: {n / 1e6:.2f}M trainable parameters on "
                f"{run.device} ({run.gpu_name}); {d['train_examples']} train examples in {d['train_rows']} rows of "
                f"{run.cfg.seq_len} tokens ({d['train_trained_tokens']:,} trained tokens), {d['val_examples']} "
                f"held out; {d['truncated_examples']} cut to --seq-len; {run.tokens_per_step:,} tokens/step; "
                f"steps {st['step']} -> {st['max_steps']}")

    def _eval_rows(self, max_windows: int | None) -> range:
        if self.val_rows is None:
            return range(0)
        return range(len(self.val_rows) if max_windows is None else min(max_windows, len(self.val_rows)))

    @torch.no_grad()
    def evaluate(self, run, max_windows: int | None) -> dict[str, float]:
        """Mean loss over the held-out examples' trained tokens (max_windows: at most that many packed rows)."""
        if self.val_rows is None:
            return {}
        self.model.eval()
        rows, mb = self._eval_rows(max_windows), run.cfg.micro_batch
        total, count = torch.zeros((), device=run.device, dtype=torch.float64), 0
        for i in range(0, len(rows), mb):
            batch = self.val_rows.batch(list(rows[i:i + mb]), run.device)
            with run.autocast:
                s, n = self.loss(*batch, reduction="sum")
            total += s.double()
            count += n
        self.model.train()
        return {"val_loss": total.item() / max(1, count)}

    def eval_line(self, val: dict) -> str:
        loss = val.get("val_loss", float("nan"))
        return f"val loss {loss:.4f} (ppl {math.exp(loss):.2f})"

    def eval_tokens(self, max_windows: int | None) -> int:
        return len(self._eval_rows(max_windows)) * self.seq_len

    def predicted_memory(self, run) -> dict:
        """brrr calc train --lora-r's prediction for the projections actually adapted (an --adapter's targets may
        be a PEFT regex)."""
        kinds = sorted({name.rsplit(".", 1)[-1] for name in lora_modules(self.model)})
        predicted = finetune_memory(self.model_cfg, self.lora.r, kinds, self.cfg.qlora, self.lora.use_dora,
                                    self.lora.lora_dropout > 0, run.cfg.micro_batch, run.cfg.seq_len,
                                    self.cfg.activation_checkpointing)
        return {"bytes": predicted["total"], "zero": 0}

    def log_fields(self) -> dict:
        return {}

    def summary(self, run, final: dict) -> dict:
        # base_name names the model without --model too (the shipped default's path)
        return {"model": self.base_name, "params": param_counts(self.model_cfg)["total"],
                **{k.replace("val_loss", "val_ppl"): math.exp(v) for k, v in final.items()}}

    def export(self, run) -> dict:
        save_adapter(run.out, lora_state(self.model, self.base_name))
        return {}

