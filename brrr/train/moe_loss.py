"""Training mixture-of-experts models: the router losses and the per-expert token counts.

- Load balancing (Switch Transformer eqs. 4-6, Mixtral's `router_aux_loss_coef`): over all MoE layers' routed
  tokens, f_e = the fraction of (token, choice) assignments that went to expert e (each token's top-k of the
  softmax), P_e = the mean router probability of e; loss = E * sum_e f_e P_e, 1 x top_k when perfectly balanced.
  f is a count (no gradient); the gradient flows through P. Computed as transformers' load_balancing_loss_func.
- Router z-loss (ST-MoE): mean over routed tokens of logsumexp(logits)^2, keeping router logits small
  (transformers' Switch Transformers `router_z_loss_func`).
- Counts: tokens each expert of each MoE layer received, summed between log lines (the expert-utilization plot).
- Auxiliary-loss-free balancing (DeepSeek-V3, sec. 2.1.2; `--moe-bias-update-speed` gamma): after each optimizer
  step, each router's e_score_correction_bias (which only picks experts) moves by
  gamma * sign(mean load - load_e), load_e = the (token, choice) pairs routed to e over the step's micro-batches,
  summed over the data-parallel ranks first so every rank applies the same update.

The router logits come from forward hooks on the routers (what transformers' OutputRecorder does), so the model
keeps no training state and its forward is the same in training and serving.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from brrr.config import ModelConfig
from brrr.kernels.moe_routing import route
from brrr.models.moe import Router


@torch.no_grad()
def balance_bias(bias: torch.Tensor, loads: torch.Tensor, speed: float) -> None:
    """DeepSeek-V3's bias update, in place: bias_e += speed * sign(mean(loads) - loads_e); loads [E] this step's
    routed (token, choice) pairs per expert. Overloaded experts get picked less, idle ones more."""
    loads = loads.float()
    bias += (speed * torch.sign(loads.mean() - loads)).to(bias.dtype)


def load_balancing_loss(router_logits: list[torch.Tensor], num_experts: int, top_k: int) -> torch.Tensor:
    """router_logits: each MoE layer's [tokens, E] -> the scalar auxiliary loss (unweighted)."""
    assignments = torch.zeros(num_experts, device=router_logits[0].device)
    prob_sum = torch.zeros(num_experts, device=router_logits[0].device)
    rows = 0
    for logits in router_logits:
        probs = F.softmax(logits.float(), dim=-1)
        chosen = torch.topk(probs, top_k, dim=-1).indices.flatten()
        assignments = assignments + torch.zeros_like(assignments).scatter_add_(0, chosen, torch.ones_like(chosen,
                                                                                                       dtype=torch.float))
        prob_sum = prob_sum + probs.sum(dim=0)
        rows += logits.shape[0]
    return torch.sum((assignments / rows) * (prob_sum / rows)) * num_experts


def router_z_loss(router_logits: list[torch.Tensor]) -> torch.Tensor:
    logits = torch.cat([t.float() for t in router_logits])
    return torch.logsumexp(logits, dim=-1).square().mean()


class RouterRecorder:
    """Collects every router's logits of a forward, in layer order."""

    def __init__(self, model: nn.Module):
        self.logits: list[torch.Tensor] = []
        self.routers = [m for m in model.modules() if isinstance(m, Router)]
        self.handles = [r.register_forward_hook(self._record) for r in self.routers]

    def _record(self, module, args, out):
        self.logits.append(out)

    def take(self) -> list[torch.Tensor]:
        out, self.logits = self.logits, []
        return out

    def remove(self):
        for h in self.handles:
            h.remove()


class MoELoss(nn.Module):
    """`loss` (a mean next-token loss module) plus aux_coef x load balancing plus z_coef x router z-loss; keeps the
    per-expert token counts. With reduction other than "mean" (evaluation's sums) it is the plain next-token loss."""

    def __init__(self, loss: nn.Module, model: nn.Module, cfg: ModelConfig, aux_coef: float, z_coef: float,
                 bias_update_speed: float = 0.0):
        super().__init__()
        self.loss, self.cfg, self.aux_coef, self.z_coef = loss, cfg, aux_coef, z_coef
        self.bias_update_speed = bias_update_speed
        self.recorder = RouterRecorder(model)
        self.counts = torch.zeros(len(self.recorder.routers), cfg.num_experts, dtype=torch.long)
        self.step_loads = None  # [MoE layers, E] on the device: this optimizer step's loads, for balance_step

    def meta(self, *args):
        return self.loss.meta(*args)

    def forward(self, inputs, targets, reduction: str = "mean"):
        self.recorder.take()
        loss = self.loss(inputs, targets, reduction)
        logits = self.recorder.take()
        if reduction != "mean" or not logits:
            return loss
        with torch.no_grad():  # the experts each token went to (the router's own rule)
            loads = torch.stack([self._loads(layer, lg) for layer, lg in enumerate(logits)])
            self.step_loads = loads if self.step_loads is None else self.step_loads + loads
            self.counts += loads.cpu()
        if self.aux_coef:
            loss = loss + self.aux_coef * load_balancing_loss(logits, self.cfg.num_experts, self.cfg.num_experts_per_tok)
        if self.z_coef:
            loss = loss + self.z_coef * router_z_loss(logits)
        return loss

    def _loads(self, layer: int, logits: torch.Tensor) -> torch.Tensor:
        """[E] int64: the (token, choice) pairs of this micro-batch routed to each expert of MoE layer `layer`
        (scatter_add: bincount would read its maximum back to the host)."""
        cfg, router = self.cfg, self.recorder.routers[layer]
        chosen = route(logits, cfg.num_experts_per_tok, cfg.router_scoring, False, cfg.n_group, cfg.topk_group,
                       router.e_score_correction_bias)[1].flatten()
        return torch.zeros(cfg.num_experts, dtype=torch.long, device=chosen.device).scatter_add_(
            0, chosen, torch.ones_like(chosen))

    def balance_step(self, group=None) -> None:
        """After an optimizer step: with a bias update speed, every balancing bias moves by `balance_bias` from the
        step's loads (all-reduced over `group` first: the data-parallel ranks'); the step's loads reset."""
        loads, self.step_loads = self.step_loads, None
        if not self.bias_update_speed or loads is None:
            return
        if group is not None:
            dist.all_reduce(loads, group=group)
        for router, layer_loads in zip(self.recorder.routers, loads):
            if router.e_score_correction_bias is not None:
                balance_bias(router.e_score_correction_bias, layer_loads, self.bias_update_speed)

    def take_counts(self) -> list[list[int]]:
        """Tokens per expert per MoE layer since the last call."""
        out = self.counts.tolist()
        self.counts.zero_()
        return out
