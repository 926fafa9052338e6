"""FP8 KV cache: the Triton cache write (quantize, saturating) and the split decode / varlen prefill kernels
(dequantize in registers) against the torch reference over the same fp8 cache, through `attention` and alone.

Small shapes for Triton's CPU interpreter: a mixed step (decodes and prefill chunks over cached prefixes), GQA,
both fp8 formats, scales other than 1.0, and values past the format's range (saturated, never inf or NaN).
"""
import pytest
import torch

from brrr.kernels.attention import attention_ref, attention_triton, write_kv_ref, write_kv_triton
from brrr.kernels.attention.kv_quant import QuantKV, as_bytes, dequantize, quantize
from tests.kernels.test_attention import make_step

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def fp8_meta(meta, dtype, k_scale, v_scale):
    """The step's cache as fp8 (its prefix quantized with the scales), as a QuantKV pair; a fresh copy each call."""
    k_cache, v_cache = meta.kv_caches[0]
    ks, vs = (torch.tensor([s], dtype=torch.float32, device=k_cache.device) for s in (k_scale, v_scale))
    pair = QuantKV(quantize(k_cache, ks, dtype), quantize(v_cache, vs, dtype))
    pair.k_scale.copy_(ks)
    pair.v_scale.copy_(vs)
    meta = type(meta)(cu_seqlens_q=meta.cu_seqlens_q, seqlens_q=meta.seqlens_q, context_lens=meta.context_lens,
                      slot_mapping=meta.slot_mapping, block_tables=meta.block_tables, kv_caches=[pair])
    return meta


@pytest.mark.parametrize("dtype", FP8)
def test_fp8_write_quantizes_saturates_and_matches_reference(device, dtype):
    n, kv_heads, dim, blocks, bs = 5, 2, 16, 4, 4
    g = torch.Generator().manual_seed(0)
    k = (torch.randn(n, kv_heads, dim, generator=g) * 3).to(device)
    # magnitudes 1e-6 .. 1e3: subnormals, roundings that carry into the exponent, the top of the range
    v = (torch.randn(n, kv_heads, dim, generator=g) * 10 ** (torch.rand(n, kv_heads, dim, generator=g) * 9 - 6)
         ).to(device)
    k[0, 0, 0], v[1, 1, 3] = 1e9, -1e9  # past either format's range: saturated to the largest finite value
    k[2, 1, 5], k[2, 1, 6] = -0.0, -1e-9  # a negative zero, and a negative rounded to zero, keep the sign bit
    scales = (torch.tensor([0.5], device=device), torch.tensor([2.0], device=device))
    slots = torch.tensor([0, 5, 6, 13, 15], device=device)
    caches = [tuple(torch.zeros(blocks, bs, kv_heads, dim, dtype=dtype, device=device) for _ in range(2))
              for _ in range(2)]
    write_kv_ref(k, v, *caches[0], slots, scales)
    write_kv_triton(k, v, *caches[1], slots, scales)
    for want, got in zip(caches[0], caches[1]):
        assert torch.equal(as_bytes(want), as_bytes(got))
    top = torch.finfo(dtype).max
    stored_k = caches[0][0].view(-1, kv_heads, dim).float()
    assert torch.isfinite(stored_k).all() and stored_k[0, 0, 0] == top
    assert caches[0][1].view(-1, kv_heads, dim).float()[5, 1, 3] == -top
    back = dequantize(as_bytes(caches[0][0]).view(-1, kv_heads, dim)[slots].view(dtype), scales[0], torch.float32)
    rel = ((back - k).abs() / k.abs().clamp_min(1e-3))[1:]  # the saturated element aside
    assert rel.max() < (2 ** -3 if dtype == torch.float8_e4m3fn else 2 ** -2)  # half an ulp of 3 / 2 mantissa bits


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (2, 2)])
def test_fp8_mixed_step_triton_equals_reference(device, dtype, heads, kv_heads):
    """Decodes and prefill chunks over cached prefixes in one step: the kernels' outputs and the caches they wrote
    equal the reference's over the same fp8 cache."""
    q_lens, ctx = [1, 7, 1, 12], [9, 20, 33, 12]
    q, k, v, meta = make_step(q_lens, ctx, heads, kv_heads, 32, 8, torch.float32, device, seed=3)
    ref_meta, tri_meta = fp8_meta(meta, dtype, 0.75, 1.5), fp8_meta(meta, dtype, 0.75, 1.5)
    want = attention_ref(q, k.clone(), v.clone(), ref_meta, 0, 32 ** -0.5)
    got = attention_triton(q, k.clone(), v.clone(), tri_meta, 0, 32 ** -0.5)
    for a, b in zip(ref_meta.kv_caches[0], tri_meta.kv_caches[0]):
        assert torch.equal(as_bytes(a), as_bytes(b))
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    # and fp8 is a real approximation: the fp32 cache's output differs, but not by much
    exact = attention_ref(q, k.clone(), v.clone(), meta, 0, 32 ** -0.5)
    err = (want - exact).abs().max().item()
    assert 0 < err < (0.15 if dtype == torch.float8_e4m3fn else 0.3)
