"""MoE ops: the routing rules' defining properties, and the grouped-GEMM dispatch against the per-expert loop."""
import pytest
import torch

from brrr.kernels.fused_moe import (align_by_expert, aligned_candidates, decode_plan, down_candidates, finish_decode,
                                    fused_moe_decode, fused_moe_plan, fused_moe_triton, gate_up_candidates,
                                    sum_in_expert_order)
from brrr.kernels.moe_experts import moe_experts_grouped_mm, moe_experts_ref
from brrr.kernels.moe_routing import route_ref, topk_softmax_triton


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


def _stacked(experts):
    return (torch.stack([torch.cat([g, u]) for g, u, _ in experts]), torch.stack([d for _, _, d in experts]))


def test_align_pads_each_experts_run_to_whole_blocks():
    ids = torch.tensor([[2, 0], [2, 1], [0, 2], [2, 3]])  # expert 0: 2 pairs, 1: 1, 2: 4, 3: 1, 4: none
    pairs, block_expert = align_by_expert(ids, 5, 4)
    assert block_expert.tolist()[:4] == [0, 1, 2, 3] and all(b == -1 for b in block_expert.tolist()[4:])
    runs = pairs.view(-1, 4).tolist()
    assert runs[0] == [1, 4, 8, 8] and runs[1] == [3, 8, 8, 8] and runs[2] == [0, 2, 5, 6] and runs[3] == [7, 8, 8, 8]


@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fused_moe_kernel_equals_the_reference(device, top_k, dtype):
    if device == "cpu" and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter multiplies bf16 bit patterns in tl.dot (triton-lang/triton#11584); "
                    "bf16 is checked on the GPU (tests/gpu/test_fused_moe_cuda.py)")
    gen = torch.Generator().manual_seed(10 + top_k)
    num, hidden, inter, tokens = 9, 64, 48, 21  # 48: a partial BLOCK_N tile
    experts = [tuple(t.to(device, dtype) for t in e) for e in _experts(num, hidden, inter, gen)]
    x = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
    logits = torch.randn(tokens, num, generator=gen) + torch.linspace(0, 4, num)  # uneven loads
    logits[:, 4] = -1e9  # an expert no token picks
    weights, ids = route_ref(logits, min(top_k, num - 1), renormalize=True)
    assert not (ids == 4).any()
    weights, ids = weights.to(device), ids.to(device)
    ref = moe_experts_ref(x, weights, ids, experts)
    w_gate_up, w_down = _stacked(experts)
    for block_m in (16, 32):
        plan = dict(fused_moe_plan(tokens, top_k, num, hidden, inter), BLOCK_M=block_m)
        got = fused_moe_triton(x, weights, ids, w_gate_up, w_down, plan)
        # half precision: the GEMMs' summation order moves the roundings of the intermediate activations
        tol = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}[dtype]
        torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_one_token_decode_path_equals_the_reference(device, top_k, dtype):
    # no tl.dot on this path, so bf16 runs under the interpreter too (which truncates fp32 -> bf16: within tol)
    gen = torch.Generator().manual_seed(20 + top_k)
    num, hidden, inter = 9, 96, 80  # neither a multiple of the tiles
    experts = [tuple(t.to(device, dtype) for t in e) for e in _experts(num, hidden, inter, gen)]
    x = torch.randn(1, hidden, generator=gen).to(device, dtype)
    weights, ids = route_ref(torch.randn(1, num, generator=gen), top_k, renormalize=True)
    assert top_k == 1 or not torch.equal(ids, ids.sort().values)  # the expert-order sum reorders the choices
    weights, ids = weights.to(device), ids.to(device)
    ref = moe_experts_ref(x, weights, ids, experts)
    w_gate_up, w_down = _stacked(experts)
    # down's K (80) in 3 splits of 32, the last one partial; the default plan does not split so small a layer
    plan = decode_plan(top_k, hidden, inter)
    split = dict(plan, down=dict(plan["down"], BLOCK_K=16, K_PER_SPLIT=32))
    tol = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}[dtype]
    for got in (fused_moe_triton(x, weights, ids, w_gate_up, w_down),
                fused_moe_decode(x, weights, ids, w_gate_up, w_down, split)):
        torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_finish_sums_in_expert_order_bit_for_bit(device, dtype):
    if device == "cpu" and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter truncates fp32 -> bf16 where the GPU rounds to nearest")
    # rows of very different sizes, so that half-precision sums in another order come out different
    gen = torch.Generator().manual_seed(30)
    splits, top_k, hidden = 3, 8, 40
    scale = 10.0 ** torch.randint(-3, 3, (1, top_k, 1), generator=gen)
    partial = torch.randn(splits, top_k, hidden, generator=gen) * scale
    weights = torch.rand(1, top_k, generator=gen)
    like = torch.empty(1, hidden, dtype=dtype)
    acc = partial[0]
    for s in range(1, splits):
        acc = acc + partial[s]
    rows = (acc.to(like.dtype).float() * weights[0, :, None]).to(like.dtype)
    distinct = torch.randperm(16, generator=gen)[:top_k][None]
    for ids in (distinct, torch.tensor([[3, 1, 3, 0, 1, 3, 2, 0]])):  # and ties, in choice order as a stable sort
        want = sum_in_expert_order(rows, ids, like)
        assert not torch.equal(want, rows.float().sum(0, keepdim=True).to(like.dtype))  # the order matters here
        got = finish_decode(partial.to(device), weights.to(device), ids.to(device), like.to(device))
        assert torch.equal(got.cpu(), want)


def test_decode_plan_fills_the_sms_at_the_real_shapes():
    def programs(top_k, hidden, inter, sms=132):
        p = decode_plan(top_k, hidden, inter, sms)
        gate_up, down = p["gate_up"], p["down"]
        splits = -(-inter // down["K_PER_SPLIT"])
        assert down["K_PER_SPLIT"] % down["BLOCK_K"] == 0 and (splits - 1) * down["K_PER_SPLIT"] < inter
        return top_k * -(-inter // gate_up["BLOCK_N"]), top_k * -(-hidden // down["BLOCK_N"]) * splits, splits

    for shape in ((2, 4096, 14336), (8, 2048, 768), (6, 2048, 1408)):  # Mixtral-8x7B, Qwen3-30B-A3B, DeepSeek-V2-Lite
        gate_up, down, splits = programs(*shape)
        assert gate_up >= 4 * 132 and down >= 4 * 132 and splits > 1
    assert programs(2, 4096, 14336, sms=16)[2] == 1  # a small GPU needs no split


def test_decode_candidates_lead_with_the_plan_and_every_one_runs(device):
    """The warm-up times these: each list starts with `decode_plan`'s config (what runs untuned), holds no
    duplicate, and every candidate gives the reference's output (a sample of them under the interpreter)."""
    gen = torch.Generator().manual_seed(40)
    num, hidden, inter, top_k = 6, 128, 96, 2
    gate_up = gate_up_candidates(top_k, hidden, inter, sms=4)
    down = down_candidates(top_k, hidden, inter, sms=4)
    rule = decode_plan(top_k, hidden, inter, sms=4)
    assert gate_up[0] == rule["gate_up"] and down[0] == rule["down"] and len(gate_up) > 4 and len(down) > 4
    assert all(c not in gate_up[:i] for i, c in enumerate(gate_up)) and all(c not in down[:i] for i, c in enumerate(down))
    experts = [tuple(t.to(device) for t in e) for e in _experts(num, hidden, inter, gen)]
    x = torch.randn(1, hidden, generator=gen).to(device)
    weights, ids = (t.to(device) for t in route_ref(torch.randn(1, num, generator=gen), top_k, renormalize=True))
    ref = moe_experts_ref(x, weights, ids, experts)
    w_gate_up, w_down = _stacked(experts)
    for g, d in zip(gate_up[::5], down[::3]):
        got = fused_moe_decode(x, weights, ids, w_gate_up, w_down, {"gate_up": g, "down": d})
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("experts, top_k", [(8, 1), (8, 2), (60, 6), (128, 8)])
@pytest.mark.parametrize("renormalize", [False, True])
def test_topk_kernel_equals_the_softmax_rule(device, experts, top_k, renormalize):
    """The Triton selection after torch's softmax gives route_ref's experts in its order (descending p) and its
    weights (the renormalizing sum may add in another order: within an ulp or two)."""
    gen = torch.Generator().manual_seed(experts + top_k)
    logits = torch.randn(5, experts, generator=gen)
    want_w, want_ids = route_ref(logits, top_k, renormalize=renormalize, scaling_factor=2.5)
    got_w, got_ids = topk_softmax_triton(logits.to(device).softmax(dim=-1), top_k, renormalize, 2.5)
    assert torch.equal(got_ids.cpu(), want_ids)
    torch.testing.assert_close(got_w.cpu(), want_w, atol=1e-6, rtol=1e-6)


def test_topk_kernel_takes_the_lowest_index_among_equal_scores(device):
    probs = torch.tensor([[0.1, 0.3, 0.2, 0.3, 0.1], [0.2, 0.2, 0.2, 0.2, 0.2]], device=device)
    weights, ids = topk_softmax_triton(probs, 3)
    assert ids.cpu().tolist() == [[1, 3, 2], [0, 1, 2]]
    torch.testing.assert_close(weights.cpu(), probs.cpu().gather(1, ids.cpu()))


@pytest.mark.parametrize("tokens", [5, 40])
def test_aligned_candidates_lead_with_the_plan_and_every_one_runs(device, tokens):
    """The warm-up times these for the aligned kernels: led by `fused_moe_plan`'s config, no BLOCK_M past twice the
    mean rows per expert, no duplicate; every candidate gives the reference's output (a sample, interpreter)."""
    gen = torch.Generator().manual_seed(50 + tokens)
    num, hidden, inter, top_k = 6, 64, 96, 2
    configs = aligned_candidates(tokens, top_k, num, hidden, inter)
    assert configs[0] == fused_moe_plan(tokens, top_k, num, hidden, inter) and len(configs) > 8
    assert all(c not in configs[:i] for i, c in enumerate(configs))
    assert max(c["BLOCK_M"] for c in configs) <= max(16, 2 * tokens * top_k / num)
    experts = [tuple(t.to(device) for t in e) for e in _experts(num, hidden, inter, gen)]
    x = torch.randn(tokens, hidden, generator=gen).to(device)
    weights, ids = (t.to(device) for t in route_ref(torch.randn(tokens, num, generator=gen), top_k, renormalize=True))
    ref = moe_experts_ref(x, weights, ids, experts)
    w_gate_up, w_down = _stacked(experts)
    for cfg in configs[::7]:
        torch.testing.assert_close(fused_moe_triton(x, weights, ids, w_gate_up, w_down, cfg), ref, atol=1e-5, rtol=1e-5)


def test_tuning_times_an_even_routing():
    # what the aligned kernels' tiles are tuned on: each token's experts distinct, every expert's load within one
    from brrr.kernels.fused_moe import even_routing

    for tokens, k, e in ((64, 8, 128), (7, 2, 8), (300, 6, 64), (3, 4, 4)):
        ids = even_routing(tokens, k, e, torch.zeros(1, dtype=torch.int32))
        assert ids.shape == (tokens, k) and ids.dtype == torch.int32
        assert all(len(set(row)) == k for row in ids.tolist())
        counts = torch.bincount(ids.flatten().long(), minlength=e)
        assert counts.max() - counts.min() <= 1
