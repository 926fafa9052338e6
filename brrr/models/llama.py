"""Llama family: Llama 2/3/3.1/3.2, Mistral, Qwen2 (qkv bias), Qwen3 (per-head q/k RMSNorm).

Module names and projection shapes follow Hugging Face's, so checkpoints load by name and every GEMM has the
shape transformers runs. That is deliberate: packing q/k/v into one GEMM changed cuBLAS's kernel choice on the
H200 and with it bf16 rounding, enough to flip greedy tokens of a random 8B model (docs/models.md). Packing is
a fast-path transform, not part of the reference.
Shapes: activations are a flattened batch of tokens [N, hidden]; `AttnMeta` says how they split into sequences.
"""
from __future__ import annotations

import torch
from torch import nn

from brrr.config import ModelConfig
from brrr.kernels import (AttnMeta, add_rms_norm, attention, rms_norm, rope_inv_freq, rotary_cos_sin,
                          silu_and_mul)
from brrr.kernels.rms_norm import embed_rms_norm

# Batch-1 decode with the norms in the GEMVs: lm_head's GEMV takes the final norm as a PendingNorm (False: a norm
# kernel before it; bench/pdl_decode.py's A/B)
FINAL_NORM_IN_LM_HEAD = True


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

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        cfg = self.cfg
        # Dynamic NTK re-derives the base from the longest position in the step, as transformers does.
        seq_len = int(positions.max()) + 1 if cfg.rope.type == "dynamic" else None
        if seq_len is not None and seq_len <= cfg.max_position_embeddings:
            seq_len = None
        key = (positions.device, seq_len)
        if key not in self._cache:
            inv_freq, scale = rope_inv_freq(cfg.rope, cfg.head_dim, cfg.max_position_embeddings, seq_len)
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
        self.qkv_proj = None  # set by pack_projections (serving fast path)

    def forward(self, x, cos, sin, meta: AttnMeta, residual=None, next_norm=None):
        """residual (with the next RMSNorm's (weight, eps)): o_proj adds it and gives (h, the next norm's
        PendingNorm), `LlamaDecoderLayer.forward_in_gemvs`; x may then be a PendingNorm for the packed q/k/v."""
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x).split([self.n_heads * self.head_dim] + [self.n_kv * self.head_dim] * 2, -1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(-1, self.n_heads, self.head_dim)
        k = k.view(-1, self.n_kv, self.head_dim)
        v = v.view(-1, self.n_kv, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        # RoPE inside the decode kernel pays after a Triton projection (PDL lets attention start early), not cuBLAS's
        proj = self.qkv_proj if self.qkv_proj is not None else self.q_proj
        decode_rope = type(proj) is not nn.Linear
        out = attention(q, k, v, meta, self.layer, self.scale, self.sliding_window, rope=(cos, sin),
                        decode_rope=decode_rope)
        return self.o_proj(out) if residual is None else self.o_proj(out, residual=residual, next_norm=next_norm)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.gate_up_proj = None  # set by pack_projections (serving fast path)

    def forward(self, x, residual=None, next_norm=None):
        """residual, next_norm: as `LlamaAttention.forward`'s, for down_proj."""
        if self.gate_up_proj is not None:
            gated = getattr(self.gate_up_proj, "gated", None)  # QuantLinear: SiLU-and-mul in the GEMV's epilogue
            act = gated(x) if gated else silu_and_mul(*self.gate_up_proj(x).chunk(2, -1))
        else:
            act = silu_and_mul(self.gate_proj(x), self.up_proj(x))
        return self.down_proj(act) if residual is None else self.down_proj(act, residual=residual, next_norm=next_norm)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

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

    def forward_in_gemvs(self, x, h, cos, sin, meta, next_norm):
        """Batch-1 decode with the RMSNorms and residual adds inside the quantized GEMVs (`LlamaModel.norms_in_gemvs`):
        h is the stream, x this layer's normed input (a PendingNorm; the first layer's a tensor). o_proj and
        down_proj add the residual and write the next norm's PendingNorm (next_norm: the next layer's input norm's
        (weight, eps), or the final norm's). Returns the next layer's (x, h)."""
        post = self.post_attention_layernorm
        h, x = self.self_attn(x, cos, sin, meta, residual=h, next_norm=(post.weight, post.eps))
        h, x = self.mlp(x, residual=h, next_norm=next_norm)
        return x, h


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg)
        # set by brrr/quant/linear.py's pack_quantized_projections when every projection's GEMV can take the norms
        self.norms_in_gemvs = False

    def embed(self, input_ids, positions):
        """The stream entering the first layer, and the rotation every layer applies: (h, cos, sin)."""
        h = self.embed_tokens(input_ids)
        return (h, *self.rotary_emb(positions, h.dtype))

    def forward(self, input_ids, positions, meta, pending: bool = False):
        """pending: on the batch-1 path with the norms in the GEMVs, the final norm is returned as the PendingNorm
        the last GEMV wrote, for an lm_head GEMV that takes it (`LlamaForCausalLM.logits`)."""
        first = self.layers[0].input_layernorm
        x, h = embed_rms_norm(input_ids, self.embed_tokens.weight, first.weight, first.eps)  # one gather-and-norm
        cos, sin = self.rotary_emb(positions, h.dtype)
        # fp16 keeps the norm kernels: weight * h before the 1 / rms could overflow where h / rms would not
        if self.norms_in_gemvs and h.shape[0] == 1 and h.dtype != torch.float16:
            nexts = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
            for layer, norm in zip(self.layers, nexts):
                x, h = layer.forward_in_gemvs(x, h, cos, sin, meta, (norm.weight, norm.eps))
            return x if pending and FINAL_NORM_IN_LM_HEAD else self.norm(h)
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
        """compute_logits(forward(...)) for a step that samples every row (a decode graph): an lm_head GEMV that
        takes the norms (`QuantLinear.takes_norms`) reads the final norm as its PendingNorm, no norm kernel before."""
        pending = getattr(self.lm_head, "takes_norms", False)
        return self.compute_logits(self.model(input_ids, positions, meta, pending=pending))

    def compute_logits(self, hidden) -> torch.Tensor:
        """fp32 logits of hidden (a tensor, or a PendingNorm from `logits`); a QuantLinear lm_head stores them as
        fp32 from its GEMV (`QuantLinear.logits`)."""
        head = getattr(self.lm_head, "logits", None)
        return head(hidden) if head is not None else self.lm_head(hidden).float()

    def checkpoint_target(self, name: str) -> torch.nn.Parameter | None:
        """The parameter checkpoint tensor `name` goes into, or None for tensors to skip. Unknown: AttributeError."""
        if name.endswith("rotary_emb.inv_freq"):  # old checkpoints saved this derived buffer
            return None
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None  # same storage as embed_tokens
        return self.get_parameter(name)


def _packed(linears: list[nn.Linear]) -> nn.Linear | None:
    if not all(type(m) is nn.Linear for m in linears):  # quantized or otherwise swapped: leave them
        return None
    w = linears[0].weight
    out = nn.Linear(w.shape[1], sum(m.out_features for m in linears), bias=linears[0].bias is not None,
                    device=w.device, dtype=w.dtype)
    with torch.no_grad():
        out.weight.copy_(torch.cat([m.weight for m in linears]))
        if out.bias is not None:
            out.bias.copy_(torch.cat([m.bias for m in linears]))
    out.requires_grad_(False)
    return out


@torch.no_grad()
def pack_projections(model: LlamaForCausalLM) -> int:
    """Serving fast path: q/k/v become one GEMM and gate/up another, layer by layer (the originals are dropped as
    each layer is packed, so peak memory grows by one layer). At small batch a GEMM is a read of its weights, and
    three reads of 8-32 MB cost more than one of 48 MB (launches, tails). bf16 sums can round differently from
    HF's separate GEMMs (docs/models.md), so the reference path and the checkpoint writers never pack.
    Returns how many modules it packed. The packed model cannot be saved by name."""
    packed = 0
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if attn.qkv_proj is None and (qkv := _packed([attn.q_proj, attn.k_proj, attn.v_proj])) is not None:
            attn.qkv_proj, attn.q_proj, attn.k_proj, attn.v_proj = qkv, None, None, None
            packed += 1
        if mlp.gate_up_proj is None and (gu := _packed([mlp.gate_proj, mlp.up_proj])) is not None:
            mlp.gate_up_proj, mlp.gate_proj, mlp.up_proj = gu, None, None
            packed += 1
    return packed
