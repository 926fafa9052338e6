"""Rotary position embeddings (RoFormer), with the context-extension scalings HF checkpoints use:
linear (position interpolation), dynamic NTK, llama3 (wavelength-banded) and YaRN."""
import math

import torch

from brrr.config import RopeConfig


def rope_inv_freq(rope: RopeConfig, head_dim: int, max_positions: int, seq_len: int | None = None):
    """Inverse frequencies [head_dim/2] (fp32) and the factor cos/sin are multiplied by (YaRN's attention scaling).
    `seq_len` matters only for dynamic NTK, which stretches the base once a sequence outgrows max_positions."""
    p, base, dim = rope.params, rope.theta, head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    if rope.type == "dynamic":
        seq_len = max(seq_len or max_positions, max_positions)
        factor = p["factor"]
        base = base * ((factor * seq_len / max_positions) - (factor - 1)) ** (dim / (dim - 2))
    inv_freq = 1.0 / (base**exponents)
    scale = 1.0
    if rope.type == "linear":
        inv_freq = inv_freq / p["factor"]
    elif rope.type == "llama3":
        inv_freq = _llama3(inv_freq, p)
    elif rope.type == "yarn":
        inv_freq, scale = _yarn(base, dim, p)
    return inv_freq, scale


def _llama3(inv_freq, p):
    # Long wavelengths (beyond the original context / low_freq_factor) are divided by factor, short ones kept,
    # and the band between is blended linearly in 1/wavelength.
    factor, old_ctx = p["factor"], p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / p["low_freq_factor"], old_ctx / p["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - p["low_freq_factor"]) / (p["high_freq_factor"] - p["low_freq_factor"])
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, blended, scaled)


def _yarn(base, dim, p):
    factor, old_ctx = p["factor"], p["original_max_position_embeddings"]

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention_factor = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations):  # the dimension whose wavelength fits `rotations` times in the old context
        return dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolate = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attention_factor)


def rotary_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float, dtype: torch.dtype):
    """cos, sin of shape [tokens, head_dim], computed in fp32 and cast to the activations' dtype."""
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q [tokens, heads, head_dim], k [tokens, kv_heads, head_dim]; rotate-half (GPT-NeoX) layout as in HF Llama."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def apply_rotary(q, k, cos, sin):
    return apply_rotary_ref(q, k, cos, sin)
