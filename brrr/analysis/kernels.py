"""FLOPs and minimum HBM bytes of the ops in brrr/kernels (each input read once, each output written once), as
roofline `Op`s, for `brrr bench kernels`.

Attention counts 4 * head_dim FLOPs per (query, key) pair and head (q.k and p.v, as `attention_flops_per_pair`);
a causal block of S new tokens counts S^2 / 2 pairs, FlashAttention's convention, so TFLOP/s compare with the
published figures and with SDPA measured the same way.
"""
from __future__ import annotations

from brrr.analysis.roofline import Op


def rms_norm_op(tokens: int, hidden: int, dtype_bytes: int = 2, residual: bool = False) -> Op:
    """x (and the residual) read, the normed output (and the new residual) written, the weight read once."""
    tensors = 4 if residual else 2
    name = f"{'add+' if residual else ''}RMSNorm {tokens}x{hidden}"
    return Op(name, (5 if residual else 4) * tokens * hidden, dtype_bytes * (tensors * tokens * hidden + hidden))


def rotary_op(tokens: int, heads: int, kv_heads: int, head_dim: int, dtype_bytes: int = 2) -> Op:
    """q and k read and written in place; cos and sin [tokens, head_dim] read."""
    elements = tokens * (heads + kv_heads) * head_dim
    return Op(f"RoPE {tokens}x({heads}+{kv_heads})x{head_dim}", 3 * elements,
              dtype_bytes * (2 * elements + 2 * tokens * head_dim))


def silu_and_mul_op(tokens: int, width: int, dtype_bytes: int = 2) -> Op:
    return Op(f"SiLU-and-mul {tokens}x{width}", 5 * tokens * width, dtype_bytes * 3 * tokens * width)


def kv_write_op(tokens: int, kv_heads: int, head_dim: int, dtype_bytes: int = 2) -> Op:
    """New K and V read and scattered into the cache: a copy, no arithmetic."""
    return Op(f"KV write {tokens}x{kv_heads}x{head_dim}", 0, dtype_bytes * 4 * tokens * kv_heads * head_dim)


def decode_attention_op(batch: int, context: int, heads: int, kv_heads: int, head_dim: int,
                        dtype_bytes: int = 2, kv_bytes: int | None = None) -> Op:
    """One query per sequence over `context` cached tokens: the K/V read dominates. kv_bytes: the cache's element
    size when it differs from q's (1 for an fp8 cache)."""
    kv = 2 * batch * context * kv_heads * head_dim
    q_and_out = 2 * batch * heads * head_dim
    fp8 = " fp8 KV" if kv_bytes == 1 else ""
    return Op(f"decode attention{fp8} b={batch} x {context} ({heads}/{kv_heads}, hd{head_dim})",
              4 * head_dim * heads * batch * context,
              (dtype_bytes if kv_bytes is None else kv_bytes) * kv + dtype_bytes * q_and_out)


def mla_decode_op(batch: int, context: int, heads: int, rank: int, rope: int, dtype_bytes: int = 2) -> Op:
    """MLA's absorbed decode: every query head against one latent row of r + rope values per cached token, the
    latent also the value; the cache rows dominate the bytes."""
    rows = batch * context * (rank + rope)
    q_and_out = batch * heads * (2 * rank + rope)
    return Op(f"MLA decode b={batch} x {context} ({heads} heads, r{rank} + rope{rope})",
              2 * batch * heads * context * (2 * rank + rope), dtype_bytes * (rows + q_and_out))


def prefill_attention_op(batch: int, new_tokens: int, heads: int, kv_heads: int, head_dim: int, prefix: int = 0,
                         dtype_bytes: int = 2) -> Op:
    """Causal over the new tokens, plus every new token against a cached `prefix` (read from the cache)."""
    pairs = batch * (new_tokens * new_tokens / 2 + new_tokens * prefix)
    tokens = batch * new_tokens
    moved = 2 * tokens * heads * head_dim + 2 * tokens * kv_heads * head_dim + 2 * batch * prefix * kv_heads * head_dim
    name = f"prefill attention {batch}x{new_tokens}" + (f" +{prefix} cached" if prefix else "") + \
        f" ({heads}/{kv_heads}, hd{head_dim})"
    return Op(name, 4 * head_dim * heads * pairs, dtype_bytes * moved)


def fused_moe_op(tokens: int, top_k: int, experts_run: int, hidden: int, inter: int, dtype_bytes: int = 2) -> Op:
    """The routed experts of one MoE layer: three GEMMs of hidden x inter per (token, choice); the bytes are the
    weights of the experts that got tokens (each read once), x read and the output written."""
    return Op(f"fused MoE {tokens}x{hidden} top{top_k} ({experts_run} experts x {inter})",
              2 * 3 * tokens * top_k * hidden * inter,
              dtype_bytes * (experts_run * 3 * hidden * inter + 2 * tokens * hidden))
