"""Data parallelism over the mesh's dp dimensions: DDP (replicate only) and FSDP2 (shard, or replicate x shard).

FSDP2 (`fully_shard`) groups each decoder layer's parameters into one all-gather / reduce-scatter; the root
group holds the embedding, final norm and LM head (and keeps a tied embedding/LM-head weight in one group).
reshard_after_forward=True frees each layer's gathered weights after its forward and gathers them again for
backward (ZeRO-3); False keeps them until backward (ZeRO-2: gradients and optimizer state sharded, weights whole
between forward and backward, one all-gather fewer per layer).
DDP is the composable `replicate` (DistributedDataParallel's bucketed all-reduce overlapped with backward,
without a wrapper module, so parameter names and checkpoints stay those of the plain model).
"""
from __future__ import annotations

import torch
from torch import nn

from brrr.train.parallel.expert_parallel import shard_experts
from brrr.train.parallel.layout import Mesh


def mixed_precision(device: torch.device, fp16: bool = False):
    """bf16 weights and compute, fp32 gradient reduction and fp32 master weights on CUDA; fp32 throughout on CPU
    (where bf16 matmuls are slow and the tests compare against fp32). fp16: fp16 weights and compute on any
    device, fp32 reduction and master weights (with dynamic loss scaling: brrr.train.loss_scaling)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    # no input casting: the inputs are token ids, positions and AttnMeta (a dataclass FSDP's cast cannot rebuild),
    # and between layers the stream is already in the weights' dtype
    if fp16:
        return MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32, cast_forward_inputs=False)
    if device.type == "cuda":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)
    return MixedPrecisionPolicy()


def apply_fsdp(model: nn.Module, layers, mesh: Mesh, device: torch.device, reshard_after_forward: bool,
               fp16: bool = False):
    """fully_shard every layer in `layers`, then the root. With dp_replicate > 1 the mesh is 2-D: HSDP (shard
    inside a replica group, all-reduce gradients across groups). With cp the shard group is dp_shard x cp; with ep
    dp_shard x ep, and each MoE layer's experts are a group of their own first (expert_parallel.shard_experts)."""
    from torch.distributed.fsdp import fully_shard

    dp_mesh = mesh.fsdp_mesh
    mp = mixed_precision(device, fp16)
    if mesh.layout.ep > 1:
        shard_experts(layers, mesh, mp, reshard_after_forward)
    for layer in layers:
        fully_shard(layer, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp)  # the root keeps its weights gathered until backward
    return model


def apply_ddp(model: nn.Module, mesh: Mesh):
    from torch.distributed._composable.replicate import replicate

    replicate(model, device_mesh=mesh.get("dp_replicate"), bucket_cap_mb=100)
    return model

