"""Performance arithmetic: parameters, bytes, FLOPs, KV cache, serving capacity, training memory, the roofline.

The one source of FLOP and byte counts in brrr: bench/ and the trainer's MFU import these, never their own
formulas. Formulas and worked examples: docs/arithmetic.md.
"""
from brrr.analysis.formats import kv_bytes, weight_format
from brrr.analysis.hardware import GPU, GPUS, get_gpu, measure
from brrr.analysis.model import (attended_tokens, compute_bound_batch, decode_bytes_per_step, decode_flops_per_step,
                                 decode_intensity, decode_weight_bytes, flops_per_token, kv_bytes_per_sequence,
                                 kv_bytes_per_token, matmul_params, param_counts, prefill_flops,
                                 prefill_flops_per_token, training_flops_per_token, weight_bytes)
from brrr.analysis.roofline import Op, matmul, place, transformer_ops
from brrr.analysis.serve import decode_step, serve_plan, ttft
from brrr.analysis.train import pipeline_bubble, train_plan, training_state_bytes

__all__ = [
    "GPU", "GPUS", "Op", "attended_tokens", "compute_bound_batch", "decode_bytes_per_step", "decode_flops_per_step",
    "decode_intensity", "decode_step", "decode_weight_bytes", "flops_per_token", "get_gpu", "kv_bytes",
    "kv_bytes_per_sequence", "kv_bytes_per_token", "matmul", "matmul_params", "measure", "param_counts",
    "pipeline_bubble",
    "place", "prefill_flops", "prefill_flops_per_token", "serve_plan", "train_plan", "training_flops_per_token",
    "training_state_bytes", "transformer_ops", "ttft", "weight_bytes", "weight_format",
]
