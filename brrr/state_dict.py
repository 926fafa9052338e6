"""A model's weights under Hugging Face names, for every writer of HF checkpoints (brrr.loader, brrr.quant)."""
from __future__ import annotations

import torch


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
            out[k] = v
    return out
