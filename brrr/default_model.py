"""The model brrr uses when none is named: a 7.2M-parameter Llama-architecture code model (14.4 MB of bf16
safetensors, 1,024 tokens of context, an 8,192-token byte-level BPE) that brrr's own pipeline trained on the
Python standard library and site-packages of an H200 machine. It ships inside the package
(brrr/assets/default-model), so every command works offline on a fresh CPU machine. How it was made, its
validation loss and samples: docs/default-model.md.
"""
from __future__ import annotations

from pathlib import Path

from brrr.errors import BrrrError

__all__ = ["DEFAULT_MODEL_DIR", "default_model_dir"]
DEFAULT_MODEL_DIR = Path(__file__).parent / "assets" / "default-model"
FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json")


def default_model_dir() -> Path:
    """The shipped default model's directory (an HF model directory that brrr and transformers load)."""
    missing = [f for f in FILES if not (DEFAULT_MODEL_DIR / f).is_file()]
    if missing:
        raise BrrrError(f"brrr's default model is incomplete: {', '.join(missing)} missing from {DEFAULT_MODEL_DIR} "
                        "(a broken install? reinstall brrr, or pass --model DIR)")
    return DEFAULT_MODEL_DIR
