"""Serving capacity on a GPU: memory left for the KV cache, sequences that fit, roofline decode speed and TTFT.

Per GPU under tensor parallelism `tp`: weights and FLOPs split tp ways; KV heads split tp ways, replicated when
there are fewer KV heads than GPUs (MLA's latent is one per token, so every GPU keeps all of it). Each decode
step and prefill also runs 2 all-reduces per layer of the hidden state, timed as a ring over the GPU link
plus a fixed latency per collective (ALLREDUCE_LATENCY_S, an assumption, not a measurement).
Step time is the roofline bound: max(bytes / bandwidth, FLOPs / peak) + communication. Real kernels reach a
fraction of it (docs/arithmetic.md compares with measurements), so read the speeds as ceilings.
"""
from __future__ import annotations

import math

from brrr.analysis.formats import kv_bytes, weight_format
from brrr.analysis.hardware import GPU
from brrr.analysis.model import (decode_flops_per_step, decode_weight_bytes, is_mla, kv_bytes_per_token,
                                 kv_elements_per_token, attended_tokens, mlp_width_per_token, prefill_flops,
                                 weight_bytes)
from brrr.config import ModelConfig
from brrr.errors import BrrrError

ALLREDUCE_LATENCY_S = 10e-6  # assumed: a small NCCL all-reduce inside one NVLink node takes ~5-20 us
ACTIVATION_BYTES = 2  # bf16 activations


def check_tp(cfg: ModelConfig, tp: int) -> None:
    if tp < 1 or cfg.num_heads % tp:
        raise BrrrError(f"--tp {tp} must be >= 1 and divide num_attention_heads ({cfg.num_heads})")


def kv_bytes_per_token_per_gpu(cfg: ModelConfig, kv_dtype: str, tp: int) -> float:
    if is_mla(cfg) or tp == 1:
        return kv_bytes_per_token(cfg, kv_dtype)
    heads_per_gpu = math.ceil(cfg.num_kv_heads / tp)
    return kv_elements_per_token(cfg) / cfg.num_kv_heads * heads_per_gpu * kv_bytes(kv_dtype)


def activation_reserve_bytes(cfg: ModelConfig, tokens: int, tp: int) -> float:
    """Peak activation memory of a forward over `tokens` tokens (the scheduler's prefill chunk), per GPU: the
    residual, the normed input and the attention output (3 x hidden) plus the MLP's gate and up outputs
    (2 x intermediate / tp) in bf16, and fp32 logits for the rows sampled (one per sequence, bounded by tokens)."""
    per_token = (3 * cfg.hidden_size + 2 * mlp_width_per_token(cfg) / tp) * ACTIVATION_BYTES
    return tokens * per_token + min(tokens, 1024) * cfg.vocab_size / tp * 4


def allreduce_seconds(nbytes: float, tp: int, gpu: GPU) -> float:
    """Ring all-reduce of nbytes over tp GPUs: each sends 2 (tp-1)/tp of the buffer, plus fixed latency."""
    if tp == 1:
        return 0.0
    return 2 * (tp - 1) / tp * nbytes / gpu.link_bandwidth + ALLREDUCE_LATENCY_S


def decode_step(cfg: ModelConfig, gpu: GPU, batch: int, context: int, tp: int = 1, weight_dtype: str = "bf16",
                kv_dtype: str = "bf16") -> dict:
    """Roofline time of one decode step of `batch` sequences attending to `context` tokens, on each of tp GPUs."""
    fmt = weight_format(weight_dtype)
    kv_token = kv_bytes_per_token_per_gpu(cfg, kv_dtype, tp)
    nbytes = decode_weight_bytes(cfg, batch, fmt) / tp + batch * kv_token * (attended_tokens(cfg, context) + 1)
    flops = decode_flops_per_step(cfg, batch, context) / tp
    memory_s, compute_s = nbytes / gpu.bandwidth, flops / gpu.peak(fmt.compute_dtype)
    comm_s = 2 * cfg.num_layers * allreduce_seconds(batch * cfg.hidden_size * ACTIVATION_BYTES, tp, gpu)
    step = max(memory_s, compute_s) + comm_s
    return {"batch": batch, "context": context, "bytes_per_gpu": nbytes, "flops_per_gpu": flops,
            "memory_s": memory_s, "compute_s": compute_s, "comm_s": comm_s, "step_s": step,
            "bound": "compute" if compute_s > memory_s else "memory",
            "tok_s_per_seq": 1 / step, "tok_s_total": batch / step}


def ttft(cfg: ModelConfig, gpu: GPU, prompt: int, tp: int = 1, weight_dtype: str = "bf16",
         kv_dtype: str = "bf16") -> dict:
    """Roofline time to first token: one prefill of `prompt` tokens (weights read once, KV written, all FLOPs)."""
    fmt = weight_format(weight_dtype)
    flops = prefill_flops(cfg, prompt) / tp
    nbytes = (decode_weight_bytes(cfg, prompt, fmt) / tp
              + kv_bytes_per_token_per_gpu(cfg, kv_dtype, tp) * attended_tokens(cfg, prompt))
    compute_s, memory_s = flops / gpu.peak(fmt.compute_dtype), nbytes / gpu.bandwidth
    comm_s = 2 * cfg.num_layers * allreduce_seconds(prompt * cfg.hidden_size * ACTIVATION_BYTES, tp, gpu)
    return {"prompt": prompt, "flops_per_gpu": flops, "bytes_per_gpu": nbytes, "compute_s": compute_s,
            "memory_s": memory_s, "comm_s": comm_s, "ttft_s": max(compute_s, memory_s) + comm_s,
            "bound": "compute" if compute_s > memory_s else "memory"}


def serve_plan(cfg: ModelConfig, gpu: GPU, tp: int = 1, weight_dtype: str = "bf16", kv_dtype: str = "bf16",
               util: float = 0.9, context: int = 4096, prompt: int = 1024, batches=(1, 8, 16, 32, 64, 128, 256),
               block_size: int = 16, prefill_chunk: int = 8192) -> dict:
    """Memory budget, KV capacity, decode speed at each batch size and TTFT for one model on tp GPUs."""
    check_tp(cfg, tp)
    if not 0 < util <= 1:
        raise BrrrError(f"--util must be in (0, 1], got {util}")
    if context < 1 or prompt < 1 or block_size < 1:
        raise BrrrError(f"--context ({context}), --prompt ({prompt}) and block size ({block_size}) must be >= 1")
    if any(b < 1 for b in batches):
        raise BrrrError(f"batch sizes must be >= 1, got {list(batches)}")
    weights = weight_bytes(cfg, weight_dtype) / tp
    reserve = activation_reserve_bytes(cfg, prefill_chunk, tp)
    budget = util * gpu.memory
    kv_memory = budget - weights - reserve
    kv_token = kv_bytes_per_token_per_gpu(cfg, kv_dtype, tp)
    block_bytes = kv_token * block_size
    blocks = max(0, int(kv_memory // block_bytes))
    blocks_per_seq = math.ceil(attended_tokens(cfg, context) / block_size)
    max_seqs = blocks // blocks_per_seq
    rows = []
    for b in batches:
        row = decode_step(cfg, gpu, b, context, tp, weight_dtype, kv_dtype)
        row["fits"] = b <= max_seqs
        rows.append(row)
    return {
        "gpu": gpu.name, "tp": tp, "weight_dtype": weight_format(weight_dtype).name, "kv_dtype": kv_dtype,
        "util": util, "context": context, "memory_per_gpu": gpu.memory, "budget_per_gpu": budget,
        "weights_per_gpu": weights, "activation_reserve_per_gpu": reserve, "kv_memory_per_gpu": max(0.0, kv_memory),
        "fits": kv_memory >= block_bytes * blocks_per_seq,
        "kv_bytes_per_token_per_gpu": kv_token, "kv_tokens": blocks * block_size, "max_sequences": max_seqs,
        "decode": rows, "ttft": ttft(cfg, gpu, prompt, tp, weight_dtype, kv_dtype),
    }
