"""Transformer arithmetic from a ModelConfig: parameters by part, bytes, FLOPs per token, KV cache, decode intensity.

This module is brrr's one source of FLOP and byte counts; bench/ and the trainer's MFU call it.
Conventions (docs/arithmetic.md derives each):
  * N (matmul parameters) counts every weight a token multiplies with, the LM head included, the embedding
    table excluded (a lookup is not a matmul); for MoE only the routed experts a token uses.
  * A forward pass costs 2N FLOPs per token plus 2 * layers * heads * (d_qk + d_v) per (query, key) pair.
    Elementwise work (norms, RoPE, softmax, SiLU) is left out: under 1% of the total for these shapes.
  * `context` for decode is the number of tokens the new token attends to, itself included; a sliding
    window caps it. KV bytes read per step = context tokens; the new token's K/V is written once.
"""
from __future__ import annotations

from dataclasses import dataclass

from brrr.analysis.formats import WeightFormat, kv_bytes, weight_format
from brrr.analysis.hardware import GPU
from brrr.config import ModelConfig
from brrr.errors import BrrrError


@dataclass(frozen=True)
class Matrix:
    """One kind of weight matrix (out x in), `count` of them in the model, `active` used by each token."""
    name: str
    part: str  # attention | mlp | head
    rows: int
    cols: int
    count: int
    active: float
    routed_experts: int = 0  # > 0: a routed expert weight; experts per MoE layer
    quantizable: bool = True  # routers, and a head tied to the embedding, stay at 16 bits

    @property
    def size(self) -> int:
        return self.rows * self.cols


def check(cfg: ModelConfig) -> None:
    """Raise BrrrError naming the config fields an MoE or MLA config lacks for the arithmetic."""
    if cfg.num_experts:
        need = {"num_experts_per_tok": cfg.num_experts_per_tok}
        if cfg.architecture != "MixtralForCausalLM":
            need["moe_intermediate_size"] = cfg.moe_intermediate_size
        missing = [k for k, v in need.items() if not v]
        if missing:
            raise BrrrError(f"{cfg.architecture} config has {cfg.num_experts} experts but no {', '.join(missing)}; "
                            f"add the field(s) to config.json")
        if cfg.num_experts_per_tok > cfg.num_experts:
            raise BrrrError(f"field 'num_experts_per_tok' ({cfg.num_experts_per_tok}) must be <= the number of "
                            f"experts ({cfg.num_experts})")
    if cfg.kv_lora_rank:
        missing = [k for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim") if not getattr(cfg, k)]
        if missing:
            raise BrrrError(f"config has kv_lora_rank {cfg.kv_lora_rank} (multi-head latent attention) but no "
                            f"{', '.join(missing)}; add the field(s) to config.json")


def is_mla(cfg: ModelConfig) -> bool:
    return cfg.kv_lora_rank > 0


def qk_v_head_dims(cfg: ModelConfig, decode: bool = False) -> tuple[int, int]:
    """Per-head width of the query-key dot product and of the value vector. MLA prefill expands the latent
    into per-head keys (nope + rope wide) and values (v_head_dim); MLA decode absorbs kv_b_proj into the query
    and output, so each head dots against the cached latent + rotary key and sums latents."""
    if is_mla(cfg) and decode:
        return cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.kv_lora_rank
    if is_mla(cfg):
        return cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    return cfg.head_dim, cfg.head_dim


def moe_layers(cfg: ModelConfig) -> int:
    return cfg.num_layers - len(cfg.dense_mlp_layers) if cfg.num_experts else 0


def mlp_width_per_token(cfg: ModelConfig) -> int:
    """Intermediate width one token's MLP computes in the widest layer: dense, or k routed experts + shared."""
    dense = cfg.intermediate_size if not cfg.num_experts or cfg.dense_mlp_layers else 0
    if not cfg.num_experts:
        return dense
    expert = cfg.moe_intermediate_size or cfg.intermediate_size
    shared = cfg.num_shared_experts * cfg.moe_intermediate_size or cfg.shared_expert_intermediate_size
    return max(dense, cfg.num_experts_per_tok * expert + shared)


def matrices(cfg: ModelConfig) -> list[Matrix]:
    """Every weight matrix of the model, grouped by kind (HF module shapes, e.g. q_proj is heads*d x hidden)."""
    check(cfg)
    h, L, nh = cfg.hidden_size, cfg.num_layers, cfg.num_heads
    out = []

    def add(name, part, rows, cols, count, active=None, **kw):
        if count:
            out.append(Matrix(name, part, rows, cols, count, count if active is None else active, **kw))

    if is_mla(cfg):
        d_qk, d_v = qk_v_head_dims(cfg)
        if cfg.q_lora_rank:
            add("q_a_proj", "attention", cfg.q_lora_rank, h, L)
            add("q_b_proj", "attention", nh * d_qk, cfg.q_lora_rank, L)
        else:
            add("q_proj", "attention", nh * d_qk, h, L)
        add("kv_a_proj_with_mqa", "attention", cfg.kv_lora_rank + cfg.qk_rope_head_dim, h, L)
        add("kv_b_proj", "attention", nh * (cfg.qk_nope_head_dim + d_v), cfg.kv_lora_rank, L)
        add("o_proj", "attention", h, nh * d_v, L)
    else:
        q, kv = nh * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        add("q_proj", "attention", q, h, L)
        add("k_proj", "attention", kv, h, L)
        add("v_proj", "attention", kv, h, L)
        add("o_proj", "attention", h, q, L)
    dense = len(cfg.dense_mlp_layers) if cfg.num_experts else L
    i = cfg.intermediate_size
    add("mlp.gate_up_proj", "mlp", 2 * i, h, dense)
    add("mlp.down_proj", "mlp", h, i, dense)
    moe = moe_layers(cfg)
    if moe:
        E, k = cfg.num_experts, cfg.num_experts_per_tok
        ie = cfg.moe_intermediate_size or cfg.intermediate_size  # Mixtral's experts are intermediate_size wide
        add("router", "mlp", E, h, moe, quantizable=False)
        add("experts.gate_up_proj", "mlp", 2 * ie, h, moe * E, moe * k, routed_experts=E)
        add("experts.down_proj", "mlp", h, ie, moe * E, moe * k, routed_experts=E)
        shared = cfg.num_shared_experts * cfg.moe_intermediate_size or cfg.shared_expert_intermediate_size
        add("shared_expert.gate_up_proj", "mlp", 2 * shared, h, moe if shared else 0)
        add("shared_expert.down_proj", "mlp", h, shared, moe if shared else 0)
        if cfg.shared_expert_intermediate_size:  # Qwen2-MoE gates its shared expert with a sigmoid
            add("shared_expert_gate", "mlp", 1, h, moe, quantizable=False)
    add("lm_head", "head", cfg.vocab_size, h, 1, quantizable=not cfg.tie_word_embeddings)
    return out


def _vectors(cfg: ModelConfig) -> dict[str, int]:
    """Parameters outside matrices: norm weights and biases, by part."""
    h, L = cfg.hidden_size, cfg.num_layers
    attn = 0
    if is_mla(cfg):
        attn += L * (cfg.q_lora_rank + cfg.kv_lora_rank)  # q_a_layernorm, kv_a_layernorm
        if cfg.attention_bias:
            attn += L * (cfg.q_lora_rank + cfg.kv_lora_rank + cfg.qk_rope_head_dim + h)
    else:
        kv = cfg.num_kv_heads * cfg.head_dim
        attn += L * (cfg.num_heads * cfg.head_dim + 2 * kv) * cfg.attention_bias + L * h * cfg.o_proj_bias
        attn += L * 2 * cfg.head_dim * cfg.qk_norm  # q_norm, k_norm
    dense = len(cfg.dense_mlp_layers) if cfg.num_experts else L
    mlp = dense * (2 * cfg.intermediate_size + h) * cfg.mlp_bias
    return {"attention": attn, "mlp": mlp, "norms": (2 * L + 1) * h}


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    """Parameters by part; `active` is what one token uses (differs from `total` for MoE)."""
    mats, vec = matrices(cfg), _vectors(cfg)
    parts = {"embedding": cfg.vocab_size * cfg.hidden_size, "attention": vec["attention"], "mlp": vec["mlp"],
             "norms": vec["norms"], "head": 0}
    for m in mats:
        if m.part == "head" and cfg.tie_word_embeddings:
            continue
        parts[m.part] += m.size * m.count
    total = sum(parts.values())
    inactive = sum(m.size * (m.count - m.active) for m in mats)
    return {**parts, "total": total, "active": int(total - inactive),
            "routed_experts": sum(m.size * m.count for m in mats if m.routed_experts)}


def matmul_params(cfg: ModelConfig) -> float:
    """N of '2N FLOPs per token': weights one token multiplies with (LM head in, embedding lookup out)."""
    return sum(m.size * m.active for m in matrices(cfg))


def weight_bytes(cfg: ModelConfig, weight_dtype: str | WeightFormat = "bf16") -> float:
    """Bytes to store the model: linear weights in `weight_dtype` (scales included), the rest at 16 bits."""
    fmt = weight_format(weight_dtype)
    counts = param_counts(cfg)
    stored = 0.0
    for m in matrices(cfg):
        if m.part == "head" and cfg.tie_word_embeddings:
            continue  # stored once, as the embedding
        per = fmt.matrix_bytes(m.rows, m.cols) if m.quantizable else m.size * fmt.other_bytes
        stored += per * m.count
    others = counts["embedding"] + counts["norms"] + sum(_vectors(cfg)[p] for p in ("attention", "mlp"))
    return stored + others * fmt.other_bytes


def experts_touched(num_experts: int, per_token: int, tokens: int) -> float:
    """Expected distinct experts a layer runs for `tokens` tokens, each routed to `per_token` of them uniformly:
    E * (1 - (1 - k/E)^tokens)."""
    return num_experts * (1 - (1 - per_token / num_experts) ** tokens)


def decode_weight_bytes(cfg: ModelConfig, batch: int, weight_dtype: str | WeightFormat = "bf16") -> float:
    """Weight bytes one decode step reads: every matrix once (MoE: the experts the batch's tokens touch),
    norms and biases, and `batch` rows of the embedding table (not the whole table)."""
    fmt = weight_format(weight_dtype)
    total = 0.0
    for m in matrices(cfg):
        per = fmt.matrix_bytes(m.rows, m.cols) if m.quantizable else m.size * fmt.other_bytes
        n = m.count
        if m.routed_experts:
            n = m.count / m.routed_experts * experts_touched(m.routed_experts, cfg.num_experts_per_tok, batch)
        total += per * n
    vec = _vectors(cfg)
    total += (vec["attention"] + vec["mlp"] + vec["norms"] + batch * cfg.hidden_size) * fmt.other_bytes
    return total


def kv_elements_per_token(cfg: ModelConfig) -> int:
    """KV-cache elements one token stores across all layers: 2 * kv_heads * head_dim per layer (MHA/GQA/MQA),
    or kv_lora_rank + qk_rope_head_dim per layer (MLA's compressed latent plus the shared rotary key)."""
    check(cfg)
    per_layer = cfg.kv_lora_rank + cfg.qk_rope_head_dim if is_mla(cfg) else 2 * cfg.num_kv_heads * cfg.head_dim
    return cfg.num_layers * per_layer


def kv_bytes_per_token(cfg: ModelConfig, kv_dtype: str = "bf16") -> int:
    return kv_elements_per_token(cfg) * kv_bytes(kv_dtype)


def attended_tokens(cfg: ModelConfig, context: int) -> int:
    """Tokens a query at this context length attends to (and the cache keeps): a sliding window caps it."""
    if context < 1:
        raise BrrrError(f"context must be >= 1 token, got {context}")
    return min(context, cfg.sliding_window) if cfg.sliding_window else context


def kv_bytes_per_sequence(cfg: ModelConfig, tokens: int, kv_dtype: str = "bf16") -> int:
    return kv_bytes_per_token(cfg, kv_dtype) * attended_tokens(cfg, tokens)


def attention_flops_per_pair(cfg: ModelConfig, decode: bool = False) -> int:
    """FLOPs for one (query, key) pair over all layers and heads: q.k is 2*d_qk, p*v is 2*d_v."""
    d_qk, d_v = qk_v_head_dims(cfg, decode)
    return 2 * cfg.num_layers * cfg.num_heads * (d_qk + d_v)


def flops_per_token(cfg: ModelConfig, context: int) -> float:
    """Forward FLOPs to decode one token that attends to `context` tokens: 2N + attention."""
    return 2 * matmul_params(cfg) + attention_flops_per_pair(cfg, decode=True) * attended_tokens(cfg, context)


def prefill_flops(cfg: ModelConfig, tokens: int) -> float:
    """Forward FLOPs to prefill a `tokens`-long prompt, causal: token i attends to min(i, window) tokens."""
    if tokens < 1:
        raise BrrrError(f"prompt must be >= 1 token, got {tokens}")
    s, w = tokens, cfg.sliding_window or tokens
    attended_total = s * (s + 1) // 2 if s <= w else w * (w + 1) // 2 + (s - w) * w
    return 2 * matmul_params(cfg) * s + attention_flops_per_pair(cfg) * attended_total


def prefill_flops_per_token(cfg: ModelConfig, tokens: int) -> float:
    return prefill_flops(cfg, tokens) / tokens


def training_flops_per_token(cfg: ModelConfig, seq_len: int, recompute: bool = False) -> float:
    """Forward + backward (backward = 2x forward) per token of seq_len-long sequences; +1 forward if recomputing."""
    return (4 if recompute else 3) * prefill_flops_per_token(cfg, seq_len)


def decode_flops_per_step(cfg: ModelConfig, batch: int, context: int) -> float:
    return batch * flops_per_token(cfg, context)


def decode_bytes_per_step(cfg: ModelConfig, batch: int, context: int, weight_dtype: str | WeightFormat = "bf16",
                          kv_dtype: str = "bf16") -> float:
    """HBM bytes of one decode step of `batch` sequences each attending to `context` tokens: weights read once,
    each sequence's KV read, each new token's KV written. Activations (a few KB per token) are left out."""
    kv_token = kv_bytes_per_token(cfg, kv_dtype)
    kv = batch * (kv_token * attended_tokens(cfg, context) + kv_token)
    return decode_weight_bytes(cfg, batch, weight_dtype) + kv


def decode_intensity(cfg: ModelConfig, batch: int, context: int, weight_dtype: str = "bf16",
                     kv_dtype: str = "bf16") -> float:
    """Arithmetic intensity (FLOP/byte) of one decode step."""
    return decode_flops_per_step(cfg, batch, context) / decode_bytes_per_step(cfg, batch, context, weight_dtype,
                                                                              kv_dtype)


def compute_bound_batch(cfg: ModelConfig, gpu: GPU, context: int, weight_dtype: str = "bf16", kv_dtype: str = "bf16",
                        limit: int = 1 << 24) -> int | None:
    """Smallest batch whose decode step takes longer on compute (FLOPs / peak) than on memory (bytes / bandwidth);
    None when the KV reads alone keep it memory-bound at any batch (long contexts)."""
    peak = gpu.peak(weight_format(weight_dtype).compute_dtype)

    def compute_bound(b):
        return decode_flops_per_step(cfg, b, context) / peak >= \
            decode_bytes_per_step(cfg, b, context, weight_dtype, kv_dtype) / gpu.bandwidth

    hi = 1
    while not compute_bound(hi):  # compute - memory time is convex in batch: once it turns positive it stays
        hi *= 2
        if hi > limit:
            return None
    lo = hi // 2
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if compute_bound(mid) else (mid, hi)
    return hi
