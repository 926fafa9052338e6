"""Multi-head latent attention (DeepSeek-V2/V3) in the reference form, expanded.

Per token the model compresses what attention needs into a latent c = RMSNorm(W_dkv x) of kv_lora_rank values and
one rotary key k_r = RoPE(W_kr x) of qk_rope_head_dim values shared by every head (`kv_a_proj_with_mqa` computes
both). kv_b_proj expands c into each head's non-rotary key k_n and value v; a head's key is [k_n, k_r]. Queries
are [q_n, RoPE(q_r)] per head, from q_proj or, with q_lora_rank, from the low-rank q_a_proj -> RMSNorm -> q_b_proj.

Without a cache (training, one-shot scoring) attention runs expanded through the ordinary attention op: keys of
qk_nope + qk_rope per head, values padded with zeros to the same width (the attention kernels take one head dim for
q, k and v), the padding sliced off the output. With a cache (the engine, reference generation) the cache is the
latent one, kv_lora_rank + qk_rope_head_dim per token (ModelConfig.kv_cache_dims), written and read by
brrr/kernels/mla_attention.py: decodes through the absorbed weights, prefill chunks expanded from the latents.

DeepSeek's rotary half is laid out in interleaved pairs (x0, x1), (x2, x3), ...; permuting it to [evens, odds]
turns that rotation into the rotate-half one brrr's rotary op applies (transformers' V3 does the same permutation).
The softmax scale is (qk_nope + qk_rope)^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from brrr.config import ModelConfig
from brrr.kernels import AttnMeta, apply_rotary, attention, rms_norm
from brrr.kernels.mla_attention import mla_attention, write_latent_ref


def mla_softmax_scale(cfg: ModelConfig) -> float:
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    p = cfg.rope.params
    if cfg.rope.type != "default" and p.get("mscale_all_dim") and p.get("factor", 1) > 1:
        m = 0.1 * p["mscale_all_dim"] * math.log(p["factor"]) + 1.0
        scale *= m * m
    return scale


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., (x0, x1), (x2, x3), ...] -> [..., x0, x2, ..., x1, x3, ...]."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class MLANorm(nn.Module):
    """The RMSNorm on q's and kv's latents (DeepSeek's eps is transformers' default 1e-6, not rms_norm_eps)."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return rms_norm(x, self.weight, 1e-6)


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer, self.n_heads = layer, cfg.num_heads
        self.nope, self.rope, self.v_dim, self.rank = (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                                                       cfg.kv_lora_rank)
        qk = self.nope + self.rope
        bias = cfg.attention_bias
        if cfg.q_lora_rank:
            self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=bias)
            self.q_a_layernorm = MLANorm(cfg.q_lora_rank)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, cfg.num_heads * qk, bias=False)
        else:
            self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = MLANorm(cfg.kv_lora_rank)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, cfg.num_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * self.v_dim, cfg.hidden_size, bias=bias)
        self.scale = mla_softmax_scale(cfg)
        self.interleaved = cfg.rope_interleave

    def queries(self, x):
        """-> q_nope [N, H, nope], q_rot [N, H, rope] (rotary half not yet rotated, in rotate-half layout)."""
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if hasattr(self, "q_b_proj") else self.q_proj(x)
        q_nope, q_rot = q.view(-1, self.n_heads, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        return q_nope, deinterleave(q_rot) if self.interleaved else q_rot

    def latents(self, x):
        """-> c [N, kv_lora_rank] (normed), k_rot [N, 1, rope] (not yet rotated, rotate-half layout)."""
        c, k_rot = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        k_rot = k_rot.unsqueeze(1)
        return self.kv_a_layernorm(c), deinterleave(k_rot) if self.interleaved else k_rot

    def absorbed_weights(self):
        """kv_b_proj's rows per head as (W_kb [H, nope, r], W_vb [H, v, r]): views, no copy."""
        w = self.kv_b_proj.weight.view(self.n_heads, self.nope + self.v_dim, self.rank)
        return w[:, : self.nope], w[:, self.nope:]

    def forward(self, x, cos, sin, meta: AttnMeta):
        n, h = x.shape[0], self.n_heads
        q_nope, q_rot = self.queries(x)
        c, k_rot = self.latents(x)
        if meta.kv_caches is not None:  # the latent cache
            q_rot, k_rot = apply_rotary(q_rot.contiguous(), k_rot.contiguous(), cos, sin)
            cache = meta.kv_caches[self.layer][0]
            write_latent_ref(c, k_rot[:, 0], cache, meta.slot_mapping)
            out = mla_attention(q_nope, q_rot, cache, meta, *self.absorbed_weights(), self.scale)
            return self.o_proj(out.reshape(n, h * self.v_dim))
        k_nope, v = self.kv_b_proj(c).view(n, h, self.nope + self.v_dim).split([self.nope, self.v_dim], dim=-1)
        # the rotation first (the shared key once, not per head), then one head dim for q, k and padded v
        q_rot, k_rot = apply_rotary(q_rot.contiguous(), k_rot.contiguous(), cos, sin)
        q = torch.cat((q_nope, q_rot), dim=-1)
        k = torch.cat((k_nope, k_rot.expand(n, h, self.rope)), dim=-1)
        v = nn.functional.pad(v, (0, self.nope + self.rope - self.v_dim))
        out = attention(q, k, v, meta, self.layer, self.scale)
        return self.o_proj(out.view(n, h, -1)[..., : self.v_dim].reshape(n, h * self.v_dim))
