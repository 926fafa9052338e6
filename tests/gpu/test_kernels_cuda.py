"""Triton kernels on the GPU at real shapes, bf16: against the references, under CUDA-graph replay, and inside a
model (Triton path vs `use_reference()`)."""
import pytest
import torch

from brrr.kernels.activation import silu_and_mul, silu_and_mul_ref
from brrr.kernels.attention import (AttnMeta, attention, attention_ref, decode_attention_triton,
                                    prefill_attention_triton)
from brrr.kernels.dispatch import use_reference
from brrr.kernels.rms_norm import add_rms_norm, add_rms_norm_ref, rms_norm, rms_norm_ref
from brrr.kernels.rotary import apply_rotary, apply_rotary_ref, rope_inv_freq, rotary_cos_sin
from brrr.config import RopeConfig
from tests.kernels.test_attention import clone_meta, make_step

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16


def within_ulps(got, want, ulps):
    """Same dtype and shape, |got - want| <= `ulps` bf16 ulps of want. The kernels round where torch rounds, so
    outputs differ only where an fp32 sum (RMSNorm) or exp (SiLU) lands on the other side of a rounding step,
    and such a step followed by the weight multiply can move the result by up to 2 ulps."""
    assert got.dtype == want.dtype and got.shape == want.shape
    err = (got.float() - want.float()).abs()
    assert (err <= ulps * 2**-7 * want.float().abs() + 1e-6).all(), f"max error {err.max().item()}"


def test_rms_norm_and_fused_add_at_8b_width():
    g = torch.Generator(device="cuda").manual_seed(0)
    x, res = (torch.randn(1000, 4096, device="cuda", generator=g).to(BF16) for _ in range(2))
    w = torch.randn(4096, device="cuda", generator=g).to(BF16)
    within_ulps(rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5), 2)
    normed, new_res = add_rms_norm(x, res, w, 1e-5)
    want_normed, want_res = add_rms_norm_ref(x, res, w, 1e-5)
    assert torch.equal(new_res, want_res)
    within_ulps(normed, want_normed, 2)


def test_rotary_llama3_scaling_bitwise():
    """Every product and the sum rounded as torch rounds them: the same bits."""
    rope = RopeConfig("llama3", 500000.0, {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                           "original_max_position_embeddings": 8192})
    positions = torch.randint(0, 100_000, (2000,), device="cuda")
    inv_freq, scale = rope_inv_freq(rope, 128, 131072)
    cos, sin = rotary_cos_sin(positions, inv_freq.cuda(), scale, BF16)
    q = torch.randn(2000, 32, 128, device="cuda").to(BF16)
    k = torch.randn(2000, 8, 128, device="cuda").to(BF16)
    want_q, want_k = apply_rotary_ref(q, k, cos, sin)
    got_q, got_k = apply_rotary(q, k, cos, sin)
    assert got_q.data_ptr() == q.data_ptr()  # the Triton path ran (in place)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


def test_silu_and_mul_8b_width():
    gate, up = (torch.randn(512, 14336, device="cuda").to(BF16) * 3 for _ in range(2))
    within_ulps(silu_and_mul(gate, up), silu_and_mul_ref(gate, up), 2)


@pytest.mark.parametrize("dim,heads,kv_heads", [(64, 16, 16), (128, 32, 8), (256, 8, 1)])
def test_decode_real_shapes(dim, heads, kv_heads):
    lens = [1, 16, 17, 1000, 4096, 333]
    q, k, v, meta = make_step([1] * len(lens), lens, heads, kv_heads, dim, 16, BF16, "cuda")
    want = attention_ref(q, k, v, clone_meta(meta), 0, dim**-0.5)
    got = attention(q, k, v, meta, 0, dim**-0.5)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dim", [64, 128, 256])
@pytest.mark.parametrize("window", [None, 300])
def test_mixed_prefill_and_decode_real_shapes(dim, window):
    """A new 1500-token prompt (autotuned path), a 700-token chunk over a 1000-token prefix, a prefix hit, and
    decodes, GQA 4."""
    q, k, v, meta = make_step([1500, 700, 1, 1, 37], [1500, 1700, 2049, 90, 37], 16, 4, dim, 16, BF16, "cuda")
    want = attention_ref(q, k, v, clone_meta(meta), 0, dim**-0.5, window)
    got = attention(q, k, v, meta, 0, dim**-0.5, window)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_cache_free_prefill_matches_sdpa():
    lens = [2048, 300, 1]
    n = sum(lens)
    q = torch.randn(n, 32, 128, device="cuda").to(BF16)
    k, v = (torch.randn(n, 8, 128, device="cuda").to(BF16) for _ in range(2))
    meta = AttnMeta.causal(lens, "cuda")
    got = prefill_attention_triton(q, k, v, meta.cu_seqlens_q, max(lens), 128**-0.5)
    want = attention_ref(q, k, v, meta, 0, 128**-0.5)
    torch.testing.assert_close(got.view(n, -1).float(), want.float(), rtol=2e-2, atol=2e-2)


def test_decode_graph_replay_equals_eager():
    """Capture the decode kernel once (split-KV grid fixed by the context bound), then replay it over new block
    tables, contexts and queries: the replay equals an eager call on the same inputs."""
    batch, heads, kv_heads, dim, bs, max_blocks = 8, 32, 8, 128, 16, 64
    caches = [torch.randn(300, bs, kv_heads, dim, device="cuda").to(BF16) for _ in range(2)]
    q = torch.empty(batch, heads, dim, device="cuda", dtype=BF16)
    cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    ctx = torch.ones(batch, dtype=torch.int32, device="cuda")
    tables = torch.zeros(batch, max_blocks, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)

    def step():
        decode_attention_triton(q, *caches, cu, ctx, tables, dim**-0.5, max_context_len=max_blocks * bs, out=out)

    q.normal_()
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for trial in range(3):
        q.copy_(torch.randn_like(q))
        ctx.copy_(torch.randint(1, max_blocks * bs + 1, (batch,), device="cuda", dtype=torch.int32))
        tables.copy_(torch.randint(0, 300, (batch, max_blocks), device="cuda", dtype=torch.int32))
        graph.replay()
        replayed = out.clone()
        step()
        assert torch.equal(replayed, out)
        want = torch.empty(batch, heads * dim, device="cuda", dtype=BF16)
        for b in range(batch):  # the reference per sequence, reading the same cache
            n = ctx[b].item()
            blocks = tables[b, : -(-n // bs)].long()
            kb = caches[0][blocks].flatten(0, 1)[:n].repeat_interleave(heads // kv_heads, 1)
            vb = caches[1][blocks].flatten(0, 1)[:n].repeat_interleave(heads // kv_heads, 1)
            s = torch.einsum("hd,nhd->hn", q[b].float(), kb.float()) * dim**-0.5
            want[b] = torch.einsum("hn,nhd->hd", s.softmax(-1), vb.float()).reshape(-1).to(BF16)
        torch.testing.assert_close(replayed.view(batch, -1).float(), want.float(), rtol=2e-2, atol=2e-2)


def test_model_triton_path_matches_reference_path(tmp_path):
    """A tiny Llama in bf16 through the paged engine step shape: logits of the Triton path vs the references."""
    from brrr import forward_logits, load_model
    from tests import hf_models

    hf_models.save(hf_models.build("llama3-rope", hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=512), tmp_path)
    model = load_model(tmp_path, dtype=BF16, device="cuda")
    ids = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.inference_mode():
        fast = forward_logits(model, ids)
        with use_reference():
            slow = forward_logits(model, ids)
    assert (fast.argmax(-1) == slow.argmax(-1)).float().mean() > 0.97
    torch.testing.assert_close(fast, slow, rtol=0.05, atol=0.05 * slow.abs().max().item())
