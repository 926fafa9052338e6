"""Swap or recompute a preempted sequence: what each costs the device, and the context length above which swapping
is the cheaper.

Swapping copies the sequence's K/V to host memory and back: 2 x (its KV bytes / one direction of PCIe + a launch
per copied tensor). Recomputing prefills its tokens again: prefill FLOPs / the matmul peak (a recompute joins a
step whose weights are read anyway, so its cost is its FLOPs). The copies grow linearly with the tokens and the
prefill at least as fast (its attention quadratically), so past one length swapping wins and stays ahead.

Roofline figures (bytes / bandwidth, FLOPs / peak): real copies and prefills reach a fraction of them, so the
crossover is an estimate, not a measurement. COPY_LAUNCH_S is an assumption.
"""
from __future__ import annotations

from brrr.analysis.hardware import GPU
from brrr.analysis.model import kv_bytes_per_token, prefill_flops
from brrr.config import ModelConfig
from brrr.errors import BrrrError

COPY_LAUNCH_S = 5e-6  # assumed: one cudaMemcpyAsync issued from Python (a K or V tensor of one layer) ~5 us


def copied_tensors(cfg: ModelConfig) -> int:
    """Cache tensors one swap direction copies: K and V of every layer (MLA: the latent alone)."""
    return cfg.num_layers * (1 if cfg.kv_lora_rank else 2)


def swap_seconds(cfg: ModelConfig, tokens: int, gpu: GPU, kv_dtype: str = "bf16") -> float:
    """Out to the host and back in: both directions of `tokens` tokens' K/V over one direction of PCIe each."""
    if not gpu.pcie:
        raise BrrrError(f"{gpu.name} has no PCIe bandwidth figure: swap time is unknown")
    one_way = kv_bytes_per_token(cfg, kv_dtype) * tokens / (gpu.pcie / 2) + copied_tensors(cfg) * COPY_LAUNCH_S
    return 2 * one_way


def recompute_seconds(cfg: ModelConfig, tokens: int, gpu: GPU, dtype: str = "bf16") -> float:
    """The prefill of `tokens` tokens again, at the matmul peak of the model's dtype."""
    return prefill_flops(cfg, tokens) / gpu.peak(dtype)


def prefers_swap(cfg: ModelConfig, tokens: int, gpu: GPU, kv_dtype: str = "bf16", dtype: str = "bf16") -> bool:
    return swap_seconds(cfg, tokens, gpu, kv_dtype) < recompute_seconds(cfg, tokens, gpu, dtype)


def swap_threshold(cfg: ModelConfig, gpu: GPU, max_tokens: int, kv_dtype: str = "bf16", dtype: str = "bf16"
                   ) -> int | None:
    """The fewest computed tokens (up to max_tokens) at which swapping is cheaper; None if it never is. Recompute
    minus swap is convex in the tokens (prefill FLOPs are, the copies linear) and negative at 0 (the launches), so
    it changes sign once: a bisection finds where."""
    if max_tokens < 1:
        raise BrrrError(f"max_tokens must be >= 1, got {max_tokens}")
    if not prefers_swap(cfg, max_tokens, gpu, kv_dtype, dtype):
        return None
    lo, hi = 0, max_tokens  # swap loses at lo (or lo is 0), wins at hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if prefers_swap(cfg, mid, gpu, kv_dtype, dtype):
            hi = mid
        else:
            lo = mid
    return hi
