"""Pipeline parallelism with torch.distributed.pipelining: the model cut into stages of consecutive layers over
the mesh's "pp" dimension, each rank's micro-batch split into --microbatches pieces that flow through them.

Schedules: GPipe (all forwards, then all backwards: m microbatches of activations held), 1F1B (after a warm-up
of p - 1 forwards, one forward one backward: at most p in flight), both idle (p - 1) / (m + p - 1) of a step;
interleaved 1F1B gives each rank v = 2 stages (rank r holds stages r and r + p), so a bubble slot is a v-th as
long: (p - 1) / (v m + p - 1), for twice the point-to-point sends.
Every stage keeps the plain model's parameter names (model.layers.<i>...; layers in a ModuleDict keyed by their
index), so a checkpoint written under one layout loads under any other.
"""
from __future__ import annotations

import copy
import time

import torch
import torch.nn.functional as F
from torch import nn

from brrr.analysis.train import SCHEDULES, head_layers, pipeline_bubble, rank_stages, stage_layers
from brrr.errors import BrrrError
from brrr.kernels import AttnMeta
from brrr.kernels.dispatch import use_reference
from brrr.train.loss import head_weight, linear_cross_entropy

INTERLEAVED_CHUNKS = 2  # stages per rank with the interleaved schedule


class PipelineStageModule(nn.Module):
    """Layers [first, last) of a LlamaForCausalLM; the embedding if it is the first stage, the final norm and LM
    head if it is the last. Activations between stages: (h, residual), each [tokens, hidden] of flattened
    [batch, seq_len] tokens; under TP each rank sends its own token shard to the rank of the same TP coordinate in
    the next stage (sequence parallelism's layout, so nothing is gathered at a stage boundary)."""

    def __init__(self, causal_lm: nn.Module, layer_ids: list[int], first: bool, last: bool, seq_len: int):
        super().__init__()
        self.seq_len, self.tp_mesh = seq_len, None  # apply_tp sets tp_mesh
        self.config = causal_lm.config
        inner = causal_lm.model
        inner.layers = nn.ModuleDict({str(i): inner.layers[i] for i in layer_ids})
        if not first:
            inner.embed_tokens = None
        if not last:
            inner.norm = None
        self.model = inner
        self.lm_head = causal_lm.lm_head if last else None
        self.first, self.last = first, last
        self.returns_hidden = False  # set by the last stage's forward
        self._meta: dict = {}

    def _meta_for(self, batch: int, seq: int, device):
        key = (batch, seq, str(device))
        if key not in self._meta:
            self._meta[key] = (AttnMeta.causal([seq] * batch, device), torch.arange(seq, device=device).repeat(batch))
        return self._meta[key]

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """First stage: token ids [batch, seq_len]; later stages: the previous one's (h, residual). Returns the
        next stage's inputs, or on the last stage what `loss` takes: the final hidden states [tokens, hidden], or
        the fp32 logits [tokens, vocab] (vocabulary-sharded under TP).

        Always through the reference ops: PipelineStage infers its outputs' metadata from a forward under no_grad,
        which on CUDA would take the Triton kernels, and checks every training forward (the references, which
        autograd differentiates) against it, strides included in torch 2.11; evaluation under TP needs the
        references too (the kernels take no DTensors)."""
        with use_reference():
            return self._forward(x, residual)

    def _forward(self, x: torch.Tensor, residual: torch.Tensor | None):
        tp = self.tp_mesh.size() if self.tp_mesh is not None else 1
        tokens = x.numel() if self.first else x.shape[0] * tp
        meta, positions = self._meta_for(tokens // self.seq_len, self.seq_len, x.device)
        inner = self.model
        if self.first:
            h, cos, sin = inner.embed(x.reshape(-1), positions)
        else:
            h, residual = self._sharded(x), self._sharded(residual)
            cos, sin = inner.rotary_emb(positions, h.dtype)
        for layer in inner.layers.values():
            h, residual = layer(h, cos, sin, meta, residual)
        if self.last:
            h = inner.norm(h, residual)[0]
            # the chunked loss takes the final hidden states and the head's weight (brrr.train.loss); a
            # vocabulary-sharded head (TP) or fp16 hands over the logits
            self.returns_hidden = head_weight(self.lm_head, h) is not None
            return h if self.returns_hidden else self.lm_head(h).float()
        return _local_shard(h), _local_shard(residual)

    def loss(self, out: torch.Tensor, target: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """The last stage's next-token loss of what its forward returned."""
        if self.returns_hidden:
            return linear_cross_entropy(out, self.lm_head.weight, target, reduction)
        return F.cross_entropy(out, target.flatten(), reduction=reduction)

    def _sharded(self, t: torch.Tensor) -> torch.Tensor:
        """A received token shard as the TP layers' Shard(0) DTensor (the tensor itself without TP)."""
        if self.tp_mesh is None:
            return t
        from torch.distributed.tensor import DTensor, Shard

        return DTensor.from_local(t, self.tp_mesh, [Shard(0)], run_check=False)


def _local_shard(t: torch.Tensor) -> torch.Tensor:
    """What a stage sends: this rank's token shard (pipelining sends plain tensors)."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def check_pipeline(schedule: str, pp: int, microbatches: int, num_layers: int):
    if schedule not in SCHEDULES:
        raise BrrrError(f"--pp-schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    stages = pp * (INTERLEAVED_CHUNKS if schedule == "interleaved" else 1)
    if stages > num_layers:
        raise BrrrError(f"--pp {pp} with --pp-schedule {schedule} makes {stages} stages, more than the model's "
                        f"num_hidden_layers {num_layers}")
    if schedule == "1f1b" and microbatches < pp:
        raise BrrrError(f"--pp-schedule 1f1b needs --microbatches ({microbatches}) >= --pp ({pp})")
    if schedule == "interleaved" and microbatches % pp:
        raise BrrrError(f"--pp-schedule interleaved needs --microbatches ({microbatches}) to be a multiple of "
                        f"--pp ({pp})")


class Pipeline:
    """This rank's stage modules and the schedule that runs one micro-batch through all of them."""

    def __init__(self, model: nn.Module, pp_mesh, schedule: str, microbatches: int, grad_accum: int, seq_len: int,
                 device, recompute: bool = False):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        pp, rank = pp_mesh.size(), pp_mesh.get_local_rank()
        chunks = INTERLEAVED_CHUNKS if schedule == "interleaved" else 1
        n_stages = pp * chunks
        # the last stage runs the LM head too, so it takes fewer layers (brrr calc train splits the same way)
        layers = stage_layers(model.config.num_layers, n_stages, head_layers(model.config, seq_len, recompute))
        ids = rank_stages(pp, chunks)[rank]  # the looped placement interleaved 1F1B expects
        self.modules = [PipelineStageModule(copy.deepcopy(model) if chunks > 1 else model, layers[s], s == 0,
                                            s == n_stages - 1, seq_len) for s in ids]
        self.stage_ids, self.n_stages, self.pp_mesh, self.device = ids, n_stages, pp_mesh, device
        self.microbatches, self.grad_accum, self.schedule_name = microbatches, grad_accum, schedule
        self.has_last = n_stages - 1 in ids
        self._build = lambda: [PipelineStage(m, s, n_stages, device, group=pp_mesh.get_group())
                               for m, s in zip(self.modules, ids)]
        self._classes = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}
        self.schedule = None
        self.busy_s = self.wall_s = 0.0  # this rank's stage compute, and the pipeline steps' wall time
        self.loss_multiplier = 1.0  # fp16's loss scale for the next step

    def _timed(self, run_chunk):
        """A stage's forward_one_chunk / backward_one_chunk that adds its compute time to busy_s (the loss of a
        last stage included); the rest of a step is waiting: the bubble, and the sends it waits on."""
        def timed(*args, **kwargs):
            self._sync()
            start = time.perf_counter()
            out = run_chunk(*args, **kwargs)
            self._sync()
            self.busy_s += time.perf_counter() - start
            return out
        return timed

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def timings(self) -> tuple[float, float]:
        """(this rank's stage compute, the pipeline steps' wall time) in seconds since the last call."""
        out = (self.busy_s, self.wall_s)
        self.busy_s = self.wall_s = 0.0
        return out

    def bubble_formula(self) -> float:
        """(p - 1) / (v m + p - 1) (brrr.analysis.train.pipeline_bubble)."""
        return pipeline_bubble(self.pp_mesh.size(), self.microbatches, self.schedule_name,
                               len(self.stage_ids))["fraction"]

    def finish_setup(self):
        """Stages and schedule, after FSDP has wrapped the stage modules."""
        stages = self._build()
        for stage in stages:
            stage.forward_one_chunk = self._timed(stage.forward_one_chunk)
            stage.backward_one_chunk = self._timed(stage.backward_one_chunk)
        cls = self._classes[self.schedule_name]
        # the loss of one microbatch, divided so the gradients sum to those of the step's mean loss (and times
        # fp16's loss scale)
        divisor = self.microbatches * self.grad_accum

        last = self.modules[-1]  # the last stage, where this rank holds it

        def loss_fn(out, target):
            return last.loss(out, target) * self.loss_multiplier / divisor

        self.schedule = cls(stages if self.schedule_name == "interleaved" else stages[0], self.microbatches,
                            loss_fn=loss_fn, scale_grads=False)

    def run(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One micro-batch through the pipeline, forward and backward. Returns this micro-batch's mean loss on
        ranks holding the last stage, zero elsewhere."""
        losses: list = []
        # stages check each input's strides against the first step's: a [:, :-1] slice of the token buffer is
        # strided on one device and copied dense on another, so hand the schedule dense tensors always
        inputs, targets = inputs.contiguous(), targets.contiguous()
        first = 0 in self.stage_ids
        args = (inputs,) if first else ()
        target = targets if self.has_last else None
        self._sync()
        start = time.perf_counter()
        self.schedule.step(*args, target=target, losses=losses, return_outputs=False)
        self._sync()
        self.wall_s += time.perf_counter() - start
        if not self.has_last:
            return torch.zeros((), device=self.device)
        return local_sum(losses) * (self.grad_accum / self.loss_multiplier)

    def eval_sum(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Summed next-token loss of one [micro_batch, seq_len] batch, forward only (targets -100 are skipped):
        on ranks holding the last stage; zero elsewhere."""
        schedule = self.schedule
        inputs, targets = inputs.contiguous(), targets.contiguous()  # as in run()
        train_loss = schedule._loss_fn
        schedule._loss_fn = lambda out, t: self.modules[-1].loss(out, t, reduction="sum")
        try:
            losses: list = []
            schedule.eval(*((inputs,) if 0 in self.stage_ids else ()), target=targets if self.has_last else None,
                          losses=losses, return_outputs=False)
        finally:
            schedule._loss_fn = train_loss
        return local_sum(losses) if losses else torch.zeros((), device=self.device)


def measured_bubble(timings: list[tuple[float, float]]) -> dict:
    """From every rank's (stage compute, schedule wall time) of the same steps: the bubble, the busiest rank's idle
    share of the pipeline's duration (the longest rank's time: a rank's own ends at its last backward, so the last
    stage's leaves out the drain through the stages before it), and the stage imbalance, the busiest rank's compute
    over the mean rank's. The formula assumes equal stages; the busiest one sets the pace, and a lighter one's idle
    time is the bubble plus its wait for it."""
    busiest = max(busy for busy, _ in timings)
    duration = max(wall for _, wall in timings)
    mean = sum(busy for busy, _ in timings) / len(timings)
    return {"pp_bubble": 1 - busiest / duration if duration else None,
            "pp_stage_imbalance": busiest / mean if mean else None}


def local_sum(losses: list) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return torch.stack([x.detach().full_tensor() if isinstance(x, DTensor) else x.detach() for x in losses]).sum()
