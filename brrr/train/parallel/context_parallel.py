"""Context parallelism (--cp N): each sequence of a micro-batch split over N ranks, head-tail balanced (rank r
holds chunks r and 2N-1-r of 2N), attention run as a ring over them (ring_attention.py), every other op local
to the rank's tokens. The cp ranks of one data-parallel replica read the same rows; each keeps its own tokens.

RoPE rotates each token at its global position (the shard's positions are passed to the model as they are). The
loss is the mean over the full sequence: a rank's loss is (its summed token losses) x N / (the counted targets of
the whole micro-batch, which every rank holds), so FSDP's gradient average over the cp ranks (they are part of its
shard group) is the gradient of the full mean, and the loss averaged over them (ParallelStep.mean_loss) is the
full mean. Batches whose length 2N does not divide (short evaluation windows) are padded at the end with ignored
targets: a causal mask keeps padding out of every real token's attention.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from brrr.kernels import AttnMeta
from brrr.train.loss import IGNORE_INDEX, CausalLMLoss, lm_head_loss
from brrr.train.parallel.layout import Mesh
from brrr.train.parallel.ring_attention import Ring, ring_attention


def shard_positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """The global positions of rank `rank`'s tokens: chunk r then chunk 2N-1-r of 2N equal chunks."""
    c = seq_len // (2 * cp)
    head, tail = rank * c, (2 * cp - 1 - rank) * c
    return torch.cat([torch.arange(head, head + c, device=device), torch.arange(tail, tail + c, device=device)])


class ContextParallelLoss(nn.Module):
    """CausalLMLoss's interface ([B, T] inputs and targets -> mean next-token loss) over a cp group: this rank
    runs the model on its head-tail shard, attention through the ring."""

    def __init__(self, model: nn.Module, group):
        super().__init__()
        self.model, self.group = model, group
        self.cp, self.rank = dist.get_world_size(group), dist.get_rank(group)

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """reduction "mean": this rank's share of the full mean (see the module); "sum": this rank's summed token
        losses (the caller sums over the cp group)."""
        batch, length = inputs.shape
        pad = -length % (2 * self.cp)
        count = (targets != IGNORE_INDEX).sum()
        if pad:
            inputs, targets = F.pad(inputs, (0, pad)), F.pad(targets, (0, pad), value=IGNORE_INDEX)
        positions = shard_positions(length + pad, self.cp, self.rank, inputs.device)
        x, y = inputs[:, positions], targets[:, positions]
        chunk = (length + pad) // (2 * self.cp)
        meta = AttnMeta.causal([positions.numel()] * batch, inputs.device)
        meta.attend = lambda q, k, v, scale, window: ring_attention(q, k, v, scale, Ring(self.group, chunk, window),
                                                                    batch)
        hidden = self.model(x.reshape(-1), positions.repeat(batch), meta)
        total = lm_head_loss(self.model, hidden, y, reduction="sum")
        return total if reduction == "sum" else total * self.cp / count


def layout_loss(model: nn.Module, mesh: Mesh) -> nn.Module:
    """The next-token loss module of a layout: the ring's under --cp, else CausalLMLoss."""
    if mesh.layout.cp > 1:
        return ContextParallelLoss(model, mesh.get("cp").get_group())
    return CausalLMLoss(model)
