"""`attention`, the op the models call: the Triton kernels on CUDA (decodes through `decode.decode_attention_triton`,
prefill chunks through the varlen kernel), else the plain-torch reference."""
from __future__ import annotations

import torch

from brrr.kernels.attention.decode import decode_attention_triton
from brrr.kernels.attention.invariant import attention_invariant
from brrr.kernels.attention.kv_quant import FP8, calibrate, kv_scales, quantize
from brrr.kernels.attention.kv_write import write_kv_triton
from brrr.kernels.attention.meta import AttnMeta
from brrr.kernels.attention.plan import MAX_HEAD_DIM
from brrr.kernels.attention.prefill import prefill_attention_triton
from brrr.kernels.attention.reference import attention_ref, paged_decode_ref, paged_verify_ref, write_kv_ref
from brrr.kernels.dispatch import batch_invariant_on, use_triton
from brrr.kernels.rotary import apply_rotary, apply_rotary_triton, rotary_triton_ok


def attention_triton(q, k, v, meta: AttnMeta, layer: int, scale: float, sliding_window: int | None = None,
                     rope=None, decode_rope: bool = True):
    """The Triton path of `attention`: same arguments, same result (up to fp32 summation order). rope (with a
    cache only): (cos, sin), applied by the kernel that writes the cache: the decode kernel itself when every
    sequence has one new token and decode_rope, else the rotary kernel."""
    n_tokens, n_heads, dim = q.shape
    out = torch.empty_like(q)
    if meta.kv_caches is None:
        prefill_attention_triton(q, k, v, meta.cu_seqlens_q, meta.max_seqlen_q, scale,
                                 sliding_window=sliding_window, out=out)
        return out.view(n_tokens, n_heads * dim)
    k_cache, v_cache = meta.kv_caches[layer]
    scales = kv_scales(meta.kv_caches[layer])
    context_lens = meta.device_context_lens(q.device)
    if scales is not None:  # fp8: the cache write quantizes, the kernels dequantize what they read
        return _attention_fp8(q, k, v, meta, k_cache, v_cache, scales, context_lens, scale, sliding_window, out)
    if (rope is not None and meta.max_seqlen_q == 1 and decode_rope
            and rope[0].stride(0) == rope[1].stride(0)):  # all decodes: rotation and cache write in one kernel
        decode_attention_triton(q, k_cache, v_cache, meta.cu_seqlens_q, context_lens, meta.block_tables, scale,
                                sliding_window, meta.context_bound(k_cache.shape[1]), out=out,
                                rope=(k, v, *rope, meta.slot_mapping))
        return out.view(n_tokens, n_heads * dim)
    if rope is not None and k.shape[0]:
        apply_rotary_triton(q, k, *rope, cache=(v, k_cache, v_cache, meta.slot_mapping))
    else:
        write_kv_triton(k, v, k_cache, v_cache, meta.slot_mapping)
    if meta.has_single_token_rows:
        decode_attention_triton(q, k_cache, v_cache, meta.cu_seqlens_q, context_lens, meta.block_tables, scale,
                                sliding_window, meta.context_bound(k_cache.shape[1]), out=out)
    if meta.max_seqlen_q > 1:
        prefill_attention_triton(q, k, v, meta.cu_seqlens_q, meta.max_seqlen_q, scale, k_cache, v_cache,
                                 context_lens, meta.block_tables, sliding_window, skip_single=True, out=out)
    return out.view(n_tokens, n_heads * dim)


def _attention_fp8(q, k, v, meta: AttnMeta, k_cache, v_cache, scales, context_lens, scale, sliding_window, out):
    """attention_triton over an fp8 cache: q and k come rotated; the write quantizes, decodes take the split kernel,
    and prefill chunks see their own new k/v as the cache holds them (the fp8 values, cast exactly): both kernels
    multiply the scores by K's scale and the output by V's, so a token's keys are the same values whichever step
    reads them."""
    n_tokens, n_heads, dim = q.shape
    write_kv_triton(k, v, k_cache, v_cache, meta.slot_mapping, scales)
    if meta.has_single_token_rows:
        decode_attention_triton(q, k_cache, v_cache, meta.cu_seqlens_q, context_lens, meta.block_tables, scale,
                                sliding_window, meta.context_bound(k_cache.shape[1]), out=out, kv_scales=scales)
    if meta.max_seqlen_q > 1:
        k, v = (quantize(x, s, k_cache.dtype).to(q.dtype) for x, s in zip((k, v), scales))
        prefill_attention_triton(q, k, v, meta.cu_seqlens_q, meta.max_seqlen_q, scale, k_cache, v_cache,
                                 context_lens, meta.block_tables, sliding_window, skip_single=True, out=out,
                                 kv_scales=scales)
    return out.view(n_tokens, n_heads * dim)


def _triton_ok(q, k, v, meta: AttnMeta) -> bool:
    dim = q.shape[-1]
    if not (q.dim() == 3 and q.shape[0] > 0 and dim <= MAX_HEAD_DIM and k.shape[-1] == dim and v.shape[-1] == dim
            and q.dtype in (torch.float16, torch.bfloat16, torch.float32) and k.dtype == v.dtype == q.dtype
            and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and q.shape[1] % k.shape[1] == 0):
        return False
    if meta.kv_caches is not None:
        k_cache, v_cache = meta.kv_caches[0]
        if (k_cache.dtype not in (q.dtype, *FP8) or v_cache.stride() != k_cache.stride() or k_cache.stride(-1) != 1
                or meta.block_tables is None or meta.slot_mapping is None
                or (meta.context_lens is None and meta.context_lens_t is None)):
            return False
    return use_triton(q, k, v)


def attention(q, k, v, meta: AttnMeta, layer: int, scale: float, sliding_window: int | None = None, rope=None,
              decode_rope: bool = True):
    """q [N, H, D], k/v [N, KVH, D] for the new tokens -> [N, H * D]. rope: (cos, sin) to rotate q and k with
    first (`apply_rotary`: q and k may be rotated in place). With a cache, the new K/V are written into it first;
    on the Triton path the rotation and that write are one kernel (the decode kernel in a step of decodes, if
    decode_rope). Triton on CUDA (decodes through the split-KV kernel, prefill chunks through the varlen kernel),
    else the reference. In the batch-invariant mode, the invariant kernel (attention/invariant.py) for every row.
    meta.observe, when set, is called after with the rotated queries (the rotation then runs apart: not fused)."""
    if meta.observe is None:
        return _attention(q, k, v, meta, layer, scale, sliding_window, rope, decode_rope)
    if rope is not None:
        q, k = apply_rotary(q, k, *rope)
    out = _attention(q, k, v, meta, layer, scale, sliding_window, None, decode_rope)
    meta.observe(layer, q, scale)
    return out


def _attention(q, k, v, meta: AttnMeta, layer: int, scale: float, sliding_window: int | None, rope,
               decode_rope: bool):
    if batch_invariant_on():
        if rope is not None:
            q, k = apply_rotary(q, k, *rope)
        return attention_invariant(q, k, v, meta, layer, scale, sliding_window)
    pair = meta.kv_caches[layer] if meta.kv_caches is not None else None
    scales = kv_scales(pair)
    fused = (rope is not None and pair is not None and scales is None and _triton_ok(q, k, v, meta)
             and rotary_triton_ok(q, k, *rope))
    if rope is not None and not fused:
        q, k = apply_rotary(q, k, *rope)
    if meta.attend is not None:
        return meta.attend(q, k, v, scale, sliding_window)
    calibrate(pair, k, v)  # an fp8 cache whose scales come from its first write
    if _triton_ok(q, k, v, meta):
        return attention_triton(q, k, v, meta, layer, scale, sliding_window, rope if fused else None, decode_rope)
    if meta.kv_caches is not None and meta.context_lens is None:  # device-only meta (a captured step)
        k_cache, v_cache = pair
        write_kv_ref(k, v, k_cache, v_cache, meta.slot_mapping, scales)
        if meta.max_seqlen_q > 1:  # a verify graph: every row has the same number of new tokens
            return paged_verify_ref(q, k, v, k_cache, v_cache, meta.block_tables, meta.context_lens_t, scale,
                                    sliding_window, scales)
        return paged_decode_ref(q, k_cache, v_cache, meta.block_tables, meta.context_lens_t, scale, sliding_window,
                                scales)
    return attention_ref(q, k, v, meta, layer, scale, sliding_window)
