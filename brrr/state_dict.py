"""A model's weights under Hugging Face names, for every writer of HF checkpoints (brrr.loader, brrr.quant)."""
from __future__ import annotations

import torch


def checkpoint_name(cfg, name: str) -> str:
    """A checkpoint tensor's name -> the parameter's in brrr's model: Mixtral's MoE block is `mlp` in memory (as in
    transformers v5) and block_sparse_moe on disk."""
    if cfg.architecture == "MixtralForCausalLM":
        return name.replace(".block_sparse_moe.", ".mlp.")
    return name


def hf_name(cfg, name: str) -> str:
    """A parameter's name in brrr's model -> the checkpoint's (checkpoint_name's inverse)."""
    if cfg.architecture == "MixtralForCausalLM" and ".mlp." in name:
        return name.replace(".mlp.", ".block_sparse_moe.")
    return name


def hf_state_dict(model) -> dict[str, torch.Tensor]:
    """The model's weights under Hugging Face names (a tied lm_head is stored once, as transformers does; packed
    q/k/v and gate/up projections of the serving form (brrr.serving_form) are split back as views)."""
    cfg = model.config
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    out = {}
    for k, v in model.state_dict().items():
        if cfg.tie_word_embeddings and k == "lm_head.weight":
            continue
        if ".qkv_proj." in k:
            for name, part in zip(("q_proj", "k_proj", "v_proj"), v.split([q, kv, kv])):
                out[k.replace("qkv_proj", name)] = part
        elif ".gate_up_proj." in k:
            for name, part in zip(("gate_proj", "up_proj"), v.chunk(2)):
                out[k.replace("gate_up_proj", name)] = part
        else:
            out[hf_name(cfg, k)] = v
    return out
