"""Tensor parallelism (Megatron-style, with sequence parallelism) for brrr's Llama-family blocks, through DTensor
`parallelize_module` plans over the mesh's "tp" dimension.

Per layer: q/k/v and gate/up are column-parallel (each rank computes its heads and its slice of the MLP width, no
communication), o_proj and down_proj row-parallel (their partial sums are reduce-scattered over tokens). Between
them the residual stream stays sharded by token (sequence parallelism: Shard(0) of the flattened [tokens, hidden]
activations), so the norms and residual adds run on 1/tp of the tokens and each block costs one all-gather of
its input and one reduce-scatter of its output (the bytes of one all-reduce) in forward, and the same in backward.
The embedding is vocabulary-parallel (each rank owns vocab/tp rows; its masked partial rows are reduce-scattered
onto the token shards) and the LM head column-parallel over the vocabulary, its logits left sharded for
`loss_parallel`, which computes the cross-entropy without gathering [tokens, vocab].
Attention reads `n_heads` / `n_kv` from its module to view q/k/v: they become this rank's local head counts; per-head
q/k norms (Qwen3) take those heads as a Shard(1) DTensor, so their replicated weights' gradients sum over TP ranks.
"""
from __future__ import annotations

from torch import nn

from brrr.train.parallel.layout import Mesh


def replicate_params(module: nn.Module, tp_mesh):
    """Norm weights as Replicate DTensors: the norm runs on the token shards it is given (DTensor inputs), and
    autograd sums its weight's partial gradients over the TP ranks."""
    from torch.distributed.tensor import Replicate, distribute_module, distribute_tensor

    def partition(name, mod, mesh):
        for pname, param in list(mod.named_parameters(recurse=False)):
            mod.register_parameter(pname, nn.Parameter(distribute_tensor(param, mesh, [Replicate()])))

    distribute_module(module, tp_mesh, partition)


def apply_tp(model: nn.Module, mesh: Mesh):
    """Shard `model` (a LlamaForCausalLM, or a pipeline stage of one) over mesh["tp"] in place."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                                   RowwiseParallel, parallelize_module)

    tp_mesh, tp = mesh.get("tp"), mesh.layout.tp
    inner = model.model
    tied = model.lm_head is not None and inner.embed_tokens is not None \
        and model.lm_head.weight is inner.embed_tokens.weight
    if inner.embed_tokens is not None:
        parallelize_module(inner.embed_tokens, tp_mesh,
                           RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0),
                                                           use_local_output=False))
    for layer in inner.layers.values() if isinstance(inner.layers, nn.ModuleDict) else inner.layers:
        attn = layer.self_attn
        attn.n_heads, attn.n_kv = attn.n_heads // tp, attn.n_kv // tp
        parallelize_module(layer, tp_mesh, {
            # the stream arrives token-sharded; attention needs every token of its heads
            "self_attn": PrepareModuleInput(input_layouts=(Shard(0), None, None, None),
                                            desired_input_layouts=(Replicate(), None, None, None)),
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(0), use_local_output=False),
            "mlp": PrepareModuleInput(input_layouts=(Shard(0),), desired_input_layouts=(Replicate(),)),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=Shard(0), use_local_output=False),
        })
        if attn.q_norm is not None:  # per-head norms (Qwen3) see this rank's heads: Shard(1) of [tokens, heads, dim]
            for norm in (attn.q_norm, attn.k_norm):
                replicate_params(norm, tp_mesh)
                parallelize_module(norm, tp_mesh, PrepareModuleInput(input_layouts=(Shard(1),),
                                                                     desired_input_layouts=(Shard(1),)))
                parallelize_module(norm, tp_mesh, PrepareModuleOutput(output_layouts=(Shard(1),),
                                                                      desired_output_layouts=(Shard(1),)))
        replicate_params(layer.input_layernorm, tp_mesh)
        replicate_params(layer.post_attention_layernorm, tp_mesh)
    if inner.norm is not None:
        replicate_params(inner.norm, tp_mesh)
    if model.lm_head is not None:
        parallelize_module(model.lm_head, tp_mesh,
                           ColwiseParallel(input_layouts=Shard(0), output_layouts=Shard(-1), use_local_output=False))
        if tied:  # each plan made its own DTensor of the shared table; both are Shard(0) of [vocab, hidden]: one again
            model.lm_head.weight = inner.embed_tokens.weight
    return model
