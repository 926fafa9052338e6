"""Ops the models call. Each file holds `<op>_ref` (plain torch, the oracle), `<op>_triton` and `<op>()`, the
dispatcher: Triton on CUDA when triton imports, the reference elsewhere (brrr/kernels/dispatch.py says when)."""
from brrr.kernels.activation import silu_and_mul
from brrr.kernels.attention import AttnMeta, attention
from brrr.kernels.batch_invariant import batch_invariant
from brrr.kernels.log_softmax import log_softmax
from brrr.kernels.rms_norm import add_rms_norm, rms_norm
from brrr.kernels.rotary import apply_rotary, rope_inv_freq, rotary_cos_sin

__all__ = ["AttnMeta", "add_rms_norm", "attention", "apply_rotary", "batch_invariant", "log_softmax", "rms_norm", "rope_inv_freq", "rotary_cos_sin",
           "silu_and_mul"]
