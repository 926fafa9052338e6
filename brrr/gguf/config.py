"""GGUF metadata -> an HF config.json dict, which ModelConfig.from_hf turns into brrr's ModelConfig.

llama.cpp keys a model's shape by its architecture (`llama.block_count`, `qwen3.attention.key_length`, ...). What
the keys leave out comes from the tensors: tied embeddings (no `output.weight`), q/k/v and MLP biases (Llama with
attention_bias), and Llama 3's RoPE scaling, which llama.cpp stores as per-frequency divisors (`rope_freqs.weight`)
rather than as its four parameters; `llama3_rope` recovers them. Mistral files say `llama` (llama.cpp converts
Mistral as Llama) and are told apart by their general.name, as transformers does."""
from __future__ import annotations

import math

import numpy as np

from brrr.errors import BrrrError
from brrr.gguf.reader import GGUFFile

# general.architecture -> the HF architecture brrr runs it as
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}
# the rope parameter sets tried when a file carries rope_freqs.weight (Llama 3.1/3.2/3.3's published values)
LLAMA3_ROPE_CANDIDATES = ({"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},)


def hf_architecture(f: GGUFFile) -> str:
    arch = f.architecture
    if arch not in ARCHITECTURES:
        raise BrrrError(f"{f.path}: metadata key 'general.architecture' is {arch!r}; brrr runs "
                        f"{', '.join(ARCHITECTURES)}")
    if arch == "llama" and "mistral" in str(f.get("general.name", str, "")).lower():
        return "MistralForCausalLM"
    return ARCHITECTURES[arch]


def hf_config(f: GGUFFile) -> dict:
    """The HF config.json dict this file describes."""
    hf_arch = hf_architecture(f)
    a = f.architecture
    heads = f.get(f"{a}.attention.head_count", int)
    hidden = f.get(f"{a}.embedding_length", int)
    if heads <= 0 or hidden <= 0:
        raise BrrrError(f"{f.path}: metadata keys '{a}.attention.head_count' and '{a}.embedding_length' must be > 0")
    head_dim = f.get(f"{a}.attention.key_length", int, None) or f.get(f"{a}.rope.dimension_count", int, None) \
        or hidden // heads
    names = set(f.tensors)
    if "token_embd.weight" not in f.tensors:
        raise BrrrError(f"{f.path}: tensor 'token_embd.weight' is missing")
    vocab = f.get(f"{a}.vocab_size", int, None)
    if vocab is None:
        tokens = f.metadata.get("tokenizer.ggml.tokens")
        vocab = len(tokens) if isinstance(tokens, list) else f.tensors["token_embd.weight"].shape[0]
    context = f.get(f"{a}.context_length", int, 4096)
    cfg = {
        "architectures": [hf_arch],
        "hidden_size": hidden,
        "num_hidden_layers": f.get(f"{a}.block_count", int),
        "num_attention_heads": heads,
        "num_key_value_heads": f.get(f"{a}.attention.head_count_kv", int, heads),
        "head_dim": head_dim,
        "intermediate_size": f.get(f"{a}.feed_forward_length", int),
        "vocab_size": vocab,
        "max_position_embeddings": context,
        "rms_norm_eps": f.get(f"{a}.attention.layer_norm_rms_epsilon", float, 1e-6),
        "rope_theta": f.get(f"{a}.rope.freq_base", float, 10000.0),
        "rope_scaling": rope_scaling(f, head_dim),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "mlp_bias": "blk.0.ffn_up.bias" in names,
        "bos_token_id": f.get("tokenizer.ggml.bos_token_id", int, None),
        "eos_token_id": f.get("tokenizer.ggml.eos_token_id", int, None),
        "torch_dtype": _dtype(f),
    }
    window = f.get(f"{a}.attention.sliding_window", int, None)
    if hf_arch.startswith("Qwen"):
        cfg["use_sliding_window"] = False
    elif window:
        cfg["sliding_window"] = window
    return cfg


def rope_scaling(f: GGUFFile, head_dim: int) -> dict | None:
    a = f.architecture
    kind = f.get(f"{a}.rope.scaling.type", str, "none")
    if "rope_freqs.weight" in f.tensors:
        return llama3_rope(f, head_dim)
    if kind == "none":
        return None
    factor = f.get(f"{a}.rope.scaling.factor", float)
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        orig = f.get(f"{a}.rope.scaling.original_context_length", int)
        return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": orig}
    raise BrrrError(f"{f.path}: metadata key '{a}.rope.scaling.type' is {kind!r}; brrr reads none, linear, yarn")


def llama3_factors(head_dim: int, theta: float, factor: float, low_freq_factor: float, high_freq_factor: float,
                   original_max_position_embeddings: int) -> np.ndarray:
    """The per-frequency divisors llama.cpp stores as rope_freqs.weight for Llama 3's RoPE scaling."""
    low_wavelen = original_max_position_embeddings / low_freq_factor
    high_wavelen = original_max_position_embeddings / high_freq_factor
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = ((original_max_position_embeddings / wavelen - low_freq_factor)
                      / (high_freq_factor - low_freq_factor))
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def llama3_rope(f: GGUFFile, head_dim: int) -> dict:
    """Llama 3's rope parameters, recovered from rope_freqs.weight. Its largest divisor is the factor. The other
    three enter the formula only as two wavelengths (original / low_freq_factor, original / high_freq_factor), so
    the published set is tried first, then the two wavelengths are fitted on the smoothly scaled frequencies (the
    interpolation weight is linear in 1 / wavelength) with low_freq_factor 1; either must reproduce the tensor."""
    t = f.tensors["rope_freqs.weight"]
    if t.numel != head_dim // 2 or t.data.dtype != np.float32:
        raise BrrrError(f"{f.path}: tensor 'rope_freqs.weight' must be {head_dim // 2} float32 values, got "
                        f"{t.numel} {t.data.dtype}")
    stored = np.asarray(t.data, dtype=np.float32).reshape(-1)
    theta = f.get(f"{f.architecture}.rope.freq_base", float, 10000.0)
    factor = float(stored.max())
    candidates = list(LLAMA3_ROPE_CANDIDATES)
    if factor > 1:
        candidates += [{"low_freq_factor": 1.0, "high_freq_factor": float(xh / xl),
                        "original_max_position_embeddings": float(1 / xl)}
                       for xl, xh in _wavelength_fits(head_dim, theta, factor, stored)]
    for params in candidates:
        if np.allclose(llama3_factors(head_dim, theta, factor, **params), stored, rtol=1e-4, atol=1e-6):
            return {"rope_type": "llama3", "factor": factor, **params}
    raise BrrrError(f"{f.path}: tensor 'rope_freqs.weight' holds RoPE divisors brrr cannot match to Llama 3's "
                    "rope parameters (factor, low/high_freq_factor, original_max_position_embeddings)")


def _wavelength_fits(head_dim: int, theta: float, factor: float, stored: np.ndarray):
    """(1 / low wavelength, 1 / high wavelength) pairs that may reproduce `stored`: frequencies above 1 / high keep
    divisor 1, those below 1 / low get `factor`, and between them the weight (1/f - 1/factor) / (1 - 1/factor) is
    linear in the frequency. With two or more such frequencies the line is fitted; with fewer, the bounds are
    only known to lie between neighbouring frequencies, so points inside those gaps are proposed."""
    x = np.array([1 / (2 * math.pi * theta ** (i / head_dim)) for i in range(0, head_dim, 2)])  # falling
    ones, full = stored <= 1 + 1e-6, stored >= factor - 1e-6
    mid = ~ones & ~full
    weight = (1 / stored - 1 / factor) / (1 - 1 / factor)
    if mid.sum() >= 2:
        slope, intercept = np.polyfit(x[mid], weight[mid], 1)
        if slope > 0:
            yield -intercept / slope, (1 - intercept) / slope
        return
    top = x[ones].min() if ones.any() else x[0] * 2          # xh lies below every divisor-1 frequency
    bottom = x[full].max() if full.any() else x[-1] / 2      # xl lies above every full-factor frequency
    if mid.sum() == 1:
        x1, w1 = x[mid][0], weight[mid][0]
        for xh in np.linspace(x1, top, 11)[1:-1]:
            xl = (x1 - w1 * xh) / (1 - w1)
            if bottom < xl < x1:
                yield xl, xh
    else:
        yield bottom + (top - bottom) / 3, bottom + 2 * (top - bottom) / 3


def _dtype(f: GGUFFile) -> str:
    """The float type of the file's weights, what `--dtype auto` loads on a GPU; quantized files run in bf16."""
    types = {t.type.name for t in f.tensors.values() if len(t.shape) == 2}
    if types <= {"F32"}:
        return "float32"
    if types <= {"F32", "F16"}:
        return "float16"
    return "bfloat16"
