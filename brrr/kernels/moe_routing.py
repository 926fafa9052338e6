"""MoE routing: a router's logits [tokens, experts] -> each token's top-k experts and their weights.

Three rules cover the open MoE checkpoints (`ModelConfig.router_scoring`):
- softmax: p = softmax(logits) in fp32, the top-k of p, optionally renormalized to sum to 1 (Mixtral always,
  Qwen-MoE when norm_topk_prob, DeepSeek-V2's "greedy" never).
- softmax_group_limited (DeepSeek-V2): experts form n_group groups; a group scores its best expert's p; a token keeps
  the topk_group best groups and takes the top-k of p among their experts.
- sigmoid_grouped (DeepSeek-V3's "noaux_tc"): s = sigmoid(logits); the choice uses s + e_score_correction_bias (the
  bias-based balancing: the trainer nudges it, the gradient never sees it), a group scores the sum of its best two,
  and the weights are the unbiased s of the chosen experts, renormalized when norm_topk_prob.
DeepSeek then multiplies the weights by routed_scaling_factor. Weights come back in fp32, ids in int64; the order
of a token's k choices is not meaningful (the expert computation sums them in expert order).

On CUDA the softmax rule's selection runs as one Triton kernel (`topk_softmax_triton`: the top-k of each row of p,
the renormalization and the scaling), after torch's softmax: torch.topk, its sort of the k values, the sum and the
division were five launches, ~12 us a layer of a batch-1 decode step (48 layers in Qwen3-30B-A3B).
"""
from __future__ import annotations

import torch

from brrr.kernels.dispatch import next_power_of_2, use_triton


def route_ref(logits: torch.Tensor, top_k: int, scoring: str = "softmax", renormalize: bool = False,
              n_group: int = 1, topk_group: int = 1, correction_bias: torch.Tensor | None = None,
              scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k] fp32, expert ids [T, k] int64), the plain-torch form of each rule."""
    logits = logits.float()
    if scoring == "softmax":
        weights, ids = torch.topk(logits.softmax(dim=-1), top_k, dim=-1)
    elif scoring == "softmax_group_limited":
        scores = logits.softmax(dim=-1)
        group_scores = scores.view(scores.shape[0], n_group, -1).max(dim=-1).values
        keep = _group_mask(group_scores, topk_group, scores.shape[-1])
        weights, ids = torch.topk(scores.masked_fill(~keep, 0.0), top_k, dim=-1, sorted=False)
    elif scoring == "sigmoid_grouped":
        scores = logits.sigmoid()
        choice = scores if correction_bias is None else scores + correction_bias.float()
        group_scores = choice.view(choice.shape[0], n_group, -1).topk(2, dim=-1)[0].sum(dim=-1)
        keep = _group_mask(group_scores, topk_group, choice.shape[-1])
        ids = torch.topk(choice.masked_fill(~keep, float("-inf")), top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if renormalize:  # DeepSeek-V3 adds 1e-20 so an all-zero row stays finite
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * scaling_factor, ids
    else:
        raise ValueError(f"unknown router scoring {scoring!r}")
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if scaling_factor != 1.0:
        weights = weights * scaling_factor
    return weights, ids


def _group_mask(group_scores: torch.Tensor, topk_group: int, num_experts: int) -> torch.Tensor:
    """[T, n_group] group scores -> [T, E] bool: the experts of each token's topk_group best groups."""
    best = torch.topk(group_scores, topk_group, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return mask.repeat_interleave(num_experts // group_scores.shape[1], dim=1)


def route(logits, top_k, scoring="softmax", renormalize=False, n_group=1, topk_group=1, correction_bias=None,
          scaling_factor=1.0):
    """The op the MoE blocks call: the softmax rule's selection in Triton on CUDA (up to 1,024 experts), the
    reference otherwise (the grouped rules, CPU, training)."""
    if scoring == "softmax" and use_triton(logits) and top_k <= logits.shape[-1] <= 1024:
        return topk_softmax_triton(logits.float().softmax(dim=-1), top_k, renormalize, scaling_factor)
    return route_ref(logits, top_k, scoring, renormalize, n_group, topk_group, correction_bias, scaling_factor)


try:
    import triton
    import triton.language as tl
except Exception:
    triton = None

if triton is not None:

    @triton.jit
    def _topk_kernel(P, W, IDS, num_experts, stride_p, scale, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                     BLOCK_E: tl.constexpr, RENORMALIZE: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        e = tl.arange(0, BLOCK_E)
        p = tl.load(P + row * stride_p + e, mask=e < num_experts, other=float("-inf"))
        slot = tl.arange(0, K_PAD)
        values = tl.zeros((K_PAD,), dtype=tl.float32)
        ids = tl.zeros((K_PAD,), dtype=tl.int64)
        for j in tl.static_range(TOP_K):  # the best left, the lowest index among equals, then masked out
            best = tl.max(p, axis=0)
            pick = tl.min(tl.where(p == best, e, BLOCK_E), axis=0)
            values = tl.where(slot == j, best, values)
            ids = tl.where(slot == j, pick.to(tl.int64), ids)
            p = tl.where(e == pick, float("-inf"), p)
        if RENORMALIZE:
            values = values / tl.sum(tl.where(slot < TOP_K, values, 0.0), axis=0)
        values = values * scale
        tl.store(W + row * TOP_K + slot, values, mask=slot < TOP_K)
        tl.store(IDS + row * TOP_K + slot, ids, mask=slot < TOP_K)


def topk_softmax_triton(probs: torch.Tensor, top_k: int, renormalize: bool = False, scaling_factor: float = 1.0
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """probs [T, E] fp32 (a softmax's output) -> (weights [T, k] fp32, ids [T, k] int64) as `route_ref`'s softmax
    rule: the k largest in descending order, renormalized to sum to 1 when asked, times scaling_factor. One program
    per token, k passes of a max over the row."""
    tokens, experts = probs.shape
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=probs.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=probs.device)
    if tokens:
        _topk_kernel[(tokens,)](probs, weights, ids, experts, probs.stride(0), float(scaling_factor), TOP_K=top_k,
                                K_PAD=next_power_of_2(top_k), BLOCK_E=next_power_of_2(experts),
                                RENORMALIZE=renormalize, num_warps=1 if experts <= 256 else 4)
    return weights, ids
