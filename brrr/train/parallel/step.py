"""One optimizer step and one evaluation batch on a layout: under its loss context (TP's vocabulary-parallel
cross-entropy), with its gradient clipping (the global norm over every shard and stage), fp16's loss scale, and a
pipeline's schedule in place of forward/backward when there is one; plus what the step logs and checkpoints of
itself (the loss scale, the pipeline's bubble).
"""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist

from brrr.kernels.dispatch import use_reference
from brrr.train.loss_scaling import DynamicLossScale
from brrr.train.parallel.layout import Mesh
from brrr.train.parallel.pipeline import Pipeline, measured_bubble
from brrr.train.parallel.ranks import Ranks


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def clip_grad_norm(params, max_norm: float, pp_group=None, ep=None) -> torch.Tensor:
    """torch's clip_grad_norm_ over DTensor gradients (FSDP shards, TP slices) on any mesh: the norm of every
    shard's gradients, reduced to the global norm (across pipeline stages too), then one scale for all. ep: (the
    experts' mesh, the ep group) under expert parallelism (`_expert_parallel_clip`)."""
    if ep is not None:
        return _expert_parallel_clip(params, max_norm, *ep)
    grads = [p.grad for p in params if p.grad is not None]
    total = _local(torch.nn.utils.get_total_norm(grads, 2.0))
    if pp_group is not None:
        total = total**2
        dist.all_reduce(total, group=pp_group)
        total = total.sqrt()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def _expert_parallel_clip(params, max_norm: float, expert_mesh, ep_group) -> torch.Tensor:
    """The experts' gradients are DTensors on a mesh of their own (DTensor ops take one mesh: each mesh's
    gradients are taken apart) and hold this rank's experts alone: their squared norm is summed over the ep ranks,
    then added to the other parameters' (which every ep rank holds the same of)."""
    by_mesh: dict = {}
    for p in params:
        if p.grad is not None:
            by_mesh.setdefault(p.grad.device_mesh, []).append(p)
    total = None
    for mesh, group in by_mesh.items():
        sq = _local(torch.nn.utils.get_total_norm([p.grad for p in group], 2.0)) ** 2
        if mesh == expert_mesh:
            dist.all_reduce(sq, group=ep_group)
        total = sq if total is None else total + sq
    total = total.sqrt()
    for group in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


class ParallelStep:
    """The step and the evaluation of this rank's share of a layout (a one-process mesh: the plain step).
    pipeline: set once parallelize built one (brrr.train.parallel.parallelize); micro_batch and seq_len are the
    shape its stages were built for, to which evaluation batches are padded."""

    def __init__(self, mesh: Mesh, micro_batch: int, seq_len: int, fp16: bool = False):
        self.mesh, self.micro_batch, self.seq_len = mesh, micro_batch, seq_len
        self.pipeline: Pipeline | None = None
        self.loss_scale = DynamicLossScale() if fp16 else None

    def loss_context(self):
        """Cross-entropy over vocabulary-sharded logits under TP (forward and backward inside)."""
        if self.mesh.layout.tp > 1:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    def _kernels(self):
        # without gradients the ops would take their Triton kernels on CUDA, which take no DTensors (TP's
        # token-sharded stream): the references then, which DTensor dispatches
        return use_reference() if self.mesh.layout.tp > 1 else contextlib.nullcontext()

    def __call__(self, optimizer_step, loss_fn, optimizer, params, batches, grad_clip: float, autocast):
        """The trainer's `optimizer_step(loss_fn, optimizer, params, batches, grad_clip, autocast, clip=...)` on
        this layout (a pipeline runs its schedule instead): (mean loss over the data-parallel ranks, global
        pre-clip gradient norm), both on the device."""
        pp_group = self.mesh.get("pp").get_group() if self.pipeline is not None else None
        ep = (self.mesh.expert_mesh, self.mesh.get("ep").get_group()) if self.mesh.layout.ep > 1 else None
        clip = functools.partial(clip_grad_norm, pp_group=pp_group, ep=ep)
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
        last stage's value, summed over stages (the others hold zero); with cp averaged over the cp ranks (each
        holds its tokens' share of the full mean, x cp: brrr.train.parallel.context_parallel)."""
        if not self.mesh.distributed:
            return loss
        loss = loss.detach().clone()
        if self.mesh.layout.cp > 1:
            dist.all_reduce(loss, group=self.mesh.get("cp").get_group())
            loss /= self.mesh.layout.cp
        if self.pipeline is not None:
            dist.all_reduce(loss, group=self.mesh.get("pp").get_group())
        if self.mesh.dp_world > 1:
            dist.all_reduce(loss, group=self.mesh.get("dp").get_group())
            loss /= self.mesh.dp_world
        return loss

    @torch.no_grad()
    def eval_loss_sum(self, loss_module, inputs: torch.Tensor, targets: torch.Tensor, autocast) -> torch.Tensor:
        """Summed next-token loss of a [rows, len] evaluation batch; every rank evaluates the same rows (with cp,
        each its tokens of them, summed over the cp ranks)."""
        if self.pipeline is None:
            with self.loss_context(), autocast, self._kernels():
                total = _local(loss_module(inputs, targets, reduction="sum"))
            if self.mesh.layout.cp > 1:
                dist.all_reduce(total, group=self.mesh.get("cp").get_group())
            return total
        return self._pipeline_eval(inputs, targets)

    def _pipeline_eval(self, inputs, targets):
        """Evaluation batches are padded to the training shape the stages were built for (padded targets are
        ignored), run forward-only through the schedule, and the summed loss shared from the last stage."""
        rows, length = inputs.shape
        x = torch.zeros(self.micro_batch, self.seq_len, dtype=inputs.dtype, device=inputs.device)
        y = torch.full((self.micro_batch, self.seq_len), -100, dtype=targets.dtype, device=targets.device)
        x[:rows, :length], y[:rows, :length] = inputs, targets
        with self.loss_context(), self._kernels():
            total = self.pipeline.eval_sum(x, y)
        dist.all_reduce(total, group=self.mesh.get("pp").get_group())
        return total

    def log_fields(self, ranks: Ranks) -> dict:
        """Per-layout measurements for the step log since the last call: fp16's loss scale, and with a pipeline
        the bubble and stage imbalance over every rank's timings (pipeline.measured_bubble)."""
        fields = {}
        if self.loss_scale is not None:
            fields.update(loss_scale=self.loss_scale.scale, overflow_steps=self.loss_scale.overflows)
        if self.pipeline is None:
            return fields
        fields.update(measured_bubble(ranks.gather(self.pipeline.timings())),
                      pp_bubble_formula=self.pipeline.bubble_formula())
        return fields

    # -- what a checkpoint keeps of the step ----------------------------------------------------------------
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
