"""Training on many processes, split by concern as torchtitan does; parallelism is applied by functions to the
plain model over one DeviceMesh.

layout.py (the degrees from the flags, their checks, the DeviceMesh, and brrr calc train's memory prediction for the
layout on this device), parallelize.py (pipeline stages, TP, activation checkpointing, per-layer compile, FSDP2 /
DDP applied to a plain model), step.py (the optimizer step and the evaluation on a layout: loss context, global
gradient clipping, fp16 loss scaling, the pipeline's schedule), ranks.py (this rank's place and the step-boundary
agreements between ranks), dcp.py (sharded checkpoints); the mechanisms under them: data_parallel.py,
tensor_parallel.py, pipeline.py, context_parallel.py (--cp: head-tail sequence shards, the loss over them) over
ring_attention.py, expert_parallel.py (--ep: each rank's share of the experts, all-to-all dispatch, their FSDP group).
"""
from brrr.train.parallel.dcp import Checkpointer, load_model_weights
from brrr.train.parallel.layout import Layout, Mesh, plan_layout, predicted_memory, zero_stage
from brrr.train.parallel.parallelize import checkpoint_activations, decoder_layers, parallelize
from brrr.train.parallel.ranks import Ranks
from brrr.train.parallel.step import ParallelStep, clip_grad_norm

__all__ = ["Checkpointer", "Layout", "Mesh", "ParallelStep", "Ranks", "checkpoint_activations", "clip_grad_norm",
           "decoder_layers", "load_model_weights", "parallelize", "plan_layout", "predicted_memory", "zero_stage"]
