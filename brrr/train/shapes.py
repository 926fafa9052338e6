"""Model shapes `brrr train --config` accepts: brrr's own training shapes, the published presets (brrr.presets),
or a config.json. The tokenizer decides the special-token ids; a shape without vocab_size takes the tokenizer's."""
from __future__ import annotations

import json
from pathlib import Path

from brrr.config import ModelConfig
from brrr.errors import BrrrError
from brrr.presets import PRESETS

# The model brrr ships (brrr/assets/default-model): 7.2M parameters, 14.4 MB in bf16, 1,024 tokens of context.
# Deep and thin for its size; the embedding (tied to the LM head) is 29% of it.
SHAPES: dict[str, dict] = {
    "brrr-default": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
                     "intermediate_size": 768, "num_hidden_layers": 6, "num_attention_heads": 4,
                     "num_key_value_heads": 4, "head_dim": 64, "max_position_embeddings": 1024,
                     "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "vocab_size": None},
    # A target for speculative decoding with brrr-default as its draft (bench/spec_trained.sh): 311M parameters
    # at the 8,192-token vocabulary, 43 times the draft, Llama-style with 2:1 grouped-query attention; wide enough
    # (1,024) for its matmuls to use an H100 well, so a few minutes of training move it far.
    "brrr-300m": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 1024,
                  "intermediate_size": 3072, "num_hidden_layers": 24, "num_attention_heads": 16,
                  "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 1024,
                  "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "vocab_size": None},
}


def resolve_config(spec: str, vocab: int, special_tokens: dict, seq_len: int) -> ModelConfig:
    """The ModelConfig to train: `spec` is a shape name, a preset name, or a config.json (or its directory)."""
    if spec in SHAPES:
        raw, source = dict(SHAPES[spec]), f"shape {spec}"
    elif spec in PRESETS:
        raw, source = dict(PRESETS[spec]), f"preset {spec}"
    else:
        path = Path(spec).expanduser()
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise BrrrError(f"--config {spec!r} is not a shape ({', '.join(SHAPES)}), a preset "
                            f"({', '.join(PRESETS)}) or a config.json file")
        try:
            raw, source = json.loads(file.read_text()), str(file)
        except json.JSONDecodeError as e:
            raise BrrrError(f"{file} is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise BrrrError(f"{file}: expected a JSON object")
    if raw.get("vocab_size") is None:
        raw["vocab_size"] = vocab
    elif isinstance(raw["vocab_size"], int) and raw["vocab_size"] < vocab:
        raise BrrrError(f"{source}: field 'vocab_size' ({raw['vocab_size']}) is smaller than the data's tokenizer "
                        f"vocabulary ({vocab}); raise it to at least {vocab} or rebuild the data with "
                        f"--vocab {raw['vocab_size']}")
    raw["bos_token_id"] = special_tokens["bos"]
    raw["eos_token_id"] = [special_tokens["eos"], special_tokens["im_end"]]
    cfg = ModelConfig.from_hf(raw, source=source)
    if not cfg.runnable:
        raise BrrrError(f"{source}: brrr cannot train a {cfg.architecture} (it runs Llama-family models only)")
    if seq_len > cfg.max_context:
        raise BrrrError(f"--seq-len {seq_len} exceeds the model's context ({source}: max_position_embeddings "
                        f"{cfg.max_position_embeddings})")
    return cfg
