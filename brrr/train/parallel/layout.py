"""The parallel layout of a training run: flags -> one DeviceMesh with named dimensions, and what the layout
costs in memory (brrr calc train's prediction for this device).

World = pp x dp_replicate x dp_shard x ep x cp x tp (torchtitan's order: tensor parallel innermost, so its ranks share
a host and its per-layer collectives stay on NVLink; context parallel next, whose ring sends K/V every layer; expert
parallel next, whose all-to-all runs twice per MoE layer; pipeline outermost, whose point-to-point sends are the
cheapest traffic). The ep ranks are data-parallel ranks too (each reads its own rows): dp = dp_replicate x dp_shard
x ep. Every check here reads only the flags,
WORLD_SIZE and the model config, so every rank reaches the same verdict before any collective: a bad layout raises
on all ranks at once and none waits for the others.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from brrr.analysis.hardware import GPU
from brrr.analysis.train import train_plan
from brrr.config import ModelConfig
from brrr.errors import BrrrError
from brrr.train.config import ParallelConfig
from brrr.train.parallel.pipeline import INTERLEAVED_CHUNKS, check_pipeline

DIMS = ("pp", "dp_replicate", "dp_shard", "ep", "cp", "tp")


@dataclass(frozen=True)
class Layout:
    dp_replicate: int = 1
    dp_shard: int = -1  # -1: every rank the other dimensions leave
    tp: int = 1
    pp: int = 1
    cp: int = 1  # context parallel: each sequence split over cp ranks (ring attention)
    ep: int = 1  # expert parallel: each MoE layer's experts split over ep ranks (all-to-all dispatch)

    def resolve(self, world: int) -> "Layout":
        """The layout with dp_shard filled in, checked against the world size."""
        for name in ("dp_replicate", "tp", "pp", "cp", "ep"):
            if getattr(self, name) < 1:
                raise BrrrError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.dp_shard == 0 or self.dp_shard < -1:
            raise BrrrError(f"--dp-shard must be >= 1 (or -1: the ranks left over), got {self.dp_shard}")
        others = self.dp_replicate * self.tp * self.pp * self.cp * self.ep
        cp = (f" x --cp {self.cp}" if self.cp > 1 else "") + (f" x --ep {self.ep}" if self.ep > 1 else "")
        shard = self.dp_shard
        if shard == -1:
            if world % others:
                raise BrrrError(f"--dp-replicate {self.dp_replicate} x --tp {self.tp} x --pp {self.pp}{cp} = "
                                f"{others} does not divide the world size {world} (WORLD_SIZE, torchrun's "
                                f"--nproc_per_node x --nnodes)")
            shard = world // others
        if others * shard != world:
            raise BrrrError(f"--dp-replicate {self.dp_replicate} x --dp-shard {shard} x --tp {self.tp} x --pp "
                            f"{self.pp}{cp} = {others * shard}, but the world size is {world} (WORLD_SIZE, "
                            f"torchrun's --nproc_per_node x --nnodes): the product must equal it")
        return Layout(self.dp_replicate, shard, self.tp, self.pp, self.cp, self.ep)

    @property
    def dp(self) -> int:
        """Data-parallel ranks: every rank that reads rows of its own (the ep ranks included)."""
        return self.dp_replicate * self.dp_shard * self.ep

    @property
    def world(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    def describe(self) -> str:
        return " x ".join(f"{d} {getattr(self, d)}" for d in DIMS if getattr(self, d) > 1) or "one process"


def check_model(layout: Layout, cfg: ModelConfig, micro_batch: int, seq_len: int, microbatches: int | None = None):
    """What the model's shape must allow for this layout: TP splits heads, KV heads, the MLP width and the
    vocabulary; PP splits layers; sequence parallelism splits each micro-batch's tokens; CP splits each sequence
    into 2 x cp chunks."""
    check_context_parallel(layout, cfg, seq_len)
    check_expert_parallel(layout, cfg)
    tp = layout.tp
    if tp > 1:
        for field, size in (("num_attention_heads", cfg.num_heads), ("num_key_value_heads", cfg.num_kv_heads),
                            ("intermediate_size", cfg.intermediate_size), ("vocab_size", cfg.vocab_size)):
            if size % tp:
                raise BrrrError(f"--tp {tp} must divide the model's {field} ({size})")
        if (micro_batch * seq_len) % tp:
            raise BrrrError(f"--tp {tp} must divide the tokens of a micro-batch (--micro-batch {micro_batch} x "
                            f"--seq-len {seq_len}): sequence parallelism splits them")
    if layout.pp > 1:
        if layout.pp > cfg.num_layers:
            raise BrrrError(f"--pp {layout.pp} stages need at least that many layers; the model has "
                            f"num_hidden_layers {cfg.num_layers}")
        if cfg.tie_word_embeddings:
            raise BrrrError("--pp > 1 needs untied embeddings (the first stage holds embed_tokens, the last "
                            "lm_head); this model has tie_word_embeddings true")
        if microbatches is not None and micro_batch % microbatches:
            raise BrrrError(f"--microbatches {microbatches} must divide --micro-batch {micro_batch} (the pipeline "
                            "splits each rank's micro-batch into them)")


def check_context_parallel(layout: Layout, cfg: ModelConfig, seq_len: int):
    cp = layout.cp
    if cp == 1:
        return
    if layout.tp > 1 or layout.pp > 1:
        raise BrrrError(f"--cp {cp} composes with --dp-shard and --dp-replicate; with --tp or --pp it is not "
                        f"supported (got --tp {layout.tp} --pp {layout.pp})")
    if seq_len % (2 * cp):
        raise BrrrError(f"--cp {cp} splits each sequence into 2 x {cp} chunks (head-tail balancing): --seq-len "
                        f"{seq_len} must be a multiple of {2 * cp}")
    if cfg.rope.type == "dynamic" and seq_len > cfg.max_position_embeddings:
        raise BrrrError(f"--cp {cp}: dynamic NTK rope re-derives its base from the longest position a rank sees, "
                        f"which differs between the shards beyond max_position_embeddings "
                        f"({cfg.max_position_embeddings}); --seq-len {seq_len} is past it")


def check_expert_parallel(layout: Layout, cfg: ModelConfig):
    ep = layout.ep
    if ep == 1:
        return
    if layout.tp > 1 or layout.pp > 1 or layout.cp > 1:
        raise BrrrError(f"--ep {ep} composes with --dp-shard and --dp-replicate; with --tp, --pp or --cp it is not "
                        f"supported (got --tp {layout.tp} --pp {layout.pp} --cp {layout.cp})")
    if not cfg.num_experts:
        raise BrrrError(f"--ep {ep} splits the experts of MoE layers; {cfg.architecture} here is a dense model "
                        f"(num_experts 0)")
    if cfg.num_experts % ep:
        raise BrrrError(f"--ep {ep} must divide the model's num_experts ({cfg.num_experts}): each ep rank holds "
                        f"an equal share")


@dataclass
class Mesh:
    """This rank's place: the resolved layout, the DeviceMesh (None for one process) and the data-parallel
    coordinates the data loader shards by."""
    layout: Layout
    device_mesh: object | None
    rank: int
    dp_rank: int
    dp_mesh: object | None = None  # dp_replicate x dp_shard flattened
    fsdp_mesh: object | None = None  # FSDP's mesh: dp_shard, or with cp / ep the dp_shard x cp / ep ranks (HSDP: 2-D)
    expert_mesh: object | None = None  # with ep: FSDP's mesh for the experts, the ranks holding the same ones

    @property
    def world(self) -> int:
        return self.layout.world

    @property
    def dp_world(self) -> int:
        return self.layout.dp

    @property
    def distributed(self) -> bool:
        return self.device_mesh is not None

    @property
    def fsdp(self) -> bool:
        """Whether FSDP wraps the model (its policy casts to bf16 on CUDA: no autocast then): whenever parameters
        are sharded over data-parallel ranks, and with TP or PP even on a one-rank dp mesh (the composable DDP takes
        no DTensor parameters; FSDP's policy gives every such layout the same bf16 compute and fp32 master
        weights); DDP for replicas alone."""
        layout = self.layout
        return self.distributed and (layout.dp_shard > 1 or layout.tp > 1 or layout.pp > 1 or layout.cp > 1
                                     or layout.ep > 1)

    def get(self, *names: str):
        """The sub-mesh over `names` ("dp" is dp_replicate x dp_shard x ep flattened)."""
        if names == ("dp",):
            return self.dp_mesh
        return self.device_mesh[names if len(names) > 1 else names[0]]


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def build_mesh(layout: Layout, device: torch.device) -> Mesh:
    """Join the process group torchrun set up (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the environment) and lay
    the ranks out; a lone process gets no process group at all."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    layout = layout.resolve(world)
    if world == 1:
        return Mesh(layout, None, 0, 0)
    if not dist.is_initialized():
        dist.init_process_group(backend_for(device), device_id=device if device.type == "cuda" else None)
    from torch.distributed.device_mesh import init_device_mesh

    shape = tuple(getattr(layout, d) for d in DIMS)
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=DIMS)
    dp_mesh = mesh["dp_replicate", "dp_shard", "ep"]._flatten("dp")
    # the cp ranks of a replica hold the same weights and each the gradients of its own tokens: FSDP shards over
    # them too (torchtitan's dp_shard_cp), so its reduce-scatter sums their gradients; the ep ranks likewise for
    # every parameter but the experts
    shard = "dp_shard"
    if layout.cp > 1:
        mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        shard = "dp_shard_cp"
    expert_mesh = None
    if layout.ep > 1:
        mesh["dp_shard", "ep"]._flatten("dp_shard_ep")
        shard = "dp_shard_ep"
        # an expert lives on the ranks of one ep coordinate: FSDP shards it over their dp_replicate x dp_shard
        expert_mesh = mesh["dp_replicate", "dp_shard"] if layout.dp_replicate > 1 else mesh["dp_shard"]
    fsdp_mesh = mesh["dp_replicate", shard] if layout.dp_replicate > 1 else mesh[shard]
    return Mesh(layout, mesh, dist.get_rank(), dp_mesh.get_local_rank(), dp_mesh, fsdp_mesh, expert_mesh)


def microbatches(cfg: ParallelConfig, layout: Layout) -> int:
    """Pipeline microbatches per micro-batch: --microbatches, else one per stage."""
    return cfg.microbatches or layout.pp


def plan_layout(cfg: ParallelConfig, model_cfg: ModelConfig, micro_batch: int, seq_len: int,
                device: torch.device) -> Mesh:
    """The layout the flags ask for, checked against WORLD_SIZE and the model on every rank before any collective
    (a bad layout is refused everywhere at once), then joined: the mesh."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    layout = Layout(cfg.dp_replicate, cfg.dp_shard, cfg.tp, cfg.pp, cfg.cp, cfg.ep).resolve(world)
    m = microbatches(cfg, layout)
    check_model(layout, model_cfg, micro_batch, seq_len, m if layout.pp > 1 else None)
    if layout.pp > 1:
        check_pipeline(cfg.pp_schedule, layout.pp, m, model_cfg.num_layers)
    return build_mesh(layout, device)


def zero_stage(cfg: ParallelConfig, mesh: Mesh) -> int:
    """FSDP resharding after forward is ZeRO-3, keeping the weights ZeRO-2; DDP and one process 0."""
    return (3 if cfg.reshard_after_forward else 2) if mesh.fsdp else 0


def predicted_memory(cfg: ParallelConfig, mesh: Mesh, model_cfg: ModelConfig, micro_batch: int, seq_len: int,
                     checkpointing: bool, gpu: GPU | None) -> dict | None:
    """Per-GPU bytes `brrr calc train` (brrr.analysis.train.train_plan) predicts for this layout on this device
    (state + activations), its ZeRO stage, and whether it fits the device's memory; None without a GPU. calc has
    one data-parallel dimension, so HSDP is quoted as FSDP over its shard group: each rank holds 1/dp_shard of the
    state whatever the replicas."""
    if gpu is None:
        return None
    layout, zero = mesh.layout, zero_stage(cfg, mesh)
    m = microbatches(cfg, layout)
    pp_kw = dict(microbatches=m, schedule=cfg.pp_schedule,
                 chunks=INTERLEAVED_CHUNKS if cfg.pp_schedule == "interleaved" else 1) if layout.pp > 1 else {}
    rows = micro_batch // (m if layout.pp > 1 else 1)
    gpus = layout.world // layout.dp_replicate if mesh.fsdp else layout.world
    # calc has no cp dimension: a cp rank's activations are those of its seq_len / cp tokens
    plan = train_plan(model_cfg, gpu, gpus=gpus, zero=zero, tp=layout.tp, pp=layout.pp, micro_batch=rows,
                      seq_len=seq_len // layout.cp, checkpointing=checkpointing, ep=layout.ep, **pp_kw)
    return {"zero": zero, "bytes": plan["memory"]["total"], "gpu": gpu.name, "gpu_memory": gpu.memory,
            "fits": plan["memory"]["fits"]}
