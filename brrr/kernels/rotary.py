"""Rotary position embeddings (RoFormer), with the context-extension scalings HF checkpoints use:
linear (position interpolation), dynamic NTK, llama3 (wavelength-banded) and YaRN.

Every scaling only changes the inverse frequencies and the factor on cos/sin (`rope_inv_freq`); the rotation
itself (`apply_rotary`) is the same for all of them, so one Triton kernel serves each: it takes the step's
cos/sin [tokens, head_dim] (computed once per forward, shared by every layer) and rotates q and k in place."""
import math

import torch

from brrr.config import RopeConfig
from brrr.kernels.dispatch import next_power_of_2, use_triton
from brrr.kernels.pdl import pdl_on


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
    if use_triton(positions, inv_freq) and positions.numel() > 0:
        return rotary_cos_sin_triton(positions, inv_freq, scale, dtype)
    return rotary_cos_sin_ref(positions, inv_freq, scale, dtype)


def rotary_cos_sin_ref(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float, dtype: torch.dtype):
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


try:
    import triton
    import triton.language as tl
except Exception:
    triton = None

if triton is not None:
    from brrr.kernels.pdl import wait_previous

    @triton.jit
    def _rotate_heads(X, stride_h, n_heads, c1, c2, s1, s2,
                      HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
        heads = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_HALF)
        mask = (heads < n_heads)[:, None] & (d < HALF)[None, :]
        ptr1 = X + heads[:, None] * stride_h + d[None, :]
        x1 = tl.load(ptr1, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(ptr1 + HALF, mask=mask, other=0.0).to(tl.float32)
        dt = X.dtype.element_ty
        # torch rounds each product and the sum to the activation dtype, and so do we
        # (in fp32 the compiler may fuse an FMA: within an ulp)
        o1 = (x1 * c1[None, :]).to(dt).to(tl.float32) + (-x2 * s1[None, :]).to(dt).to(tl.float32)
        o2 = (x2 * c2[None, :]).to(dt).to(tl.float32) + (x1 * s2[None, :]).to(dt).to(tl.float32)
        tl.store(ptr1, o1.to(dt), mask=mask)
        tl.store(ptr1 + HALF, o2.to(dt), mask=mask)
        return o1.to(dt), o2.to(dt)

    @triton.jit
    def _cos_sin_kernel(POS, INV, COS, SIN, scale, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, PDL: tl.constexpr):
        """One token's cos and sin rows [2 * HALF]: the ops of `rotary_cos_sin`'s torch form in one launch (its
        fp32 product, libdevice cos/sin as torch's, the scale, one rounding to the table's dtype)."""
        wait_previous(PDL)
        t = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, BLOCK_HALF)
        dm = d < HALF
        f = tl.load(POS + t).to(tl.float32) * tl.load(INV + d, mask=dm, other=0.0)
        dt = COS.dtype.element_ty
        c, s = (tl.cos(f) * scale).to(dt), (tl.sin(f) * scale).to(dt)
        for half in tl.static_range(2):  # emb = cat(freqs, freqs)
            tl.store(COS + t * 2 * HALF + half * HALF + d, c, mask=dm)
            tl.store(SIN + t * 2 * HALF + half * HALF + d, s, mask=dm)

    @triton.jit
    def _rotary_kernel(Q, K, COS, SIN, V, KC, VC, SLOTS, stride_qn, stride_qh, stride_kn, stride_kh, stride_cos,
                       stride_sin, stride_vn, stride_vh, stride_cb, stride_ct, stride_ch, block_size, n_q_heads,
                       n_k_heads, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
                       WRITE_KV: tl.constexpr, PDL: tl.constexpr):
        """One token: q and k rotated in place; WRITE_KV: the rotated k and v also go to the paged cache at the
        token's slot (negative: padding, skipped), the work of attention's `_write_kv_kernel`, one launch fewer."""
        wait_previous(PDL)
        t = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, BLOCK_HALF)
        dm = d < HALF
        c1 = tl.load(COS + t * stride_cos + d, mask=dm, other=0.0).to(tl.float32)
        c2 = tl.load(COS + t * stride_cos + HALF + d, mask=dm, other=0.0).to(tl.float32)
        s1 = tl.load(SIN + t * stride_sin + d, mask=dm, other=0.0).to(tl.float32)
        s2 = tl.load(SIN + t * stride_sin + HALF + d, mask=dm, other=0.0).to(tl.float32)
        _rotate_heads(Q + t * stride_qn, stride_qh, n_q_heads, c1, c2, s1, s2, HALF, BLOCK_H, BLOCK_HALF)
        k1, k2 = _rotate_heads(K + t * stride_kn, stride_kh, n_k_heads, c1, c2, s1, s2, HALF, BLOCK_H, BLOCK_HALF)
        if WRITE_KV:
            slot = tl.load(SLOTS + t).to(tl.int64)
            if slot >= 0:
                heads = tl.arange(0, BLOCK_H)
                mask = (heads < n_k_heads)[:, None] & dm[None, :]
                row = (slot // block_size) * stride_cb + (slot % block_size) * stride_ct
                dst = row + heads[:, None] * stride_ch + d[None, :]
                tl.store(KC + dst, k1, mask=mask)
                tl.store(KC + dst + HALF, k2, mask=mask)
                src = V + t * stride_vn + heads[:, None] * stride_vh + d[None, :]
                tl.store(VC + dst, tl.load(src, mask=mask), mask=mask)
                tl.store(VC + dst + HALF, tl.load(src + HALF, mask=mask), mask=mask)


def rotary_cos_sin_triton(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float, dtype: torch.dtype):
    """`rotary_cos_sin` in one launch (the torch form is ~9 small elementwise kernels a decode step)."""
    half = inv_freq.shape[0]
    cos = torch.empty(positions.shape[0], 2 * half, dtype=dtype, device=positions.device)
    sin = torch.empty_like(cos)
    pdl = pdl_on(positions)
    _cos_sin_kernel[(positions.shape[0],)](positions, inv_freq.float().contiguous(), cos, sin, float(scale),
                                           HALF=half, BLOCK_HALF=next_power_of_2(half), PDL=pdl, num_warps=1,
                                           enable_fp_fusion=False, launch_pdl=pdl > 0)
    return cos, sin


def apply_rotary_triton(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache=None):
    """Rotates q and k IN PLACE (last dim unit-stride) and returns them. cache: (v, k_cache, v_cache, slot_mapping)
    to also write the rotated k and v into the paged cache [blocks, block_size, kv heads, D], as write_kv does."""
    n, _, dim = q.shape
    half = dim // 2
    block_h = next_power_of_2(max(q.shape[1], k.shape[1]))
    block_half = next_power_of_2(half)
    warps = min(8, max(1, block_h * block_half // 512))
    pdl = pdl_on(q)
    # enable_fp_fusion=False: LLVM would otherwise narrow the products to bf16 and fuse one into an FMA with the
    # sum, skipping a rounding torch does (1-ulp differences); without it the bits match
    v, kc, vc, slots = cache if cache is not None else (k, k, k, k)
    _rotary_kernel[(n,)](q, k, cos, sin, v, kc, vc, slots, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                         cos.stride(0), sin.stride(0), v.stride(0), v.stride(1), kc.stride(0), kc.stride(1),
                         kc.stride(2), kc.shape[1] if cache is not None else 1, q.shape[1], k.shape[1], HALF=half,
                         BLOCK_H=block_h, BLOCK_HALF=block_half, WRITE_KV=cache is not None, num_warps=warps,
                         enable_fp_fusion=False, PDL=pdl, launch_pdl=pdl > 0)
    return q, k


def rotary_triton_ok(q, k, cos, sin) -> bool:
    return (q.shape[0] > 0 and q.shape[-1] % 2 == 0 and q.shape[-1] == k.shape[-1] == cos.shape[-1] == sin.shape[-1]
            and q.dtype == k.dtype == cos.dtype == sin.dtype and q.stride(-1) == k.stride(-1) == 1
            and cos.stride(-1) == sin.stride(-1) == 1 and use_triton(q, k, cos, sin))


def apply_rotary(q, k, cos, sin):
    """-> rotated (q, k). On the Triton path q and k are rotated in place and returned; don't reuse the inputs."""
    if rotary_triton_ok(q, k, cos, sin):
        return apply_rotary_triton(q, k, cos, sin)
    return apply_rotary_ref(q, k, cos, sin)
