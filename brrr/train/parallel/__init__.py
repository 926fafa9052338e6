"""Training on many processes: the layout from the flags, and what it does to the model, the step and the
checkpoints. Parallelism is applied by functions to the plain model over one DeviceMesh (torchtitan's way), in
torchtitan's order: pipeline stages, tensor parallel, activation checkpointing, torch.compile per block, then
data parallel (FSDP2 or DDP) on the result.

mesh.py (Layout, the DeviceMesh, validation), data_parallel.py (FSDP2 / HSDP / DDP), tensor_parallel.py (DTensor
plans), pipeline.py (stages and schedules), dcp.py (sharded checkpoints).
"""
from __future__ import annotations

import contextlib
import functools
import os

import torch
import torch.distributed as dist
from torch import nn

from brrr.kernels.dispatch import use_reference
from brrr.train.loss_scaling import DynamicLossScale
from brrr.train.parallel.data_parallel import apply_ddp, apply_fsdp, uses_fsdp
from brrr.train.parallel.dcp import Checkpointer, load_model_weights
from brrr.train.parallel.mesh import Layout, Mesh, build_mesh, check_model
from brrr.train.parallel.pipeline import INTERLEAVED_CHUNKS, Pipeline, check_pipeline, measured_bubble
from brrr.train.parallel.tensor_parallel import apply_tp

__all__ = ["Checkpointer", "Layout", "Mesh", "Parallel", "checkpoint_activations", "clip_grad_norm", "decoder_layers",
           "load_model_weights"]


def decoder_layers(module: nn.Module) -> list[nn.Module]:
    layers = module.model.layers
    return list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)


def checkpoint_activations(layers, selective: bool = False):
    """Recompute each layer in backward instead of keeping its activations (only forward is wrapped, so the
    parameters' names and the FSDP / TP hooks on the module's call are unchanged). selective: keep the outputs of
    wide matmuls and attention, recompute the cheap rest (`_keep_wide_matmuls`)."""
    from torch.utils.checkpoint import checkpoint as recompute

    kwargs = {"use_reentrant": False}
    if selective:
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

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
    from torch.utils.checkpoint import CheckpointPolicy

    aten = torch.ops.aten
    if op in (aten.mm.default, aten.addmm.default):
        a = args[1] if op is aten.addmm.default else args[0]
        return CheckpointPolicy.MUST_SAVE if a.shape[-1] > _WIDE_CONTRACTION else CheckpointPolicy.PREFER_RECOMPUTE
    if op in (aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
              aten._scaled_dot_product_cudnn_attention.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def clip_grad_norm(params, max_norm: float, pp_group=None) -> torch.Tensor:
    """torch's clip_grad_norm_ over DTensor gradients (FSDP shards, TP slices) on any mesh: the norm of every
    shard's gradients, reduced to the global norm (across pipeline stages too), then one scale for all."""
    grads = [p.grad for p in params if p.grad is not None]
    total = _local(torch.nn.utils.get_total_norm(grads, 2.0))
    if pp_group is not None:
        total = total**2
        dist.all_reduce(total, group=pp_group)
        total = total.sqrt()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


class Parallel:
    """This process's share of a run: built from the TrainConfig's layout flags before the model exists (so a
    bad layout is refused on every rank before any collective), then applied to the model."""

    def __init__(self, cfg, model_cfg, device: torch.device):
        world = int(os.environ.get("WORLD_SIZE", 1))
        layout = Layout(cfg.dp_replicate, cfg.dp_shard, cfg.tp, cfg.pp).resolve(world)
        microbatches = cfg.microbatches or layout.pp
        check_model(layout, model_cfg, cfg.micro_batch, cfg.seq_len, microbatches if layout.pp > 1 else None)
        if layout.pp > 1:
            check_pipeline(cfg.pp_schedule, layout.pp, microbatches, model_cfg.num_layers)
        self.cfg, self.device, self.microbatches = cfg, device, microbatches
        self.mesh: Mesh = build_mesh(layout, device)
        self.layout = self.mesh.layout
        self.distributed = self.mesh.device_mesh is not None
        self.pipeline: Pipeline | None = None
        self.loss_scale = DynamicLossScale() if cfg.fp16 else None
        # step-boundary decisions (stop on a signal, out of time) are agreed over a CPU group: no device sync
        self._flags_group = dist.new_group(backend="gloo") if self.distributed else None

    # -- where this rank sits --------------------------------------------------------------------------------
    @property
    def dp_rank(self) -> int:
        return self.mesh.dp_rank

    @property
    def dp_world(self) -> int:
        return self.mesh.dp_world

    @property
    def fsdp(self) -> bool:
        """Whether FSDP wraps the model (its policy casts to bf16 on CUDA: no autocast then)."""
        return self.distributed and uses_fsdp(self.mesh)

    @property
    def compiles_blocks(self) -> bool:
        """Distributed runs compile per decoder layer (FSDP's and TP's hooks sit between layers)."""
        return self.distributed

    # -- the model -------------------------------------------------------------------------------------------
    def apply(self, model: nn.Module) -> nn.Module:
        """The model this rank trains: pipeline stages, TP, activation checkpointing, per-layer compile,
        FSDP / DDP. Returns a module whose parameters carry the plain model's names."""
        cfg, layout = self.cfg, self.layout
        parts = [model]
        if layout.pp > 1:
            self.pipeline = Pipeline(model, self.mesh.get("pp"), cfg.pp_schedule, self.microbatches,
                                     cfg.grad_accum, cfg.seq_len, self.device, cfg.activation_checkpointing)
            parts = self.pipeline.modules
        if self.distributed:
            # the fused gather-and-norm reads layer 0's norm weight from outside that layer's call, where FSDP has
            # not gathered it and TP's plans do not reach; in training it runs the same two reference ops anyway
            for part in parts:
                part.model.embed_fused = False
        if layout.tp > 1:
            for part in parts:
                apply_tp(part, self.mesh)
                if self.pipeline is not None:  # stages exchange TP's token shards
                    part.tp_mesh = self.mesh.get("tp")
        for part in parts:
            layers = decoder_layers(part)
            if cfg.activation_checkpointing:  # all layers, or every N-th (memory traded for less recompute)
                checkpoint_activations([layer for layer in layers
                                        if layer.self_attn.layer % cfg.activation_checkpointing_every == 0])
            if cfg.compile and self.compiles_blocks:
                for layer in layers:
                    layer.compile()
            if self.fsdp:
                apply_fsdp(part, layers, self.mesh, self.device, cfg.reshard_after_forward, cfg.fp16)
            elif layout.dp > 1:
                apply_ddp(part, self.mesh)
        if self.pipeline is None:
            return model
        self.pipeline.finish_setup()
        return parts[0] if len(parts) == 1 else _Parts(parts)

    # -- one optimizer step ----------------------------------------------------------------------------------
    def loss_context(self):
        """Cross-entropy over vocabulary-sharded logits under TP (forward and backward inside)."""
        if self.layout.tp > 1:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    def step(self, optimizer_step, loss_fn, optimizer, params, batches, grad_clip: float, autocast):
        """The trainer's `optimizer_step(loss_fn, optimizer, params, batches, grad_clip, autocast, clip=...)` on
        this layout (under its loss context, with its gradient clipping; a pipeline runs its schedule instead):
        (mean loss over the data-parallel ranks, global pre-clip gradient norm), both on the device."""
        pp_group = self.mesh.get("pp").get_group() if self.pipeline is not None else None
        clip = functools.partial(clip_grad_norm, pp_group=pp_group)
        scale = 1.0
        if self.loss_scale is not None:  # fp16
            scale = self.loss_scale.scale
            loss_fn, clip = self.loss_scale.scaled(loss_fn), self.loss_scale.unscaled_clip(clip)
        if self.pipeline is not None:
            self.pipeline.loss_multiplier = scale
            with self.loss_context():
                total = sum(self.pipeline.run(x, y) for x, y in batches) / len(batches)
            norm = clip(params, grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            loss = total
        else:
            with self.loss_context():
                loss, norm = optimizer_step(loss_fn, optimizer, params, batches, grad_clip, autocast, clip=clip)
            loss = _local(loss) / scale
        return self.mean_loss(loss), norm

    def mean_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss averaged over data-parallel ranks (each saw its own share of the batch); with a pipeline the
        last stage's value, summed over stages (the others hold zero)."""
        if not self.distributed:
            return loss
        loss = loss.detach().clone()
        if self.pipeline is not None:
            dist.all_reduce(loss, group=self.mesh.get("pp").get_group())
        if self.dp_world > 1:
            dist.all_reduce(loss, group=self.mesh.get("dp").get_group())
            loss /= self.dp_world
        return loss

    @torch.no_grad()
    def eval_loss_sum(self, loss_module, inputs: torch.Tensor, targets: torch.Tensor, autocast) -> torch.Tensor:
        """Summed next-token loss of a [rows, len] evaluation batch; every rank evaluates the same rows."""
        if self.pipeline is None:
            # without gradients the ops would take their Triton kernels on CUDA, which take no DTensors (TP's
            # token-sharded stream): the references then, which DTensor dispatches
            kernels = use_reference() if self.layout.tp > 1 else contextlib.nullcontext()
            with self.loss_context(), autocast, kernels:
                return _local(loss_module(inputs, targets, reduction="sum"))
        return self._pipeline_eval(inputs, targets)

    def _pipeline_eval(self, inputs, targets):
        """Evaluation batches are padded to the training shape the stages were built for (padded targets are
        ignored), run forward-only through the schedule, and the summed loss shared from the last stage."""
        rows, length = inputs.shape
        mb, seq = self.cfg.micro_batch, self.cfg.seq_len
        x = torch.zeros(mb, seq, dtype=inputs.dtype, device=inputs.device)
        y = torch.full((mb, seq), -100, dtype=targets.dtype, device=targets.device)
        x[:rows, :length], y[:rows, :length] = inputs, targets
        kernels = use_reference() if self.layout.tp > 1 else contextlib.nullcontext()
        with self.loss_context(), kernels:
            total = self.pipeline.eval_sum(x, y)
        dist.all_reduce(total, group=self.mesh.get("pp").get_group())
        return total

    def log_fields(self) -> dict:
        """Per-layout measurements for the step log since the last call: fp16's loss scale, and with a pipeline
        the bubble and stage imbalance over every rank's timings (pipeline.measured_bubble)."""
        fields = {}
        if self.loss_scale is not None:
            fields.update(loss_scale=self.loss_scale.scale, overflow_steps=self.loss_scale.overflows)
        if self.pipeline is None:
            return fields
        mine = torch.tensor(self.pipeline.timings(), dtype=torch.float64)
        gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, mine, group=self._flags_group)
        fields.update(measured_bubble([tuple(t.tolist()) for t in gathered]),
                      pp_bubble_formula=self.pipeline.bubble_formula())
        return fields

    # -- what a checkpoint keeps of this object -----------------------------------------------------------------
    def state(self) -> dict:
        """For the trainer's checkpoint state: fp16's loss scale (a resume starts from it, not from 2^16)."""
        if self.loss_scale is None:
            return {}
        return {"loss_scale": self.loss_scale.scale, "loss_scale_finite_steps": self.loss_scale.finite_steps,
                "overflow_steps": self.loss_scale.overflows}

    def restore(self, saved: dict):
        if self.loss_scale is not None and "loss_scale" in saved:
            self.loss_scale.scale = saved["loss_scale"]
            self.loss_scale.finite_steps = saved["loss_scale_finite_steps"]
            self.loss_scale.overflows = saved["overflow_steps"]

    # -- what `brrr calc train` predicts for this layout ----------------------------------------------------
    def calc_train_memory(self, model_cfg) -> dict:
        """Per-GPU bytes `brrr calc train` predicts for this layout (state + activations), and its ZeRO stage:
        FSDP resharding after forward is ZeRO-3, keeping the weights ZeRO-2, DDP and one process 0. calc has one
        data-parallel dimension, so HSDP is quoted as FSDP over its shard group: each rank holds 1/dp_shard of the
        state whatever the replicas."""
        from brrr.analysis.hardware import GPUS
        from brrr.analysis.train import train_plan

        cfg, layout = self.cfg, self.layout
        zero = (3 if cfg.reshard_after_forward else 2) if self.fsdp else 0
        pp_kw = dict(microbatches=self.microbatches, schedule=cfg.pp_schedule,
                     chunks=INTERLEAVED_CHUNKS if cfg.pp_schedule == "interleaved" else 1) if layout.pp > 1 else {}
        rows = cfg.micro_batch // (self.microbatches if layout.pp > 1 else 1)
        gpus = layout.world // layout.dp_replicate if self.fsdp else layout.world
        plan = train_plan(model_cfg, GPUS["h100-sxm"], gpus=gpus, zero=zero, tp=layout.tp, pp=layout.pp,
                          micro_batch=rows, seq_len=cfg.seq_len, checkpointing=cfg.activation_checkpointing,
                          **pp_kw)
        return {"zero": zero, "bytes": plan["memory"]["total"]}

    def max_over_ranks(self, value: float) -> float:
        if not self.distributed:
            return value
        t = torch.tensor([float(value)], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._flags_group)
        return float(t.item())

    # -- agreement between ranks -----------------------------------------------------------------------------
    def any(self, flag: bool) -> bool:
        """True on every rank if it is on any (a signal that reached one rank stops them all at one step)."""
        if not self.distributed:
            return flag
        t = torch.tensor([int(flag)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._flags_group)
        return bool(t.item())

    def min_int(self, value: int) -> int:
        if not self.distributed:
            return value
        t = torch.tensor([value])
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self._flags_group)
        return int(t.item())


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
