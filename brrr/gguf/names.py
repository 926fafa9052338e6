"""llama.cpp tensor names <-> Hugging Face names, and the Q/K row permutation.

llama.cpp's converter reorders the rows of q_proj and k_proj for llama and mistral: HF's rotary embedding pairs
dimension i with i + head_dim/2 (rotate_half), ggml's "normal" RoPE pairs 2i with 2i+1, so each head's rows are
interleaved: HF row (half h, index i) goes to GGUF row 2i + h. Qwen2/Qwen3 use ggml's "neox" RoPE, which pairs like
HF does, so their rows stay as they are. `unpermute` undoes the interleave, `permute` applies it (export)."""
from __future__ import annotations

import re

import torch

from brrr.errors import BrrrError

# architectures whose attn_q / attn_k rows llama.cpp interleaves
PERMUTED_ARCHITECTURES = ("llama", "mistral")

_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_LAYER_BACK = {v: k for k, v in _LAYER.items()}
_GGUF_LAYER = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.([a-z_]+\.[a-z_]+|[a-z_]+)\.(weight|bias)")
# tensors llama.cpp writes that brrr computes itself: RoPE frequency factors (read in config.py)
DERIVED = ("rope_freqs.weight",)


def hf_name(name: str) -> str | None:
    """The HF name of a llama.cpp tensor; None for one brrr derives itself. Unknown names raise."""
    if name in _TOP:
        return _TOP[name]
    if name in DERIVED:
        return None
    m = _GGUF_LAYER.fullmatch(name)
    if m and m.group(2) in _LAYER:
        return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}.{m.group(3)}"
    raise BrrrError(f"GGUF tensor {name!r} is not one brrr maps to a Llama/Mistral/Qwen2/Qwen3 parameter")


def gguf_name(name: str) -> str:
    """The llama.cpp name of an HF tensor."""
    back = {v: k for k, v in _TOP.items()}
    if name in back:
        return back[name]
    m = _HF_LAYER.fullmatch(name)
    if m and m.group(2) in _LAYER_BACK:
        return f"blk.{m.group(1)}.{_LAYER_BACK[m.group(2)]}.{m.group(3)}"
    raise BrrrError(f"tensor {name!r} has no llama.cpp name (brrr exports Llama/Mistral/Qwen2/Qwen3 tensors)")


def permuted_heads(arch: str, hf: str, num_heads: int, num_kv_heads: int) -> int | None:
    """The head count whose rows llama.cpp interleaved in tensor `hf`, or None when it left them as they are."""
    if arch not in PERMUTED_ARCHITECTURES:
        return None
    if hf.endswith("self_attn.q_proj.weight") or hf.endswith("self_attn.q_proj.bias"):
        return num_heads
    if hf.endswith("self_attn.k_proj.weight") or hf.endswith("self_attn.k_proj.bias"):
        return num_kv_heads
    return None


def permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """HF rows -> llama.cpp rows: per head, row (h, i) of [2, head_dim/2] goes to 2i + h."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp rows -> HF rows (the inverse of `permute`)."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def row_order(rows: int, heads: int) -> torch.Tensor:
    """The index r such that hf_rows = gguf_rows[r] (for permuting quantized blocks row by row)."""
    return unpermute(torch.arange(rows), heads)
