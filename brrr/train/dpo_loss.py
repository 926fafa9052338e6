"""The DPO objective over sequence log-probabilities (Rafailov et al.; IPO: Azar et al.), with TRL's names.

For a pair (prompt x, chosen y_w, rejected y_l), with log pi(y|x) the sum of the completion's token log-probs:

    h = (log pi(y_w|x) - log pi_ref(y_w|x)) - (log pi(y_l|x) - log pi_ref(y_l|x))

    sigmoid  -log sigmoid(beta * h)                        (DPO)
    hinge    max(0, 1 - beta * h)                          (SLiC)
    ipo      (h_w / |y_w| - h_l / |y_l| - 1 / (2 beta))^2   (IPO, each log-ratio averaged over its tokens, as TRL)

The loss is the mean over pairs. The implicit rewards are beta times each log-ratio: rewards/chosen,
rewards/rejected, their difference rewards/margins, and rewards/accuracies the share of pairs whose chosen reward
is the larger.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from brrr.errors import BrrrError

LOSS_TYPES = ("sigmoid", "ipo", "hinge")


def dpo_loss(chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor,
             beta: float, loss_type: str = "sigmoid", chosen_tokens: torch.Tensor | None = None,
             rejected_tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(mean loss, metrics) over B pairs: the policy's and the reference's sequence log-probs [B] each; ipo also
    takes each completion's token count [B]. Metrics are per pair, detached."""
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * (chosen_ratio - rejected_ratio))
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * (chosen_ratio - rejected_ratio))
    elif loss_type == "ipo":
        if chosen_tokens is None or rejected_tokens is None:
            raise BrrrError("the ipo loss averages each log-ratio over its completion's tokens: pass their counts")
        delta = chosen_ratio / chosen_tokens.clamp(min=1) - rejected_ratio / rejected_tokens.clamp(min=1)
        losses = (delta - 1 / (2 * beta)) ** 2
    else:
        raise BrrrError(f"--loss-type must be one of {', '.join(LOSS_TYPES)}; got {loss_type!r}")
    chosen_rewards, rejected_rewards = beta * chosen_ratio.detach(), beta * rejected_ratio.detach()
    metrics = {"rewards/chosen": chosen_rewards, "rewards/rejected": rejected_rewards,
               "rewards/margins": chosen_rewards - rejected_rewards,
               "rewards/accuracies": (chosen_rewards > rejected_rewards).float(),
               "logps/chosen": chosen.detach(), "logps/rejected": rejected.detach()}
    return losses.mean(), metrics
