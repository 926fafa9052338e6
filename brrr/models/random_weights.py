"""Random-weight models of real shapes (from brrr.presets), built straight on the target device: benchmarks and
tensor-parallel loads without a checkpoint measure speed, which does not depend on the values, so nothing is
downloaded."""
from __future__ import annotations

from pathlib import Path

import torch

from brrr.config import ModelConfig
from brrr.errors import BrrrError
from brrr.gguf import is_gguf
from brrr.models import model_class
from brrr.presets import PRESETS, preset_config


def model_config(spec: str) -> ModelConfig:
    if spec in PRESETS:
        return preset_config(spec)
    if Path(spec).is_dir() or is_gguf(spec):
        return ModelConfig.from_dir(spec)
    raise BrrrError(f"--model must be a preset ({', '.join(sorted(PRESETS))}), a model directory or a .gguf file; "
                    f"got {spec!r}")


@torch.no_grad()
def random_model(cfg: ModelConfig, dtype: torch.dtype, device, seed: int = 0):
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    model = model.to(dtype).to_empty(device=device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return randomize(model, seed)


@torch.no_grad()
def randomize(model, seed: int = 0):
    """Fill a model's parameters as transformers initializes a Llama (norms 1, biases 0); also a tensor-parallel
    shard's, which each rank fills on its own device."""
    gen = torch.Generator(next(model.parameters()).device).manual_seed(seed)
    for name, p in model.checkpoint_tensors():  # DeepSeek-V3's balancing biases too: zero, as transformers starts them
        if "norm" in name:
            p.fill_(1.0)
        elif name.endswith("bias"):
            p.zero_()
        else:
            p.normal_(0.0, 0.02, generator=gen)  # transformers' Llama init
    return model.requires_grad_(False).eval()
