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
"""
from __future__ import annotations

import torch


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
    """The op the MoE blocks call; the reference everywhere (the routing is [T, E] elementwise work and a top-k, a
    few microseconds beside the expert GEMMs; the fused MoE kernel takes its output)."""
    return route_ref(logits, top_k, scoring, renormalize, n_group, topk_group, correction_bias, scaling_factor)
