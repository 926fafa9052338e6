"""MoE ops: the routing rules' defining properties, and the grouped-GEMM dispatch against the per-expert loop."""
import pytest
import torch

from brrr.kernels.moe_experts import moe_experts_grouped_mm, moe_experts_ref
from brrr.kernels.moe_routing import route_ref


def test_softmax_topk_renormalized_and_not():
    logits = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
    w, ids = route_ref(logits, 2)
    p = logits.softmax(-1)
    assert torch.equal(w, p.gather(1, ids)) and torch.equal(ids, p.topk(2).indices)
    w_norm, _ = route_ref(logits, 2, renormalize=True, scaling_factor=2.5)
    torch.testing.assert_close(w_norm.sum(-1), torch.full((16,), 2.5))


@pytest.mark.parametrize("scoring", ["softmax_group_limited", "sigmoid_grouped"])
def test_grouped_routers_only_pick_experts_of_the_best_groups(scoring):
    logits = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(16, generator=torch.Generator().manual_seed(2)) if scoring == "sigmoid_grouped" else None
    w, ids = route_ref(logits, 3, scoring, renormalize=scoring == "sigmoid_grouped", n_group=4, topk_group=2,
                       correction_bias=bias)
    groups = ids // 4  # 16 experts in 4 groups of 4
    assert all(len(set(g.tolist())) <= 2 for g in groups)
    if scoring == "sigmoid_grouped":  # the bias steers the choice; the weights are the unbiased scores, renormalized
        s = logits.sigmoid().gather(1, ids)
        torch.testing.assert_close(w, s / s.sum(-1, keepdim=True))
        choice = logits.sigmoid() + bias
        group_score = choice.view(64, 4, 4).topk(2, -1).values.sum(-1)
        best = group_score.topk(2, -1).indices
        assert all(set(g.tolist()) <= set(b.tolist()) for g, b in zip(groups, best))
    else:
        p = logits.softmax(-1)
        torch.testing.assert_close(w, p.gather(1, ids))


def _experts(num, hidden, inter, gen):
    return [tuple(torch.randn(shape, generator=gen) * 0.1 for shape in ((inter, hidden), (inter, hidden), (hidden, inter)))
            for _ in range(num)]


@pytest.mark.parametrize("top_k", [1, 2, 8])
def test_grouped_mm_dispatch_equals_the_expert_loop(top_k):
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no torch._grouped_mm")
    gen = torch.Generator().manual_seed(top_k)
    num, hidden, inter, tokens = 8, 64, 32, 37
    experts = _experts(num, hidden, inter, gen)
    x = torch.randn(tokens, hidden, generator=gen)
    # uneven loads and one expert (3) that no token picks: route over 7 experts, skipping 3
    logits = torch.randn(tokens, num, generator=gen) + torch.linspace(0, 3, num)
    logits[:, 3] = -1e9
    weights, ids = route_ref(logits, min(top_k, num - 1), renormalize=True)
    if top_k == 8:  # every expert but the empty one, and a load as uneven as it gets
        weights, ids = route_ref(logits, 7)
    assert not (ids == 3).any() and torch.bincount(ids.flatten(), minlength=num).unique().numel() > 1
    ref = moe_experts_ref(x, weights, ids, experts)
    w_gate_up = torch.stack([torch.cat([g, u]) for g, u, _ in experts])
    w_down = torch.stack([d for _, _, d in experts])
    got = moe_experts_grouped_mm(x, weights, ids, w_gate_up, w_down)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert moe_experts_ref(x[:0], weights[:0], ids[:0], experts).shape == (0, hidden)
