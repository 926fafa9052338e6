"""Expert parallelism for training: each of the N ranks of a process group holds E/N of every MoE layer's experts
and its own micro-batch; tokens travel to the rank of each expert they chose and back (all-to-all dispatch and
combine, through torch.distributed on any backend, gloo on CPU).

Per MoE layer and micro-batch, on every rank:
1. route the local tokens (the router is replicated); each (token, choice) pair's destination is the rank that
   holds its expert, e // (E / N);
2. exchange the pair counts (one small all-to-all), then the pairs' inputs and routing weights, sorted by
   destination (an all-to-all with those splits; autograd carries the gradients back the same way);
3. run the received pairs through the local experts (dropless: every pair an expert got is computed);
4. send the weighted outputs home and sum each token's k outputs in expert order, as the one-process block does.
The local experts keep their global indices (`experts` is a LocalExperts, a ModuleDict keyed "0".."E-1" with this
rank's keys), so parameter names match the full model's. Their computation is LocalExperts' forward, so FSDP's hooks
on that module gather its weights before it and reduce its gradients after; it runs every local expert, those that
got no pair on zero rows, so every expert has a gradient (zero when idle) and the reduce-scatter over the ranks
holding it carries the same tensors on each.

Gradients: every rank's loss is the mean over its own tokens and the objective is the mean over ranks, so the
replicated parameters' gradients are averaged over the group and the experts' (which already hold every rank's
tokens' contributions, through the all-to-all's backward) divided by N: `sync_expert_parallel_grads` on a plain
process group. Under `brrr train --ep` (the mesh's ep dimension) FSDP does both: `shard_experts`.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd

from brrr.errors import BrrrError
from brrr.kernels.activation import silu_and_mul
from brrr.kernels.fused_moe import sum_in_expert_order
from brrr.models.moe import SparseMoeBlock
from brrr.train.parallel.layout import Mesh


class LocalExperts(nn.ModuleDict):
    """This rank's experts under their global indices, and the computation of the pairs they received."""

    def forward(self, x: torch.Tensor, expert: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x [P, H] the received pairs' inputs, expert [P] their experts, weight [P] their routing weights -> the
        weighted outputs [P, H]."""
        out = x.new_zeros(x.shape)
        for key, mlp in self.items():  # every local expert, an idle one on zero rows (see the module)
            rows = torch.where(expert == int(key))[0]
            gate, up, down = mlp.projections()
            h = x[rows]
            y = down(silu_and_mul(gate(h), up(h)))
            out = out.index_add(0, rows, (y * weight[rows, None]).to(x.dtype))
        return out


class ExpertParallelMoE(nn.Module):
    def __init__(self, block: SparseMoeBlock, group: dist.ProcessGroup):
        super().__init__()
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        num = len(block.experts)
        if num % world:
            raise BrrrError(f"expert parallelism over {world} ranks needs the experts ({num}) to divide evenly")
        self.group, self.world, self.local = group, world, num // world
        self.first = rank * self.local
        # the block's router and shared experts under the same names as in the block (so parameter names match
        # the one-process model's); the block itself is kept unregistered, for its route / add_shared
        object.__setattr__(self, "block", block)
        self.gate, self.shared_expert, self.shared_expert_gate = block.gate, block.shared_expert, block.shared_expert_gate
        self.shared_experts = block.shared_experts
        self.experts = LocalExperts({str(e): block.experts[e] for e in range(self.first, self.first + self.local)})
        block.experts = None  # the other ranks' experts are not held here

    def forward(self, x):
        block, k = self.block, self.block.top_k
        weights, ids = block.route(x)
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)  # by expert, hence by destination rank
        send = torch.bincount(flat // self.local, minlength=self.world)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        send_sizes, recv_sizes = send.tolist(), recv.tolist()
        pair_x = x[order // k]
        pair_w = weights.flatten()[order]
        got_x = all_to_all_single_autograd(pair_x, recv_sizes, send_sizes, self.group)
        got_w = all_to_all_single_autograd(pair_w, recv_sizes, send_sizes, self.group)
        got_e = torch.empty(sum(recv_sizes), dtype=flat.dtype, device=flat.device)
        dist.all_to_all_single(got_e, flat[order].contiguous(), recv_sizes, send_sizes, group=self.group)
        out = self.experts(got_x, got_e, got_w)
        back = all_to_all_single_autograd(out, send_sizes, recv_sizes, self.group)
        per_pair = back.new_zeros(back.shape).index_add(0, order, back)  # (token, choice) order again
        return block.add_shared(x, sum_in_expert_order(per_pair, ids, x))


def apply_expert_parallel(model: nn.Module, group: dist.ProcessGroup) -> nn.Module:
    """Every MoE block of `model` (in place) keeps this rank's share of the experts and dispatches all-to-all."""
    layers = model.model.layers
    found = False
    for layer in layers:
        if type(layer.mlp) is SparseMoeBlock:
            layer.mlp = ExpertParallelMoE(layer.mlp, group)
            found = True
    if not found:
        raise BrrrError("expert parallelism: the model has no MoE layers")
    return model


@torch.no_grad()
def sync_expert_parallel_grads(model: nn.Module, group: dist.ProcessGroup) -> None:
    """After backward: replicated parameters' gradients averaged over the group, the local experts' divided by
    the group size (each rank's loss is a mean over its own tokens; the objective the mean over ranks)."""
    world = dist.get_world_size(group)
    experts = {id(p) for m in model.modules() if isinstance(m, ExpertParallelMoE) for p in m.experts.parameters()}
    for p in model.parameters():
        if p.grad is None:
            continue
        if id(p) in experts:
            p.grad.div_(world)
        else:
            dist.all_reduce(p.grad, group=group)
            p.grad.div_(world)


def shard_experts(layers, mesh: Mesh, mp_policy, reshard_after_forward: bool):
    """fully_shard each MoE layer's local experts over the ranks holding the same ones (mesh.expert_mesh: one
    ep coordinate's dp_replicate x dp_shard), before the layer itself is sharded over all data-parallel ranks.
    Their gradients are divided by every data-parallel rank (dp_replicate x dp_shard x ep), not only by those they
    are reduced over: each already sums the tokens of all ep ranks (the all-to-all's backward)."""
    from torch.distributed.fsdp import fully_shard  # a distributed run's import: one process never loads FSDP

    for layer in layers:
        if not isinstance(layer.mlp, ExpertParallelMoE):
            continue
        experts = fully_shard(layer.mlp.experts, mesh=mesh.expert_mesh, mp_policy=mp_policy,
                              reshard_after_forward=reshard_after_forward)
        experts.set_gradient_divide_factor(float(mesh.dp_world))
        if mesh.layout.dp_shard > 1:
            # sum over the shard group, then divide: a divide factor other than the group's size is NCCL's
            # PREMUL_SUM otherwise, which gloo has not (with one shard rank FSDP divides without a collective,
            # and forcing the sum there would divide twice)
            experts.set_force_sum_reduction_for_comms(True)
