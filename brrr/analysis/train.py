"""Training arithmetic: per-GPU memory (state + activations), communication per step, pipeline bubble, step time, MFU.

Parallelism: gpus = dp * tp * pp. Tensor parallelism (Megatron, with sequence parallelism) splits weights and
activations tp ways; pipeline parallelism splits layers pp ways (evenly, embedding and head ignored in the
split); data parallelism replicates the rest, and ZeRO shards optimizer state (stage 1), + gradients (2),
+ weights (3) across the dp replicas. Mixed-precision Adam keeps 16 bytes per parameter: bf16 weights (2),
bf16 gradients (2), fp32 master weights, Adam m and v (4 + 4 + 4). MoE experts are not expert-parallel here.
"""
from __future__ import annotations

import math

from brrr.analysis.hardware import GPU
from brrr.analysis.model import (is_mla, matmul_params, mlp_width_per_token, param_counts, prefill_flops_per_token,
                                 qk_v_head_dims, training_flops_per_token)
from brrr.analysis.serve import allreduce_seconds
from brrr.config import ModelConfig
from brrr.errors import BrrrError

STATE_BYTES_PER_PARAM = {"params": 2, "grads": 2, "optimizer": 12}
SCHEDULES = ("gpipe", "1f1b", "interleaved")


def training_state_bytes(params: float, dp: int, zero: int = 0, model_parallel: int = 1) -> dict:
    """Per-GPU bytes of weights, gradients and optimizer state for `params` parameters split model_parallel
    (tp * pp) ways, with ZeRO stage `zero` sharding across the dp data-parallel replicas."""
    if zero not in (0, 1, 2, 3):
        raise BrrrError(f"--zero must be 0, 1, 2 or 3, got {zero}")
    local = params / model_parallel
    shard = {"params": dp if zero >= 3 else 1, "grads": dp if zero >= 2 else 1, "optimizer": dp if zero >= 1 else 1}
    out = {k: local * STATE_BYTES_PER_PARAM[k] / shard[k] for k in STATE_BYTES_PER_PARAM}
    out["total"] = sum(out.values())
    return out


def activation_bytes_per_token_per_layer(cfg: ModelConfig) -> float:
    """Bytes one layer saves for backward per token, bf16, flash attention (no seq x seq matrix), SwiGLU:
    norm inputs (2h each) + fp32 rstd (4 each), the normed inputs of the q/k/v and gate/up projections (2h each),
    q, k, v and the attention output (2 bytes per element) + fp32 log-sum-exp per head, and in the MLP the gate
    and up outputs, silu(gate) and the down projection's input (4 x 2 bytes x width). MoE adds the router's fp32
    logits and one copy of the token's input per routed expert; MLA its latents; qk-norm the pre-norm q and k."""
    h, nh = cfg.hidden_size, cfg.num_heads
    d_qk, d_v = qk_v_head_dims(cfg)
    kv_heads = nh if is_mla(cfg) else cfg.num_kv_heads
    attn = 2 * nh * d_qk + 2 * kv_heads * (d_qk + d_v) + 2 * nh * d_v + 4 * nh
    if is_mla(cfg):
        attn += 2 * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + 2 * cfg.kv_lora_rank + 4 * cfg.q_lora_rank
    if cfg.qk_norm:
        attn += 2 * (nh + kv_heads) * d_qk
    mlp = 8 * mlp_width_per_token(cfg)
    if cfg.num_experts:
        mlp += 4 * cfg.num_experts + 2 * h * cfg.num_experts_per_tok
    return 2 * (2 * h + 4) + 2 * (2 * h) + attn + mlp


def pipeline_bubble(stages: int, microbatches: int, schedule: str = "1f1b", chunks: int = 1) -> dict:
    """Idle fraction of a pipeline step. GPipe and 1F1B both idle (p - 1) microbatch-slots per stage out of
    m + p - 1; interleaved 1F1B with v model chunks per GPU shrinks each slot v-fold: (p - 1) / (v m + p - 1).
    `overhead` is bubble time over ideal compute time, (p - 1) / (v m) (Narayanan et al., 2021)."""
    if schedule not in SCHEDULES:
        raise BrrrError(f"--schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    if stages < 1 or microbatches < 1 or chunks < 1:
        raise BrrrError(f"--pp ({stages}), --microbatches ({microbatches}) and --chunks ({chunks}) must be >= 1")
    if schedule != "interleaved" and chunks != 1:
        raise BrrrError(f"--chunks {chunks} needs --schedule interleaved")
    v = chunks if schedule == "interleaved" else 1
    slots = v * microbatches
    return {"fraction": (stages - 1) / (slots + stages - 1), "overhead": (stages - 1) / slots}


def in_flight_microbatches(stages: int, microbatches: int, schedule: str, chunks: int = 1) -> float:
    """Microbatches whose activations the first stage holds at its peak: GPipe all m; 1F1B min(m, p); interleaved
    min(m, p) * (1 + (p - 1) / (p v)) (its deeper warm-up)."""
    if schedule == "gpipe":
        return microbatches
    held = min(microbatches, stages)
    return held * (1 + (stages - 1) / (stages * chunks)) if schedule == "interleaved" else held


# The fraction of the bf16 peak that training's matmuls reach when nothing is assumed: large, well-tuned bf16 runs
# report 38-43% MFU (Llama 3 on 16k H100s); 1.0 gives the roofline, what the layout alone costs.
TYPICAL_EFFICIENCY = 0.4


def train_plan(cfg: ModelConfig, gpu: GPU, gpus: int = 8, zero: int = 0, tp: int = 1, pp: int = 1,
               micro_batch: int = 1, seq_len: int = 4096, microbatches: int | None = None,
               checkpointing: bool = False, schedule: str = "1f1b", chunks: int = 1, gpus_per_node: int = 8,
               network_bandwidth: float = 50e9, efficiency: float = TYPICAL_EFFICIENCY) -> dict:
    """Per-GPU memory, communication, bubble and roofline step time / MFU of one optimizer step.
    network_bandwidth (bytes/s per GPU, one direction) is used for data-parallel traffic across nodes; 50e9 is
    an assumed 400 Gb/s InfiniBand NIC per GPU. `efficiency` is the fraction of the bf16 peak the matmuls
    reach (TYPICAL_EFFICIENCY by default; 1.0: the roofline bound; a measured GPU's peak is already its measured
    matmul rate)."""
    if gpus < 1 or tp < 1 or pp < 1 or gpus % (tp * pp):
        raise BrrrError(f"--gpus ({gpus}) must be a positive multiple of --tp x --pp ({tp} x {pp})")
    if cfg.num_heads % tp:
        raise BrrrError(f"--tp {tp} must divide num_attention_heads ({cfg.num_heads})")
    if pp > cfg.num_layers:
        raise BrrrError(f"--pp {pp} must be <= num_hidden_layers ({cfg.num_layers})")
    if micro_batch < 1 or seq_len < 1:
        raise BrrrError(f"--micro-batch ({micro_batch}) and --seq-len ({seq_len}) must be >= 1")
    dp = gpus // (tp * pp)
    m = microbatches if microbatches is not None else (4 * pp if pp > 1 else 1)
    bubble = pipeline_bubble(pp, m, schedule, chunks)
    if schedule == "interleaved" and m % pp:
        raise BrrrError(f"--schedule interleaved needs --microbatches ({m}) to be a multiple of --pp ({pp})")
    h, layers = cfg.hidden_size, math.ceil(cfg.num_layers / pp)
    params = param_counts(cfg)["total"]
    state = training_state_bytes(params, dp, zero, tp * pp)

    # activations: layers of this stage x microbatches in flight; with checkpointing only each layer's input
    # stays, and backward rematerializes one layer at a time; fp32 + bf16 logits on the last stage
    tokens_mb = micro_batch * seq_len
    full_layer = activation_bytes_per_token_per_layer(cfg) * tokens_mb / tp
    kept_layer = 2 * h * tokens_mb / tp if checkpointing else full_layer
    rematerialized = full_layer if checkpointing else 0.0
    logits = 6 * cfg.vocab_size * tokens_mb / tp
    first = in_flight_microbatches(pp, m, schedule, chunks) * layers * kept_layer + rematerialized
    last = layers * kept_layer + rematerialized + logits
    activations = first + logits if pp == 1 else max(first, last)

    # communication per GPU per step (bytes sent; a ring moves (n-1)/n of the buffer per GPU per pass)
    local = params / (tp * pp)
    ring = (dp - 1) / dp
    if zero <= 1:  # one bf16 gradient all-reduce (ZeRO-1: reduce-scatter + all-gather, same bytes)
        dp_bytes = 2 * ring * 2 * local
    elif zero == 2:  # gradients reduce-scattered every microbatch, updated weights all-gathered once
        dp_bytes = (m + 1) * ring * 2 * local
    else:  # weights all-gathered for forward and again for backward, gradients reduce-scattered: per microbatch
        dp_bytes = 3 * m * ring * 2 * local
    tp_collectives = (6 if checkpointing else 4) * layers * m if tp > 1 else 0
    tp_buffer = tokens_mb * h * 2
    tp_bytes = tp_collectives * 2 * (tp - 1) / tp * tp_buffer
    pp_bytes = 2 * m * chunks * tokens_mb * h * 2 / tp if pp > 1 else 0

    # time: FLOPs at efficiency x the GPU's bf16 peak, stretched by the bubble; TP collectives sit on the critical path;
    # DP traffic overlaps backward (ZeRO-3: forward too) and only its excess shows
    tokens = tokens_mb * m * dp
    model_flops = training_flops_per_token(cfg, seq_len) * tokens
    hardware_flops = training_flops_per_token(cfg, seq_len, recompute=checkpointing) * tokens
    if not 0 < efficiency <= 1:
        raise BrrrError(f"--efficiency must be in (0, 1], got {efficiency}")
    peak = gpu.peak("bf16") * efficiency
    compute_s = hardware_flops / (gpus * peak)
    pipeline_s = compute_s / (1 - bubble["fraction"])
    tp_s = tp_collectives * allreduce_seconds(tp_buffer, tp, gpu)
    dp_link = gpu.link_bandwidth if gpus <= gpus_per_node else network_bandwidth
    dp_s = dp_bytes / dp_link if dp > 1 else 0.0
    overlap_s = compute_s if zero == 3 else compute_s * (hardware_flops - model_flops / 3) / hardware_flops
    step_s = pipeline_s + tp_s + max(0.0, dp_s - overlap_s)
    return {
        "gpu": gpu.name, "gpus": gpus, "dp": dp, "tp": tp, "pp": pp, "zero": zero, "micro_batch": micro_batch,
        "seq_len": seq_len, "microbatches": m, "schedule": schedule, "chunks": chunks,
        "checkpointing": checkpointing, "efficiency": efficiency, "params": params, "tokens_per_step": tokens,
        "memory": {**{k: v for k, v in state.items() if k != "total"}, "activations": activations,
                   "total": state["total"] + activations, "gpu_memory": gpu.memory,
                   "fits": state["total"] + activations <= gpu.memory},
        "communication_bytes": {"data_parallel": dp_bytes, "tensor_parallel": tp_bytes, "pipeline": pp_bytes},
        "bubble": bubble,
        "flops": {"model": model_flops, "hardware": hardware_flops,
                  "per_token": training_flops_per_token(cfg, seq_len),
                  "six_n_per_token": 6 * matmul_params(cfg),
                  "attention_per_token": 3 * (prefill_flops_per_token(cfg, seq_len) - 2 * matmul_params(cfg))},
        "time": {"compute_s": compute_s, "pipeline_s": pipeline_s, "tensor_parallel_s": tp_s,
                 "data_parallel_s": dp_s, "data_parallel_exposed_s": max(0.0, dp_s - overlap_s), "step_s": step_s},
        "tokens_per_s": tokens / step_s, "mfu": model_flops / (step_s * gpus * gpu.datasheet_peak("bf16")),
    }
