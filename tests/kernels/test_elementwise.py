"""RMSNorm (+ fused residual add), RoPE and SiLU-and-mul: Triton against the plain-torch references.

fp32 and fp16 agree to an ulp of the output (the kernels round where torch's ops round), and so does bf16 on a
GPU. Triton's CPU interpreter converts fp32 -> bf16 by truncation where the GPU rounds to nearest, so there bf16
is held to 2 ulps of the row's largest value (ulp_check).
"""
import pytest
import torch

from brrr.config import RopeConfig
from brrr.kernels.activation import silu_and_mul_ref, silu_and_mul_triton
from brrr.kernels.attention import write_kv_ref
from brrr.kernels.rms_norm import (add_rms_norm_ref, add_rms_norm_triton, embed_rms_norm_triton, rms_norm_ref,
                                   rms_norm_triton)
from brrr.kernels.rotary import (apply_rotary_ref, apply_rotary_triton, rope_inv_freq, rotary_cos_sin,
                                 rotary_cos_sin_ref, rotary_cos_sin_triton)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def ulp_check(dtype, device):
    """check(got, want, ulps): |got - want| <= ulps units in the last place of want (fp32: of 2^-20, since the
    kernels sum in another order). bf16 under the interpreter rounds toward zero at each of the reference's
    rounding steps, so there the error may reach 2 ulps of the largest value in the row instead."""
    eps = {torch.float32: 2**-20, torch.float16: 2**-10, torch.bfloat16: 2**-7}[dtype]
    truncating = dtype == torch.bfloat16 and device == "cpu"

    def check(got, want, ulps=1):
        assert got.dtype == want.dtype == dtype and got.shape == want.shape
        got, want = got.float(), want.float()
        assert torch.isfinite(got).all()
        err = (got - want).abs()
        if truncating:
            bound = 2 * eps * want.abs().amax(-1, keepdim=True) + 1e-6
        else:
            bound = ulps * eps * want.abs() + 1e-6
        assert (err <= bound).all(), f"{dtype}: max error {err.max().item()}"
    return check


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 100), (70, 32), (3, 3000)])
def test_rms_norm(device, dtype, rows, hidden):
    check = ulp_check(dtype, device)
    g = torch.Generator().manual_seed(rows * hidden)
    x = (torch.randn(rows, hidden, generator=g) * 3).to(dtype).to(device)
    w = torch.randn(hidden, generator=g).to(dtype).to(device)
    check(rms_norm_triton(x, w, 1e-5), rms_norm_ref(x, w, 1e-5), ulps=2)  # rounding after normalise, then after w


def test_rms_norm_strided_rows_and_promoted_weight(device):
    """Rows with a gap between them (a slice of a wider tensor), a 3-d input, and an fp32 weight on fp16
    activations: the output is fp32, as torch's type promotion makes it."""
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(5, 2, 80, generator=g).to(torch.float16).to(device)
    x = wide[..., :48]
    assert not x.is_contiguous()
    w = torch.randn(48, generator=g).to(device)
    got, want = rms_norm_triton(x, w, 1e-6), rms_norm_ref(x, w, 1e-6)
    assert got.dtype == want.dtype == torch.float32 and got.shape == (5, 2, 48)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm(device, dtype):
    check = ulp_check(dtype, device)
    g = torch.Generator().manual_seed(1)
    x, res = (torch.randn(9, 200, generator=g).to(dtype).to(device) for _ in range(2))
    w = torch.randn(200, generator=g).to(dtype).to(device)
    x0, res0 = x.clone(), res.clone()
    normed, new_res = add_rms_norm_triton(x, res, w, 1e-6)
    want_normed, want_res = add_rms_norm_ref(x, res, w, 1e-6)
    check(new_res, want_res, ulps=0 if dtype != torch.bfloat16 else 1)  # one rounded add
    check(normed, want_normed, ulps=2)
    assert torch.equal(x, x0) and torch.equal(res, res0)  # inputs untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_embed_rms_norm(device, dtype):
    """The first layer's norm reading its rows from the embedding table: the gathered rows exactly, the norm as
    rms_norm's of them (one row, the decode step, and several, repeated ids and the last row included)."""
    check = ulp_check(dtype, device)
    g = torch.Generator().manual_seed(2)
    table = (torch.randn(50, 96, generator=g) * 2).to(dtype).to(device)
    w = torch.randn(96, generator=g).to(dtype).to(device)
    for ids in ([7], [49, 3, 3, 0, 12]):
        ids = torch.tensor(ids, device=device)
        normed, h = embed_rms_norm_triton(ids, table, w, 1e-5)
        assert torch.equal(h, table[ids])
        check(normed, rms_norm_ref(table[ids], w, 1e-5), ulps=2)


ROPES = {
    "default": RopeConfig(),
    "linear": RopeConfig("linear", 10000.0, {"factor": 4.0}),
    "dynamic": RopeConfig("dynamic", 10000.0, {"factor": 2.0}),
    "llama3": RopeConfig("llama3", 500000.0, {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 64}),
    "yarn": RopeConfig("yarn", 10000.0, {"factor": 4.0, "original_max_position_embeddings": 64}),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rope", sorted(ROPES))
def test_rotary_every_scaling(device, dtype, rope):
    """cos/sin of each scaling from the reference's rope_inv_freq; positions beyond the original context."""
    check = ulp_check(dtype, device)
    dim, n = 64, 11
    positions = torch.tensor([0, 1, 2, 15, 16, 63, 64, 100, 127, 300, 1000])
    inv_freq, scale = rope_inv_freq(ROPES[rope], dim, 64, seq_len=1001 if rope == "dynamic" else None)
    cos, sin = rotary_cos_sin(positions, inv_freq, scale, dtype)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(n, 6, dim, generator=g).to(dtype).to(device)
    k = torch.randn(n, 2, dim, generator=g).to(dtype).to(device)
    cos, sin = cos.to(device), sin.to(device)
    want_q, want_k = apply_rotary_ref(q, k, cos, sin)
    got_q, got_k = apply_rotary_triton(q, k, cos, sin)
    assert got_q is q and got_k is k  # rotated in place
    check(got_q, want_q)
    check(got_k, want_k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rope", sorted(ROPES))
@pytest.mark.parametrize("dim", [64, 24])
def test_rotary_cos_sin_kernel_every_scaling(device, dtype, rope, dim):
    """The one-launch cos/sin tables against the torch form's ops: on a GPU bit for bit (the same fp32 product,
    libdevice cos/sin as torch's, one rounding); under the interpreter numpy's cos/sin, within an ulp."""
    positions = torch.tensor([0, 1, 2, 15, 16, 63, 64, 100, 127, 300, 1000, 131071], device=device)
    inv_freq, scale = rope_inv_freq(ROPES[rope], dim, 64, seq_len=1001 if rope == "dynamic" else None)
    want = rotary_cos_sin_ref(positions, inv_freq.to(device), scale, dtype)
    got = rotary_cos_sin_triton(positions, inv_freq.to(device), scale, dtype)
    for g, w in zip(got, want):
        if device == "cuda":
            assert torch.equal(g, w)
        else:
            ulp_check(dtype, device)(g, w)


def test_rotary_packed_qkv_odd_head_dim(device):
    """q and k as views of one packed projection (rows strided past their heads), head_dim 24 (half not a power
    of 2), MQA (one kv head)."""
    n, heads, dim = 5, 3, 24
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(n, (heads + 2) * dim, generator=g).to(device)
    q, k = qkv[:, : heads * dim].view(n, heads, dim), qkv[:, heads * dim: (heads + 1) * dim].view(n, 1, dim)
    v_before = qkv[:, (heads + 1) * dim:].clone()
    inv_freq, scale = rope_inv_freq(RopeConfig(), dim, 128)
    cos, sin = (t.to(device) for t in rotary_cos_sin(torch.arange(7, 7 + n), inv_freq, scale, torch.float32))
    want_q, want_k = apply_rotary_ref(q, k, cos, sin)
    apply_rotary_triton(q, k, cos, sin)
    torch.testing.assert_close(q, want_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k, want_k, rtol=1e-6, atol=1e-6)
    assert torch.equal(qkv[:, (heads + 1) * dim:], v_before)  # v, beside them, untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [64, 24])
def test_rotary_that_writes_the_kv_cache(device, dtype, dim):
    """The fused form attention uses with a cache: q and k rotated as by the plain kernel, and the rotated k and v
    stored at each token's slot of the paged cache [blocks, 16, kv heads, D] exactly as write_kv does; a padded
    row (slot -1) writes nothing."""
    n, blocks = 6, 4
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(n, h, dim, generator=g).to(dtype).to(device) for h in (4, 2, 2))
    inv_freq, scale = rope_inv_freq(RopeConfig(), dim, 128)
    cos, sin = (t.to(device) for t in rotary_cos_sin(torch.arange(3, 3 + n), inv_freq, scale, dtype))
    slots = torch.tensor([17, 5, -1, 40, 16, 63], device=device)
    caches = [torch.zeros(blocks, 16, 2, dim, dtype=dtype, device=device) for _ in range(2)]
    want_q, want_k = apply_rotary_triton(q.clone(), k.clone(), cos, sin)
    got_q, got_k = apply_rotary_triton(q, k, cos, sin, cache=(v, *caches, slots))
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    want = [torch.zeros_like(c) for c in caches]
    keep = slots >= 0
    write_kv_ref(want_k[keep], v[keep], *want, slots[keep])
    assert torch.equal(caches[0], want[0]) and torch.equal(caches[1], want[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (3, 1000), (2, 4097)])
def test_silu_and_mul(device, dtype, shape):
    check = ulp_check(dtype, device)
    g = torch.Generator().manual_seed(shape[1])
    gate = (torch.randn(shape, generator=g) * 4).to(dtype).to(device)
    up = torch.randn(shape, generator=g).to(dtype).to(device)
    check(silu_and_mul_triton(gate, up), silu_and_mul_ref(gate, up), ulps=2)  # silu's exp may differ by an ulp
