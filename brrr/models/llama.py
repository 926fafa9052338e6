"""Llama family: Llama 2/3/3.1/3.2, Mistral, Qwen2 (qkv bias), Qwen3 (per-head q/k RMSNorm); with a
mixture-of-experts MLP on the sparse layers (brrr/models/moe.py), Mixtral, Qwen2-MoE and Qwen3-MoE; with multi-head
latent attention (brrr/models/mla.py) as well, DeepSeek-V2/V3. All share the one pre-norm decoder layer.

The reference form. Module names and projection shapes follow Hugging Face's, so checkpoints load by name and
every GEMM has the shape transformers runs. That is deliberate: packing q/k/v into one GEMM changes cuBLAS's kernel
choice and with it bf16 rounding, enough to flip greedy tokens (docs/models.md). Packed projections, quantized GEMV
epilogues and norms folded into GEMVs are serving modules that `brrr.serving_form.prepare_for_serving` swaps in.
Shapes: activations are a flattened batch of tokens [N, hidden]; `AttnMeta` says how they split into sequences.
"""
from __future__ import annotations

import torch
from torch import nn

from brrr.config import ModelConfig
from brrr.kernels import (AttnMeta, add_rms_norm, attention, rms_norm, rope_inv_freq, rotary_cos_sin,
                          silu_and_mul)
from brrr.kernels.rms_norm import embed_rms_norm
from brrr.models.mla import MLAttention
from brrr.models.moe import BALANCING_BIAS, SparseMoeBlock, is_sparse
from brrr.state_dict import checkpoint_name


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x, residual=None):
        """rms_norm(x); with a residual, (rms_norm(x + residual), x + residual) in one fused pass."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self._cache: dict = {}  # (device, seq_len bucket) -> (inv_freq, scale); not a buffer, so meta init is safe
        self.dim = cfg.qk_rope_head_dim if cfg.kv_lora_rank else cfg.head_dim  # MLA rotates only the rope half

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        cfg = self.cfg
        # Dynamic NTK re-derives the base from the longest position in the step, as transformers does.
        seq_len = int(positions.max()) + 1 if cfg.rope.type == "dynamic" else None
        if seq_len is not None and seq_len <= cfg.max_position_embeddings:
            seq_len = None
        key = (positions.device, seq_len)
        if key not in self._cache:
            inv_freq, scale = rope_inv_freq(cfg.rope, self.dim, cfg.max_position_embeddings, seq_len)
            self._cache[key] = (inv_freq.to(positions.device), scale)
        inv_freq, scale = self._cache[key]
        return rotary_cos_sin(positions, inv_freq, scale, dtype)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer, self.n_heads, self.n_kv, self.head_dim = layer, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, q_size, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_size, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.head_dim**-0.5
        self.sliding_window = cfg.sliding_window

    def forward(self, x, cos, sin, meta: AttnMeta):
        q = self.q_proj(x).view(-1, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(-1, self.n_kv, self.head_dim)
        v = self.v_proj(x).view(-1, self.n_kv, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        # the rotary kernel, then attention: RoPE inside the decode kernel pays only after a projection that lets
        # attention start early (the serving form's packed Triton GEMVs), not after cuBLAS's GEMMs
        out = attention(q, k, v, meta, self.layer, self.scale, self.sliding_window, rope=(cos, sin),
                        decode_rope=False)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x):
        return self.down_proj(silu_and_mul(self.gate_proj(x), self.up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAttention(cfg, layer) if cfg.kv_lora_rank else LlamaAttention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoeBlock(cfg) if is_sparse(cfg, layer) else LlamaMLP(cfg)

    def forward(self, h, cos, sin, meta, residual=None, normed=None):
        """The residual stream is h + residual (residual None: h alone, the first layer, whose input norm of h may
        come as `normed`). Returns the MLP output and the stream before it, so each residual add is fused into the
        norm that follows it; the sums are the same bf16 additions as `h = h + attn(...)`, `h = h + mlp(...)`."""
        if residual is None:
            residual, x = h, self.input_layernorm(h) if normed is None else normed
        else:
            x, residual = self.input_layernorm(h, residual)
        x, residual = self.post_attention_layernorm(self.self_attn(x, cos, sin, meta), residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg)
        # the first layer's norm fused into the embedding gather; parallel training turns it off (FSDP gathers
        # layer 0's norm weight only inside that layer's call, TP's vocabulary-parallel plan hooks embed_tokens')
        self.embed_fused = True

    def embed(self, input_ids, positions):
        """The stream entering the first layer, and the rotation every layer applies: (h, cos, sin)."""
        h = self.embed_tokens(input_ids)
        return (h, *self.rotary_emb(positions, h.dtype))

    def forward(self, input_ids, positions, meta):
        first = self.layers[0].input_layernorm
        if self.embed_fused:
            x, h = embed_rms_norm(input_ids, self.embed_tokens.weight, first.weight, first.eps)  # one gather-and-norm
        else:
            x, h = None, self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions, h.dtype)
        h, residual = self.layers[0](h, cos, sin, meta, normed=x)
        for layer in self.layers[1:]:
            h, residual = layer(h, cos, sin, meta, residual)
        return self.norm(h, residual)[0]


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMeta) -> torch.Tensor:
        """input_ids, positions: [N] -> final hidden states [N, hidden]."""
        return self.model(input_ids, positions, meta)

    def logits(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMeta) -> torch.Tensor:
        """compute_logits(forward(...)), for a step that samples every row (a decode graph)."""
        return self.compute_logits(self(input_ids, positions, meta))

    def compute_logits(self, hidden) -> torch.Tensor:
        """fp32 logits of the final hidden states [rows, hidden]."""
        return self.lm_head(hidden).float()

    def checkpoint_target(self, name: str) -> torch.Tensor | None:
        """The parameter (or balancing-bias buffer) checkpoint tensor `name` goes into, or None for tensors to skip.
        Unknown: AttributeError."""
        if name.endswith("rotary_emb.inv_freq"):  # old checkpoints saved this derived buffer
            return None
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None  # same storage as embed_tokens
        name = checkpoint_name(self.config, name)
        if name.endswith(BALANCING_BIAS):
            return self.get_buffer(name)
        return self.get_parameter(name)

    def checkpoint_tensors(self):
        """(name, tensor) of everything a checkpoint fills: the parameters and DeepSeek-V3's balancing biases."""
        yield from self.named_parameters()
        yield from ((n, b) for n, b in self.named_buffers() if n.endswith(BALANCING_BIAS))

