"""Parallelism applied to a plain model over the mesh, in torchtitan's order: pipeline stages, tensor parallel,
expert parallel, activation checkpointing, torch.compile per block, then data parallel (FSDP2 or DDP) on the result.
The parameters keep the plain model's names whatever the layout, so the optimizer and the checkpoints see one model.
"""
from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from torch.utils.checkpoint import checkpoint as recompute

from brrr.train.config import ParallelConfig
from brrr.train.parallel.data_parallel import apply_ddp, apply_fsdp
from brrr.train.parallel.expert_parallel import apply_expert_parallel
from brrr.train.parallel.layout import Mesh, microbatches
from brrr.train.parallel.pipeline import Pipeline
from brrr.train.parallel.tensor_parallel import apply_tp


def parallelize(model: nn.Module, mesh: Mesh, cfg: ParallelConfig, device: torch.device, *, grad_accum: int,
                seq_len: int, compile: bool = False, activation_checkpointing: bool = False,
                checkpoint_every: int = 1) -> tuple[nn.Module, Pipeline | None]:
    """The model this rank trains, and its pipeline (None without one): pipeline stages, TP, EP (each MoE layer
    keeps this rank's experts), activation checkpointing (every checkpoint_every-th layer), per-layer compile
    (distributed runs: FSDP's and TP's hooks sit between layers; one process compiles its whole loss instead),
    FSDP / DDP. Returns a module whose parameters carry the plain model's names."""
    layout, pipeline = mesh.layout, None
    parts = [model]
    if layout.pp > 1:
        pipeline = Pipeline(model, mesh.get("pp"), cfg.pp_schedule, microbatches(cfg, layout), grad_accum, seq_len,
                            device, activation_checkpointing)
        parts = pipeline.modules
    if mesh.distributed:
        # the fused gather-and-norm reads layer 0's norm weight from outside that layer's call, where FSDP has
        # not gathered it and TP's plans do not reach; in training it runs the same two reference ops anyway
        for part in parts:
            part.model.embed_fused = False
    if layout.tp > 1:
        for part in parts:
            apply_tp(part, mesh)
            if pipeline is not None:  # stages exchange TP's token shards
                part.tp_mesh = mesh.get("tp")
    if layout.ep > 1:
        for part in parts:
            apply_expert_parallel(part, mesh.get("ep").get_group())
    for part in parts:
        layers = decoder_layers(part)
        if activation_checkpointing:  # all layers, or every N-th (memory traded for less recompute)
            checkpoint_activations([layer for layer in layers if layer.self_attn.layer % checkpoint_every == 0])
        if compile and mesh.distributed:
            for layer in layers:
                layer.compile()
        if mesh.fsdp:
            apply_fsdp(part, layers, mesh, device, cfg.reshard_after_forward, cfg.fp16)
        elif layout.dp > 1:
            apply_ddp(part, mesh)
    if pipeline is None:
        return model, None
    pipeline.finish_setup()
    return (parts[0] if len(parts) == 1 else _Parts(parts)), pipeline


def decoder_layers(module: nn.Module) -> list[nn.Module]:
    layers = module.model.layers
    return list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)


def checkpoint_activations(layers, selective: bool = False):
    """Recompute each layer in backward instead of keeping its activations (only forward is wrapped, so the
    parameters' names and the FSDP / TP hooks on the module's call are unchanged). selective: keep the outputs of
    wide matmuls and attention, recompute the cheap rest (`_keep_wide_matmuls`)."""
    kwargs = {"use_reentrant": False}
    if selective:
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _keep_wide_matmuls)
    for layer in layers:
        layer.forward = _recomputed(layer.forward, recompute, kwargs)


def _recomputed(forward, recompute, kwargs):
    # a function, not functools.partial(recompute, forward): torch.compile of the layer traces a plain function
    # into its graph, but silently runs a partial of checkpoint eagerly (no graph, no graph-break warning)
    def run(*args, **kw):
        return recompute(forward, *args, **kwargs, **kw)
    return run


_WIDE_CONTRACTION = 256  # a matmul contracting fewer columns (a LoRA B of rank r) is cheaper to redo than to keep


def _keep_wide_matmuls(ctx, op, *args, **kwargs):
    aten = torch.ops.aten
    if op in (aten.mm.default, aten.addmm.default):
        a = args[1] if op is aten.addmm.default else args[0]
        return CheckpointPolicy.MUST_SAVE if a.shape[-1] > _WIDE_CONTRACTION else CheckpointPolicy.PREFER_RECOMPUTE
    if op in (aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
              aten._scaled_dot_product_cudnn_attention.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE



class _Parts(nn.Module):
    """Several pipeline stages of one rank (interleaved) as one module with the plain model's parameter names:
    the optimizer and the checkpoint see one model."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.stages = parts  # a plain list: not registered, so the names below are the only ones
        self.model = nn.Module()
        self.model.layers = nn.ModuleDict({k: v for p in parts for k, v in p.model.layers.items()})
        for p in parts:
            if p.model.embed_tokens is not None:
                self.model.embed_tokens = p.model.embed_tokens
            if p.model.norm is not None:
                self.model.norm = p.model.norm
            if p.lm_head is not None:
                self.lm_head = p.lm_head
