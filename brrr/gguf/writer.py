"""HF tensors, config and tokenizer -> a GGUF file, through `gguf.GGUFWriter`.

What llama.cpp's converter writes for Llama/Mistral/Qwen2/Qwen3: `general.*`, the `<arch>.*` shape keys, the
tokenizer keys (tokenizer.py), and the tensors under llama.cpp names (names.py) with llama/mistral's q/k rows
interleaved. 1-D tensors (norms, biases) stay F32; each 2-D tensor takes the type `tensor_types` picks for the
file type (Q4_K_M mixes Q4_K with Q6_K on the tensors most sensitive to error, as llama.cpp's recipe does)."""
from __future__ import annotations

from collections.abc import Iterable
from itertools import chain

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T, GGUFWriter, LlamaFileType, RopeScalingType
from gguf import quants as gq

from brrr.errors import BrrrError
from brrr.gguf.config import llama3_factors
from brrr.gguf.kquants import quantize_q4_k, quantize_q6_k
from brrr.gguf.names import gguf_name, permute, permuted_heads

FILE_TYPES = {"f32": LlamaFileType.ALL_F32, "f16": LlamaFileType.MOSTLY_F16, "bf16": LlamaFileType.MOSTLY_BF16,
              "q8_0": LlamaFileType.MOSTLY_Q8_0, "q4_0": LlamaFileType.MOSTLY_Q4_0,
              "q4_k_m": LlamaFileType.MOSTLY_Q4_K_M, "q6_k": LlamaFileType.MOSTLY_Q6_K}
GGUF_ARCH = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
             "Qwen3ForCausalLM": "qwen3"}
_BASE = {"f32": T.F32, "f16": T.F16, "bf16": T.BF16, "q8_0": T.Q8_0, "q4_0": T.Q4_0, "q4_k_m": T.Q4_K,
         "q6_k": T.Q6_K}
_OWN = {T.Q4_K: quantize_q4_k, T.Q6_K: quantize_q6_k}


def _more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v / ffn_down get Q6_K in Q4_K_M: the first and last eighth,
    and every third one between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_type(file_type: str, name: str, shape: tuple[int, ...], layers: int) -> T:
    """The GGUF type of tensor `name` (llama.cpp name) in a file of `file_type`."""
    if len(shape) < 2:
        return T.F32
    qtype = _BASE[file_type]
    if file_type == "q4_k_m":
        if name == "output.weight":
            qtype = T.Q6_K
        elif name.endswith(("attn_v.weight", "ffn_down.weight")) and _more_bits(int(name.split(".")[1]), layers):
            qtype = T.Q6_K
    if shape[-1] % GGML_QUANT_SIZES[qtype][0]:  # rows that do not fill whole blocks: the nearest type that fits
        qtype = T.Q8_0 if shape[-1] % 32 == 0 and qtype != T.F32 else T.F16 if qtype != T.F32 else T.F32
    return qtype


def quantize(w: torch.Tensor, qtype: T) -> np.ndarray:
    """The GGUF data of a float tensor: float arrays for F32/F16, else the raw blocks [rows, row bytes]."""
    if qtype in _OWN:  # in slices of rows: the scale search's temporaries stay ~100 MB for an 8B projection
        rows = w.detach().reshape(-1, w.shape[-1]).float().cpu()
        step = max(1, (1 << 22) // rows.shape[1])
        return torch.cat([_OWN[qtype](rows[i:i + step]) for i in range(0, rows.shape[0], step)]).numpy()
    return gq.quantize(w.detach().float().cpu().numpy(), qtype)


def write_gguf(out, hf_config: dict, tensors: Iterable[tuple[str, torch.Tensor]], tokenizer_meta: dict,
               file_type: str = "f16", name: str | None = None, progress=None) -> dict[str, int]:
    """Write a GGUF file; returns how many tensors took each type."""
    if file_type not in FILE_TYPES:
        raise BrrrError(f"--type must be one of {', '.join(FILE_TYPES)}; got {file_type!r}")
    hf_arch = hf_config["architectures"][0]
    if hf_arch not in GGUF_ARCH:
        raise BrrrError(f"brrr exports {', '.join(GGUF_ARCH)} to GGUF, not {hf_arch}")
    arch = GGUF_ARCH[hf_arch]
    heads = hf_config["num_attention_heads"]
    kv_heads = hf_config.get("num_key_value_heads") or heads
    hidden = hf_config["hidden_size"]
    head_dim = hf_config.get("head_dim") or hidden // heads
    layers = hf_config["num_hidden_layers"]
    w = GGUFWriter(str(out), arch)
    # llama.cpp converts Mistral as "llama"; readers (brrr, transformers) tell it apart by general.name
    w.add_name(f"mistral {name}" if hf_arch == "MistralForCausalLM" and name else name or arch)
    w.add_file_type(int(FILE_TYPES[file_type]))
    w.add_context_length(hf_config.get("max_position_embeddings", 4096))
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(hf_config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(float(hf_config.get("rms_norm_eps", 1e-6)))
    w.add_vocab_size(hf_config["vocab_size"])
    rope = dict(hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {})
    theta = float(rope.get("rope_theta", hf_config.get("rope_theta", 10000.0)))
    w.add_rope_freq_base(theta)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    extra = []
    if rope_type == "linear":
        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(rope["factor"]))
    elif rope_type == "yarn":
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(rope["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    elif rope_type == "llama3":
        factors = llama3_factors(head_dim, theta, float(rope["factor"]), float(rope["low_freq_factor"]),
                                 float(rope["high_freq_factor"]), int(rope["original_max_position_embeddings"]))
        extra.append(("rope_freqs.weight", torch.from_numpy(factors)))
    elif rope_type not in ("default", None):
        raise BrrrError(f"rope type {rope_type!r} has no GGUF form brrr writes (default, linear, yarn, llama3)")
    if hf_config.get("sliding_window") and hf_arch != "Qwen2ForCausalLM" and hf_arch != "Qwen3ForCausalLM":
        w.add_sliding_window(int(hf_config["sliding_window"]))
    for key, value in tokenizer_meta.items():
        _add(w, key, value)
    counts: dict[str, int] = {}
    for hf, t in chain(tensors, extra):
        gname = hf if hf == "rope_freqs.weight" else gguf_name(hf)
        p = permuted_heads(arch, hf, heads, kv_heads)
        if p is not None:
            t = permute(t, p)
        qtype = T.F32 if gname == "rope_freqs.weight" else tensor_type(file_type, gname, tuple(t.shape), layers)
        data = quantize(t, qtype)
        w.add_tensor(gname, data, raw_dtype=qtype if qtype not in (T.F32, T.F16) else None)
        counts[qtype.name] = counts.get(qtype.name, 0) + 1
        if progress is not None:
            progress()
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return counts


def _add(w: GGUFWriter, key: str, value):
    """One tokenizer key with the value type llama.cpp uses for it."""
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    else:  # the writer types an array by its first element: str, float -> FLOAT32, int -> INT32
        w.add_array(key, value)
