"""The policy of preference and RL training (brrr dpo, brrr grpo): the model that trains, full-parameter or through
LoRA/QLoRA adapters, and its frozen reference.

Full-parameter: every weight trains (fp32 master weights; bf16 autocast on CUDA); the reference is the policy as it
was loaded, whose log-probs a task computes once before the first step. With --use-peft (or --qlora) the base is
frozen (bf16 on CUDA, NF4 with --qlora) under LoRA adapters (brrr/lora/layers.py), and the reference is the same
model with its adapters disabled: no second copy of the weights. The output is an HF model directory or a PEFT
adapter.
"""
from __future__ import annotations

import contextlib
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from brrr.errors import BrrrError
from brrr.loader import save_model
from brrr.lora import LoraConfig, save_adapter
from brrr.lora.layers import adapters_disabled, apply_lora, lora_state
from brrr.train.finetune import DEFAULT_TARGETS, TrainableState, load_base

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "generation_config.json")


@dataclass
class PolicyConfig:
    """The flags that say what trains (TRL's ModelConfig names: use_peft, lora_r, lora_alpha, ...)."""
    use_peft: bool = False
    lora_r: int = 16
    lora_alpha: float = 32.0
    lora_dropout: float = 0.05
    target_modules: str = DEFAULT_TARGETS
    use_rslora: bool = False
    qlora: bool = False  # implies use_peft
    dtype: str = "auto"  # the weights: auto = bfloat16 for a frozen base on CUDA, else float32

    @property
    def peft(self) -> bool:
        return self.use_peft or self.qlora

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        auto = torch.bfloat16 if self.peft and device.type == "cuda" else torch.float32
        dtype = {"auto": auto, "bfloat16": torch.bfloat16, "float32": torch.float32}.get(self.dtype)
        if dtype is None:
            raise BrrrError(f"--dtype must be auto, bfloat16 or float32, got {self.dtype!r}")
        if not self.peft and dtype != torch.float32:
            raise BrrrError("full-parameter training keeps fp32 master weights (bf16 autocast on CUDA): --dtype "
                            "bfloat16 needs --use-peft")
        return dtype

    def lora_config(self, base: str) -> LoraConfig:
        targets = tuple(t.strip() for t in self.target_modules.split(",") if t.strip())
        return LoraConfig(r=self.lora_r, lora_alpha=self.lora_alpha, target_modules=targets,
                          lora_dropout=self.lora_dropout, use_rslora=self.use_rslora, base_model_name_or_path=base)


class Policy:
    """The trained model and how to reach its reference (`reference()`), checkpoint and export it."""

    def __init__(self, cfg: PolicyConfig, model_path: Path, base_name: str, device: torch.device):
        self.cfg, self.model_path, self.base_name = cfg, model_path, base_name
        self.model: nn.Module = load_base(model_path, device, cfg.torch_dtype(device), cfg.qlora)
        self.lora = None
        if cfg.peft:
            self.lora = cfg.lora_config(base_name)
            apply_lora(self.model, self.lora)
            self.checkpointed = TrainableState(self.model)
        else:
            self.model.requires_grad_(True)
            self.checkpointed = self.model

    @property
    def reference_is_live(self) -> bool:
        """True: the reference is this model with its adapters off, so its log-probs can be computed any time."""
        return self.lora is not None

    def reference(self):
        """A context inside which the model is the reference (adapters off); full-parameter policies have none
        after the first step, so a task precomputes their reference log-probs first."""
        return adapters_disabled(self.model) if self.lora is not None else contextlib.nullcontext()

    def describe(self) -> str:
        n = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        kind = "QLoRA (NF4 base)" if self.cfg.qlora else (f"LoRA r={self.lora.r}" if self.lora else "full-parameter")
        return f"{self.base_name} ({kind}, {n / 1e6:.2f}M trainable)"

    def export(self, out: Path) -> None:
        """A PEFT adapter, or an HF model directory with the base's tokenizer files."""
        if self.lora is not None:
            save_adapter(out, lora_state(self.model, self.base_name))
            return
        save_model(self.model, out, torch.float32)
        for name in TOKENIZER_FILES:
            if (self.model_path / name).is_file():
                shutil.copyfile(self.model_path / name, out / name)
