"""The fused MoE kernel on the GPU, bf16, at Mixtral-8x7B's layer shape and fine-grained (DeepSeek-, Qwen3-style) ones:
against the per-expert loop and torch._grouped_mm, and replayed from a CUDA graph. One token takes the decode path
(GEMVs, no alignment), checked against the aligned kernels too."""
import pytest
import torch

from brrr.kernels.fused_moe import fused_moe_plan, fused_moe_triton
from brrr.kernels.moe_experts import grouped_mm_ok, moe_experts, moe_experts_grouped_mm, moe_experts_ref
from brrr.kernels.moe_routing import route_ref

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("experts, top_k, hidden, inter, tokens", [
    (8, 2, 4096, 14336, 1), (8, 2, 4096, 14336, 64), (8, 2, 4096, 14336, 300),
    (64, 6, 2048, 1408, 1), (64, 6, 2048, 1408, 513), (128, 8, 2048, 768, 1), (128, 8, 2048, 768, 33)])
def test_fused_moe_equals_the_loop_and_grouped_mm(experts, top_k, hidden, inter, tokens):
    g = torch.Generator(device="cuda").manual_seed(0)
    w_gate_up = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=g) * 0.02).bfloat16()
    w_down = (torch.randn(experts, hidden, inter, device="cuda", generator=g) * 0.02).bfloat16()
    x = torch.randn(tokens, hidden, device="cuda", generator=g).bfloat16()
    logits = torch.randn(tokens, experts, device="cuda", generator=g) + torch.linspace(0, 3, experts, device="cuda")
    logits[:, 1] = -1e9  # an empty expert
    weights, ids = route_ref(logits, top_k, renormalize=True)
    ref = moe_experts_ref(x, weights, ids, [(w[:inter], w[inter:], d) for w, d in zip(w_gate_up, w_down)])
    got = fused_moe_triton(x, weights, ids, w_gate_up, w_down)
    scale = ref.float().abs().max().item()
    assert (got.float() - ref.float()).abs().max().item() <= 2e-2 * scale
    if tokens == 1:  # the decode path; an explicit plan takes the aligned kernels
        aligned = fused_moe_triton(x, weights, ids, w_gate_up, w_down, fused_moe_plan(1, top_k, experts, hidden, inter))
        assert (got.float() - aligned.float()).abs().max().item() <= 2e-2 * scale
    if grouped_mm_ok(x, w_gate_up, w_down):
        gm = moe_experts_grouped_mm(x, weights, ids, w_gate_up, w_down)
        assert (gm.float() - ref.float()).abs().max().item() <= 2e-2 * scale


@pytest.mark.parametrize("t", [1, 4])  # the decode path and the aligned one
def test_fused_moe_replays_from_a_cuda_graph(t):
    g = torch.Generator(device="cuda").manual_seed(1)
    e, k, h, i = 8, 2, 1024, 2048
    w_gate_up = (torch.randn(e, 2 * i, h, device="cuda", generator=g) * 0.02).bfloat16()
    w_down = (torch.randn(e, h, i, device="cuda", generator=g) * 0.02).bfloat16()
    x = torch.randn(t, h, device="cuda", generator=g).bfloat16()
    logits = torch.randn(t, e, device="cuda", generator=g)

    def step():
        weights, ids = route_ref(logits, k, renormalize=True)
        return moe_experts(x, weights, ids, w_gate_up, w_down)
    want = step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    logits.copy_(torch.randn(t, e, device="cuda", generator=g))  # new routing, same graph
    graph.replay()
    assert not torch.equal(out, want)
    torch.testing.assert_close(out, step(), atol=0, rtol=0)
