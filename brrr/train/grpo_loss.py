"""The GRPO objective (Shao et al., DeepSeekMath) with TRL's GRPOTrainer names and normalizations.

A group is num_generations completions o_1..o_G of one prompt with rewards r_1..r_G (the weighted sum of the reward
functions). The advantage of every token of o_i is

    A_i = r_i - mean(r)                                         (scale_rewards "none": Dr. GRPO)
    A_i = (r_i - mean(r)) / (std(r) + 1e-4)                     ("group": std over the group; "batch": over all)

with std Bessel-corrected, as TRL's nanstd. Per token t of o_i, with the ratio rho = exp(logp - logp_old) to the
policy that sampled the batch (exactly 1, value and not gradient, on the first inner step):

    l_it = -min(rho A_i, clip(rho, 1 - epsilon, 1 + epsilon_high) A_i) + beta * rho * KL_it
    KL_it = exp(ref - logp) - (ref - logp) - 1                  (the k3 estimator of KL(pi || pi_ref), >= 0)

(rho times KL is TRL's use_bias_correction_kl: the unbiased reverse-KL gradient.) The loss aggregates l over the
completion tokens (mask) by loss_type:

    grpo     mean over sequences of (sum_t l_it / |o_i|)
    dr_grpo  sum_it l_it / (sequences x max_completion_length)
    dapo     sum_it l_it / (completion tokens of the whole step)  (num_items: every micro-batch of the step)

When the engine that sampled the tokens scores them differently from the trainer (logp_old here, logp_engine
there), each token's loss is multiplied by the truncated importance weight exp(logp_old - logp_engine) (per token,
or per sequence from the summed difference), capped at clip_max ("truncate") or zeroed outside [clip_min, clip_max]
("mask"), as TRL corrects vLLM's sampling.
"""
from __future__ import annotations

import math

import torch

from brrr.errors import BrrrError

LOSS_TYPES = ("grpo", "dr_grpo", "dapo")
SCALE_REWARDS = ("group", "batch", "none")
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Bessel-corrected standard deviation ignoring NaNs (NaN where fewer than two values)."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True) if dim is not None else (~torch.isnan(x)).sum()
    var = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    var = var * torch.where(count > 1, count / (count - 1).clamp(min=1), torch.full_like(var, math.nan))
    std = var.sqrt()
    return std.squeeze(dim) if dim is not None else std.reshape(())


def group_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group"
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages [N], std [N]) of rewards [N] laid out group by group (N = groups x num_generations). A NaN
    reward (every reward function returned None) is left out of its group's statistics and gets advantage 0."""
    if scale_rewards not in SCALE_REWARDS:
        raise BrrrError(f"--scale-rewards must be one of {', '.join(SCALE_REWARDS)}; got {scale_rewards!r}")
    if rewards.numel() % num_generations:
        raise BrrrError(f"{rewards.numel()} rewards do not split into groups of --num-generations {num_generations}")
    grouped = rewards.view(-1, num_generations)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)
    if scale_rewards == "batch":
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    else:  # "none" keeps the group std only to report groups whose rewards are all equal
        std = nanstd(grouped, dim=1).repeat_interleave(num_generations) if num_generations > 1 \
            else torch.zeros_like(rewards)
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0), std


def importance_weights(old_logps: torch.Tensor, sampling_logps: torch.Tensor, mask: torch.Tensor, mode: str,
                       clip_max: float | None, clip_min: float | None = None) -> torch.Tensor:
    """The truncated importance-sampling correction [B, T] (token modes) or [B, 1] (sequence modes) for tokens
    sampled by the engine (sampling_logps) and scored by the trainer (old_logps), both [B, T] with mask [B, T]."""
    if mode not in IS_MODES:
        raise BrrrError(f"--importance-sampling-mode must be one of {', '.join(IS_MODES)}; got {mode!r}")
    diff = torch.nan_to_num((old_logps - sampling_logps) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = diff.exp()
    if mode.endswith("truncate"):
        return ratio.clamp(min=clip_min, max=clip_max)
    low = clip_min if clip_min is not None else -math.inf
    high = clip_max if clip_max is not None else math.inf
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def grpo_loss(logps: torch.Tensor, old_logps: torch.Tensor | None, ref_logps: torch.Tensor | None,
              advantages: torch.Tensor, mask: torch.Tensor, *, loss_type: str = "dapo", beta: float = 0.0,
              epsilon: float = 0.2, epsilon_high: float | None = None, max_completion_length: int | None = None,
              num_items: float | None = None, is_weights: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss, metrics) of one micro-batch: the policy's per-token log-probs logps [B, T] (with gradients), the
    sampling policy's old_logps [B, T] (None: logps detached, the first inner step), the reference's ref_logps
    [B, T] (needed when beta != 0), advantages [B], mask [B, T] (1 on completion tokens). dr_grpo takes
    max_completion_length; dapo takes num_items, the step's completion tokens per micro-batch (all tokens of the
    step / grad_accum). is_weights: importance_weights' output."""
    if loss_type not in LOSS_TYPES:
        raise BrrrError(f"--loss-type must be one of {', '.join(LOSS_TYPES)}; got {loss_type!r}")
    mask = mask.to(logps.dtype)
    old = logps.detach() if old_logps is None else old_logps
    ratio = torch.exp(logps - old)
    high = epsilon if epsilon_high is None else epsilon_high
    clipped = ratio.clamp(1 - epsilon, 1 + high)
    adv = advantages[:, None]
    per_token = -torch.min(ratio * adv, clipped * adv)
    if is_weights is not None:
        per_token = per_token * is_weights
    kl = None
    if beta != 0.0:
        if ref_logps is None:
            raise BrrrError("--beta != 0 needs the reference's log-probs")
        kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        per_token = per_token + beta * kl * ratio
    if loss_type == "grpo":
        loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "dr_grpo":
        if max_completion_length is None:
            raise BrrrError("the dr_grpo loss divides by --max-completion-length: pass it")
        loss = (per_token * mask).sum() / (per_token.size(0) * max_completion_length)
    else:
        if num_items is None:
            raise BrrrError("the dapo loss divides by the step's completion tokens: pass num_items")
        loss = (per_token * mask).sum() / max(float(num_items), 1.0)
    with torch.no_grad():
        tokens = mask.sum().clamp(min=1.0)
        low_clip = ((ratio < 1 - epsilon) & (adv < 0)).to(mask.dtype)
        high_clip = ((ratio > 1 + high) & (adv > 0)).to(mask.dtype)
        metrics = {"clip_ratio/low_mean": (low_clip * mask).sum() / tokens,
                   "clip_ratio/high_mean": (high_clip * mask).sum() / tokens,
                   "clip_ratio/region_mean": ((low_clip + high_clip) * mask).sum() / tokens}
        if kl is not None:
            metrics["kl"] = (kl * mask).sum() / tokens
    return loss, metrics
